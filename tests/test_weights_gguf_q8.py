"""GGUF Q8_0 matrices held 8-bit (weights/gguf.kept_int8, models/layers.Int8Linear) on the llama.cpp-converted
fixtures (tests/data/gguf: qwen35, qwen35moe, qwen3next): the held model's logits equal the dequantized model's to
float32 rounding (Q8_0's scale x code is exact in float32: an 11-bit scale times an 8-bit code), the hybrid layouts'
reordered value heads (rows, and out_proj's input columns as a permutation) and Qwen3-Next's fused in_proj_qkvz
included, and the ledger's weights line is what the loaded model holds, within 1%."""

from pathlib import Path

import pytest
import torch

from deltaserve.engine.loader import load_model
from deltaserve.models.layers import Int8Linear
from deltaserve.weights import load_checkpoint
from test_models_hybrid import prefill_logits
from test_weights_gguf_moe import ARCHS
from tolerance import config_rtol

DATA = Path(__file__).parent / "data" / "gguf"
FIXTURES = ["tiny-qwen35-q8_0.gguf", "tiny-qwen35moe-q8_0.gguf", "tiny-qwen3next-q8_0.gguf"]


@pytest.mark.parametrize("name", FIXTURES)
def test_int8_held_linears_equal_the_dequantized_model(name):
    import transformers

    path = DATA / name
    dense, held = load_model(path).model, load_model(path, dequantize=False).model
    int8 = {n: m for n, m in held.named_modules() if type(m) is Int8Linear}
    assert "model.layers.0.linear_attn.out_proj" in int8
    if "qwen3next" in name:
        assert "model.layers.0.linear_attn.in_proj_qkvz" in int8
    if name.startswith("tiny-qwen35-"):  # its value heads are stored reordered: out_proj's columns come permuted
        assert int8["model.layers.0.linear_attn.out_proj"].perm is not None
    ids = list(range(5, 40))
    expected = prefill_logits(dense, ids)
    arch = name.split("-")[1]
    config_cls = ARCHS[arch][0] if arch in ARCHS else transformers.Qwen3_5TextConfig
    rtol = config_rtol(config_cls(**{k: v for k, v in load_checkpoint(path).config.items()
                                     if k not in ("architectures", "model_type")}), len(ids))
    got = prefill_logits(held, ids)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= rtol


@pytest.mark.parametrize("layout", ["dequantized", "packed"])
@pytest.mark.parametrize("name", FIXTURES)
def test_ledger_weights_line_equals_resident_bytes(name, layout, monkeypatch):
    """A Q8_0 linear: a byte a weight and a float32 scale per 32 (no offsets: Q8_0 is symmetric); the embedding also
    a float32 offset per 32 (Int8Embedding's lookups)."""
    from deltaserve.budget import plan_budget, spec_from_checkpoint
    from test_weights_compressed_tensors import load_as, resident_bytes

    path = DATA / name
    model, config, kind = load_as(path, layout, monkeypatch)
    budget = plan_budget(spec_from_checkpoint(path), config, device_total_bytes=4 * 2**30, device_kind=kind)
    predicted, measured = budget.line("weights").bytes, resident_bytes(model)
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    if layout == "packed":
        assert any(type(m) is Int8Linear for m in model.modules())
