"""A GGUF load's peak resident memory stays within the weights as the ledger says the load holds them (packed, before
the int8-activation swap: budget/lines.loaded_weight_bytes, which the ledger checks against the usable memory) plus
one tensor's transient: the file's pages are not kept mapped beside the weights made from them, the int8-activation
swap frees each layer as its panels replace it, and the arena move copies one tensor at a time (issue 53: the field's
27B, 16.8 GB of weights on a 24 GiB machine, was killed by the OOM killer at 19.75 GB resident while converting). At
the end the model holds the ledger's weights line: the swap's compact K-quant panels once the lead's change to
kernels/int4_int8.py lands; until then the swap moves the packed bytes, and the end holds the load's form.

The fixture is bench/make_real_size.py's Qwen3.5-shaped Q4_K_M file at a small size (hidden 1024, 12 layers, a
16,384-row tied Q6_K embedding: ~105 MB, most of it the 4-bit body, so that a second copy of the layers shows beside
one tensor's). What is measured, in a fresh process, per stage (the load, the int8 swap, the arena move): VmHWM, the
kernel's own high-water mark of the process's resident memory (file-backed pages included), reset to the current
resident size (/proc/self/clear_refs) at the stage's start, less that size. It cannot miss a peak as sampling could.
Planted and seen to fail (2026-12-07): the file's pages left mapped (load 293 MiB above its start against 254
allowed), the swap keeping every replaced layer to its end (94 MiB against 80), a copy of every tensor's bytes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIZE = dict(hidden=1024, layers=12, ffn=3072, heads=4, kv_heads=1, k_heads=4, v_heads=4, tied=True)
VOCAB = 16384
# The load beyond the weights: one tensor's temporaries (a matrix's byte-per-weight codes before packing), the
# tokenizer and the Python objects the load makes (measured 53 MiB on Sapphire Rapids; the file's pages would be 100)
SLACK = 112 * 2**20
# The swap and the move copy one tensor at a time and give freed pages back every 32 MiB (RELEASE_EVERY), with room
# for Python's own: a second copy of every layer is the whole 4-bit body (~110 MiB here)
STEP_SLACK = 64 * 2**20

PROBE = r"""
import json, sys
import torch
from deltaserve.engine.loader import load_model, return_freed_memory
from deltaserve.kernels import int4_int8
from deltaserve.models.arena import pack_weights
from deltaserve.models.int8_activations import use_int8_activations
int4_int8.load()  # built (or not) before the marks: a build's memory is not the load's

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

def mark():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return status("VmRSS")

stages, start = {}, mark()
model = load_model(sys.argv[1], dequantize=False).model
stages["load"] = status("VmHWM") - start
loaded = sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())
before = mark()
swapped = use_int8_activations(model, release=return_freed_memory, in_place=True)[0] if int4_int8.built() else 0
stages["swap"] = status("VmHWM") - before
before = mark()
pack_weights(model, return_freed_memory)
stages["move"] = status("VmHWM") - before
tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
print(json.dumps({"stages": stages, "end": status("VmRSS") - start, "held": sum(tensors.values()), "loaded": loaded,
                  "largest": max(tensors.values()), "swapped": swapped}))
"""


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import make_real_size
    finally:
        sys.path.remove(str(ROOT / "bench"))
    saved = make_real_size.VOCAB
    make_real_size.SIZES["test"], make_real_size.VOCAB = SIZE, VOCAB
    try:
        return make_real_size.make("test", "q4_k_m", tmp_path_factory.mktemp("load_peak") / "qwen35-small.gguf")
    finally:
        make_real_size.VOCAB = saved
        del make_real_size.SIZES["test"]


def load_peak(path: Path, probe: str = PROBE) -> dict:
    """The probe's figures for a load of `path` in a fresh process (this tree first on its path)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the resident high-water mark")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_load_peak_stays_within_the_weights_line_and_one_tensor(path):
    from deltaserve.budget import plan_budget, spec_from_checkpoint
    from deltaserve.budget.lines import loaded_weight_bytes
    from deltaserve.config import EngineConfig

    spec, config = spec_from_checkpoint(path), EngineConfig(max_total_tokens=64)
    budget = plan_budget(spec, config, device_total_bytes=64 * 2**30, device_kind="cpu")
    weights, loaded = budget.line("weights").bytes, loaded_weight_bytes(spec, config.for_device("cpu"))
    result = load_peak(path)
    assert abs(result["loaded"] - loaded) <= 0.01 * loaded, (result, loaded)  # the ledger prices the load's form
    # the swap compacts K-quants once the lead's panels land (then the end must hold the weights line, the panels)
    compacted = result["held"] < 0.99 * result["loaded"]
    end = weights if compacted else loaded
    assert abs(result["held"] - end) <= 0.01 * end, (result, weights, loaded)
    assert result["stages"]["load"] <= loaded + SLACK, (
        f"the load peaked {result['stages']['load'] / 2**20:,.1f} MiB above its start; the weights as loaded are "
        f"{loaded / 2**20:,.1f} MiB and the allowance for one tensor's transient {SLACK / 2**20:,.0f} MiB", result)
    step = result["largest"] + STEP_SLACK  # the swap and the move: one tensor beside the rest, freed pages batched
    for stage in ("swap", "move"):
        assert result["stages"][stage] <= step, (
            f"the {stage} peaked {result['stages'][stage] / 2**20:,.1f} MiB above the weights it started from; "
            f"one tensor's copy is at most {step / 2**20:,.1f} MiB", result)
