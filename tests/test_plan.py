"""`deltaserve plan` on the 27B fixture and the built-in GGUF: table, JSON, chart, what fits, errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.budget import plan_budget, spec_from_config
from deltaserve.config import EngineConfig, GiB
from deltaserve.plan import main

FIXTURE = Path(__file__).parent / "data" / "qwen3_5_27b_w4a16" / "config.json"
# GPU1 of the field notes: the language model only (test_plan_vision.py prices the vision tower)
FIELD = ["--model", str(FIXTURE), "--device", "24GiB", "--embed-quant", "int8", "--lm-head-quant", "int4",
         "--language-model-only"]


def expected_budget(**settings):
    spec = spec_from_config(json.loads(FIXTURE.read_text()), embed_quant="int8", lm_head_quant="int4")
    config = EngineConfig(model=str(FIXTURE), device="cuda", device_memory=24 * GiB, language_model_only=True,
                          **settings)
    return plan_budget(spec, config, device_total_bytes=24 * GiB, device_kind="cuda")


def test_table_on_the_27b_fixture(capsys):
    assert main(FIELD + ["--request-context", "32768"]) == 0
    out = capsys.readouterr().out
    budget = expected_budget()
    for line in budget.lines:
        assert line.name in out and f"{line.bytes / 2**20:,.0f}" in out
    assert "64 layers: 16 attention + 48 GDN" in out
    assert f"largest context of one request: {budget.max_context_tokens:,} tokens" in out
    fit = min(budget.kv_pages // math.ceil(32768 / 16), budget.state_slots)
    assert f"requests of 32,768 tokens at once: {fit} " in out
    for option in ("--mem-fraction 0.91", "--state-dtype float32", "host prefix tier 12 GB", "INT8 GDN state",
                   "--checkpoint-slots 16", "--no-prefix-cache", "tokens of KV", "buys hits for 8 prefixes"):
        assert option in out


def test_json_is_the_ledger(capsys):
    assert main(FIELD + ["--json", "--max-total-tokens", "40004", "--mem-fraction", "0.91"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == expected_budget(max_total_tokens=40004, mem_fraction=0.91).to_json()
    assert printed["kv_tokens"] == 40004 // 16 * 16  # whole pages, rounded down


def test_chart_writes_a_png(tmp_path, capsys):
    from matplotlib import image

    chart = tmp_path / "budget.png"
    assert main(FIELD + ["--chart", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.imread(str(chart)).shape[:2]
    assert width > 2 * height > 100


def test_builtin_gguf_on_cpu(capsys):
    assert main(["--device", "cpu", "--device-memory", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "llama, 30 layers: 30 attention" in out and "checkpoint headers" in out
    assert "4-bit matrices packed" in out  # the CPU default: the Q4_1 blocks stay 4-bit


@pytest.mark.parametrize("argv, words", [
    (FIELD + ["--mem-fraction", "1.5"], ["--mem-fraction 1.5", "(0, 1]"]),
    (FIELD + ["--max-total-tokens", "10000000"], ["short by", "MiB", "Fix:"]),
    (["--model", "/nonexistent/model", "--device", "24GiB"], ["/nonexistent/model", "no such file"]),
    (["--device", "cpu", "--quant", "w4a16-g128"], ["apply to a config.json alone"]),
    (FIELD + ["--quant", "w7"], ["'w7' is not understood"]),
])
def test_errors_exit_2_with_one_line(capsys, argv, words):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("deltaserve plan: ")
    for word in words:
        assert word in captured.err


def test_module_entry_point_exit_code():
    result = subprocess.run([sys.executable, "-m", "deltaserve.plan", "--model", str(FIXTURE), "--device", "24GiB",
                             "--headroom=-1GiB"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "deltaserve plan: --headroom -1073741824 is negative: it must be >= 0 bytes"
