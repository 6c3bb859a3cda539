"""The 4-bit x int8 dot-product kernel (kernels/int4_int8.py, csrc/int4_int8dot.cpp), on each build (native: AVX-512
VNNI where the CPU has it; AVX2; AVX-VNNI without AVX-512 where the CPU has avx_vnni): its activation quantization
against the same float32 operations in torch, its product against a float64 product of exactly that int8
arithmetic, and against the float32 packed path within the activations' rounding; the AVX-VNNI build's product is the
AVX2 build's, bit for bit."""

import contextlib

import pytest
import torch
from test_kernels_int4 import random_codes

from deltaserve.kernels import int4_int8
from deltaserve.kernels.cpp_build import cpu_features
from deltaserve.kernels.int4 import Int4Codes, int4_linear, pack

U = 2.0**-24  # float32 unit roundoff


@pytest.fixture(scope="module")
def avx2_build():
    flags = cpu_features().split()
    if "avx2" not in flags or "fma" not in flags:
        pytest.skip("this CPU has no AVX2: the AVX2 build cannot run here")
    module = int4_int8.KERNELS.variant("avx2").load(print)
    assert module is not None
    return module


@pytest.fixture(scope="module")
def avxvnni_build():
    flags = cpu_features().split()
    if "avx_vnni" not in flags:
        pytest.skip("this CPU has no AVX-VNNI (avx_vnni): the AVX-VNNI build cannot run here")
    module = int4_int8.KERNELS.variant("avxvnni").load(print)
    assert module is not None
    return module


@pytest.fixture(params=["native", "avx2", "avxvnni"], autouse=True)
def isa(request):
    """Each build in turn: -march=native (VNNI here when the CPU has it), AVX2 only (vpmaddubsw) and AVX2 with
    AVX-VNNI (256-bit vpdpbusd, no AVX-512: Alder Lake's native build)."""
    assert int4_int8.load(print) is not None
    with contextlib.ExitStack() as stack:
        if request.param != "native":
            stack.enter_context(int4_int8.KERNELS.using(request.getfixturevalue(f"{request.param}_build")))
            assert int4_int8.isa() == {"avx2": "avx2", "avxvnni": "avx_vnni"}[request.param]
        yield request.param


def torch_quantize(x: torch.Tensor):
    """x [M, K] float32 quantized per 32 columns with the kernel's float32 operations: d = max|x| * fl(1/127),
    q = round-half-even(x * fl(1 / d))."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(-1) * torch.tensor(1 / 127, dtype=torch.float32)
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    q = torch.round(blocks * inv[..., None])
    return q.to(torch.int8).view(m, k), d


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows with an outlier column (as a transformer's hidden state has) and one all-zero block."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 40
    x[0, 32:64] = 0
    return x


def dequantized_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d * q in float64, d per column) from the kernel's own quantization of x."""
    q, d, _ = int4_int8.quantize(x, group)
    d_cols = d.double().repeat_interleave(32, dim=1)
    return q.double() * d_cols, d_cols


@pytest.mark.parametrize("group", [32, 64, 160])
def test_quantization_is_the_float32_rounding(group):
    k = 320
    x = activations(7, k, 3)
    x[1, :32] = torch.linspace(-1, 1, 32)  # exact halves on the way: ties go to even
    q, d, gsum = int4_int8.quantize(x, group)
    q_ref, d_ref = torch_quantize(x)
    assert torch.equal(d, d_ref)
    assert torch.equal(q, q_ref)
    assert int(q.abs().max()) == 127  # every block's largest value lands on +-127
    per_block = d.double() * q.double().view(7, k // 32, 32).sum(-1)
    expect = per_block.view(7, k // group, group // 32).sum(-1)
    bound = (group // 32 + 1) * U * (d.double() * q.double().view(7, k // 32, 32).abs().sum(-1)).view(
        7, k // group, group // 32).sum(-1)
    assert bool(((gsum.double() - expect).abs() <= bound).all())


CASES = [  # (N, K, group, symmetric, scale dtype, permutation): GGUF Q4_1 and Q4_0, group sizes, per channel
    (96, 576, 32, False, torch.float16, False), (64, 576, 32, True, torch.float16, False),
    (48, 512, 64, False, torch.float32, False), (32, 512, 128, True, torch.bfloat16, True),
    (16, 256, 256, False, torch.bfloat16, False), (32, 160, 160, False, torch.float16, False)]
IDS = [f"{n}x{k}-g{g}{'-sym' if s else ''}-{str(t)[6:]}{'-perm' if p else ''}" for n, k, g, s, t, p in CASES]


def weight(case, seed: int) -> Int4Codes:
    n, k, group, symmetric, dtype, perm = case
    return random_codes(n, k, group, seed, perm=perm, dtype=dtype, symmetric=symmetric)


def magnitude(codes: Int4Codes) -> torch.Tensor:
    """|scale * code| + |offset| per weight, float64 in the checkpoint's column order."""
    return Int4Codes(codes.codes, codes.scales.float().abs(), codes.offset_values().abs(), codes.group_size,
                     None, codes.perm).dequantize(torch.float64)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 64, 150])  # 150: three tasks of rows (ROW_CHUNK 64)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_product_is_the_int8_arithmetic_to_float32_rounding(case, rows):
    """The kernel's result against W (dequantized, float64) times d * q (the kernel's own quantized rows, float64).
    Every c . q is an exact int32; what rounds is the float32 part: each block's s * d (one rounding), its multiply-
    add into the row's sum (one), each group's offset term and block sums (K / 32 more at most): fewer than
    2 K / 32 + 4 roundings on any path, so |got - exact| <= (2 K / 32 + 4) u sum_k (|s c_k| + |o|) |d q_k|, plus
    one rounding of the bias add."""
    n, k, group = case[:3]
    codes = weight(case, rows)
    x = activations(rows, k, rows + 11)
    bias = torch.randn(n)
    panel = int4_int8.repack(pack(codes))
    got = int4_int8.linear(x, panel, bias)
    # the kernel quantizes the columns in stored order: the reference does the same, then multiplies W in it
    stored_x = x if codes.perm is None else x[:, codes.perm]
    xq, _ = dequantized_activations(stored_x.contiguous(), group)
    w = codes.dequantize(torch.float64)
    mag = magnitude(codes)
    if codes.perm is not None:
        w, mag = w[:, codes.perm], mag[:, codes.perm]
    exact = xq @ w.T + bias.double()
    bound = (2 * k // 32 + 4) * U * (xq.abs() @ mag.T) + U * exact.abs()
    err = (got.double() - exact).abs()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, bound {bound.min().item():.3g}"


@pytest.mark.parametrize("rows", [1, 4, 33])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_product_is_within_the_activation_rounding_of_the_float32_path(case, rows):
    """Against the float32 packed path: x_k and d q_k differ by at most d / 2 (half a quantum; the float32 x * (1/d)
    and d = max|x| * fl(1/127) move x / d by a few units of roundoff of 127, covered by the factor 1 + 2^-14), so
    |int8 - float32| <= sum_k |w_k| d_k / 2 (1 + 2^-14), plus each side's float32 rounding (the bound above for the
    int8 side, (K + 2) u sum |x| |w| for the float32 one)."""
    n, k, group = case[:3]
    codes = weight(case, rows + 100)
    x = activations(rows, k, rows + 5)
    w = pack(codes)
    got = int4_int8.linear(x, int4_int8.repack(w))
    ref = int4_linear(x, w)
    stored_x = x if codes.perm is None else x[:, codes.perm]
    xq, d_cols = dequantized_activations(stored_x.contiguous(), group)
    mag = magnitude(codes)
    if codes.perm is not None:
        mag = mag[:, codes.perm]
    rounding = (d_cols / 2 * (1 + 2.0**-14)) @ mag.T
    bound = rounding + (2 * k // 32 + 4) * U * (xq.abs() @ mag.T) + (k + 2) * U * (stored_x.double().abs() @ mag.T)
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"
    assert err.max() > 0  # the int8 path is not the float32 one (a dispatch mistake would pass the bound)


BIT_CASES = [  # (N, K, group, symmetric, scale dtype): NP_MAX pairs of units and a lone one, groups of 1..18 blocks
    (576, 576, 32, False, torch.float16), (144, 576, 64, True, torch.float32), (48, 1536, 128, False, torch.bfloat16),
    (16, 576, 576, True, torch.bfloat16), (80, 320, 320, False, torch.float32), (32, 256, 32, True, torch.float16)]


@pytest.mark.parametrize("isa", ["avxvnni"], indirect=True)  # this test compares the builds itself
@pytest.mark.parametrize("case", BIT_CASES, ids=[f"{n}x{k}-g{g}{'-sym' if s else ''}-{str(t)[6:]}"
                                                 for n, k, g, s, t in BIT_CASES])
def test_avxvnni_product_is_the_avx2_product_bit_for_bit(case, isa, avx2_build):
    """The AVX-VNNI tile sums each block's products into int32 with vpdpbusd, the AVX2 one into int16 pairs and then
    int32: the same exact integers, scaled and summed by the same float32 operations in the same order, so every
    row count (tails of the 2-row tile, several 64-row tasks) gives the same bits."""
    n, k, group, symmetric, dtype = case
    panel = int4_int8.repack(pack(random_codes(n, k, group, n + k, dtype=dtype, symmetric=symmetric)))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    for rows in range(1, 71):
        x = activations(rows, k, rows + n)
        got = int4_int8.linear(x, panel, bias)
        with int4_int8.KERNELS.using(avx2_build):
            expect = int4_int8.linear(x, panel, bias)
        assert torch.equal(got, expect), (rows, (got - expect).abs().max().item())


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_split_the_panels_without_changing_a_bit(threads):
    codes = weight(CASES[0], 5)
    panel = int4_int8.repack(pack(codes))
    x = activations(9, 576, 2)
    kept = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = int4_int8.linear(x, panel)
    finally:
        torch.set_num_threads(kept)
    assert torch.equal(got, int4_int8.linear(x, panel))  # a row's sum runs in one order whatever the split


def test_repacking_moves_the_bytes_and_keeps_their_count():
    w = pack(weight(CASES[0], 1))
    panel = int4_int8.repack(w)
    assert panel.nbytes() == w.nbytes() and panel.shape == w.shape
    assert torch.equal(torch.sort(panel.codes.flatten()).values, torch.sort(w.packed.flatten()).values)


def test_declines_what_it_cannot_take():
    from deltaserve.weights.gguf_int4 import IQ4_LEVELS

    assert int4_int8.declines(96, 576, 32) is None
    assert int4_int8.declines(96, 576, 32, torch.tensor(IQ4_LEVELS, dtype=torch.float32)) is None
    assert "not integers" in int4_int8.declines(96, 576, 32, torch.linspace(-1, 1, 16))
    assert "not integers" in int4_int8.declines(96, 576, 32, torch.arange(16.0) * 20)  # past 127
    assert "offsets" in int4_int8.declines(96, 576, 32, torch.tensor(IQ4_LEVELS, dtype=torch.float32), offsets=True)
    assert "16-row panel" in int4_int8.declines(50, 576, 32)
    assert int4_int8.declines(96, 560, 32) is not None
    with pytest.raises(ValueError, match="16-row panel"):
        int4_int8.repack(pack(random_codes(50, 256, 64, 0)))


def test_the_model_swap_takes_the_layers_the_kernel_serves():
    from torch import nn

    from deltaserve.models.int8_activations import Int8DotLinear, use_int8_activations
    from deltaserve.models.layers import Int4Linear

    served, declined = weight(CASES[0], 3), random_codes(50, 576, 32, 4)
    model = nn.Sequential(Int4Linear(served, torch.randn(96)), Int4Linear(declined, None))
    held = sum(b.numel() * b.element_size() for b in model.buffers())
    x = activations(3, 576, 9)
    expect = int4_int8.linear(x, int4_int8.repack(pack(served)), model[0].bias)
    swapped, lines = use_int8_activations(model)
    assert swapped == 1 and type(model[0]) is Int8DotLinear and type(model[1]) is Int4Linear
    assert len(lines) == 1 and "16-row panel" in lines[0] and "1 layers" in lines[0]
    assert sum(b.numel() * b.element_size() for b in model.buffers()) == held  # the same bytes, moved
    assert torch.equal(model[0](x), expect)
