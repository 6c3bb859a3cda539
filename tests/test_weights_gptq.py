"""GPTQ-layout 4-bit modules (AutoRound's auto_round / auto_round:auto_gptq packings, AutoGPTQ) packed by AutoRound's
own torch QuantLinear and checked against that layer's own dequantization (its forward on the identity).

Its forward computes scale * (code - zero) in float16: the same number as ours (float32) to within half a float16
ulp, so the tolerance is a relative 2^-11 (float16 has 10 fraction bits)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.int4 import Int4Codes
from deltaserve.weights import gptq

pytest.importorskip("auto_round_extension")
from auto_round_extension.torch import qlinear_torch, qlinear_torch_zp  # noqa: E402

PACKINGS = {"auto_round": qlinear_torch, "auto_round:gptqmodel": qlinear_torch,
            "auto_round:auto_gptq": qlinear_torch_zp}


def packed_module(layer_module, n: int, k: int, group: int, act_order: bool, seed: int):
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
    with torch.no_grad():
        expected = layer(torch.eye(k)).t()  # [N, K], the package's own dequantization
    tensors = {"m.qweight": layer.qweight, "m.qzeros": layer.qzeros, "m.scales": layer.scales}
    if act_order:
        tensors["m.g_idx"] = layer.g_idx
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


def test_tiny_qwen3_in_auto_round_layout_matches_transformers(tmp_path):
    """Every decoder linear of a tiny Qwen3 packed by AutoRound's QuantLinear (auto_round:auto_gptq, group 32, one
    with activation order): our logits equal transformers run on the package's dequantized weights, within the
    package's float16 rounding."""
    import json

    import transformers
    from safetensors.torch import save_file

    from deltaserve.models import build_model
    from deltaserve.weights import load_checkpoint
    from tests.tolerance import config_rtol
    from tests.test_models_hybrid import VOCAB, prefill_logits, prompt, rel_error, save_tiny_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=False, initializer_range=0.1)
    ref = transformers.Qwen3ForCausalLM(config).eval()
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    for i, (name, linear) in enumerate((n, m) for n, m in ref.named_modules()
                                       if isinstance(m, torch.nn.Linear) and n != "lm_head"):
        n, k = linear.weight.shape
        tensors, expected = packed_module(qlinear_torch_zp, n, k, 32, act_order=i == 0, seed=i)
        linear.weight.data.copy_(expected)
        del state[name + ".weight"]
        state.update({f"{name}.{part}": t for part, t in ((p.split(".")[1], t) for p, t in tensors.items())})
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": False,
                                   "packing_format": "auto_round:auto_gptq"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    save_file(state, tmp_path / "model.safetensors")
    save_tiny_tokenizer(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    ours = build_model(ckpt.config, ckpt.tensors)
    ids = prompt(33, seed=4)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    # The package's weights are float16-rounded (2^-11 relative each, see above); a token's path crosses 4
    # sequential linears per layer (qkv, o, gate/up, down), 2 layers: at most 8 such errors on top of float32's.
    assert rel_error(prefill_logits(ours, ids), expected) <= config_rtol(ref.config, context=len(ids)) + 8 * 2**-11
