"""4-bit weights held packed: codes read from GGUF blocks against transformers' dequantizer, and the packed matmul
(C++ decode kernel, widened-tile prefill, portable torch path) against a float64 product of the dequantized weight."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_weights_gguf import transformers_dequant, write_gguf

from deltaserve.kernels import int4_cpu
from deltaserve.kernels.int4 import Int4Codes, PackedInt4, _stored, int4_linear, pack, packable
from deltaserve.weights import load_checkpoint

# every test here runs on each build of the C++ kernels: native and AVX2-only (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")


@pytest.fixture(scope="module")
def q4_checkpoint(tmp_path_factory):
    """A GGUF with Q4_0 and Q4_1 matrices, one of them llama's rotary-permuted attn_q, and what each decodes to."""
    rng = np.random.default_rng(1)
    tensors, expected = {}, {}
    for qtype, name in ((Q.Q4_0, "blk.0.ffn_up.weight"), (Q.Q4_1, "blk.0.attn_q.weight")):
        values = rng.standard_normal((64, 256)).astype(np.float32)
        raw = gguf.quants.quantize(values, qtype)
        tensors[name] = (raw, qtype)
        expected[name] = transformers_dequant(raw, qtype).reshape(64, 256)
    path = write_gguf(tmp_path_factory.mktemp("q4") / "q4.gguf", tensors, heads=2, kv_heads=1, hidden=256)
    return path, expected


def test_codes_read_from_blocks_decode_like_transformers(q4_checkpoint):
    path, expected = q4_checkpoint
    packed = load_checkpoint(path, keep_int4=True).tensors
    dense = load_checkpoint(path).tensors
    for hf_name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        codes = packed[hf_name]
        assert isinstance(codes, PackedInt4) and codes.group_size == 32  # packed as read: no 1-byte codes kept
        assert codes.packed.dtype == torch.uint8 and codes.packed.shape == (64, 128)
        # the same values as the dequantized load (which undoes the rotary permutation of attn_q) ...
        torch.testing.assert_close(codes.dequantize(), dense[hf_name], rtol=0, atol=1e-6)
    # ... and the plain tensor is transformers' own dequantization of the block bytes.
    up = packed["model.layers.0.mlp.up_proj.weight"].dequantize().numpy()
    np.testing.assert_allclose(up, expected["blk.0.ffn_up.weight"], rtol=0, atol=1e-6)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """The C++ kernel, built once per machine; without a compiler the portable path is what gets tested."""
    return int4_cpu.load()


def random_codes(n: int, k: int, group: int, seed: int, lut: bool = False, perm: bool = False,
                 dtype: torch.dtype = torch.float32, symmetric: bool = False) -> Int4Codes:
    """Random codes with float16-representable scales and offsets (as GGUF stores them), held in `dtype` (a 16-bit
    dtype: kept so by pack), none when `symmetric`; optionally an IQ4-style level table and an activation-order
    column permutation."""
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(torch.bfloat16 if dtype == torch.bfloat16
                                                                           else torch.float16).to(dtype)
    offsets = None if symmetric else (torch.randn(n, k // group, generator=g) * 0.05).half().to(dtype)
    table = torch.sort(torch.randn(16, generator=g) * 8).values if lut else None
    order = torch.randperm(k, generator=g) if perm else None
    return Int4Codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scales, offsets, group,
                     table, order)


def assert_float32_exact(got: torch.Tensor, x: torch.Tensor, codes: Int4Codes, bias: torch.Tensor | None = None):
    """got equals x @ W.T (W the float32 dequantized weight, multiplied exactly in float64) to float32 rounding.

    Forming each weight (scale * level + offset) rounds at most twice, and a K-term float32 dot product in any
    order errs by at most K units of rounding (u = 2^-24) of sum |x| |w|: so |got - exact| <= (K + 2) u
    sum_k |x_k| (|scale level_k| + |offset|), plus one rounding of the bias add. A wrong code, scale or column is
    off by orders of magnitude more."""
    n, k = codes.shape
    w = codes.dequantize(torch.float64)
    magnitude = Int4Codes(codes.codes, codes.scales.float().abs(), codes.offset_values().abs(), codes.group_size,
                          None if codes.lut is None else codes.lut.abs(), codes.perm).dequantize(torch.float64)
    exact = x.double().reshape(-1, k) @ w.T
    bound = (k + 2) * 2.0**-24 * (x.double().abs().reshape(-1, k) @ magnitude.T)
    if bias is not None:
        exact += bias.double()
        bound += 2.0**-24 * exact.abs()
    assert got.dtype == torch.float32 and got.shape == (*x.shape[:-1], n)
    err = (got.double().reshape(-1, n) - exact).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} over a bound of {bound.min().item():.3g}"


CASES = [  # (N, K, group, level table, permutation): every group size, per channel, odd row counts
    (96, 576, 32, False, False), (50, 256, 64, True, False), (64, 512, 128, False, True),
    (36, 512, 256, True, True), (20, 160, 160, False, False)]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 14, 17, 64, 300])  # 4-16: weight rows widened once; 17+: gemm
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-g{c[2]}{'-lut' if c[3] else ''}"
                         f"{'-perm' if c[4] else ''}")
def test_packed_linear_equals_the_dequantized_float32_product(case, rows):
    n, k, group, lut, perm = case
    codes = random_codes(n, k, group, rows, lut, perm)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(n)
    w = pack(codes)
    assert_float32_exact(int4_linear(x, w, bias), x, codes, bias)
    with int4_cpu.disabled():  # the portable path (no compiler): the same bound
        assert_float32_exact(int4_linear(x, w, bias), x, codes, bias)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [20, 50, 96, 192, 576])
def test_prefill_gemm_every_panel_width(n, threads):
    """The prefill GEMM picks its panel width (64, 32 or 16 weight rows; half on AVX2) by how the panels spread over
    the threads, and a last panel may be narrower: each choice, and row counts that leave 1-23 rows past the last
    full register tile, against the same float64 bound."""
    assert int4_cpu.load() is not None
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (17, 301, 528):
            codes = random_codes(n, 576, 32, rows, False, False)
            x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
            w = pack(codes)
            got = int4_cpu.gemm(x, w.packed, w.scales, _stored(w.offsets), w.lut, w.group_size)
            assert_float32_exact(got, x, codes)
    finally:
        torch.set_num_threads(kept)


def test_prefill_rows_take_the_gemm(monkeypatch):
    calls = []
    real = int4_cpu.gemm
    monkeypatch.setattr(int4_cpu, "gemm", lambda *a: calls.append(a[0].shape) or real(*a))
    codes = random_codes(64, 256, 32, 40, False, False)
    w = pack(codes)
    int4_linear(torch.randn(int4_cpu.MAX_ROWS, 256), w)  # decode rows: the packed-byte kernel
    assert calls == []
    int4_linear(torch.randn(int4_cpu.MAX_ROWS + 1, 256), w)
    assert calls == [(int4_cpu.MAX_ROWS + 1, 256)]


def cpu_has_avx512_bf16() -> bool:
    from deltaserve.kernels.cpp_build import cpu_features

    return "avx512_bf16" in cpu_features().split()


@pytest.mark.parametrize("n", [20, 50, 96, 576])
@pytest.mark.parametrize("lut", [False, True], ids=["affine", "lut"])
def test_bf16_gemm_within_the_bfloat16_bound(isa, n, lut):
    """--prefill-dtype bfloat16: where the build has AVX512-BF16 (the native build on a CPU with it), every input and
    weight is rounded to bfloat16 once (u = 2^-8 each; the float32 weight itself formed with at most two float32
    roundings) and the exact products are summed in float32: |got - exact| <= (c + K u32 (1 + c)) sum |x| |w| with
    c = (1 + 2^-8)^2 (1 + 2^-24)^2 - 1. A build without it (the AVX2 one, or a CPU without the instructions)
    refuses by name, and int4_linear falls back to the float32 GEMM, float32-exact."""
    k = 576
    for rows in (17, 301):
        codes = random_codes(n, k, 32, rows + n, lut, perm=False)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        w = pack(codes)
        if not int4_cpu.has_bf16():
            assert isa == "avx2" or not cpu_has_avx512_bf16()
            with pytest.raises(RuntimeError, match="AVX512-BF16"):
                int4_cpu.gemm_bf16(x, w.packed, w.scales, _stored(w.offsets), w.lut, w.group_size)
            assert_float32_exact(int4_linear(x, w, bf16_gemm=True), x, codes)
            continue
        got = int4_cpu.gemm_bf16(x, w.packed, w.scales, _stored(w.offsets), w.lut, w.group_size)
        assert torch.equal(int4_linear(x, w, bf16_gemm=True), got)  # GEMM rows take it when asked
        exact = x.double() @ codes.dequantize(torch.float64).T
        magnitude = Int4Codes(codes.codes, codes.scales.float().abs(), codes.offset_values().abs(), 32,
                              None if codes.lut is None else codes.lut.abs()).dequantize(torch.float64)
        terms = x.double().abs() @ magnitude.T
        c = (1 + 2.0**-8) ** 2 * (1 + 2.0**-24) ** 2 - 1
        bound = (c + k * 2.0**-24 * (1 + c)) * terms
        err = (got.double() - exact).abs()
        assert bool((err <= bound).all()), f"max error {err.max().item():.3g} over a bound of {bound.min().item():.3g}"
        # it really is the bfloat16 product: the float32 GEMM's bound is ~2^15 times tighter and this result fails it
        assert not bool((err <= (k + 2) * 2.0**-24 * terms).all())


def test_bf16_gemm_leaves_the_decode_rows_at_the_head_in_float32():
    """In a step that mixes decode rows (first, models/batch.py's order) with a prefill chunk, --prefill-dtype
    bfloat16 rounds the chunk's rows only: the decode rows get exactly what they get alone (the float32 kernel), the
    chunk's rows exactly the bfloat16 GEMM's, so neither depends on the other being in the step."""
    from deltaserve.kernels.int4 import decode_rows_first

    codes = random_codes(96, 576, 32, 7)
    w = pack(codes)
    x = torch.randn(3 + 40, 576, generator=torch.Generator().manual_seed(5))
    with decode_rows_first(3):
        got = int4_linear(x, w, bf16_gemm=True)
    if int4_cpu.has_bf16():
        assert torch.equal(got[:3], int4_linear(x[:3], w))
        assert torch.equal(got[3:], int4_cpu.gemm_bf16(x[3:].contiguous(), w.packed, w.scales, _stored(w.offsets),
                                                       w.lut, 32))
    else:  # no bfloat16 GEMM in this build: the whole step as without the flag
        assert torch.equal(got, int4_linear(x, w))
    with decode_rows_first(30):  # the chunk's 13 rows: too few for the GEMM, so float32 like the rest
        assert torch.equal(int4_linear(x, w, bf16_gemm=True), int4_linear(x, w))


FORMS = [(torch.float16, True), (torch.bfloat16, True), (torch.float16, False), (torch.bfloat16, False),
         (torch.float32, True)]


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"{c[0]}x{c[1]}-g{c[2]}{'-lut' if c[3] else ''}"
                         f"{'-perm' if c[4] else ''}")
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{str(f[0])[6:]}{'-sym' if f[1] else ''}")
def test_checkpoint_scale_forms_equal_the_dequantized_float32_product(form, case, rows):
    """16-bit scales kept as the checkpoint stores them and symmetric weights without offsets: the same bound."""
    dtype, symmetric = form
    n, k, group, lut, perm = case
    codes = random_codes(n, k, group, rows, lut, perm, dtype, symmetric)
    w = pack(codes)
    assert w.scales.dtype == dtype and (w.offsets is None) == symmetric
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    assert_float32_exact(int4_linear(x, w), x, codes)
    with int4_cpu.disabled():
        assert_float32_exact(int4_linear(x, w), x, codes)


def test_held_bytes_follow_the_scale_form():
    from deltaserve.kernels.int4 import held_bytes

    for dtype, symmetric in FORMS:
        w = pack(random_codes(48, 256, 64, 3, dtype=dtype, symmetric=symmetric))
        size = torch.finfo(dtype).bits // 8
        assert w.nbytes() == held_bytes(48 * 256, 64, scale_bytes=size, offsets=not symmetric)
    mixed = random_codes(48, 256, 64, 3, dtype=torch.float16)
    mixed.offsets = mixed.offsets.float()  # scales and offsets of two dtypes: both held as float32
    assert pack(mixed).scales.dtype == torch.float32 and pack(mixed).offsets.dtype == torch.float32


def test_packed_layout_round_trips_and_holds_the_predicted_bytes():
    from deltaserve.kernels.int4 import held_bytes

    for lut in (False, True):
        codes = random_codes(48, 256, 64, 3, lut)
        w = pack(codes)
        assert torch.equal(w.codes(), codes.codes)
        assert w.nbytes() == held_bytes(48 * 256, 64, lut)
        if int4_cpu.built():  # the C++ widening equals torch's up to fused multiply-add: 2 roundings at most
            want = codes.dequantize(torch.float64)[5:40]
            scale = Int4Codes(codes.codes, codes.scales.abs(), codes.offset_values().abs(), 64,
                              None if codes.lut is None else codes.lut.abs()).dequantize(torch.float64)[5:40]
            got = int4_cpu.widen(w.packed, w.scales, w.offsets, w.lut, 64, 5, 40).double()
            assert bool(((got - want).abs() <= 2 * 2.0**-24 * scale).all())


def test_int4_linear_keeps_leading_dimensions():
    w = pack(random_codes(32, 64, 32, 0))
    x = torch.randn(2, 5, 64)
    out = int4_linear(x, w)
    torch.testing.assert_close(out[1, 3], int4_linear(x[1, 3:4], w)[0])


@pytest.mark.parametrize("shape,group", [((4, 48), 16), ((16, 40), 40), ((16, 96), 64)])
def test_unpackable_shape_is_refused_by_name(shape, group):
    assert not packable(shape, group)
    groups = max(1, shape[1] // group)
    codes = Int4Codes(torch.zeros(shape, dtype=torch.uint8), torch.ones(shape[0], groups),
                      torch.zeros(shape[0], groups), group)
    with pytest.raises(ValueError, match=rf"cannot pack a \({shape[0]}, {shape[1]}\) 4-bit weight in groups of {group}"):
        pack(codes)
