"""The CPU prefill attention kernel (kernels/prefill_cpu.py) against a float64 causal softmax written here, on each
build of the C++ kernels, across the tile edges it has: key blocks of 64 cut where a tile's rows end, register
tiles of 6 rows, tiles of ~96 rows (positions x the query heads of a KV head), and a cached prefix before the rows.

Tolerance from the arithmetic (tests/tolerance.py): a score is a float32 dot product of D terms (error about
lambda * sqrt(D) * u of the sum of its terms' magnitudes, times the scale); a weight moves by its score's error
relative to the others, so the output by at most twice the largest score error times max |v|; the weighted sum of L
values and the normalisation add lambda * sqrt(L) * u of max |v|, the exponential (~1 ulp) and the online
rescaling (one rounding a key block) a few u more."""

import math

import pytest
import torch

from deltaserve.kernels import attention, prefill_cpu
from deltaserve.models.batch import DECODE_ROWS_CHUNK
from test_kernels_attention import _reference as reference  # row i attends keys 0..cached + i, in float64
from tolerance import LAMBDA, UNIT_ROUNDOFF

# every test here runs on each build of the C++ kernels: native and AVX2-only (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")


def bound(q, k, v, scale):
    """What float32 rounding allows between the kernel and the float64 reference (module docstring)."""
    d, length = q.shape[-1], k.shape[0]
    group = q.shape[1] // k.shape[1]
    magnitudes = torch.einsum("shd,thd->hst", q.double().abs(), k.double().abs().repeat_interleave(group, 1))
    score_error = LAMBDA * math.sqrt(d) * UNIT_ROUNDOFF * scale * magnitudes.max().item()
    rows = (LAMBDA * math.sqrt(length) + 16) * UNIT_ROUNDOFF
    return (2 * score_error + rows) * v.double().abs().max().item()


def case(seed, rows, cached, heads, kv_heads, d):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, d, generator=g), torch.randn(cached + rows, kv_heads, d, generator=g),
            torch.randn(cached + rows, kv_heads, d, generator=g))


@pytest.fixture(scope="module", autouse=True)
def built():
    if prefill_cpu.load() is None:
        pytest.fail("the CPU prefill attention kernel did not build here (needs ninja and a C++ compiler)")


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (6, 2, 32), (8, 1, 128), (2, 1, 48)])
@pytest.mark.parametrize("rows,cached", [(1, 0), (5, 0), (31, 0), (32, 0), (33, 0), (64, 0), (65, 0), (97, 0),
                                         (200, 0), (528, 0), (1, 7), (6, 63), (40, 64), (33, 65), (100, 300)])
def test_matches_float64(rows, cached, heads, kv_heads, d):
    q, k, v = case(rows * 1000 + cached + d, rows, cached, heads, kv_heads, d)
    got = prefill_cpu.prefill_attention(q, k, v, cached, d ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got.double() - reference(q, k, v, cached, d ** -0.5)).abs().max().item() <= bound(q, k, v, d ** -0.5)


@pytest.mark.parametrize("rows,cached", [(300, 0), (129, 200)])
def test_wide_heads_many_per_kv_head(rows, cached):
    """Qwen3.5's gated attention: heads of 256, 8 query heads to a KV head (12 positions a tile)."""
    q, k, v = case(rows + cached, rows, cached, 16, 2, 256)
    got = prefill_cpu.prefill_attention(q, k, v, cached, 256 ** -0.5)
    assert (got.double() - reference(q, k, v, cached, 256 ** -0.5)).abs().max().item() <= bound(q, k, v, 256 ** -0.5)


def test_more_query_heads_to_a_kv_head_than_a_tile_has_rows():
    """100 query heads on one KV head: each tile is a single position's 100 rows (not a multiple of 6)."""
    q, k, v = case(7, 20, 3, 100, 1, 16)
    got = prefill_cpu.prefill_attention(q, k, v, 3, 0.25)
    assert (got.double() - reference(q, k, v, 3, 0.25)).abs().max().item() <= bound(q, k, v, 0.25)


@pytest.mark.parametrize("rows,cached", [(10, 0), (70, 0), (20, 50)])
def test_scores_far_below_zero(rows, cached):
    """Every score near -120 (a softmax weight of e^-120 before its row's max is taken out): the padding keys of a
    partial block score 0 and must not enter a row's max, or every weight would be the exponential's floor."""
    g = torch.Generator().manual_seed(rows)
    q = -30 + torch.randn(rows, 4, 16, generator=g)
    k = 1 + 0.5 * torch.randn(cached + rows, 2, 16, generator=g)
    v = torch.randn(cached + rows, 2, 16, generator=g)
    want = reference(q, k, v, cached, 0.25)
    got = prefill_cpu.prefill_attention(q, k, v, cached, 0.25)
    assert (got.double() - want).abs().max().item() <= bound(q, k, v, 0.25)


def test_rows_may_be_strided():
    """q, k and v as the engine has them: views into one projection's output, each row's heads contiguous."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(150, 6 + 2 + 2, 32, generator=g)
    q, k, v = qkv[:, :6], qkv[:, 6:8], qkv[:, 8:]
    assert q.stride(0) == 10 * 32 and not q.is_contiguous()
    got = prefill_cpu.prefill_attention(q[50:], k, v, 50, 0.2)
    want = reference(q[50:], k, v, 50, 0.2)
    assert (got.double() - want).abs().max().item() <= bound(q[50:], k, v, 0.2)


def test_attention_takes_the_kernel_when_told_and_torch_otherwise():
    q, k, v = case(11, 100, 20, 6, 2, 32)
    want = reference(q, k, v, 20, 0.2)
    native = attention._prefill_attention(q, k, v, 20, 0.2, native=True)
    assert torch.equal(native, prefill_cpu.prefill_attention(q, k, v, 20, 0.2))
    portable = attention._prefill_attention(q, k, v, 20, 0.2, native=False)
    for got in (native, portable):
        assert (got.double() - want).abs().max().item() <= bound(q, k, v, 0.2)
    # inputs the kernel does not take (16-bit, a head size that is not a multiple of 16) stay on torch's kernel
    assert not prefill_cpu.serves(q.bfloat16(), k.bfloat16()) and not prefill_cpu.serves(q[..., :24], k[..., :24])
    odd = attention._prefill_attention(q[..., :24], k[..., :24], v[..., :24], 20, 0.2, native=True)
    assert (odd.double() - reference(q[..., :24], k[..., :24], v[..., :24], 20, 0.2)).abs().max() < 1e-5


def test_wrong_inputs_are_refused_with_the_reason():
    q, k, v = case(1, 4, 0, 4, 2, 16)
    module = prefill_cpu.ready()
    with pytest.raises(RuntimeError, match="float32 only"):
        module.prefill_attention(q.double(), k.double(), v.double(), 0, 1.0)
    with pytest.raises(RuntimeError, match="head shapes do not match"):
        module.prefill_attention(q[:, :3], k, v, 0, 1.0)
    with pytest.raises(RuntimeError, match="keys must be the cached rows"):
        module.prefill_attention(q, k, v, 2, 1.0)
    with pytest.raises(RuntimeError, match="head size must be a multiple"):
        module.prefill_attention(q[..., :4].contiguous(), k[..., :4].contiguous(), v[..., :4].contiguous(), 0, 1.0)


@pytest.mark.parametrize("backend,uses_kernel", [("paged", True), ("portable", False)])
def test_engine_prefill_takes_the_kernel_only_when_its_backend_says_so(monkeypatch, backend, uses_kernel):
    """--attention-backend portable keeps prefill on torch's SDPA even when this process has the kernel loaded."""
    from test_engine_support import engine, run_all, tokens_of

    from deltaserve.engine.request import SamplingParams

    calls = []
    real = prefill_cpu.prefill_attention
    monkeypatch.setattr(prefill_cpu, "prefill_attention", lambda *a: calls.append(a) or real(*a))
    eng = engine(None, max_running_requests=2, max_total_tokens=1024, attention_backend=backend)
    # longer than a chunk the step runs as decode rows (models/batch.py DECODE_ROWS_CHUNK): a prefill's work
    ids = eng.tokenizer.encode("The capital of France is Paris, the capital of Italy is Rome, and of Spain")
    assert len(ids) > DECODE_ROWS_CHUNK
    out = run_all(eng, [(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))])[0]
    assert len(tokens_of(out)) == 2
    # its prefill step: every layer but the last, which attends for the sampled row only (as a decode row)
    assert len(calls) == (eng.runner.model.config["num_hidden_layers"] - 1 if uses_kernel else 0)
