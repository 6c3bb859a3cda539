"""compressed-tensors checkpoints made by compressed-tensors' own compressor, for a tiny dense Qwen3 and a tiny
Qwen3.5 hybrid, loaded by deltaserve and compared with the same checkpoint decompressed by compressed-tensors
itself and run in transformers.

Tolerances: our dequantized weight is scale * code + offset with offset = -(zero + 2^(b-1)) * scale, the
library's (q - zero) * scale: the same real number rounded differently, so they differ by a few float32 ulps of
scale * 2^b. Over a float32 forward that is far below the float32 model tolerance the float tests use
(tests/tolerance.py, derived from float32 rounding), which therefore holds here too; greedy tokens must be identical.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
import transformers
from safetensors.torch import save_file

from deltaserve.kernels.int4 import Int4Codes
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.models import build_model, skip_prefixes
from deltaserve.models.layers import Int8Embedding, Int8Linear
from deltaserve.weights import load_checkpoint
from tests.tolerance import config_rtol
from tests.test_models_hybrid import VOCAB, greedy, prefill_logits, prompt, rel_error, save_tiny_tokenizer

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

GENERATE_TOKENS = 8
EPS32 = torch.finfo(torch.float32).eps

DENSE = (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, tie_word_embeddings=False))
HYBRID = (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                         mrope_section=[4, 2, 2], mrope_interleaved=True)))
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=4,
              num_position_embeddings=16)


def multimodal_config(vocab_size: int, initializer_range: float, tie_word_embeddings: bool, **text):
    """The layout Qwen3.5 checkpoints ship in: model.language_model.*, model.visual.*."""
    return transformers.Qwen3_5Config(text_config=dict(text, vocab_size=vocab_size,
                                                       initializer_range=initializer_range),
                                      vision_config=VISION, tie_word_embeddings=tie_word_embeddings)


MULTIMODAL = (multimodal_config, transformers.Qwen3_5ForConditionalGeneration, HYBRID[2])


def w(bits: int, group: int | None, symmetric: bool = True) -> dict:
    """A weights scheme: group None = per output channel."""
    strategy = {"strategy": "channel"} if group is None else {"strategy": "group", "group_size": group}
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, **strategy}


INT8_EMBED = {"targets": ["Embedding"], "weights": w(8, None)}
CASES = {
    # The field's layout: 4-bit body, INT8 embedding, INT4 lm_head.
    "dense_w4_g32_int8embed_int4head": (DENSE, {"body": {"targets": ["Linear"], "weights": w(4, 32)},
                                                "embed": INT8_EMBED}, []),
    "hybrid_w4_g128_int8embed": (HYBRID, {"body": {"targets": ["Linear"], "weights": w(4, 128)},
                                          "embed": INT8_EMBED}, ["lm_head", r"re:.*linear_attn\.in_proj_[ab]$"]),
    # in_proj_a / b ignored: the library's own unpacker fails on a zero point packed from fewer than 8 rows.
    "hybrid_w4_asym_g64_tied": (HYBRID, {"body": {"targets": ["Linear"], "weights": w(4, 64, symmetric=False)},
                                         "embed": INT8_EMBED}, ["lm_head", r"re:.*linear_attn\.in_proj_[ab]$"]),
    "multimodal_w4_g128_int8embed": (MULTIMODAL, {"body": {"targets": ["Linear"], "weights": w(4, 128)},
                                                  "embed": INT8_EMBED},
                                     ["lm_head", "re:.*visual.*", r"re:.*linear_attn\.in_proj_[ab]$"]),
    # One int8 per value (format int-quantized), asymmetric 8-bit linears.
    "dense_w8_asym_g64_int_quantized": (DENSE, {"body": {"targets": ["Linear"], "weights": w(8, 64, False)}},
                                        ["lm_head"]),
    # A 4-bit embedding with the head tied to it: the table dequantized for lookups, the head packed from it.
    "dense_w4_g32_w4embed_tied": (DENSE, {"body": {"targets": ["Linear", "Embedding"], "weights": w(4, 32)}},
                                  ["lm_head"]),
    "dense_w4_asym_channel_w8_mlp": (DENSE, {
        "mlp": {"targets": [r"re:.*mlp\..*"], "weights": w(8, 128)},
        "attn": {"targets": ["Linear"], "weights": w(4, None, symmetric=False)}}, ["lm_head"]),
}


def minmax_qparams_(model: torch.nn.Module) -> None:
    """Scales and zero points from each group's min / max (what a minmax observer computes), by the library."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight, args = module.weight.detach(), scheme.weights
        groups = weight.view(weight.shape[0], -1, args.group_size) if args.strategy == "group" else weight[:, None]
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)


def make_checkpoint(name: str, folder):
    """Save a compressed checkpoint of a tiny random model; return transformers running the library's own
    decompression of it."""
    (config_cls, model_cls, kwargs), groups, ignore = CASES[name]
    tied = name.endswith("_tied")
    torch.manual_seed(zlib.crc32(name.encode()))
    config = config_cls(vocab_size=VOCAB, initializer_range=0.1, **dict(kwargs, tie_word_embeddings=tied))
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "dt_bias" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    fmt = "int-quantized" if name.endswith("int_quantized") else "pack-quantized"
    qconfig = QuantizationConfig.model_validate(dict(config_groups=groups, ignore=ignore, format=fmt,
                                                     quantization_status="frozen"))
    apply_quantization_config(model, qconfig, show_progress=False)
    minmax_qparams_(model)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    config.save_pretrained(folder)
    save_file(state, folder / "model.safetensors")
    compressor.update_config(str(folder))
    save_tiny_tokenizer(folder)

    compressor.decompress_model(model)
    ref = model_cls(config).eval()
    plain = ref.state_dict()
    # Tied: the compressed model's lm_head still holds the float table it shared before compression.
    keep = {k: v for k, v in model.state_dict().items() if k in plain and not (tied and k == "lm_head.weight")}
    ref.load_state_dict(keep, strict=not tied)
    ref.tie_weights()
    return ref, state


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref, state = make_checkpoint(request.param, folder)
    ckpt = load_checkpoint(folder, skip_prefixes=skip_prefixes(json.loads((folder / "config.json").read_text())))
    return request.param, ref, build_model(ckpt.config, ckpt.tensors), ckpt, state


def test_logits_match_the_library_decompression(case):
    _, ref, ours, _, _ = case
    ids = prompt(33, seed=1)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert rel_error(prefill_logits(ours, ids), expected) <= config_rtol(ref.config, context=len(ids))


def test_greedy_tokens_identical(case):
    _, ref, ours, _, _ = case
    ids = prompt(12, seed=2)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert greedy(ours, ids, GENERATE_TOKENS) == expected


def test_packed_load_logits_match_the_library_decompression(case):
    """The CPU default keeps the 4-bit matrices packed (kernels/int4.py, float32 arithmetic) and the 8-bit ones int8
    (models/layers.Int8Linear, widened in float32): the same bound."""
    from deltaserve.engine.loader import load_model
    from deltaserve.models.layers import Int8Linear

    name, ref, _, ckpt, _ = case
    packed = load_model(ckpt.path, dequantize=False).model
    if "_w8" in name:
        assert any(type(m) is Int8Linear and not m.tied for m in packed.modules()), name
    ids = prompt(33, seed=1)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert rel_error(prefill_logits(packed, ids), expected) <= config_rtol(ref.config, context=len(ids))


def test_weights_equal_the_library_decompression(case):
    """Every quantized module dequantizes to the library's weight within a few float32 ulps of its scale range."""
    name, ref, ours, ckpt, state = case
    expected = ref.state_dict()
    for module in {k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")}:
        if name.endswith("int_quantized"):  # stored one int8 a value, not packed
            assert state[module + ".weight"].dtype == torch.int8 and module + ".weight_packed" not in state
        got = ckpt.tensors[module + ".weight"]
        got = got.dequantize() if isinstance(got, (Int4Codes, Int8Rows)) else got
        bound = 8 * EPS32 * state[module + ".weight_scale"].abs().max() * 256
        assert (got - expected[module + ".weight"]).abs().max() <= bound, module


def test_int8_embedding_stays_int8_and_lm_head_form(case):
    name, _, ours, ckpt, _ = case
    if "int8embed" in name or name == "hybrid_w4_asym_g64_tied":
        assert isinstance(ours.model.embed_tokens, Int8Embedding)
        assert ours.model.embed_tokens.codes.dtype == torch.int8
    if name == "hybrid_w4_asym_g64_tied":  # the tied head multiplies the embedding's own codes: no second table
        assert isinstance(ours.lm_head, Int8Linear) and ours.lm_head.codes is ours.model.embed_tokens.codes
    if name == "dense_w4_g32_w4embed_tied":
        from deltaserve.engine.loader import load_model
        from deltaserve.models.layers import Int4Linear

        packed = load_model(ckpt.path, dequantize=False).model
        assert isinstance(packed.lm_head, Int4Linear) and type(packed.model.embed_tokens) is torch.nn.Embedding
    if name == "dense_w4_g32_int8embed_int4head":
        assert isinstance(ckpt.tensors["lm_head.weight"], torch.Tensor)  # 4-bit, dequantized by default (exact)
        assert not any(k.endswith("weight_packed") for k in ckpt.tensors)


def test_act_order_g_idx_equals_library_on_permuted_columns(tmp_path):
    """compressed-tensors 0.20 no longer writes weight_g_idx (older exports do): a module quantized in sorted
    column order by the library, its codes moved back to the checkpoint's column order and g_idx recording
    each column's group, must dequantize to the library's weight with the columns put back."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    torch.manual_seed(5)
    n, k, group = 32, 128, 32
    scheme = QuantizationScheme(targets=["Linear"], weights=w(4, group, symmetric=False))
    sorted_w = torch.randn(n, k)
    groups = sorted_w.view(n, -1, group)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress(
        {"weight": sorted_w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    lib = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    order = torch.randperm(k)  # checkpoint column order[j] holds sorted column j
    values = unpack_from_int32(packed["weight_packed"], 4, torch.Size((n, k)))
    shuffled = torch.empty_like(values)
    shuffled[:, order] = values
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).int()
    tensors = {"m.weight_packed": pack_to_int32(shuffled, 4), "m.weight_scale": packed["weight_scale"],
               "m.weight_zero_point": packed["weight_zero_point"], "m.weight_shape": packed["weight_shape"],
               "m.weight_g_idx": g_idx}
    group_config = {"targets": ["Linear"], "weights": scheme.weights.model_dump()}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"g": group_config}}}
    from deltaserve.weights.compressed_tensors import decode

    codes = decode(config, tensors, tmp_path, torch.float32)["m.weight"]
    assert isinstance(codes, Int4Codes) and codes.perm is not None
    expected = torch.empty_like(lib)
    expected[:, order] = lib
    assert (codes.dequantize() - expected).abs().max() <= 8 * EPS32 * scale.abs().max() * 16


def resident_bytes(model: torch.nn.Module) -> int:
    """What the engine measures (Engine.measured_bytes): every state-dict tensor once per storage."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())


LAYOUTS = ["dequantized", "packed", "torch_int4"]


def load_as(path, layout: str, monkeypatch) -> tuple[torch.nn.Module, object, str]:
    """The model loaded in `layout`, and the EngineConfig and device kind its ledger is planned with. dequantized and
    packed: on the CPU, float32; packed as loaded, before the int8-activation swap (--activation-dtype float32 holds
    it so; tests/test_budget_panels.py prices the swap's panels). torch_int4: what a bfloat16 model holds on CUDA
    (kernels/int4_torch.py), built here from torch's CPU form of that layout, which holds the same bytes (codes half
    a byte a weight, the same scales and zeros): the loader's choice is made to take the CPU, nothing else
    changes."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.loader import load_model
    from deltaserve.kernels import int4_torch

    if layout == "torch_int4":
        monkeypatch.setattr(int4_torch, "serves", lambda device, dtype: dtype == torch.bfloat16)
        model = load_model(path, dtype=torch.bfloat16, dequantize=False).model
        return model, EngineConfig(max_total_tokens=64, device="cuda", dtype="bfloat16"), "cuda"
    model = load_model(path, dequantize=layout == "dequantized").model
    return model, EngineConfig(max_total_tokens=64, dequantize_weights=layout == "dequantized",
                               activation_dtype="float32"), "cpu"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ledger_weights_line_equals_resident_bytes(case, layout, monkeypatch):
    """The ledger's weights line = the bytes the loaded model holds, within 1%: dequantized (the INT8 embedding
    kept int8), packed (the CPU default: 4-bit codes with a float32 scale and offset per group, where the
    checkpoint stores a 16-bit scale: 6 bytes a group more than on disk) and torch's int4 layout (CUDA, bfloat16), a
    tied lm_head over the INT8 embedding multiplying its codes (no bytes of its own)."""
    from deltaserve.budget import plan_budget, spec_from_checkpoint
    from deltaserve.models.layers import Int4Linear, TorchInt4Linear

    name, _, _, ckpt, state = case
    model, config, kind = load_as(ckpt.path, layout, monkeypatch)
    packed = [m for m in model.modules() if isinstance(m, (Int4Linear, TorchInt4Linear))]
    four_bit = [k for k, t in state.items() if k.endswith("weight_packed") and t.numel() * 8 < 2 * state[
        k.replace("weight_packed", "weight_scale")].shape[0] * int(state[k.replace("packed", "shape")][1])]
    assert bool(packed) == (layout != "dequantized" and bool(four_bit)), name
    if layout == "torch_int4":
        assert all(isinstance(m, TorchInt4Linear) for m in packed), name
    budget = plan_budget(spec_from_checkpoint(ckpt.path), config, device_total_bytes=4 * 2**30, device_kind=kind)
    predicted, measured = budget.line("weights").bytes, resident_bytes(model)
    assert abs(predicted - measured) <= 0.01 * measured, (name, predicted, measured)


def test_load_logs_progress_in_bytes_per_second(case, caplog):
    import logging

    _, _, _, ckpt, state = case
    with caplog.at_level(logging.INFO, logger="deltaserve.weights"):
        load_checkpoint(ckpt.path)
    line = caplog.records[-1].getMessage()
    size = sum(t.numel() * t.element_size() for t in state.values())
    assert line.startswith("read 1/1 shards") and f"{size / 2**20:,.1f} MiB in" in line and "MiB/s" in line


def test_multimodal_layout_skips_the_vision_tower_by_name_and_bytes(case):
    name, _, _, ckpt, state = case
    if not name.startswith("multimodal"):
        pytest.skip("only the multimodal layout has a vision tower")
    vision = [t for k, t in state.items() if k.startswith("model.visual.")]
    nbytes = sum(t.numel() * t.element_size() for t in vision)
    assert ckpt.skipped == [f"model.visual.* ({len(vision)} tensors, {nbytes:,} bytes)"]
    assert not any(k.startswith("model.visual.") for k in ckpt.tensors)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_from_config_alone_prices_what_a_load_holds(case, layout):
    """`deltaserve plan` on the checkpoint's config.json alone (no tensors) prices each quantized module as the
    loader holds it (weights/held.py: packed with a float32 scale and offset, an INT8 embedding int8, a tied head
    its own weight), not at its checkpoint size: its weights line equals the header ledger's, which the test above
    holds to the resident bytes."""
    from deltaserve.budget import plan_budget, spec_from_checkpoint, spec_from_config
    from deltaserve.config import EngineConfig

    name, _, _, ckpt, _ = case
    kind = "cuda" if layout == "torch_int4" else "cpu"
    config = EngineConfig(max_total_tokens=64, dequantize_weights=layout == "dequantized",
                          dtype="bfloat16" if kind == "cuda" else "auto")
    lines = [plan_budget(spec, config, device_total_bytes=4 * 2**30, device_kind=kind).line("weights").bytes
             for spec in (spec_from_config(json.loads((ckpt.path / "config.json").read_text())),
                          spec_from_checkpoint(ckpt.path))]
    assert lines[0] == lines[1], (name, *lines)


@pytest.mark.parametrize("layout", ["packed", "torch_int4"])
def test_sixteen_bit_scales_are_held_as_stored(tmp_path, layout, monkeypatch):
    """The field's checkpoint stores its symmetric scales in bfloat16: a float32 load keeps them so (2 bytes a group,
    the ledger's price), not widened with the floating-point tensors; the result equals the float32-scale load of the
    same (bfloat16-representable) scales to float32 rounding, and the ledger's weights line equals the resident
    bytes in the packed layout and in torch's int4 layout."""
    from deltaserve.budget import plan_budget, spec_from_checkpoint
    from deltaserve.engine.loader import load_model
    from deltaserve.models.layers import Int4Linear, TorchInt4Linear
    from safetensors.torch import load_file

    wide = tmp_path / "f32"
    wide.mkdir()
    make_checkpoint("dense_w4_g32_int8embed_int4head", wide)
    state = load_file(str(wide / "model.safetensors"))
    scales = [k for k in state if k.endswith("weight_scale") and "embed" not in k]
    for k in scales:
        state[k] = state[k].bfloat16().float()  # representable in bfloat16: both folders hold the same weights
    save_file(state, wide / "model.safetensors")
    narrow = tmp_path / "bf16"
    narrow.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (narrow / f).write_bytes((wide / f).read_bytes())
    save_file({k: v.bfloat16() if k in scales else v for k, v in state.items()}, narrow / "model.safetensors")

    model, config, kind = load_as(narrow, layout, monkeypatch)
    held = [m for m in model.modules() if isinstance(m, (Int4Linear, TorchInt4Linear))]
    assert held and all((m.scales if isinstance(m, Int4Linear) else m.scales_and_zeros).dtype == torch.bfloat16
                        for m in held)
    budget = plan_budget(spec_from_checkpoint(narrow), config, device_total_bytes=4 * 2**30, device_kind=kind)
    predicted, measured = budget.line("weights").bytes, resident_bytes(model)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    if layout == "packed":
        ids = prompt(33, seed=1)
        expected = prefill_logits(load_model(wide, dequantize=False).model, ids)
        assert rel_error(prefill_logits(model, ids), expected) <= 64 * EPS32
