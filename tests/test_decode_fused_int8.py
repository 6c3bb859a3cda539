"""The fused decode blocks (kernels/decode_cpu.py) on --activation-dtype int8's panel weights (Int8DotLinear).

Against the per-op int8 path on the same model and caches (tiny Llama / Qwen3 with packed 4-bit projections, and the
Qwen3.5 hybrid test configs quantized to 4 bits): every decode step's logits agree to float32 rounding
(tests/tolerance.py), on the native, the AVX2 and (where the CPU has it) the AVX-VNNI build, and the whole step is one decode_stack call that multiplies no
projection through int4_int8's per-op entry. The per-op int8 product is held to the float64 int8 arithmetic and to the
float32 path within the activations' rounding by test_kernels_int4_int8.py; here the fused MLP block is held to the
fused float32 block within that rounding propagated through SiLU, the product and the down projection, and on the
AVX-VNNI build to the AVX2 build's block bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
from conftest import KERNEL_MODULES
from test_decode_fused import VOCAB, decode_batch, steps_both_ways, tiny_dense
from test_kernels_int4_int8 import magnitude
from tolerance import logits_rtol

from deltaserve.kernels import decode_cpu, int4_int8
from deltaserve.kernels.cpp_build import cpu_features
from deltaserve.kernels.int4 import Int4Codes, pack
from deltaserve.models.int8_activations import use_int8_activations
from deltaserve.models.layers import FusedParts, Int8DotLinear, Int4Linear, Linear, projection_parts
from deltaserve.models.decode_stack_path import DecodeStackPath, step_logits

U = 2.0**-24


@pytest.fixture(params=["native", "avx2", "avxvnni"])
def int8_isa(request):
    """conftest's isa builds, with int4_int8's per-op kernel on the same one (AVX2: vpmaddubsw, not VNNI), and an
    AVX-VNNI one where the CPU has avx_vnni: the AVX2 builds with decode_cpu and int4_int8 built for AVX-VNNI (the
    two modules that compile int4_int8_tile.h, whose 256-bit vpdpbusd tile is what the flag is for)."""
    for m in KERNEL_MODULES:
        assert m.load() is not None
    assert int4_int8.load(print) is not None
    if request.param == "native":
        yield request.param
        return
    if request.param == "avxvnni" and "avx_vnni" not in cpu_features().split():
        pytest.skip("this CPU has no AVX-VNNI (avx_vnni): the AVX-VNNI build cannot run here")
    builds = dict(zip(KERNEL_MODULES, request.getfixturevalue("avx2_kernels")))
    builds[int4_int8] = int4_int8.KERNELS.variant("avx2").load(print)
    if request.param == "avxvnni":
        builds[decode_cpu] = decode_cpu.KERNELS.variant("avxvnni").load(print)
        builds[int4_int8] = int4_int8.KERNELS.variant("avxvnni").load(print)
    assert all(builds.values())
    with contextlib.ExitStack() as stack:
        for m, module in builds.items():
            stack.enter_context(m.KERNELS.using(module))
        assert int4_int8.isa() == {"avx2": "avx2", "avxvnni": "avx_vnni"}[request.param]
        yield request.param


class Counting:
    """A loaded kernel module whose named entries count their calls (and still run)."""

    def __init__(self, module, names):
        self.module, self.calls = module, dict.fromkeys(names, 0)

    def __getattr__(self, name):
        entry = getattr(self.module, name)
        if name not in self.calls:
            return entry

        def counted(*args):
            self.calls[name] += 1
            return entry(*args)
        return counted


def replace_linears(model, make) -> int:
    """Every float32 Linear of the decoder layers whose width is a multiple of 32 becomes make(child, w), w its weight
    [N, K / 32, 32] in groups of 32; the fused parts are rebuilt on the next step. The number replaced."""
    replaced = 0
    for parent in list(model.model.layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not Linear or child.in_features % 32:
                continue
            w = child.weight.detach().float().view(child.out_features, -1, 32)
            bias = None if child.bias is None else child.bias.detach().float()
            setattr(parent, name, make(w, bias))
            replaced += 1
    for module in model.modules():
        if isinstance(getattr(module, "fused", None), FusedParts):
            module.fused.key = None
    return replaced


def quantized_to_int4(model) -> int:
    """replace_linears with Int4Linears of the weights rounded to 16 levels per group of 32 (scale and minimum)."""
    def make(w, bias):
        low, high = w.amin(-1), w.amax(-1)
        scales = ((high - low) / 15).clamp_min(1e-6)
        codes = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
        return Int4Linear(Int4Codes(codes.view(w.shape[0], -1), scales, low, 32), bias)
    return replace_linears(model, make)


def quantized_to_int8(model, symmetric: bool = True, group: int = 32) -> int:
    """replace_linears with Int8Linears of the weights rounded to 8 bits per group of `group` (32, or 16 as GGUF
    Q6_K's; Q8_0's max / 127 scale, or 255 levels from the minimum)."""
    from deltaserve.kernels.int8 import Int8Rows
    from deltaserve.models.layers import Int8Linear

    def make(w, bias):
        w = w.reshape(w.shape[0], -1, group)
        if symmetric:
            scales, low = (w.abs().amax(-1) / 127).clamp_min(1e-6), torch.zeros(w.shape[:2])
            q = torch.round(w / scales[..., None]).clamp(-127, 127)
        else:
            low = w.amin(-1)
            scales = ((w.amax(-1) - low) / 255).clamp_min(1e-6)
            q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 255) - 128
            low = low + 128 * scales  # w = s (q + 128) + low
        return Int8Linear(Int8Rows(q.to(torch.int8).view(w.shape[0], -1), scales, low, group), bias)
    return replace_linears(model, make)


def quantized_to_iq4(model) -> int:
    """replace_linears with Int4Linears of the weights rounded to the nearest of IQ4_NL's 16 integer levels times
    max|w| / 127 per group of 32."""
    from deltaserve.weights.gguf_int4 import IQ4_LEVELS

    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32)

    def make(w, bias):
        scales = (w.abs().amax(-1) / 127).clamp_min(1e-6)
        codes = ((w / scales[..., None])[..., None] - levels).abs().argmin(-1).to(torch.uint8)
        return Int4Linear(Int4Codes(codes.view(w.shape[0], -1), scales, None, 32, levels), bias)
    return replace_linears(model, make)


def quantized_to_kquant(model, kind: str) -> int:
    """replace_linears with the layers a GGUF K-quant loads as (weights/gguf_int4.py, gguf_int8.py), rounded in its
    structure: per 256 columns a float16 d (and dmin), per group an integer sub-scale (and minimum), so each scale is
    a float16 times a small integer as in the file: "q6_k" (codes -32 .. 31 per 16, signed 8-bit sub-scales), "q5_k"
    (0 .. 31 per 32, 6-bit sub-scales and minima), "q4_k" (0 .. 15 per 32, packed 4-bit)."""
    from deltaserve.kernels.int8 import Int8Rows
    from deltaserve.models.layers import Int8Linear

    group, top = {"q6_k": (16, 31), "q5_k": (32, 31), "q4_k": (32, 15)}[kind]

    def factored(values: torch.Tensor, most: int) -> torch.Tensor:
        """values [N, K / group] >= 0 as f16(d) x an integer 0 .. most per 256 columns (d from the largest)."""
        per = values.view(values.shape[0], -1, 256 // group)
        d = (per.amax(-1, keepdim=True) / most).clamp_min(1e-6).half().float()
        return (d * torch.round(per / d).clamp(0, most)).view(values.shape)

    def make(w, bias):
        w = w.reshape(w.shape[0], -1, group)
        if kind == "q6_k":
            scales = factored((w.abs().amax(-1) / 31).clamp_min(1e-6), 127) * torch.where(
                torch.rand(w.shape[:2]) < 0.5, -1.0, 1.0)  # Q6_K's sub-scales are signed
            scales = torch.where(scales == 0, 1e-3, scales)
            q = torch.round(w / scales[..., None]).clamp(-32, 31)
            return Int8Linear(Int8Rows(q.to(torch.int8).view(w.shape[0], -1), scales, torch.zeros_like(scales), 16),
                              bias)
        low = -factored((-w.amin(-1)).clamp_min(0), 63)  # w = s q - dmin m with dmin m >= 0
        scales = factored(((w.amax(-1) - low) / top).clamp_min(1e-6), 63)
        scales = torch.where(scales == 0, 1e-3, scales)
        q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, top)
        if kind == "q5_k":
            return Int8Linear(Int8Rows(q.to(torch.int8).view(w.shape[0], -1), scales, low, 32), bias)
        return Int4Linear(Int4Codes(q.to(torch.uint8).view(w.shape[0], -1), scales, low, 32), bias)
    return replace_linears(model, make)


def int8_model(model, compact: bool = False):
    model = copy.deepcopy(model)
    swapped, _ = use_int8_activations(model, compact=compact)
    assert swapped > 0
    return model


def assert_fused_int8_equals_per_op(model, prompts, cache, layers: int, reduction: int, compare: bool = True):
    """Both paths quantize float32 inputs that differ by rounding (the fused norm and residual adds sum in another
    order): an activation within that rounding of a tie between two int8 levels rounds one way on one path and the
    other way on the other, one quantum apart, and the caches and recurrent state carry it on. The fixed prompts
    of the cases with `compare` meet no such tie on either build; the tied hybrid config's do (its third sequence's
    first MLP input lies 1.1e-4 of a quantum from a tie, where the two paths' inputs differ by ~127 x 1e-6), so
    only its calls are checked."""
    fused, plain, caches, _, _ = steps_both_ways(model, prompts, cache, steps=4)
    if compare:
        tol = logits_rtol(layers, reduction) * plain.abs().max().item()
        assert (fused - plain).abs().max().item() <= tol
        assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    # one more step, counted: one decode_stack call and no per-op int8 product (a layer the blocks fell back on would
    # call int4_int8_linear, or the blocks one by one)
    counting = Counting(decode_cpu.KERNELS.module, ["decode_stack", "attention_block", "mlp_block", "gdn_block"])
    per_op = Counting(int4_int8.KERNELS.module, ["int4_int8_linear"])
    lens = [len(p) + 4 for p in prompts]
    with decode_cpu.KERNELS.using(counting), int4_int8.KERNELS.using(per_op):
        step_logits(model, decode_batch(fused[-1].argmax(-1).tolist(), lens), caches)
    assert counting.calls == {"decode_stack": 1, "attention_block": 0, "mlp_block": 0, "gdn_block": 0}
    assert per_op.calls == {"int4_int8_linear": 0}
    with decode_cpu.disabled(), int4_int8.KERNELS.using(per_op):  # the per-op path does take the int8 kernel
        step_logits(model, decode_batch(fused[-1].argmax(-1).tolist(), [n + 1 for n in lens]), caches)
    assert per_op.calls["int4_int8_linear"] > 0
    return fused


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
@torch.inference_mode()
def test_fused_int8_decode_equals_the_per_op_int8_path(kind, cache, int8_isa):
    float_model = tiny_dense(kind, "int4")
    model = int8_model(float_model)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 1, 40, 9)]
    fused = assert_fused_int8_equals_per_op(model, prompts, getattr(torch, cache), 3, 192)
    attn, mlp = model.model.layers[0].fused.parts
    assert all(group < 0 for group in attn[1][4:]) and all(group < 0 for group in mlp[1])  # panel weights served
    assert DecodeStackPath.of(model).stack._args is not None
    # and not the float32 packed arithmetic: the same steps of the unswapped model differ by the activation rounding
    float_fused, _, _, _, _ = steps_both_ways(float_model, prompts, getattr(torch, cache), steps=1)
    assert (fused[0] - float_fused[0]).abs().max() > logits_rtol(3, 192) * float_fused.abs().max()


SEED8 = 13  # prompts that meet no int8 rounding tie on any build (assert_fused_int8_equals_per_op's docstring)
BYTE_FORMS = {"int8": lambda m: quantized_to_int8(m, True), "int8-asym": lambda m: quantized_to_int8(m, False),
              "int8-g16": lambda m: quantized_to_int8(m, True, 16),
              "int8-g16-asym": lambda m: quantized_to_int8(m, False, 16), "iq4": quantized_to_iq4}


@pytest.mark.parametrize("kind,form", [("llama", "int8"), ("qwen3", "int8-asym"), ("llama", "int8-asym"),
                                       ("qwen3", "int8"), ("llama", "iq4"), ("qwen3", "iq4"), ("llama", "int8-g16"),
                                       ("qwen3", "int8-g16-asym")])
@torch.inference_mode()
def test_fused_decode_of_byte_valued_weights_equals_the_per_op_int8_path(kind, form, int8_isa):
    """8-bit weights (Q8_0's symmetric form, an asymmetric INT8's offsets; in groups of 16 too, as GGUF Q6_K's) in
    8-bit panels, and IQ4's 4-bit codes naming integer levels (looked up in the panel's 16-byte table): the blocks take
    them as the per-op kernel does (int4_int8_tile.h's BYTES, HALVES and LEVELS), one decode_stack call a step."""
    from deltaserve.models.layers import Int8Linear

    float_model = tiny_dense(kind, "fp32")
    assert BYTE_FORMS[form](float_model) == 3 * 7
    model = int8_model(float_model)
    assert not any(type(m) in (Int4Linear, Int8Linear) for m in model.modules())
    gen = torch.Generator().manual_seed(SEED8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 1, 40, 9)]
    fused = assert_fused_int8_equals_per_op(model, prompts, torch.float32, 3, 192)
    attn, mlp = model.model.layers[0].fused.parts
    assert all(group < 0 for group in attn[1][4:]) and all(group < 0 for group in mlp[1])
    float_fused, _, _, _, _ = steps_both_ways(float_model, prompts, torch.float32, steps=1)
    assert (fused[0] - float_fused[0]).abs().max() > logits_rtol(3, 192) * float_fused.abs().max()


@pytest.mark.parametrize("kind,form", [("llama", "q6_k"), ("qwen3", "q5_k"), ("qwen3", "q4_k")])
@torch.inference_mode()
def test_fused_decode_of_k_quants_held_as_their_files_hold_them(kind, form, int8_isa):
    """K-quant layers at widths of 256 columns (so their scales take the super form: kernels/int4_int8.py) in 6-bit
    (Q6_K, Q5_K) and 4-bit (Q4_K) panels with int8 super scales: the blocks take them as the per-op kernel does
    (int4_int8_tile.h's SIXES and SUPER), one decode_stack call a step."""
    float_model = tiny_dense(kind, "fp32", hidden=256, intermediate=512)
    assert quantized_to_kquant(float_model, form) == 3 * 7
    model = int8_model(float_model, compact=True)  # --compact-weights
    held = [m for m in model.model.layers.modules() if type(m) is Int8DotLinear]
    assert len(held) == 3 * 7 and all(m.scales.dtype == torch.int8 for m in held)
    assert {m.bits for m in held} == {4 if form == "q4_k" else 6}
    gen = torch.Generator().manual_seed(SEED8)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 1, 40, 9)]
    assert_fused_int8_equals_per_op(model, prompts, torch.float32, 3, 512)
    attn, mlp = model.model.layers[0].fused.parts
    assert all(group < 0 for group in attn[1][4:]) and all(group < 0 for group in mlp[1])


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_5_text_tied"])
@torch.inference_mode()
def test_hybrid_fused_int8_decode_equals_the_per_op_int8_path(name, int8_isa, tmp_path):
    """Gated attention, Qwen3.5's GDN (its in-projections sharing one quantized input) and SwiGLU blocks on panel
    weights; in_proj_b / in_proj_a (one row a value head: no 16-row panel) stay packed float32 in the same block."""
    from deltaserve.models import build_model, skip_prefixes
    from deltaserve.weights import load_checkpoint
    from test_models_hybrid import VOCAB as HYBRID_VOCAB, make_checkpoint

    ref = make_checkpoint(name, tmp_path)
    ckpt = load_checkpoint(tmp_path, skip_prefixes=skip_prefixes(json.loads((tmp_path / "config.json").read_text())))
    float_model = build_model(ckpt.config, ckpt.tensors)
    assert quantized_to_int4(float_model) > 0
    model = int8_model(float_model)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, HYBRID_VOCAB, (n,), generator=gen).tolist() for n in (6, 23, 2, 31)]
    assert_fused_int8_equals_per_op(model, prompts, torch.float32, ref.config.num_hidden_layers, 64 * 16,
                                    compare=not name.endswith("tied"))
    gdn = next(layer for layer in model.model.layers if layer.kind == "linear_attention")
    groups = gdn.fused.parts[0][1][4:]  # in_proj_qkv, z, b, a, out_proj
    assert type(gdn.linear_attn.in_proj_qkv) is Int8DotLinear and type(gdn.linear_attn.in_proj_b) is Int4Linear
    assert groups[0] < 0 and groups[1] < 0 and groups[2] > 0 and groups[4] < 0


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def block_quantum(v: torch.Tensor) -> torch.Tensor:
    """Per column, an upper bound of the int8 quantum d = max|v| / 127 of its 32-column block (float64)."""
    m, k = v.shape
    return (v.abs().view(m, k // 32, 32).amax(-1) / 127 * (1 + 2.0**-14)).repeat_interleave(32, dim=1)


@pytest.mark.parametrize("rows", [1, 3, 17])
@torch.inference_mode()
def test_fused_int8_mlp_is_the_float32_mlp_within_the_activation_rounding(rows, int8_isa, request):
    """mlp_block on panel weights against mlp_block on the same packed weights (float32); on the AVX-VNNI build also
    against the AVX2 build's mlp_block, bit for bit (the blocks' integer sums are exact). Each projection of n (the
    normed input) moves by at most |W| d_n / 2 (test_kernels_int4_int8's bound, d_n n's block quanta); SiLU's slope
    is at most 1.1, so h = silu(g) u moves by at most 1.1 dg (|u| + du) + |silu(g)| du; the down projection reads h's
    int8 rounding (quanta of |h| + dh at most) on top: dy <= |W_down| (dh + d_h / 2), plus each side's float32
    rounding ((2 K / 32 + 4 + K + 2) u |W| |input| a projection, the block's other operations well inside)."""
    hidden, inter, eps = 128, 192, 1e-5
    gen = torch.Generator().manual_seed(rows)
    from test_kernels_int4 import random_codes

    codes = [random_codes(inter, hidden, 32, 1), random_codes(inter, hidden, 32, 2), random_codes(hidden, inter, 32, 3)]
    norm = 1 + torch.randn(hidden, generator=gen) * 0.2
    x = torch.randn(rows, hidden, generator=gen)
    x[:, 7] *= 30  # an outlier channel: its block's quantum is large
    float_layers = [Int4Linear(c, None) for c in codes]
    int8_layers = [Int8DotLinear(int4_int8.repack(pack(c)), None) for c in codes]

    def block(layers):
        parts = [projection_parts(layer) for layer in layers]
        tensors = [norm] + [t for p, _ in parts for t in p]
        return decode_cpu.mlp_block(x.clone(), tensors, [g for _, g in parts], eps, 0.0)

    got, ref = block(int8_layers), block(float_layers)
    assert [projection_parts(layer)[1] for layer in int8_layers] == [-32] * 3
    if int8_isa == "avxvnni":
        avx2 = dict(zip(KERNEL_MODULES, request.getfixturevalue("avx2_kernels")))[decode_cpu]
        with decode_cpu.KERNELS.using(avx2):
            assert torch.equal(block(int8_layers), got)

    w = [c.dequantize(torch.float64) for c in codes]
    mag = [magnitude(c) for c in codes]
    n = rms(x.double(), norm.double(), eps)
    g, u = n @ w[0].T, n @ w[1].T
    silu = torch.nn.functional.silu
    h = silu(g) * u

    def rounding(k, inp, m):
        return (2 * k // 32 + 4 + k + 2) * U * (inp.abs() @ m.T)

    dn = block_quantum(n) / 2
    dg = dn @ mag[0].T + rounding(hidden, n, mag[0])
    du = dn @ mag[1].T + rounding(hidden, n, mag[1])
    dh = 1.1 * dg * (u.abs() + du) + silu(g).abs() * du
    h_max = h.abs() + dh
    bound = (dh + block_quantum(h_max) / 2) @ mag[2].T + rounding(inter, h_max, mag[2]) + 4 * U * x.double().abs()
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, bound {bound.min().item():.3g}"
    assert err.max() > 0  # the int8 arithmetic served, not the float32 one


def test_int8_activations_serve_an_int4_lm_head(tmp_path):
    """The field's layout (W4 body, INT8 embedding, INT4 lm_head; compressed-tensors' compressor) with
    --activation-dtype int8: the head becomes an int8-activation layer too and the model's forward takes it (it
    asked the head for a float weight's dtype and failed mid-answer, "'Int8DotLinear' object has no attribute
    'weight'"), and the answer's tokens come."""
    from test_engine_support import engine, run_all, tokens_of

    from deltaserve.engine.request import SamplingParams
    from deltaserve.models.layers import Int8DotLinear
    from tests.test_weights_compressed_tensors import make_checkpoint

    make_checkpoint("dense_w4_g32_int8embed_int4head", tmp_path)
    eng = engine(str(tmp_path), activation_dtype="int8", dequantize_weights=False)
    assert isinstance(eng.loaded.model.lm_head, Int8DotLinear), type(eng.loaded.model.lm_head)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = tokens_of(run_all(eng, [([5, 6, 7, 8], params)])[0])
    assert len(out) == 4 and all(0 <= t < eng.vocab_size for t in out)
