"""Incident 3 end to end on a tiny hybrid: three long prompts without max_tokens, admitted against the pool.

The field numbers scaled down. GPU0's pool of 133,120 tokens / 10 = 13,312 (and / 100 = 1,331): with a cap of
3,200 (320) two 1,900-token (190) prompts run and the third waits; with a cap of 1,638 (164) all three run at once.
The incident's own pool, 67,375 / 10 = 6,738, holds only one such request at a time (19,000 + 32,000 > 67,375 / 2).
"""

from __future__ import annotations

import pytest

from deltaserve.engine.engine import RequestRefused
from deltaserve.engine.request import SamplingParams
from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt

NO_MAX_TOKENS = SamplingParams(temperature=0, ignore_eos=True)  # the client sent no max_tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("admission")
    make_hybrid_checkpoint(folder)
    return str(folder)


def three_prompts(length: int) -> list[list[int]]:
    return [random_prompt(length, seed, HYBRID_VOCAB) for seed in range(3)]


def run_to_end(eng, prompts):
    """Submit all at once; step to the end; the running count at each step and every request's outputs."""
    streams = [eng.submit(p, NO_MAX_TOKENS) for p in prompts]
    running, outputs = [], [[] for _ in streams]
    while not all(s.finished for s in streams):
        eng.step()
        running.append(eng.stats().running + sum(s.finished and not out for s, out in zip(streams, outputs)))
        for s, out in zip(streams, outputs):
            out.extend(s.drain())
    return running, outputs


def assert_empty(eng) -> None:
    eng.scheduler.check()
    stats = eng.stats()
    assert (stats.kv_pages_used, stats.kv_pages_reserved, stats.state_slots_used) == (0, 0, 0)


@pytest.mark.parametrize("cap, peak", [(320, 2), (164, 3)])
def test_hundredth_scale_runs_to_the_end(checkpoint, cap, peak):
    # the pool is whole pages: 1331 tokens asked, 1328 granted, and the context is what the pool holds
    eng = engine(checkpoint, max_total_tokens=1331, context_length=1331 // 16 * 16, max_new_tokens_cap=cap)
    running, outputs = run_to_end(eng, three_prompts(190))
    assert max(running) == peak and running[0] == peak
    for out in outputs:
        assert out[-1].finish_reason == "length" and out[-1].completion_tokens == cap
        assert sum(len(o.token_ids) for o in out) == cap
    if peak == 2:  # the third started only when one of the first two had finished
        assert running.count(2) >= cap - 1 and eng.stats().finished["length"] == 3
    assert_empty(eng)


@pytest.mark.parametrize("pool, cap, peak", [(13_312, 3_200, 2), (13_312, 1_638, 3), (6_738, 3_200, 1)])
def test_tenth_scale_admission(checkpoint, pool, cap, peak):
    eng = engine(checkpoint, max_total_tokens=pool, context_length=pool // 16 * 16, max_new_tokens_cap=cap)
    streams = [eng.submit(p, NO_MAX_TOKENS, request_id=f"r{i}") for i, p in enumerate(three_prompts(1_900))]
    for _ in range(6):  # 1,900-token prompts are read in chunks of 512 (CPU default)
        eng.step()
    stats = eng.stats()
    assert (stats.running, stats.waiting) == (peak, 3 - peak)
    assert stats.kv_pages_reserved == peak * -(-(1_900 + cap) // 16) <= stats.kv_pages_total
    assert stats.kv_pages_used < stats.kv_pages_reserved  # pages are taken as the sequences grow
    assert all(len(o.token_ids) for s in streams[:peak] for o in s.drain()[:1])
    eng.abort("r0")
    eng.step()
    after = eng.stats()  # the freed reservation lets the next waiting one start
    assert (after.running, after.waiting) == (min(peak, 2), max(0, 2 - peak))
    for i in range(3):
        eng.abort(f"r{i}")
    assert_empty(eng)


def test_refusals_carry_the_arithmetic(checkpoint):
    eng = engine(checkpoint, max_total_tokens=13_312, context_length=13_312, max_new_tokens_cap=3_200)
    with pytest.raises(RequestRefused) as too_long:
        eng.submit(random_prompt(13_000, 1, HYBRID_VOCAB), SamplingParams(max_tokens=1_000))
    assert too_long.value.status == 400
    assert "maximum context length is 13312 tokens" in too_long.value.message
    assert "14000 tokens (13000 in the prompt, 1000 for the completion)" in too_long.value.message
    with pytest.raises(RequestRefused, match="outside the vocabulary"):
        eng.submit([HYBRID_VOCAB + 5], SamplingParams())
    with pytest.raises(RequestRefused, match="empty"):
        eng.submit([], SamplingParams())
    assert eng.stats().refused == {"context_length_exceeded": 1}
