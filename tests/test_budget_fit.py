"""Settings not given, fitted to the device where the defaults do not fit (budget/fit.py, issue 53): the order, a
given flag never moved, the refusal where nothing fits, and the real-size 27B GGUF planned at the defaults."""

import json
import re
from pathlib import Path

import pytest

from deltaserve.budget import BudgetError, plan_budget, spec_from_checkpoint, spec_from_config
from deltaserve.budget.fit import CPU_FIT_MEM_FRACTION, FIT_CONTEXT_FLOOR, FIT_KV_TOKENS
from deltaserve.budget.lines import CONSUMER_LINES
from deltaserve.config import CPU_MEM_FRACTION, EngineConfig, GiB, MiB
from deltaserve.plan import main

FIXTURE = Path(__file__).parent / "data" / "qwen3_5_27b_w4a16" / "config.json"
# bench/make_real_size.py's 27B-class IQ4_XS file (~14.7 GB; only its headers are read); its folder: the script's hash
REAL_27B = sorted(Path.home().glob(".cache/deltaserve/real-size/*/qwen35-27b-iq4_xs.gguf"))
HOST = 24_105 * MiB  # this project's 24 GiB host as MemTotal reports it: the size the issue was filed on


@pytest.fixture(scope="module")
def spec27():
    """The field notes' 27B (W4A16, INT8 embedding): 13,851 MiB of weights, more than half of a 24 GiB host."""
    return spec_from_config(json.loads(FIXTURE.read_text()), embed_quant="int8", lm_head_quant="int4")


def cpu_plan(spec, total=HOST, **settings):
    return plan_budget(spec, EngineConfig(language_model_only=True, **settings), device_total_bytes=total,
                       device_kind="cpu")


def within_usable(budget) -> bool:
    """Every consumer and the runtime fit in usable, and the pool holds one request of the context (of
    FIT_KV_TOKENS, an agent's prompt, where the context is the model's own and longer: the pool limits requests
    then, as at the defaults)."""
    used = sum(budget.line(n).bytes for n in CONSUMER_LINES) + budget.line("runtime").bytes
    return used <= budget.usable_bytes and budget.kv_tokens >= min(budget.context_length, FIT_KV_TOKENS)


def test_defaults_that_do_not_fit_are_fitted_in_order_and_named(spec27):
    budget = cpu_plan(spec27)
    assert budget.fitted["mem_fraction"] == CPU_FIT_MEM_FRACTION
    assert budget.mem_fraction == CPU_FIT_MEM_FRACTION and within_usable(budget)
    assert budget.usable_bytes == int(CPU_FIT_MEM_FRACTION * HOST)
    note = budget.notes[0]
    assert note.startswith("fitted to this machine: ") and note.endswith("give any of them to choose yourself")
    for name, value in budget.fitted.items():  # each fitted flag named once with its value and a why
        flag = f"--{name.replace('_', '-')} " + (f"{value:,}" if isinstance(value, int) else f"{value}")
        assert note.count(flag + " (") == 1
    assert f"at the default {CPU_MEM_FRACTION}" in note
    # The fitted values, given, plan the same ledger with nothing fitted: plan and serve read one config.
    given = cpu_plan(spec27, **budget.fitted)
    assert given.fitted == {} and [(l.name, l.bytes) for l in given.lines] == [(l.name, l.bytes) for l in budget.lines]
    # The requests went only as far as needed: twice as many, at the context they were fitted at, do not hold.
    assert "max_running_requests" in budget.fitted
    doubled = {**budget.fitted, "max_running_requests": budget.max_running_requests * 2}
    doubled.pop("context_length", None)
    try:
        assert not within_usable(cpu_plan(spec27, **doubled))
    except BudgetError:
        pass


def test_fit_that_needs_only_the_fraction_moves_nothing_else(spec27):
    budget = cpu_plan(spec27, total=32 * GiB)  # 16 GiB at 0.5 cannot hold 13.5 GiB of weights and the pools
    assert budget.fitted == {"mem_fraction": CPU_FIT_MEM_FRACTION}
    assert budget.max_running_requests == 16 and within_usable(budget)


def test_defaults_that_fit_are_not_touched(spec27):
    budget = cpu_plan(spec27, total=64 * GiB)
    assert budget.fitted == {} and budget.mem_fraction == CPU_MEM_FRACTION and budget.max_running_requests == 16
    assert not any(n.startswith("fitted") for n in budget.notes)


def test_a_given_flag_is_never_fitted(spec27):
    budget = cpu_plan(spec27, max_running_requests=16, context_length=32_768)
    assert budget.max_running_requests == 16 and budget.context_length == 32_768
    assert set(budget.fitted) == {"mem_fraction"}
    # --mem-fraction given too: today's refusal, its Fix line, and nothing fitted.
    with pytest.raises(BudgetError) as err:
        cpu_plan(spec27, mem_fraction=0.5, max_running_requests=16, context_length=32_768)
    message = str(err.value)
    assert "fitted" not in message and "short by" in message and "Fix: raise --mem-fraction" in message
    # A pool size the user gave that does not fit is refused as it was: their size stands.
    with pytest.raises(BudgetError) as err:
        cpu_plan(spec27, max_total_tokens=2_000_000)
    assert "fitted" not in str(err.value) and "--max-total-tokens 2000000 needs" in str(err.value)


def test_given_fraction_still_lets_the_others_fit_or_refuses_with_them(spec27):
    with pytest.raises(BudgetError) as err:
        cpu_plan(spec27, mem_fraction=0.5)  # 12,052 MiB usable cannot hold 13,851 MiB of weights
    message = str(err.value)
    assert "--mem-fraction 0.9" not in message and "as far as they go" in message
    assert f"--context-length {FIT_CONTEXT_FLOOR:,} (" in message and "--max-running-requests 1 (" in message
    fix = re.search(r"raise --mem-fraction to (\d\.\d\d)", message)
    assert fix and within_usable(cpu_plan(spec27, mem_fraction=float(fix.group(1))))


def test_refused_when_nothing_fits_with_the_arithmetic(spec27):
    with pytest.raises(BudgetError) as err:
        cpu_plan(spec27, total=12 * GiB)
    message = str(err.value)
    short = int(re.search(r"short by ([\d,]+) MiB", message).group(1).replace(",", ""))
    usable = int(re.search(r"of ([\d,]+) MiB usable", message).group(1).replace(",", ""))
    assert abs(usable - CPU_FIT_MEM_FRACTION * 12 * GiB / MiB) <= 1 and short > 0
    assert f"--mem-fraction {CPU_FIT_MEM_FRACTION} (" in message
    assert f"--context-length {FIT_CONTEXT_FLOOR:,} (" in message


def test_gpu_fraction_is_not_raised(spec27):
    budget = plan_budget(spec27, EngineConfig(language_model_only=True), device_total_bytes=19 * GiB,
                         device_kind="cuda")
    assert "mem_fraction" not in budget.fitted and budget.mem_fraction == 0.9 and within_usable(budget)
    assert budget.fitted["max_running_requests"] < 16


@pytest.mark.skipif(not REAL_27B, reason="bench/make_real_size.py's 27B IQ4_XS file is not in the cache")
def test_real_size_27b_gguf_plans_at_the_defaults(capsys):
    budget = plan_budget(spec_from_checkpoint(str(REAL_27B[0])), EngineConfig(), device_total_bytes=HOST,
                         device_kind="cpu")
    assert budget.fitted["mem_fraction"] == CPU_FIT_MEM_FRACTION and within_usable(budget)
    assert budget.context_length >= FIT_CONTEXT_FLOOR and budget.line("free").bytes >= 0
    assert main(["--model", str(REAL_27B[0]), "--device", "cpu", "--device-memory", f"{HOST}"]) == 0
    assert budget.notes[0] in capsys.readouterr().out


def test_engine_logs_the_fit_once_and_runs_with_it():
    from deltaserve.engine.engine import Engine

    logs = []
    engine = Engine(EngineConfig(device="cpu", device_memory=1 * GiB), log=logs.append)  # the built-in SmolLM2
    try:
        fitted = [line for line in logs if "fitted to this machine" in line]
        assert len(fitted) == 1 and f"--mem-fraction {CPU_FIT_MEM_FRACTION} (" in fitted[0]
        assert engine.config.mem_fraction == CPU_FIT_MEM_FRACTION == engine.budget.mem_fraction
    finally:
        engine.shutdown()
