"""The engine on a tiny random Qwen3.5 hybrid (GDN state in slots, KV in pages), transformers as the oracle."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.request import SamplingParams
from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt, run_all, tokens_of

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid")
    ref = make_hybrid_checkpoint(folder)
    return ref, engine(str(folder), max_running_requests=8, max_total_tokens=8192)


def prompt(length: int, seed: int) -> list[int]:
    return random_prompt(length, seed, HYBRID_VOCAB)


def reference_greedy(ref, ids: list[int], steps: int) -> list[int]:
    """transformers' forward over the whole sequence at every step (its cached generate path drifts from its own
    full forward on near-ties; the full forward is the model's definition)."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def assert_pools_empty(eng) -> None:
    eng.scheduler.check()
    assert eng.kv_pool.used_pages == 0 and eng.state_pool.used_slots == 0


def test_greedy_matches_transformers(hybrid):
    ref, eng = hybrid
    prompts = [prompt(9, 1), prompt(130, 2), prompt(70, 3)]
    eng.scheduler.prefill_chunk_tokens = 64  # mixed steps: one prompt's decode beside another's chunks
    outs = run_all(eng, [(p, SamplingParams(max_tokens=12, **GREEDY)) for p in prompts])
    eng.scheduler.prefill_chunk_tokens = 512
    for p, out in zip(prompts, outs):
        assert tokens_of(out) == reference_greedy(ref, p, 12)
    assert_pools_empty(eng)


def test_eight_prompts_together_equal_each_alone(hybrid):
    _, eng = hybrid
    prompts = [prompt(n, 10 + n) for n in (1, 5, 16, 33, 64, 65, 150, 300)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    alone = [tokens_of(run_all(eng, [(p, params)])[0]) for p in prompts]
    together = [tokens_of(out) for out in run_all(eng, [(p, params) for p in prompts])]
    assert together == alone
    assert all(len(t) == 16 for t in together) and len({tuple(t) for t in together}) > 4
    assert_pools_empty(eng)


@pytest.mark.parametrize("chunk", [64, 100, 1000])
def test_chunked_prefill_equals_unchunked(hybrid, chunk):
    _, eng = hybrid
    prompts = [prompt(900, 7), prompt(333, 8), prompt(50, 9)]  # 1,283 tokens: chunks of 1000 split one too
    params = SamplingParams(max_tokens=8, logprobs=0, **GREEDY)
    eng.scheduler.prefill_chunk_tokens = 4096
    whole = run_all(eng, [(p, params) for p in prompts])
    eng.scheduler.prefill_chunk_tokens = chunk
    chunked = run_all(eng, [(p, params) for p in prompts])
    eng.scheduler.prefill_chunk_tokens = 512
    for a, b in zip(whole, chunked):
        assert tokens_of(a) == tokens_of(b)
        assert [lp.logprob for o in a for lp in o.logprobs] == pytest.approx(
            [lp.logprob for o in b for lp in o.logprobs], abs=1e-4)
    assert_pools_empty(eng)


def test_seeded_sampling_is_the_same_in_any_batch(hybrid):
    _, eng = hybrid
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, min_p=0.02, seed=7, ignore_eos=True,
                            presence_penalty=0.3, repetition_penalty=1.1)
    p = prompt(40, 4)
    alone = tokens_of(run_all(eng, [(p, seeded)])[0])
    others = [(prompt(n, n), SamplingParams(max_tokens=n // 4 + 1, temperature=1.0, ignore_eos=True)) for n in (20, 90)]
    mixed = run_all(eng, [others[0], (p, seeded), others[1]])
    assert tokens_of(mixed[1]) == alone
    assert_pools_empty(eng)


def test_a_slot_reused_after_an_abort_starts_from_zero_state(hybrid):
    _, eng = hybrid
    params = SamplingParams(max_tokens=10, **GREEDY)
    p = prompt(25, 5)
    first = tokens_of(run_all(eng, [(p, params)])[0])
    eng.scheduler.prefill_chunk_tokens = 64
    long = eng.submit(prompt(400, 6), params, request_id="long")
    short = eng.submit(prompt(30, 11), params, request_id="short")
    for _ in range(3):
        eng.step()
    eng.abort("long")  # mid-prefill: its slot holds a half-read prompt's state
    while not short.finished:
        eng.step()
    eng.abort("short")  # already finished: nothing to do
    assert long.drain()[-1].finish_reason == "abort" and short.drain()[-1].finish_reason == "length"
    assert_pools_empty(eng)
    eng.scheduler.prefill_chunk_tokens = 512
    again = [tokens_of(out) for out in run_all(eng, [(p, params), (p, params)])]
    assert again == [first, first]
    assert_pools_empty(eng)
