"""The fused CPU RMSNorm kernel (kernels/fused_cpu.py) against the formula in float64, the model norms that
call it against their portable PyTorch paths, its argmax against torch's and its int8 row gather against
kernels/int8.py's torch widening. The fused conv is tested with the portable one (test_kernels_conv)."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels import fused_cpu
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.models.hybrid import GatedRMSNorm, ZeroCentredRMSNorm
from deltaserve.models.layers import Int8Embedding, RMSNorm

# every test here runs on each build of the C++ kernels: native and AVX2-only (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")

EPS = 1e-6


@pytest.fixture(autouse=True, scope="module")
def built():
    assert fused_cpu.load() is not None  # this machine builds it; where none could, the engine keeps portable


def reference(x, weight, offset, gate=None, residual=None):
    x = x.double() if residual is None else x.double() + residual.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (offset + weight.double())
    return y if gate is None else y * F.silu(gate.double())


@pytest.mark.parametrize("dim", [64, 40, 33, 1])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_formula(dim, offset):
    gen = torch.Generator().manual_seed(dim)
    x, gate, residual = (torch.randn(300, dim, generator=gen) * 3 for _ in range(3))
    weight = torch.randn(dim, generator=gen)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_cpu.rms_norm(x, weight, EPS, offset).double(), reference(x, weight, offset), **tol)
    torch.testing.assert_close(fused_cpu.rms_norm(x, weight, EPS, offset, gate=gate).double(),
                               reference(x, weight, offset, gate), **tol)
    normed, total = fused_cpu.add_rms_norm(x, residual, weight, EPS, offset)
    torch.testing.assert_close(normed.double(), reference(x, weight, offset, residual=residual), **tol)
    assert torch.equal(total, x + residual)


def test_rows_with_a_stride_and_leading_dims():
    """q of a gated attention layer: [T, H, D] views of a [T, H, 2D] projection (rows 2D apart), and empty input."""
    gen = torch.Generator().manual_seed(1)
    qg = torch.randn(7, 4, 32, generator=gen)
    q = qg[..., :16]
    weight = torch.randn(16, generator=gen)
    got = fused_cpu.rms_norm(q, weight, EPS, 1.0)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, weight, 1.0), rtol=1e-5, atol=1e-5)
    assert fused_cpu.rms_norm(torch.empty(0, 16), weight, EPS).shape == (0, 16)


def test_bad_input_names_the_limit():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        fused_cpu.rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="gate must be shaped like x"):
        fused_cpu.rms_norm(x, torch.ones(8), EPS, gate=torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="residual must be shaped like x"):
        fused_cpu.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), EPS)


def test_argmax_rows_is_torch_argmax():
    """The sampler's greedy choice: torch.argmax's answer on every row, ties (the first wins), NaN (the first NaN
    wins), infinities, a masked row (all -inf), widths that leave a vector tail, rows with a stride."""
    gen = torch.Generator().manual_seed(3)
    for width in (1, 7, 8, 17, 64, 1000, 49152):
        x = torch.randn(9, width, generator=gen)
        x[1] = x[1].round()  # many equal values
        x[2, width // 2:] = x[2].max() + 1.0  # ties at the maximum
        x[3] = float("-inf")  # a row a grammar masked entirely
        x[4, width - 1] = float("inf")
        x[5, width // 3] = float("nan")
        x[6, width - 1] = float("nan")
        x[6, 0] = float("inf")
        x[7, width // 2:] = float("nan")
        x[8] = 0.0
        assert torch.equal(fused_cpu.argmax(x), x.argmax(-1)), width
        strided = torch.randn(5, 2 * width, generator=gen)[:, :width]
        assert torch.equal(fused_cpu.argmax(strided), strided.argmax(-1)), width
    wide = torch.randn(3, 49152, generator=gen).round().clamp(max=2.0)  # equal maxima in every piece a thread takes
    wide[1, 5] = float("nan")  # a NaN in the first piece, a larger number in the last
    wide[1, 45000] = 3.0
    wide[2, 40000] = float("nan")
    kept = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 6):  # pieces of 8,192 at least: one to six of them
            torch.set_num_threads(threads)
            assert torch.equal(fused_cpu.argmax(wide), wide.argmax(-1)), threads
    finally:
        torch.set_num_threads(kept)
    assert fused_cpu.argmax(torch.randn(0, 5)).shape == (0,)
    with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
        fused_cpu.KERNELS.module.argmax_rows(torch.randn(4, 8).double())


@pytest.mark.parametrize("group", [32, 64, 576])
def test_int8_rows_equal_the_torch_gather(group):
    """A decode step's embedding lookup: the rows of a symmetric int8 table widened by the kernel equal
    Int8Rows.gather's torch ops bit for bit (one rounding of code * scale either way), repeated and edge ids too;
    an id outside the table is refused by name. An embedding with offsets keeps the torch path."""
    gen = torch.Generator().manual_seed(5)
    n, k = 300, 576
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02
    rows = Int8Rows(codes, scales, torch.zeros_like(scales), group)
    ids = torch.tensor([0, 7, 7, n - 1, 123])
    got = fused_cpu.int8_rows(codes, scales, ids)
    assert got.dtype == torch.float32 and torch.equal(got, rows.gather(ids))
    embedding = Int8Embedding(rows)
    assert embedding.symmetric and torch.equal(embedding(ids), rows.gather(ids))
    with pytest.raises(RuntimeError, match="int8_rows: id 300 is outside the table's 300 rows"):
        fused_cpu.int8_rows(codes, scales, torch.tensor([1, n]))
    shifted = Int8Rows(codes, scales, torch.randn(n, k // group, generator=gen), group)
    embedding = Int8Embedding(shifted)
    assert not embedding.symmetric and torch.equal(embedding(ids), shifted.gather(ids))


@pytest.mark.parametrize("norm_cls", [RMSNorm, ZeroCentredRMSNorm, GatedRMSNorm])
def test_model_norms_equal_their_portable_paths(norm_cls):
    gen = torch.Generator().manual_seed(2)
    norm = norm_cls(48, EPS)
    norm.weight = torch.nn.Parameter(torch.randn(48, generator=gen), requires_grad=False)
    x, other = torch.randn(2, 9, 48, generator=gen), torch.randn(2, 9, 48, generator=gen)

    def outputs():
        if norm_cls is GatedRMSNorm:
            return (norm(x, other),)
        return (norm(x), *norm.after_add(x[0], other[0]))

    fused = outputs()
    with fused_cpu.disabled():
        portable = outputs()
    for a, b in zip(fused, portable):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [1536, 40, 7])
def test_silu_mul_matches_float64(width):
    """silu(gate) * up in place, against float64: the exponential (~1 ulp) and three roundings (the sum, the
    quotient, the product), so a few units of float32 rounding of the product. Gates past the exponential's
    range: below -87.3 its input is clamped at 88.7, so silu is taken as ~gate * e^-88.7, within 2^-126 |gate|."""
    g = torch.Generator().manual_seed(width)
    gate = torch.randn(70, width, generator=g) * 8
    gate[0, : min(width, 4)] = torch.tensor([-100.0, 100.0, -87.5, 88.9])[: min(width, 4)]
    up = torch.randn(70, width, generator=g)
    want = F.silu(gate.double()) * up.double()
    got = fused_cpu.silu_mul(gate.clone(), up)
    clamped = 2.0**-126 * (gate.double() * up.double()).abs()
    assert ((got.double() - want).abs() <= 8 * 2.0**-24 * want.abs() + clamped).all()
    strided = torch.randn(70, 2 * width, generator=g)[:, :width]  # rows with a stride, as a split projection has
    assert torch.allclose(fused_cpu.silu_mul(strided.clone(), up), F.silu(strided) * up, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rotary", [64, 32])  # the whole head, and partial rotary (Qwen3-Next: a quarter)
def test_rope_equals_the_portable_rotation(rotary):
    """The rotate-half rotation against float64: two products and a sum a channel (two roundings with the FMA);
    channels past the rotary part pass through unchanged."""
    g = torch.Generator().manual_seed(rotary)
    qkv = torch.randn(33, 9 + 3, 64, generator=g)
    x = qkv[:, :9]  # rows with a stride, heads contiguous: a split projection's view
    angles = torch.randn(33, 1, rotary // 2, generator=g) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = fused_cpu.rope(x, cos, sin)
    xd, half = x.double(), rotary // 2
    rot = xd[..., :rotary]
    want = rot * cos.double() + torch.cat([-rot[..., half:], rot[..., :half]], -1) * sin.double()
    magnitude = rot.abs() * cos.double().abs() + rot.flip(-1).abs() * sin.double().abs()  # bounds each term
    assert ((got[..., :rotary].double() - want).abs() <= 2 * 2.0**-24 * (magnitude + rot.abs().max())).all()
    assert torch.equal(got[..., rotary:], x[..., rotary:])
    assert fused_cpu.rope(x.double(), cos, sin) is None  # not float32: the caller's torch ops serve
    with pytest.raises(RuntimeError, match="rd even <= D"):
        fused_cpu.KERNELS.module.rope(x, cos[:, 0, :rotary - 1], sin[:, 0, :rotary - 1])


def test_denormals_flushed_reads_them_as_zero_on_every_thread_and_only_inside():
    """Inside denormals_flushed (what the engine wraps each step in), a denormal input is read as zero by the kernels
    on every thread of the team: rms_norm of rows of 1e-39 gives 0, where without it 1e-39 / sqrt(1e-78 + eps) is a
    normal float (torch.set_flush_denormal alone leaves the worker thread's half of the rows: measured). After the
    block every thread computes with denormals again (process state other code relies on). And the chunked gated
    delta rule of a head whose decays pass through the denormal range keeps its result (within float32 rounding of
    the portable path)."""
    # 1e-39, a denormal, written by its bits (inside the block even torch's conversions read it as 0)
    rows = torch.full((65536, 64), 0x000AE398, dtype=torch.int32).view(torch.float32)  # split over the threads
    with fused_cpu.denormals_flushed():
        assert torch.count_nonzero(fused_cpu.rms_norm(rows, torch.ones(64), 1e-6)) == 0
    assert torch.count_nonzero(fused_cpu.rms_norm(rows, torch.ones(64), 1e-6)) == rows.numel()
    assert torch.tensor(1e-39).item() != 0.0  # this thread's own state back
    from deltaserve.kernels.gated_delta import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(200, 2, 32, generator=g), torch.randn(200, 2, 32, generator=g)
    v = torch.randn(200, 4, 32, generator=g)
    decay = -3 * torch.rand(200, 4, generator=g)  # exp(G) over a 64-row chunk reaches 1e-80: through the denormals
    beta = torch.rand(200, 4, generator=g)
    with fused_cpu.denormals_flushed():
        native, state = chunk_gated_delta_rule(q, k, v, decay, beta)
    with fused_cpu.disabled():
        portable, portable_state = chunk_gated_delta_rule(q, k, v, decay, beta)
    torch.testing.assert_close(native, portable, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, portable_state, rtol=1e-4, atol=1e-5)
