"""GGUF's K-quants held as compactly as their files hold them on the int8 dot-product kernel (kernels/int4_int8.py,
csrc/int4_int8dot.cpp), on each build (native, AVX2, AVX-VNNI: test_kernels_int4_int8's fixtures): Q4_K and IQ4_XS's
scales as a float32 per 256 columns times an int8 per group, Q6_K and Q5_K's codes in 6 bits. Blocks are random
bits with sane float16 scales (the formats' own layouts); the oracle is gguf-py's own `gguf.quants.dequantize`: the
held panels widen to its values bit for bit, the product is that weight times the kernel's own int8 rows to float32
rounding (the bound of test_kernels_int4_int8), a 4-bit product is the float-scaled panels' bit for bit, and the
tied table's rows read from 6-bit panels are its own rows."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_kernels_int4_int8 import U, activations, avx2_build, avxvnni_build, dequantized_activations, isa  # noqa: F401
from test_weights_gguf import raw_blocks
from test_weights_gguf_kquant8 import random_blocks

from deltaserve.kernels import fused_cpu, int4_int8
from deltaserve.kernels.int4 import pack
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.weights.gguf_int4 import int4_codes
from deltaserve.weights.gguf_int8 import int8_rows

FOUR_BIT, SIX_BIT = (Q.Q4_K, Q.IQ4_XS), (Q.Q6_K, Q.Q5_K)
# bytes a weight of N x K holds, per N x K / 256: codes, then (4 + G) per 256 columns for the scales and the offsets
HELD_PER_256 = {Q.Q4_K: 128 + 2 * (4 + 8), Q.IQ4_XS: 128 + 4 + 8, Q.Q6_K: 192 + 4 + 16, Q.Q5_K: 192 + 2 * (4 + 16)}
SHAPES = [(48, 512), (32, 1024)]  # a pair of 16-row units and a lone one; two and four super-blocks a row


def blocks(kind: Q, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind in (Q.Q6_K, Q.Q5_K):
        return random_blocks(kind, n, k, rng)
    if kind == Q.Q4_K:
        return raw_blocks(kind, n, k, rng)
    raw = rng.integers(0, 256, (n * k // 256, 136), dtype=np.uint8)  # IQ4_XS: float16 d, then 6-bit ls, codes
    raw[:, 0:2] = rng.uniform(1e-4, 4e-3, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def held(kind: Q, raw: np.ndarray, n: int, k: int) -> int4_int8.PanelWeight:
    if kind in FOUR_BIT:
        return int4_int8.repack(pack(int4_codes(raw, kind, (n, k))))
    return int4_int8.repack_int8(int8_rows(raw, kind, (n, k)))


def dequantized(kind: Q, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", [*FOUR_BIT, *SIX_BIT], ids=lambda q: q.name)
def test_held_compactly_and_widening_to_the_formats_own_values(kind, shape):
    n, k = shape
    raw = blocks(kind, n, k, n + k)
    w = held(kind, raw, n, k)
    assert w.bits == (6 if kind in SIX_BIT else 4) and w.scales.dtype == torch.int8
    assert (w.offsets is not None) == (kind in (Q.Q4_K, Q.Q5_K))
    assert w.nbytes() == n * k // 256 * HELD_PER_256[kind] + (16 if kind == Q.IQ4_XS else 0)
    assert torch.equal(int4_int8.panel_values(w).reshape(n, k), dequantized(kind, raw, n, k))


def magnitude(w: int4_int8.PanelWeight) -> torch.Tensor:
    """Per weight, float64 [N, K]: |s| c + |o|, the two terms the kernel sums, with c the byte it multiplies (a 4- or
    6-bit code; an IQ4 level + 128) and o the stored offset or the code's shift times s (-8 s, -32 s, -128 s)."""
    count, k = w.codes.shape[0], w.shape[1]
    panels, groups = torch.arange(count), k // w.group_size
    codes = int4_int8._panel_codes(w, panels).double() + (128 if w.levels is not None else 0)
    s = int4_int8._panel_group_params(w.scales, panels, groups).double()
    zero = 128 if w.levels is not None else {4: 8, 6: 32}[w.bits]
    o = s * -zero if w.offsets is None else int4_int8._panel_group_params(w.offsets, panels, groups).double()
    mag = codes.view(count, 16, groups, -1) * s.abs()[..., None] + o.abs()[..., None]
    return mag.reshape(count * 16, k)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("kind", [*FOUR_BIT, *SIX_BIT], ids=lambda q: q.name)
def test_product_is_the_int8_arithmetic_to_float32_rounding(kind, rows):
    """gguf-py's weight (float64) times d * q (the kernel's own int8 rows): every c . q is an exact integer; fewer
    than 2 K / 16 + 4 float32 roundings touch an output (two sums and two offset terms a half block at most), each
    at most u times the magnitudes summed, so |got - exact| <= (2 K / 16 + 4) u sum_k (|s| c_k + |o|) |d q_k|."""
    n, k = SHAPES[0]
    raw = blocks(kind, n, k, rows)
    w = held(kind, raw, n, k)
    x = activations(rows, k, rows + 7)
    got = int4_int8.linear(x, w)
    xq, _ = dequantized_activations(x, w.group_size)
    exact = xq @ dequantized(kind, raw, n, k).double().T
    bound = (2 * k // 16 + 4) * U * (xq.abs() @ magnitude(w).T)
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, bound {bound.min().item():.3g}"


@pytest.mark.parametrize("kind", FOUR_BIT, ids=lambda q: q.name)
def test_super_scales_give_the_float_scales_product_bit_for_bit(kind):
    """The same codes times the same float32 scales (d x sub is the loader's product, exactly): the same bits."""
    n, k = SHAPES[1]
    codes = pack(int4_codes(blocks(kind, n, k, 5), kind, (n, k)))
    compact = int4_int8.repack(codes)
    dense = int4_int8.PanelWeight(compact.codes, int4_int8._panel_params(codes.scales),
                                  int4_int8._panel_params(codes.offsets), compact.group_size, levels=compact.levels)
    x = activations(5, k, 9)
    assert compact.scales.dtype == torch.int8
    assert torch.equal(int4_int8.linear(x, compact), int4_int8.linear(x, dense))


@pytest.mark.parametrize("isa", ["native"], indirect=True)
def test_a_tied_q6_k_table_reads_its_own_rows_from_6_bit_panels(isa):
    n, k = 64, 512
    raw = blocks(Q.Q6_K, n, k, 3)
    w = held(Q.Q6_K, raw, n, k)
    ids = torch.tensor([[0, 17], [63, 17]])
    expect = dequantized(Q.Q6_K, raw, n, k)[ids]
    assert fused_cpu.load(print) is not None
    assert torch.equal(int4_int8.gather_rows(w, ids), expect)
    widened = int4_int8.panel_values(w, ids.reshape(-1) // 16)[torch.arange(4), ids.reshape(-1) % 16]
    assert torch.equal(widened.view(2, 2, k), expect)  # gather_rows' torch path, where the native call is absent


@pytest.mark.parametrize("isa", ["native"], indirect=True)
def test_what_does_not_factor_or_fit_keeps_the_float_form():
    n, k = 32, 512
    w = int8_rows(blocks(Q.Q6_K, n, k, 1), Q.Q6_K, (n, k))
    loose = w.scales.clone()
    loose[3, 5] *= 1.0 + 2.0**-20  # no int8 multiple of one float32 any more, in one super-block
    kept = int4_int8.repack_int8(Int8Rows(w.codes, loose, w.offsets, 16))
    assert kept.bits == 8 and kept.scales.dtype == torch.float32
    wide = w.codes.clone()
    wide[0, 0] = 40  # beyond q - 32 .. 31
    assert int4_int8.repack_int8(Int8Rows(wide, w.scales, w.offsets, 16)).bits == 8
    q8 = int8_rows(gguf.quants.quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), Q.Q8_0),
                   Q.Q8_0, (n, k))
    assert int4_int8.repack_int8(q8).bits == 8  # Q8_0's scales are free floats: its bytes stay
    assert int4_int8.KERNELS.module.int4_int8_super(loose.contiguous(), 16).numel() == 0
