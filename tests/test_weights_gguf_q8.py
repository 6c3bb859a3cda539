"""GGUF Q8_0 matrices held 8-bit (weights/gguf.kept_int8, models/layers.Int8Linear) on the llama.cpp-converted
fixtures (tests/data/gguf: qwen35, qwen35moe, qwen3next): the held model's logits equal the dequantized model's to
float32 rounding (Q8_0's scale x code is exact in float32: an 11-bit scale times an 8-bit code), the hybrid layouts'
reordered value heads (rows, and out_proj's input columns as a permutation) and Qwen3-Next's fused in_proj_qkvz
included, and the ledger's weights line is what the loaded model holds, within 1%."""

from pathlib import Path

import pytest

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


def test_int8_activations_agree_with_transformers_within_the_int8_bound():
    """The engine's default on the Q8_0 hybrid: its 8-bit linears (and out_proj's permuted columns) on the integer dot
    products, teacher-forced against transformers on gguf-py's dequantized weights: each chosen log-probability within
    the float32 bound plus the activations' rounding propagated (tests/int8_bound.py), greedy tokens equal wherever
    the oracle's margin exceeds that."""
    import json

    from int8_bound import engine_greedy_problems, swapped_layers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.models.layers import Int8DotLinear

    path = DATA / "tiny-qwen35-q8_0.gguf"
    loaded = load_checkpoint(path)
    ref = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in loaded.config.items()
                                                  if k not in ("architectures", "model_type")})).eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in loaded.tensors.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    eng = Engine(EngineConfig(model=str(path), device="cpu", max_total_tokens=512, prefix_cache=False), log=None)
    layers = swapped_layers(eng.runner.model)
    held = [m for m in eng.runner.model.modules() if type(m) is Int8DotLinear]
    assert held and all(m.bits == 8 for m in held)
    assert layers["model.layers.0.linear_attn.out_proj"] is not None  # quantized in its stored column order
    steps = 16
    prompt = json.loads((DATA / "tiny-qwen35-q4_k.llamacpp.json").read_text())["tokens"]
    problems, decided = engine_greedy_problems(eng, ref, prompt, steps,
                                               config_rtol(ref.config, context=len(prompt) + steps - 1))
    assert problems == []
    # this random model's top two logits lie close: the bound decides 5 of its 16 positions (measured)
    assert decided >= steps // 4, "the bound decides too few positions to test anything"
