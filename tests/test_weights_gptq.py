"""GPTQ-layout 4-bit modules (AutoRound's auto_round / auto_round:auto_gptq packings, AutoGPTQ) packed by AutoRound's
own torch QuantLinear and checked against that layer's own dequantization (its forward on the identity); AWQ-layout
modules (AutoRound's auto_awq export, AutoAWQ's GEMM layout) packed by AutoRound's WQLinear_GEMM.from_linear (the
packer its auto_awq export calls) and checked against its dequantize_gemm (AutoAWQ's unpacker, kept in AutoRound).

Both compute scale * (code - zero) in float16: the same number as ours (float32) to within half a float16 ulp, so
the tolerance is a relative 2^-11 (float16 has 10 fraction bits)."""

from __future__ import annotations

import json

import pytest
import torch

from deltaserve.kernels.int4 import Int4Codes
from deltaserve.weights import gptq

pytest.importorskip("auto_round_extension")
from auto_round.export.export_to_awq.utils import WQLinear_GEMM, dequantize_gemm  # noqa: E402
from auto_round_extension.torch import qlinear_torch, qlinear_torch_zp  # noqa: E402

PACKINGS = {"auto_round": qlinear_torch, "auto_round:gptqmodel": qlinear_torch,
            "auto_round:auto_gptq": qlinear_torch_zp}


def packed_module(layer_module, n: int, k: int, group: int, act_order: bool, seed: int, exact: bool = False):
    """A random [n, k] linear packed by the package's QuantLinear, and its [n, k] weight by the package's own forward:
    in float16 as it runs (each weight rounded to float16), or with `exact` in float64, where the float16 scales widen
    exactly and no product is rounded (the differential fuzzer's oracle: a rounding that flips an MoE router's choice
    would otherwise be the oracle's own, seed 251)."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False)
    w = linear.weight.data.view(n, k // group, group)
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    layer = layer_module.QuantLinear(4, group, k, n, bias=False, g_idx=act_order)
    layer.device = torch.device("cpu")  # pack reads it (set by its loaders)
    layer.pack(linear, scales, zeros.int())
    if act_order:  # activation order: column j read from group g_idx[j] (the layer's forward honours it)
        layer.g_idx = layer.g_idx[torch.randperm(k)].contiguous()
    tensors = {"m.qweight": layer.qweight, "m.qzeros": layer.qzeros, "m.scales": layer.scales}
    if act_order:
        tensors["m.g_idx"] = layer.g_idx
    with torch.no_grad():  # [N, K], the package's own dequantization (double() leaves the packed tensors above as they are)
        expected = layer.double()(torch.eye(k, dtype=torch.float64)).t().float() if exact else layer(torch.eye(k)).t()
    return tensors, expected


@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("group,act_order", [(32, False), (128, False), (64, True)])
def test_autoround_packings_equal_the_package_dequantization(tmp_path, packing, group, act_order):
    tensors, expected = packed_module(PACKINGS[packing], 64, 256, group, act_order, seed=group)
    config = {"quantization_config": {"quant_method": "auto-round", "bits": 4, "group_size": group,
                                      "packing_format": packing}}
    codes = gptq.decode(config, tensors, tmp_path)["m.weight"]
    assert isinstance(codes, Int4Codes) and (codes.perm is not None) == act_order
    torch.testing.assert_close(codes.dequantize(), expected, rtol=2**-11, atol=0)


def test_auto_gptq_stores_zero_minus_one(tmp_path):
    tensors, expected = packed_module(qlinear_torch_zp, 32, 128, 32, False, seed=3)
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}
    torch.testing.assert_close(gptq.decode(config, tensors, tmp_path)["m.weight"].dequantize(), expected,
                               rtol=2**-11, atol=0)


def awq_module(n: int, k: int, group: int, symmetric: bool, seed: int, exact: bool = False):
    """A random [n, k] linear packed by AutoRound's AWQ packer, and its [n, k] weight by AWQ's own unpacker (with
    `exact`, on the float16 scales widened to float64, so no product is rounded to float16)."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False)
    w = linear.weight.data.view(n, k // group, group)
    if symmetric:  # AutoRound's sym export: one zero point, 8, for every group
        scales, zeros = (w.abs().amax(-1) / 7).clamp(min=1e-6), 8
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-6)
        zeros = torch.round(-lo / scales).clamp(0, 15).t().contiguous()  # [groups, n], as its exporter passes it
    layer = WQLinear_GEMM.from_linear(linear, 4, group, scales=scales.t().contiguous(), zeros=zeros, device="cpu")
    tensors = {"m.qweight": layer.qweight, "m.qzeros": layer.qzeros, "m.scales": layer.scales}
    scales = layer.scales.double() if exact else layer.scales
    return tensors, dequantize_gemm(layer.qweight, layer.qzeros, scales, 4, group).t().float()


AWQ_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True},
    "auto_round:auto_awq": {"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:auto_awq"},
}


@pytest.mark.parametrize("layout", list(AWQ_CONFIGS))
@pytest.mark.parametrize("group,symmetric", [(32, False), (128, False), (64, True)])
def test_awq_layout_equals_the_package_unpacker(tmp_path, layout, group, symmetric):
    tensors, expected = awq_module(64, 256, group, symmetric, seed=group)
    config = {"quantization_config": dict(AWQ_CONFIGS[layout], group_size=group)}
    codes = gptq.decode(config, tensors, tmp_path)["m.weight"]
    assert isinstance(codes, Int4Codes) and codes.perm is None and codes.group_size == group
    torch.testing.assert_close(codes.dequantize(), expected, rtol=2**-11, atol=0)


@pytest.mark.parametrize("version", ["gemv", "gemv_fast", "marlin"])
def test_awq_other_versions_refused_by_name(tmp_path, version):
    from deltaserve.weights import CheckpointError

    tensors, _ = awq_module(32, 128, 32, False, seed=1)
    config = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": version}}
    with pytest.raises(CheckpointError, match=f"AWQ version '{version}' is not supported"):
        gptq.decode(config, tensors, tmp_path)


@pytest.fixture(scope="module", params=["auto_round:auto_gptq", "awq"])
def tiny_qwen3(request, tmp_path_factory):
    """A tiny Qwen3 checkpoint in each layout (make_tiny_qwen3)."""
    layout = request.param
    folder = tmp_path_factory.mktemp(layout.replace(":", "_"))
    return folder, make_tiny_qwen3(layout, folder), layout


def make_tiny_qwen3(layout: str, folder):
    """Every decoder linear of a tiny Qwen3 packed by AutoRound's own packer, group 32: its QuantLinear
    (auto_round:auto_gptq, one module with activation order) or its AWQ export's WQLinear_GEMM (quant_method awq),
    saved as a checkpoint folder; returns transformers holding the package's dequantized weights."""
    import transformers
    from safetensors.torch import save_file

    from tests.test_models_hybrid import VOCAB, save_tiny_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=False, initializer_range=0.1)
    ref = transformers.Qwen3ForCausalLM(config).eval()
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    for i, (name, linear) in enumerate((n, m) for n, m in ref.named_modules()
                                       if isinstance(m, torch.nn.Linear) and n != "lm_head"):
        n, k = linear.weight.shape
        if layout == "awq":
            tensors, expected = awq_module(n, k, 32, symmetric=False, seed=i)
        else:
            tensors, expected = packed_module(qlinear_torch_zp, n, k, 32, act_order=i == 0, seed=i)
        linear.weight.data.copy_(expected)
        del state[name + ".weight"]
        state.update({f"{name}.{part}": t for part, t in ((p.split(".")[1], t) for p, t in tensors.items())})
    config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data["quantization_config"] = (dict(AWQ_CONFIGS["awq"], group_size=32) if layout == "awq" else
                                   {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": False,
                                    "packing_format": layout})
    (folder / "config.json").write_text(json.dumps(data))
    save_file(state, folder / "model.safetensors")
    save_tiny_tokenizer(folder)
    return ref


@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantized", "packed"])
def test_tiny_qwen3_in_auto_round_layout_matches_transformers(tiny_qwen3, dequantize):
    """Our logits, dequantized and packed (the activation-ordered module too), equal transformers run on the
    package's dequantized weights, within the package's float16 rounding."""
    from deltaserve.engine.loader import load_model
    from tests.tolerance import config_rtol
    from tests.test_models_hybrid import prefill_logits, prompt, rel_error

    folder, ref, _ = tiny_qwen3
    ours = load_model(folder, dequantize=dequantize).model
    ids = prompt(33, seed=4)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    # The package's weights are float16-rounded (2^-11 relative each, see above); a token's path crosses 4
    # sequential linears per layer (qkv, o, gate/up, down), 2 layers: at most 8 such errors on top of float32's.
    assert rel_error(prefill_logits(ours, ids), expected) <= config_rtol(ref.config, context=len(ids)) + 8 * 2**-11


@pytest.mark.parametrize("layout", ["dequantized", "packed", "torch_int4"])
def test_ledger_weights_line_equals_resident_bytes(tiny_qwen3, layout, monkeypatch):
    """The ledger's weights line = the bytes the loaded model holds (Engine.measured_bytes' count), within 1%:
    packed, each module holds half a byte a weight and a float32 scale and offset per group, not the checkpoint's
    float16 scale, packed zero and int32 g_idx; in torch's int4 layout (CUDA, bfloat16), a bfloat16 scale and zero
    per group and the same input permutation."""
    from deltaserve.budget import plan_budget, spec_from_checkpoint, spec_from_config
    from deltaserve.models.layers import Int4Linear, TorchInt4Linear
    from tests.test_weights_compressed_tensors import load_as, resident_bytes

    folder, _, kind_of_file = tiny_qwen3
    model, config, kind = load_as(folder, layout, monkeypatch)
    packed = [m for m in model.modules() if isinstance(m, (Int4Linear, TorchInt4Linear))]
    assert len(packed) == (0 if layout == "dequantized" else 14)
    assert layout == "dequantized" or (packed[0].perm is not None) == (kind_of_file != "awq")
    budget = plan_budget(spec_from_checkpoint(folder), config, device_total_bytes=4 * 2**30, device_kind=kind)
    predicted, measured = budget.line("weights").bytes, resident_bytes(model)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    # `deltaserve plan` on config.json alone prices the same held bytes (weights/held.py), not the checkpoint's
    alone = plan_budget(spec_from_config(json.loads((folder / "config.json").read_text())), config,
                        device_total_bytes=4 * 2**30, device_kind=kind)
    assert alone.line("weights").bytes == predicted
