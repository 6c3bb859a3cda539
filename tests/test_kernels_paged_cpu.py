"""The CPU decode kernel that reads the paged KV cache in place, and the portable gather + SDPA path beside it,
against a float64 softmax attention written here."""

import pytest
import torch

from deltaserve.kernels import paged_cpu
from deltaserve.kernels.attention import _decode_attention

# every test here runs on each build of the C++ kernels: native and AVX2-only (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")


@pytest.fixture(scope="module")
def kernel():
    module = paged_cpu.load()
    if module is None:
        pytest.fail("the paged CPU kernel did not build here (needs ninja and a C++ compiler)")
    return module


def reference(q, k_cache, v_cache, slots, lens, scale):
    """float64 softmax(q k^T * scale) v per sequence, key head h serving query heads h*G .. h*G+G-1."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(lens):
        k = k_cache[slots[b, :length]].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots[b, :length]].double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", weights, v)
    return out


def scattered_case(seed, heads, kv_heads, d, lens, dtype, pool=1024):
    """Random queries [B, heads, d] and caches [pool, kv_heads, d] of `dtype`; sequence b's lens[b] rows lie at
    random slots of the pool, as pages do. Returns (q, k_cache, v_cache, slots [B, max(lens)])."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, kv_heads, d, generator=g).to(dtype)
    order = torch.randperm(pool, generator=g)
    slots = torch.zeros(len(lens), max(lens), dtype=torch.long)
    start = 0
    for b, length in enumerate(lens):
        slots[b, :length] = order[start:start + length]
        start += length
    return torch.randn(len(lens), heads, d, generator=g), k_cache, v_cache, slots


# Head sizes 64 / 128 / 256 take the vector path, 40 and groups above 16 the plain loop; lengths cross the kernel's
# 32-row tiles (31, 32, 33, 300) and stay inside one (1, 5, 17).
@pytest.mark.parametrize("heads,kv_heads,d,lens", [
    (9, 3, 64, [1, 17, 300, 64]), (4, 4, 64, [5]), (8, 1, 64, [129, 2]), (6, 2, 128, [31, 32, 33]),
    (2, 1, 256, [70]), (4, 2, 40, [3, 65]), (17, 1, 64, [40]),
])
def test_paged_decode_matches_float64_attention(kernel, heads, kv_heads, d, lens):
    q, k_cache, v_cache, slots = scattered_case(len(lens) * heads + d, heads, kv_heads, d, lens, torch.float32)
    got = paged_cpu.paged_decode_attention(q, k_cache, v_cache, slots, torch.tensor(lens), d ** -0.5)
    want = reference(q, k_cache, v_cache, slots, lens, d ** -0.5)
    assert (got.double() - want).abs().max().item() <= 1e-5
    portable = _decode_attention(q, k_cache, v_cache, slots, lens, d ** -0.5)
    assert (portable.double() - want).abs().max().item() <= 1e-5


# --kv-dtype bfloat16 / float16: the kernel widens each row on load and computes in float32, so it must equal a
# float64 attention over the very values stored (the rounding to 16 bits happened when the rows were written).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,lens", [
    (9, 3, 64, [1, 17, 300, 64]), (6, 2, 128, [31, 32, 33]), (2, 1, 256, [70]), (4, 2, 40, [3, 65]),
])
def test_paged_decode_reads_16_bit_caches(kernel, dtype, heads, kv_heads, d, lens):
    q, k_cache, v_cache, slots = scattered_case(7 * heads + d, heads, kv_heads, d, lens, dtype)
    got = paged_cpu.paged_decode_attention(q, k_cache, v_cache, slots, torch.tensor(lens), d ** -0.5)
    assert got.dtype == torch.float32
    want = reference(q, k_cache, v_cache, slots, lens, d ** -0.5)
    assert (got.double() - want).abs().max().item() <= 1e-5
    portable = _decode_attention(q, k_cache, v_cache, slots, lens, d ** -0.5)
    assert (portable.double() - want).abs().max().item() <= 1e-5


# Contexts longer than the kernel's split (128 rows: paged_attention.h SPLIT) are attended in splits merged after;
# the splits follow a row's own length alone, so a verifying request's rows (contexts L, L + 1, .., L + k over one
# slot list, attended together as a run) give each row the bits it gets alone. Lengths sit on both sides of the
# split boundaries; the first row of each run is short of a split the run's last row starts.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,first,rows", [
    (9, 3, 64, 126, 4), (9, 3, 64, 254, 5), (9, 3, 64, 511, 3), (9, 3, 64, 1000, 2), (4, 1, 64, 256, 4),
    (6, 2, 128, 767, 3), (2, 1, 256, 300, 2),
])
def test_long_contexts_and_verifying_runs_match_float64_and_each_row_alone(kernel, dtype, heads, kv_heads, d,
                                                                           first, rows):
    last = first + rows - 1
    q, k_cache, v_cache, slots = scattered_case(first + d, heads, kv_heads, d, [last], dtype, pool=2048)
    q = torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(first))
    run_slots = slots.expand(rows, -1).contiguous()
    lens = [first + j for j in range(rows)]
    together = paged_cpu.paged_decode_attention(q, k_cache, v_cache, run_slots, torch.tensor(lens), d ** -0.5)
    want = reference(q, k_cache, v_cache, run_slots, lens, d ** -0.5)
    assert (together.double() - want).abs().max().item() <= 1e-5
    for j in range(rows):
        alone = paged_cpu.paged_decode_attention(q[j:j + 1], k_cache, v_cache, slots[:, :lens[j]].contiguous(),
                                                 torch.tensor(lens[j:j + 1]), d ** -0.5)
        assert torch.equal(alone[0], together[j]), f"row {j} (context {lens[j]}) differs alone and in its run"


def test_rejects_what_it_cannot_read(kernel):
    q, cache = torch.randn(1, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 caches only"):
        paged_cpu.paged_decode_attention(q, cache.half(), cache.bfloat16(), torch.zeros(1, 1, dtype=torch.long),
                                         torch.ones(1, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 caches only"):
        paged_cpu.paged_decode_attention(q.double(), cache.double(), cache.double(), torch.zeros(1, 1,
                                         dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)


@pytest.mark.parametrize("backend,uses_kernel", [("paged", True), ("portable", False)])
def test_engine_takes_the_kernel_only_when_its_backend_says_so(kernel, monkeypatch, backend, uses_kernel):
    """--attention-backend portable keeps decode on gather + SDPA even when this process has the kernel loaded."""
    from deltaserve.engine.request import SamplingParams
    from test_engine_support import engine, run_all, tokens_of

    from deltaserve.kernels import decode_cpu

    calls = []

    def counting(real):
        def counted(*args):
            calls.append(real)
            return real(*args)
        return counted

    # the kernel serves decode on its own, or inside kernels/decode_cpu.py's fused attention block (its source),
    # called per layer or for all layers at once (decode_stack)
    monkeypatch.setattr(paged_cpu, "paged_decode_attention", counting(paged_cpu.paged_decode_attention))
    monkeypatch.setattr(decode_cpu, "attention_block", counting(decode_cpu.attention_block))
    monkeypatch.setattr(decode_cpu.Stack, "run_with", staticmethod(counting(decode_cpu.Stack.run_with)))
    eng = engine(None, max_running_requests=2, max_total_tokens=1024, attention_backend=backend)
    ids = eng.tokenizer.encode("The capital of France is")
    out = run_all(eng, [(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])[0]
    assert len(tokens_of(out)) == 4
    assert bool(calls) == uses_kernel  # each of the 3 decode steps when it does
