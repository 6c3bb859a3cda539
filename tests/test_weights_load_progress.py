"""Loading says how far it is, in bytes per second, and `deltaserve generate` / `serve` show it on stderr with the
seconds from the engine's start to ready (issue 17: a 16 GB checkpoint otherwise reads for a minute in silence)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from deltaserve.weights import load_checkpoint, progress
from tests.test_weights_compressed_tensors import make_checkpoint

GGUF = Path(__file__).parent / "data" / "gguf" / "tiny-qwen35-iq4_xs.gguf"
LINE = re.compile(r"loading (\S+): ([\d,.]+) of ([\d,.]+) MiB \((\d+)%\) in [\d.]+ s \(([\d,]+) MiB/s\)")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The field's layout (W4 body, INT8 embedding, INT4 head) from compressed-tensors' compressor, in two shards."""
    folder = tmp_path_factory.mktemp("sharded")
    make_checkpoint("dense_w4_g32_int8embed_int4head", folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, folder / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder, sum(t.numel() * t.element_size() for t in state.values())


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deltaserve.weights"]


def test_safetensors_progress_lines_and_one_per_shard(sharded, caplog, monkeypatch):
    folder, total = sharded
    monkeypatch.setattr(progress, "PROGRESS_BYTES", total // 5)  # a line each fifth: several per shard
    with caplog.at_level(logging.INFO, logger="deltaserve.weights"):
        load_checkpoint(folder)
    lines = messages(caplog)
    steps = [LINE.fullmatch(line) for line in lines if line.startswith("loading ")]
    assert len(steps) >= 4 and all(steps), lines
    done = [float(m.group(2).replace(",", "")) for m in steps]
    assert done == sorted(done) and all(m.group(3) == f"{total / 2**20:,.1f}" for m in steps)
    ends = [line for line in lines if line.startswith("read ")]
    assert [e.split(" shards")[0] for e in ends] == ["read 1/2", "read 2/2"]
    assert f"{total / 2**20:,.1f} of {total / 2**20:,.1f} MiB in" in ends[-1] and ends[-1].endswith("MiB/s)")


def test_gguf_progress(caplog, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_BYTES", GGUF.stat().st_size // 4)
    with caplog.at_level(logging.INFO, logger="deltaserve.weights"):
        load_checkpoint(GGUF)
    lines = messages(caplog)
    assert sum(bool(LINE.fullmatch(line)) for line in lines) >= 2, lines
    assert lines[-1].startswith(f"read 1/1 shards of {GGUF.name}: ") and lines[-1].endswith("MiB/s)")


def test_generate_shows_progress_and_start_to_ready_on_stderr(sharded):
    """The CLI, as a user runs it: the loggers' lines reach stderr (nothing configured them before)."""
    folder, total = sharded
    done = subprocess.run([sys.executable, "-m", "deltaserve.cli", "generate", "--model", str(folder),
                           "--max-tokens", "2", "t5 t6"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    err = done.stderr.splitlines()
    shards = [line for line in err if line.startswith("read ") and line.endswith("MiB/s)")]
    assert [s.split(" shards")[0] for s in shards] == ["read 1/2", "read 2/2"], done.stderr
    ready = [line for line in err if re.fullmatch(r"deltaserve: \S+ ready [\d.]+ s after the engine started", line)]
    assert len(ready) == 1 and err.index(ready[0]) > err.index(shards[-1]), done.stderr
