"""`--kv-dtype float16` / `bfloat16` on CPU: the KV pool stores 16-bit rows (half the bytes, twice the tokens per
byte of the ledger), the paged decode kernel widens them and computes in float32.

Oracle: transformers' Llama with a float32 cache on the same weights. A fresh prompt's first token never reads the
cache; every later token does, so the decode steps are what these tests check."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.request import SamplingParams
from deltaserve.kernels import paged_cpu
from test_engine_dense import TEXT, assert_pools_empty, transformers_greedy, transformers_twin
from test_engine_support import engine, run_all, tokens_of

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def eng(request):
    return engine(None, max_running_requests=8, max_total_tokens=4096, kv_dtype=request.param)


def test_pool_is_16_bit_and_the_ledger_counts_it(eng):
    dtype = getattr(torch, eng.config.kv_dtype)
    layer = eng.runner.model.geometry.attention_layers[0]
    assert eng.kv_pool.k[layer].dtype == eng.kv_pool.v[layer].dtype == dtype
    geometry = eng.runner.model.geometry
    per_token = len(geometry.attention_layers) * 2 * geometry.num_kv_heads * geometry.head_dim * 2
    assert eng.budget.kv_bytes_per_token == per_token
    assert eng.kv_pool.bytes == eng.kv_pool.kv_tokens * per_token == eng.budget.line("kv_pool").bytes
    assert paged_cpu.ready() is not None  # the decode steps below run on the kernel, not the portable path


def test_decode_over_a_16_bit_cache_follows_transformers(eng):
    hf = transformers_twin(eng)
    ids = eng.tokenizer.encode(TEXT * 4)
    prompts = [ids[:37], ids[:300]]
    outs = run_all(eng, [(p, SamplingParams(max_tokens=12, logprobs=2, **GREEDY)) for p in prompts])
    # bfloat16 keeps 8 significant bits, float16 11: the chosen tokens' log-probabilities move by about that much.
    tolerance = 0.03 if eng.config.kv_dtype == "bfloat16" else 0.005  # measured: 0.0085 and 0.0016
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = transformers_greedy(hf, prompt, 12)
        assert tokens_of(out) == ref_tokens
        ours = [lp for o in out for lp in o.logprobs]
        worst = max(abs(lp.logprob - ref_logprobs[step, lp.token_id].item()) for step, lp in enumerate(ours))
        assert worst <= tolerance
    assert_pools_empty(eng)


def test_eight_prompts_together_equal_each_alone(eng):
    ids = eng.tokenizer.encode(TEXT * 2)
    prompts = [ids[i * 5: i * 5 + n] for i, n in enumerate([3, 9, 17, 33, 48, 64, 65, 100])]
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = [tokens_of(run_all(eng, [(p, params)])[0]) for p in prompts]
    together = [tokens_of(out) for out in run_all(eng, [(p, params) for p in prompts])]
    assert together == alone
    assert_pools_empty(eng)


def test_hybrid_over_a_float16_cache_follows_transformers(tmp_path):
    """The tiny Qwen3.5 hybrid: its attention layers' KV in float16 pages, GDN state in float32 slots."""
    from test_engine_hybrid import prompt, reference_greedy
    from test_engine_support import make_hybrid_checkpoint

    ref = make_hybrid_checkpoint(tmp_path)
    eng = engine(str(tmp_path), max_running_requests=8, max_total_tokens=4096, kv_dtype="float16")
    prompts = [prompt(9, 1), prompt(130, 2), prompt(70, 3)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    together = [tokens_of(out) for out in run_all(eng, [(p, params) for p in prompts])]
    assert together == [reference_greedy(ref, p, 12) for p in prompts]
    assert together == [tokens_of(run_all(eng, [(p, params)])[0]) for p in prompts]
    assert eng.kv_pool.used_pages == 0 and eng.state_pool.used_slots == 0
