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

PACKINGS = {"auto_round": qlinear_torch, "auto_round:gptqmodel": qlinear_torch, "auto_round:auto_gptq": qlinear_torch_zp}


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
