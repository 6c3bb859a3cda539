"""Byte-valued weights on the int8 dot-product kernel (csrc/int4_int8dot.cpp), on each build (native, AVX2, AVX-VNNI:
the fixtures of test_kernels_int4_int8): 8-bit weights (kernels/int8.Int8Rows: GGUF Q8_0, compressed-tensors INT8;
kernels/int4_int8.repack_int8) and IQ4_NL / IQ4_XS's 4-bit codes naming integer levels (looked up to bytes in the
kernel). The product against a float64 product of exactly the int8 arithmetic, against the float32 path within the
activations' rounding, the AVX2 build's nibble-split sums against AVX-VNNI's bit for bit (codes at +-127 / -128 times
activations at +-127: where a plain vpmaddubsw would saturate), and the model swap."""

import pytest
import torch
from test_kernels_int4_int8 import U, activations, avx2_build, avxvnni_build, dequantized_activations, isa  # noqa: F401

from test_kernels_int4 import random_codes

from deltaserve.kernels import int4_int8
from deltaserve.kernels.int4 import Int4Codes, int4_linear, pack
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.weights.gguf_int4 import IQ4_LEVELS

CASES = [  # (N, K, group, symmetric, permuted): Q8_0 (group 32, symmetric), INT8 per group and per channel, and
    # groups of 16 (GGUF Q6_K: symmetric; asymmetric and permuted too, which the kernel takes alike)
    (96, 576, 32, True, False), (64, 512, 128, False, False), (32, 160, 160, True, False),
    (48, 256, 32, True, True), (576, 576, 32, True, False), (16, 1536, 1536, False, False),
    (96, 512, 16, True, False), (32, 288, 16, False, True)]
IDS = [f"{n}x{k}-g{g}{'-sym' if s else ''}{'-perm' if p else ''}" for n, k, g, s, p in CASES]


def int8_weight(case, seed: int) -> Int8Rows:
    """Codes over the whole int8 range (-128 included), float32 scales, offsets zero (symmetric) or -zero * scale."""
    n, k, group, symmetric, permuted = case
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int16).to(torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    zeros = torch.zeros_like(scales) if symmetric else torch.randint(-20, 21, scales.shape, generator=gen).float()
    perm = torch.randperm(k, generator=gen) if permuted else None
    return Int8Rows(codes, scales, -zeros * scales, group, perm)


def magnitude(rows: Int8Rows) -> torch.Tensor:
    """Per weight, in stored column order and float64: |s| c + |o - 128 s| with c = q + 128, the two terms the kernel
    sums (its offset carries the code's shift)."""
    n, k = rows.shape
    s = rows.scales.double().repeat_interleave(rows.group_size, dim=1)
    o = rows.offsets.double().repeat_interleave(rows.group_size, dim=1)
    return s.abs() * (rows.codes.double() + 128) + (o - 128 * s).abs()


def stored(rows: Int8Rows) -> torch.Tensor:
    """The weight in float64, stored column order."""
    return Int8Rows(rows.codes, rows.scales, rows.offsets, rows.group_size).dequantize(torch.float64)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 150])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_product_is_the_int8_arithmetic_to_float32_rounding(case, rows):
    """As the 4-bit kernel's: every c . q is an exact int32 (at most 32 x 255 x 127 < 2^24, exact in float32 too);
    fewer than 2 K / 32 + 4 float32 roundings touch any output (2 K / 16 + 4 in groups of 16: two sums and two offset
    terms a block), each at most u times the sum of the magnitudes summed, so |got - exact| <= (2 K / 32 + 4) u
    sum_k (|s| c_k + |o - 128 s|) |d q_k|, plus the bias add's."""
    n, k, group = case[:3]
    w = int8_weight(case, rows)
    x = activations(rows, k, rows + 7)
    bias = torch.randn(n)
    got = int4_int8.linear(x, int4_int8.repack_int8(w, w.perm), bias)
    stored_x = x if w.perm is None else x[:, w.perm]
    xq, _ = dequantized_activations(stored_x.contiguous(), group)
    exact = xq @ stored(w).T + bias.double()
    bound = (2 * k // min(group, 32) + 4) * U * (xq.abs() @ magnitude(w).T) + U * exact.abs()
    err = (got.double() - exact).abs()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, bound {bound.min().item():.3g}"


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_product_is_within_the_activation_rounding_of_the_float32_path(case, rows):
    """Against the float32 path (models/layers.Int8Linear: the dequantized weight times x in float32): x_k and d q_k
    differ by at most d / 2 (1 + 2^-14), so the difference is at most sum_k |w_k| d_k / 2 (1 + 2^-14) plus each
    side's float32 rounding."""
    from deltaserve.models.layers import Int8Linear

    n, k, group = case[:3]
    w = int8_weight(case, rows + 50)
    x = activations(rows, k, rows + 3)
    got = int4_int8.linear(x, int4_int8.repack_int8(w, w.perm))
    ref = Int8Linear(w, None, w.perm)(x)
    stored_x = x if w.perm is None else x[:, w.perm]
    xq, d_cols = dequantized_activations(stored_x.contiguous(), group)
    mag, plain = magnitude(w), stored(w).abs()
    bound = ((d_cols / 2 * (1 + 2.0**-14)) @ plain.T + (2 * k // min(group, 32) + 4) * U * (xq.abs() @ mag.T)
             + (k + 2) * U * (stored_x.double().abs() @ plain.T))
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"
    assert err.max() > 0  # the int8 path is not the float32 one


@pytest.mark.parametrize("isa", ["avxvnni"], indirect=True)  # this test compares the builds itself
@pytest.mark.parametrize("case", CASES[:3] + CASES[4:], ids=IDS[:3] + IDS[4:])
def test_avxvnni_product_is_the_avx2_product_bit_for_bit(case, isa, avx2_build):
    """AVX2 splits each code into nibbles (vpmaddubsw would saturate on 255 x 127 pairs) and joins lo + 16 hi in
    int32; AVX-VNNI sums whole bytes: the same integers, so the same bits, at every row count and at the extremes
    (codes at -128 and 127, every activation at +-127)."""
    n, k = case[:2]
    w = int8_weight(case, n)
    w.codes[0] = 127
    w.codes[1] = -128
    panel = int4_int8.repack_int8(w)
    for rows in range(1, 40):
        x = activations(rows, k, rows + n)
        x[0] = 1.0  # every block of row 0 quantizes to 127s
        got = int4_int8.linear(x, panel)
        with int4_int8.KERNELS.using(avx2_build):
            expect = int4_int8.linear(x, panel)
        assert torch.equal(got, expect), (rows, (got - expect).abs().max().item())


def test_groups_of_16_sum_each_half_block():
    """The activations' group sums in groups of 16 (GGUF Q6_K's) are d * sum(q) over each half of a 32-column block,
    to one float32 rounding, and the blocks' quantization is the one groups of 32 get."""
    k = 320
    x = activations(5, k, 11)
    q, d, gsum = int4_int8.quantize(x, 16)
    q32, d32, _ = int4_int8.quantize(x, 32)
    assert torch.equal(q, q32) and torch.equal(d, d32) and gsum.shape == (5, k // 16)
    halves = q.double().view(5, k // 16, 16).sum(-1) * d.double().repeat_interleave(2, dim=1)
    assert bool(((gsum.double() - halves).abs() <= U * halves.abs()).all())


def test_a_group_of_16_is_taken_only_with_6_or_8_bit_codes():
    assert int4_int8.declines(96, 512, 16, bits=8) is None
    assert "16" in int4_int8.declines(96, 512, 16)  # 4-bit codes: their blocks have no halves to scale apart
    assert int4_int8.declines(96, 520, 16, bits=8) is not None
    nibbles = int4_int8.PanelWeight(torch.zeros(6, 512 * 8, dtype=torch.uint8), torch.ones(6, 32, 16), None, 16)
    with pytest.raises(RuntimeError, match="or 16, with 6- or 8-bit codes"):  # the kernel's own check agrees
        int4_int8.linear(torch.ones(1, 512), nibbles)


def test_extreme_codes_do_not_saturate():
    """Row 0 all 127 (c = 255) and row 1 all -128 (c = 0) times activations all 127 in every block: the exact
    products are 127 s K and -128 s K, to float32 rounding, on whichever build the fixture runs."""
    k = 256
    w = Int8Rows(torch.full((16, k), 127, dtype=torch.int8), torch.full((16, k // 32), 0.5), torch.zeros(16, k // 32),
                 32)
    w.codes[1] = -128
    y = int4_int8.linear(torch.ones(1, k), int4_int8.repack_int8(w))
    assert abs(y[0, 0].item() - 0.5 * 127 * k) <= 1e-5 * 0.5 * 127 * k
    assert abs(y[0, 1].item() + 0.5 * 128 * k) <= 1e-5 * 0.5 * 128 * k


def test_repacking_keeps_codes_and_scales_bytes():
    w = int8_weight(CASES[0], 1)
    panel = int4_int8.repack_int8(w)
    assert panel.bits == 8 and panel.shape == w.shape and panel.offsets is None  # symmetric: none held
    assert panel.nbytes() == w.codes.numel() + w.scales.numel() * 4
    assert torch.equal(torch.sort(panel.codes.flatten()).values,
                       torch.sort((w.codes.view(torch.uint8) ^ 0x80).flatten()).values)
    with pytest.raises(ValueError, match="16-row panel"):
        int4_int8.repack_int8(int8_weight((50, 256, 32, True, False), 0))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_in_place_repack_equals_a_copying_one(case, monkeypatch):
    """repack_int8(in_place=True) (a fresh load's swap: a 248K-row head not held twice) makes the same panels in the
    codes' own storage, a few panels at a time (3 here: the last chunk a partial one where the panel count is not a
    multiple)."""
    monkeypatch.setattr(int4_int8, "PANELS_AT_ONCE", 3)
    w = int8_weight(case, 11)
    expect = int4_int8.repack_int8(w)
    mine = Int8Rows(w.codes.clone(), w.scales, w.offsets, w.group_size)
    got = int4_int8.repack_int8(mine, in_place=True)
    assert got.codes.data_ptr() == mine.codes.data_ptr() and torch.equal(got.codes, expect.codes)
    assert torch.equal(got.scales, expect.scales)


def test_the_model_swap_takes_int8_layers_and_a_tied_table_once():
    from torch import nn

    from deltaserve.models.int8_activations import use_int8_activations
    from deltaserve.models.layers import Int8DotLinear, Int8Embedding, Int8Linear, PanelEmbedding

    served, declined = int8_weight(CASES[0], 3), int8_weight((50, 576, 32, True, False), 4)
    table, skewed = int8_weight((64, 576, 32, True, False), 5), int8_weight((64, 576, 32, False, False), 6)
    model = nn.Module()
    model.layers = nn.Sequential(Int8Linear(served, torch.randn(96)), Int8Linear(declined))
    model.embed, model.skewed_embed = Int8Embedding(table), Int8Embedding(skewed)
    model.head = Int8Linear.of_embedding(model.embed)
    model.skewed_head = Int8Linear.of_embedding(model.skewed_embed)
    model.orphan_head = Int8Linear.of_embedding(Int8Embedding(int8_weight((64, 576, 32, True, False), 7)))  # no table here
    held = sum(b.numel() * b.element_size() for b in {id(b): b for b in model.buffers()}.values())
    x, ids = activations(3, 576, 9), torch.tensor([[0, 15, 16], [63, 31, 7]])
    expect = int4_int8.linear(x, int4_int8.repack_int8(served), model.layers[0].bias)
    rows, skewed_rows = model.embed(ids), model.skewed_embed(ids)
    swapped, lines = use_int8_activations(model, tied_heads=True)
    assert swapped == 2 and type(model.layers[0]) is Int8DotLinear and type(model.layers[1]) is Int8Linear
    # the tied head takes the panels and its embedding reads them: the table held once, its rows bit for bit
    assert type(model.head) is Int8DotLinear and type(model.embed) is PanelEmbedding
    assert model.embed.codes is model.head.codes and torch.equal(model.embed(ids), rows)
    assert torch.equal(model.head(x), int4_int8.linear(x, int4_int8.repack_int8(table)))
    # an asymmetric table would round its rows otherwise from the panels, and a table not in the model is not found
    assert type(model.skewed_head) is Int8Linear and torch.equal(model.skewed_embed(ids), skewed_rows)
    assert type(model.orphan_head) is Int8Linear
    assert sorted(line.split(": ")[1] for line in lines) == [
        "50 output rows, not a multiple of the 16-row panel",
        "a tied vocabulary projection over an asymmetric table (its lookups stay exact)",
        "a tied vocabulary projection whose embedding is not an int8 table here"]
    now = sum(b.numel() * b.element_size() for b in {id(b): b for b in model.buffers()}.values())
    assert now == held  # the same bytes, moved
    assert torch.equal(model.layers[0](x), expect)



@pytest.mark.parametrize("n,k,group,count", [(64, 576, 32, 6), (48, 512, 128, 100), (32, 640, 64, 1)])
def test_panel_rows_are_the_table_rows_natively_and_through_torch(n, k, group, count):
    """A panel table's rows (the embedding of a tied head under int8 activations) are the table's own rows, bit for bit,
    through fused_cpu's one-call gather (over 64 ids: its threaded loop) and through torch's indexing."""
    from deltaserve.kernels import fused_cpu

    assert fused_cpu.load() is not None
    table = int8_weight((n, k, group, True, False), 11)
    panel = int4_int8.repack_int8(table)
    ids = torch.randint(0, n, (count,), generator=torch.Generator().manual_seed(count))
    ids[: min(count, 3)] = torch.tensor([0, n - 1, 17])[: min(count, 3)]  # first and last rows, a lane past the first
    expect = table.codes[ids].float().view(count, k // group, group) * table.scales[ids][..., None]
    native = int4_int8.gather_rows(panel, ids)
    with fused_cpu.disabled():
        portable = int4_int8.gather_rows(panel, ids)
    assert torch.equal(native, expect.view(count, k)) and torch.equal(portable, native)
    assert torch.equal(int4_int8.gather_rows(panel, ids.view(1, -1)), native[None])
    with pytest.raises(RuntimeError, match=f"id {n} is outside the table's {n} rows"):
        fused_cpu.int8_panel_rows(panel.codes, panel.scales, torch.tensor([n]))

IQ4_CASES = [  # (N, K, group, scale dtype): IQ4_NL (float16 scale per 32), IQ4_XS (float32 products per 32)
    (96, 576, 32, torch.float16), (48, 512, 32, torch.float32), (576, 576, 32, torch.float32)]
IQ4_IDS = [f"{n}x{k}-{str(t)[6:]}" for n, k, _, t in IQ4_CASES]


def iq4_weight(case, seed: int) -> Int4Codes:
    n, k, group, dtype = case
    codes = random_codes(n, k, group, seed, dtype=dtype, symmetric=True)
    codes.lut = torch.tensor(IQ4_LEVELS, dtype=torch.float32)
    return codes


def iq4_magnitude(codes: Int4Codes) -> torch.Tensor:
    """|s| (l + 128) + 128 |s| per weight: the two terms the kernel sums (a level's byte and the offset -128 s)."""
    s = codes.scales.double().abs().repeat_interleave(codes.group_size, dim=1)
    return s * (codes.lut.double()[codes.codes.long()] + 128) + 128 * s


@pytest.mark.parametrize("rows", [1, 3, 17, 150])
@pytest.mark.parametrize("case", IQ4_CASES, ids=IQ4_IDS)
def test_iq4_product_is_the_int8_arithmetic_to_float32_rounding(case, rows):
    n, k, group = case[:3]
    codes = iq4_weight(case, rows)
    x = activations(rows, k, rows + 21)
    panel = int4_int8.repack(pack(codes))
    assert panel.levels is not None and panel.nbytes() == pack(codes).nbytes() - 16 * 4 + 16
    got = int4_int8.linear(x, panel)
    xq, _ = dequantized_activations(x, group)
    exact = xq @ codes.dequantize(torch.float64).T
    bound = (2 * k // 32 + 4) * U * (xq.abs() @ iq4_magnitude(codes).T)
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, bound {bound.min().item():.3g}"


@pytest.mark.parametrize("case", IQ4_CASES, ids=IQ4_IDS)
def test_iq4_product_is_within_the_activation_rounding_of_the_float32_path(case):
    n, k, group = case[:3]
    codes = iq4_weight(case, 77)
    x = activations(5, k, 6)
    got = int4_int8.linear(x, int4_int8.repack(pack(codes)))
    ref = int4_linear(x, pack(codes))
    xq, d_cols = dequantized_activations(x, group)
    plain = codes.dequantize(torch.float64).abs()
    bound = ((d_cols / 2 * (1 + 2.0**-14)) @ plain.T + (2 * k // 32 + 4) * U * (xq.abs() @ iq4_magnitude(codes).T)
             + (k + 2) * U * (x.double().abs() @ plain.T))
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"
    assert err.max() > 0


@pytest.mark.parametrize("isa", ["avxvnni"], indirect=True)
@pytest.mark.parametrize("case", IQ4_CASES, ids=IQ4_IDS)
def test_iq4_avxvnni_product_is_the_avx2_product_bit_for_bit(case, isa, avx2_build):
    n, k = case[:2]
    codes = iq4_weight(case, n)
    codes.codes[0] = 0  # level -127 throughout (byte 1), and row 1 at 113 (byte 241)
    codes.codes[1] = 15
    panel = int4_int8.repack(pack(codes))
    for rows in range(1, 40):
        x = activations(rows, k, rows + n)
        x[0] = -1.0
        got = int4_int8.linear(x, panel)
        with int4_int8.KERNELS.using(avx2_build):
            expect = int4_int8.linear(x, panel)
        assert torch.equal(got, expect), (rows, (got - expect).abs().max().item())
