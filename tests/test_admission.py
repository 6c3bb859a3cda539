"""Admission without a model: the field numbers of incident 3, refusals with their arithmetic, the ledger."""

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.budget import plan_budget
from deltaserve.config import EngineConfig, GiB
from deltaserve.engine.admission import (CONTEXT_LENGTH_EXCEEDED, INVALID_MAX_TOKENS, KV_POOL_EXCEEDED,
                                         AdmissionError, AdmissionLedger, AdmissionPolicy)
from deltaserve.budget import spec_from_config

FIXTURE = Path(__file__).parent / "data" / "qwen3_5_27b_w4a16" / "config.json"
FIELD_POOL = 67_375  # incident 3
GPU0_POOL = 133_120  # the deployment that held, GPU0


def policy(pool=FIELD_POOL, cap=32_000, default=32_000, context=262_144, slots=16, queue=64):
    return AdmissionPolicy(kv_pool_tokens=pool, page_size=16, state_slots=slots, context_length=context,
                           max_new_tokens_cap=cap, default_max_tokens=default, max_queue=queue)


def simulate(p: AdmissionPolicy, prompts: list[int], generated: list[int]):
    """FIFO admission with requests finishing after `generated[i]` steps; returns each start and end step."""
    ledger = AdmissionLedger(p)
    waiting = list(range(len(prompts)))
    running: dict[int, int] = {}  # request -> finish step
    start, end, now, peak = {}, {}, 0, 0
    while waiting or running:
        while waiting:
            r = waiting[0]
            reservation = p.reservation(prompts[r], None)
            assert generated[r] <= reservation.max_new_tokens  # it never uses more than it reserved
            if not ledger.try_admit(r, reservation):
                break
            waiting.pop(0)
            start[r], running[r] = now, now + generated[r]
        peak = max(peak, len(running))
        assert ledger.in_use_kv_pages <= p.kv_pool_pages
        now = min(running.values())
        for r in [r for r, t in running.items() if t == now]:
            del running[r]
            ledger.release(r)
            end[r] = now
    assert ledger.in_use_kv_pages == 0 and ledger.in_use_slots == 0
    return start, end, peak


def test_reservation_is_prompt_plus_budget_in_pages():
    r = policy().reservation(19_000, None)
    assert (r.prompt_tokens, r.max_new_tokens, r.state_slots) == (19_000, 32_000, 1)
    assert r.kv_pages == math.ceil(51_000 / 16) and r.kv_tokens == r.kv_pages * 16 >= 51_000


def test_field_pool_with_cap_32000_runs_them_one_after_another():
    # 19,000 + 32,000 = 51,000 each: one fits in 67,375, two do not; the others wait instead of crashing.
    p = policy()
    ledger = AdmissionLedger(p)
    reservations = [p.reservation(19_000, None) for _ in range(3)]
    assert ledger.try_admit("a", reservations[0])
    assert not ledger.try_admit("b", reservations[1])
    start, end, peak = simulate(p, [19_000] * 3, [32_000] * 3)
    assert peak == 1 and start[1] == end[0] and start[2] == end[1]


def test_field_pool_with_cap_16384_still_one_at_a_time_because_prompts_count():
    # The field notes' 3 x 16,384 = 49,152 < 67,375 leaves out the prompts: 3 x (19,000 + 16,384) > 67,375.
    p = policy(cap=16_384, default=None)
    assert 3 * 16_384 < FIELD_POOL < 2 * (19_000 + 16_384)
    _, _, peak = simulate(p, [19_000] * 3, [16_384] * 3)
    assert peak == 1


def test_gpu0_pool_cap_32000_two_run_third_waits_then_starts():
    p = policy(pool=GPU0_POOL)
    ledger = AdmissionLedger(p)
    r = p.reservation(19_000, None)
    assert ledger.try_admit(0, r) and ledger.try_admit(1, r)
    assert not ledger.try_admit(2, r)
    ledger.release(0)
    assert ledger.try_admit(2, r)
    start, end, peak = simulate(p, [19_000] * 3, [32_000, 20_000, 32_000])
    assert peak == 2 and start[2] == end[1] == 20_000 and len(end) == 3


def test_gpu0_pool_cap_16384_all_three_at_once():
    p = policy(pool=GPU0_POOL, cap=16_384, default=None)
    start, _, peak = simulate(p, [19_000] * 3, [16_384] * 3)
    assert peak == 3 and set(start.values()) == {0}


def test_budget_for():
    p = policy(cap=16_384, default=None, context=65_536)
    assert p.budget_for(1_000, 100) == 100
    assert p.budget_for(1_000, 50_000) == 16_384  # clamped to the cap; it stops with finish_reason "length"
    assert p.budget_for(60_000, None) == 5_536  # no max_tokens: the rest of the context
    assert p.budget_for(1_000, None) == 16_384
    assert policy(cap=16_384, default=4_096).budget_for(1_000, None) == 4_096


def test_context_refusal_has_the_arithmetic():
    p = policy(context=65_536, cap=16_384)
    refusal = p.refusal(60_000, 8_000)
    assert refusal.code == CONTEXT_LENGTH_EXCEEDED
    assert ("This model's maximum context length is 65536 tokens. However, you requested 68000 tokens "
            "(60000 in the prompt, 8000 for the completion).") in refusal.message
    assert p.refusal(60_000, 5_536) is None
    alone = p.refusal(65_536, None)  # the prompt fills the context: not even one token fits
    assert alone.code == CONTEXT_LENGTH_EXCEEDED and "65537 tokens (65536 in the prompt, 1 for" in alone.message


def test_pool_refusal_has_the_arithmetic_and_a_max_tokens_that_fits():
    p = policy(cap=32_000)
    refusal = p.refusal(60_000, 10_000)
    assert refusal.code == KV_POOL_EXCEEDED
    pool = (FIELD_POOL // 16) * 16
    assert "needs 70000 KV tokens (60000 in the prompt + 10000 for the completion" in refusal.message
    assert f"holds {pool} tokens" in refusal.message and f"at most {pool - 60_000}" in refusal.message
    assert p.refusal(60_000, pool - 60_000) is None
    assert p.refusal(60_000, pool - 60_000 + 1) is not None
    assert "prompt alone" in p.refusal(70_000, 1).message


def test_invalid_max_tokens():
    assert policy().refusal(10, -1).code == INVALID_MAX_TOKENS


def test_max_tokens_zero_scores_a_prompt_up_to_the_whole_context():
    """max_tokens 0 (a request scoring its prompt: SamplingParams allows it only with prompt_logprobs) reserves the
    prompt alone: a prompt of the whole context fits, one token more is refused naming the context."""
    p = policy(context=1_000)
    assert p.refusal(1_000, 0) is None and p.reservation(1_000, 0).max_new_tokens == 0
    assert "maximum context length is 1000 tokens" in p.refusal(1_001, 0).message
    assert p.refusal(1_000, None) is not None  # a generating request still needs room for one token


def test_queue_full():
    p = policy(queue=2)
    assert not p.queue_full(1) and p.queue_full(2)


def test_ledger_never_double_releases_or_overfills():
    p = policy(pool=1_600, slots=2, cap=500, default=None, context=1_600)
    ledger = AdmissionLedger(p)
    r = p.reservation(100, 300)
    ledger.admit("a", r)
    with pytest.raises(AdmissionError, match="already admitted"):
        ledger.admit("a", r)
    ledger.admit("b", r)
    with pytest.raises(AdmissionError, match="slots are free"):
        ledger.admit("c", r)  # state slots, not pages, are the limit here
    ledger.release("a")
    with pytest.raises(AdmissionError, match="released twice"):
        ledger.release("a")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 900), st.one_of(st.none(), st.integers(1, 700))),
                max_size=60))
def test_ledger_property_random_arrivals_and_finishes(events):
    p = policy(pool=2_000, slots=3, cap=600, default=None, context=1_200)
    ledger = AdmissionLedger(p)
    running = []
    for i, (finish, prompt, max_tokens) in enumerate(events):
        if finish and running:
            ledger.release(running.pop(prompt % len(running)))
        elif p.refusal(prompt, max_tokens) is None:
            r = p.reservation(prompt, max_tokens)
            assert r.kv_tokens >= prompt + r.max_new_tokens and r.max_new_tokens >= 1
            if ledger.try_admit(i, r):
                running.append(i)
        assert ledger.in_use_kv_pages <= p.kv_pool_pages and ledger.in_use_slots <= p.state_slots
    for r in running:
        ledger.release(r)
    assert ledger.in_use_kv_pages == 0


def test_policy_from_budget_admits_exactly_the_longest_context():
    spec = spec_from_config(json.loads(FIXTURE.read_text()))
    budget = plan_budget(spec, EngineConfig(max_total_tokens=12_000, context_length=12_000, max_running_requests=4,
                                            max_new_tokens_cap=8_192,
                                            language_model_only=True),  # the tower is test_plan_vision's
                         device_total_bytes=24 * GiB, device_kind="cuda")
    p = AdmissionPolicy.from_budget(budget, max_queue=8)
    assert (p.kv_pool_tokens, p.state_slots, p.context_length) == (budget.kv_tokens, 4, 12_000)
    assert p.max_new_tokens_cap == 8_192 and p.default_max_tokens is None
    assert p.refusal(12_000 - 8_192, 8_192) is None
    assert p.refusal(12_000 - 8_192 + 1, 8_192).code == CONTEXT_LENGTH_EXCEEDED
