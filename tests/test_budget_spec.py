"""ModelMemorySpec: config estimates against real safetensors headers and transformers' own parameter counts."""

import json
import math
import struct
from pathlib import Path

import pytest
import torch

from deltaserve.budget import SpecError, parse_quant, plan_budget, spec_from_checkpoint, spec_from_config
from deltaserve.config import EngineConfig, GiB

FIXTURE = Path(__file__).parent / "data" / "qwen3_5_27b_w4a16" / "config.json"
TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   linear_conv_kernel_dim=4)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def header_bytes(folder: Path, skip=lambda name: False) -> int:
    """Sum of tensor sizes, read with the safetensors package (the oracle for our own header reader)."""
    from safetensors import safe_open

    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                piece = st.get_slice(name)
                if not skip(name):
                    total += math.prod(piece.get_shape()) * sizes[piece.get_dtype()]
    return total


def estimate(folder: Path, **quant):
    return spec_from_config(json.loads((folder / "config.json").read_text()), **quant)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe", "llama", "qwen3", "qwen3_5_tied",
                                  "llama_bias", "qwen3_bias"])
def test_estimate_equals_headers(tmp_path, kind):
    import transformers as tf

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    build = {
        "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**TINY, **TINY_LINEAR)),
        "qwen3_5_tied": lambda: tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**TINY, **TINY_LINEAR,
                                                                           tie_word_embeddings=True)),
        "qwen3_next": lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**TINY, **TINY_LINEAR, **moe)),
        "qwen3_5_moe": lambda: tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(
            **{k: v for k, v in TINY.items() if k != "intermediate_size"}, **TINY_LINEAR, **moe)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**TINY)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY)),
        # attention_bias: q, k, v and o_proj biased (the fuzzer's finding 2: o_proj.bias was refused at load)
        "llama_bias": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, attention_bias=True)),
        "qwen3_bias": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY, attention_bias=True)),
    }[kind]
    torch.manual_seed(0)
    folder = save(build(), tmp_path / kind)
    measured = spec_from_checkpoint(folder)
    assert measured.weight_source == "checkpoint headers"
    assert measured.weight_bytes == header_bytes(folder)
    guessed = estimate(folder)
    assert guessed.weight_source.startswith("estimated")
    assert abs(guessed.weight_bytes - measured.weight_bytes) <= 0.02 * measured.weight_bytes
    for a, b in zip(guessed.weight_groups, measured.weight_groups, strict=True):
        assert a.name == b.name and abs(a.params - b.params) <= 0.02 * b.params
    if kind == "qwen3_5_tied":
        assert [g.name for g in measured.weight_groups] == ["embedding", "layers"]
    if kind.endswith("_bias"):  # every bias priced: the layers' parameters exactly the checkpoint's
        layers = lambda spec: next(g.params for g in spec.weight_groups if g.name == "layers")  # noqa: E731
        assert layers(guessed) == layers(measured)


def test_vision_tower_is_counted_but_not_loaded(tmp_path):
    import transformers as tf

    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=64)
    config = tf.Qwen3_5Config(text_config=dict(**TINY, **TINY_LINEAR), vision_config=vision)
    torch.manual_seed(0)
    folder = save(tf.Qwen3_5ForConditionalGeneration(config), tmp_path / "vlm")
    measured = spec_from_checkpoint(folder)
    is_vision = lambda name: ".visual." in name or name.startswith("visual.")  # noqa: E731
    vision_group = next(g for g in measured.weight_groups if g.name == "vision")
    assert vision_group.excluded and vision_group.stored_bytes == header_bytes(folder, lambda n: not is_vision(n))
    assert measured.weight_bytes == header_bytes(folder, is_vision)
    guessed = estimate(folder)
    assert abs(guessed.weight_bytes - measured.weight_bytes) <= 0.02 * measured.weight_bytes
    guessed_vision = next(g for g in guessed.weight_groups if g.name == "vision")
    assert abs(guessed_vision.params - vision_group.params) <= 0.05 * vision_group.params


def test_27b_fixture_against_transformers_parameter_counts():
    """The fixture loads as a transformers config and our counts equal the meta-device model's."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(FIXTURE.parent)
    text = config.text_config
    assert text.layer_types.count("linear_attention") == 48 and text.layer_types.count("full_attention") == 16
    with torch.device("meta"):
        lm = tf.Qwen3_5ForCausalLM(text)
        vision = tf.Qwen3_5VisionModel._from_config(config.vision_config)
    spec = spec_from_config(json.loads(FIXTURE.read_text()))
    groups = {g.name: g for g in spec.weight_groups}
    assert sum(g.params for g in spec.weight_groups if not g.excluded) == sum(p.numel() for p in lm.parameters())
    assert groups["embedding"].params == lm.model.embed_tokens.weight.numel()
    assert abs(groups["vision"].params - sum(p.numel() for p in vision.parameters())) <= 0.01 * groups["vision"].params
    assert (spec.attention_layers, spec.gdn_layers, spec.gdn_conv_dim) == (16, 48, 2 * 16 * 128 + 48 * 128)
    assert spec.kv_bytes_per_token("bfloat16") == 16 * 2 * 4 * 256 * 2


def test_27b_quantized_sizes_near_the_field_notes():
    # Field notes: 15.81 GB on disk (INT8 embedding, INT4 lm_head) instead of ~19.4 GB; both with vision and MTP.
    config = json.loads(FIXTURE.read_text())
    plain, aggressive = spec_from_config(config), spec_from_config(config, embed_quant="int8", lm_head_quant="int4")
    on_disk = lambda s: sum(g.stored_bytes for g in s.weight_groups)  # noqa: E731
    assert abs(on_disk(plain) / 1e9 - 19.4) < 0.5
    assert abs(on_disk(aggressive) / 1e9 - 15.81) < 0.8
    assert 3.0e9 < plain.weight_bytes - aggressive.weight_bytes < 3.7e9


def test_compressed_tensors_header_parts(tmp_path):
    """A packed W4 weight: stored bytes from the header, logical params from weight_shape, held packed at the
    kernel's size (kernels/int4.held_bytes: a symmetric weight keeps the file's bf16 scale per group, no offset)."""
    from safetensors.torch import save_file

    out_f, in_f, group = 64, 256, 128
    tensors = {
        "model.layers.0.mlp.down_proj.weight_packed": torch.zeros(out_f, in_f // 8, dtype=torch.int32),
        "model.layers.0.mlp.down_proj.weight_scale": torch.ones(out_f, in_f // group, dtype=torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight_shape": torch.tensor([out_f, in_f]),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(320, 64, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    qc = {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "strategy": "group", "group_size": group, "symmetric": True}}}}
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, model_type="llama", num_hidden_layers=1,
                                                          tie_word_embeddings=True, quantization_config=qc)))
    spec = spec_from_checkpoint(tmp_path)
    layers = next(g for g in spec.weight_groups if g.name == "layers")
    assert spec.weight_bytes == sum(t.nbytes for t in tensors.values())
    assert layers.params == out_f * in_f + 64 and layers.float_params == 64
    assert parse_quant("w4a16-g128").tensor_bytes(out_f, in_f) == out_f * in_f // 2 + out_f * 2 * 2 + 16
    assert layers.quantized_bytes == out_f * in_f // 2 + out_f * 2 * 2  # symmetric: the bf16 scale kept, no offset
    # on CUDA in bfloat16, torch's int4 layout (kernels/int4_torch.py): a symmetric weight's bfloat16 scale alone
    assert layers.torch_int4_bytes == out_f * in_f // 2 + out_f * 2 * 2
    gpu = plan_budget(spec, EngineConfig(max_total_tokens=64), device_total_bytes=4 * GiB, device_kind="cuda")
    gpu32 = plan_budget(spec, EngineConfig(max_total_tokens=64, dtype="float32"), device_total_bytes=4 * GiB,
                        device_kind="cuda")
    cpu = plan_budget(spec, EngineConfig(max_total_tokens=64, dequantize_weights=True), device_total_bytes=4 * GiB,
                      device_kind="cpu")
    assert gpu.line("weights").bytes == layers.torch_int4_bytes + (64 + 320 * 64) * 2
    assert gpu32.line("weights").bytes == layers.quantized_bytes + (64 + 320 * 64) * 4  # packed: int4.py's path
    assert cpu.line("weights").bytes == (out_f * in_f + 64 + 320 * 64) * 4  # dequantized, float32


def test_config_groups_matched_by_compressed_tensors_precedence():
    """A module named by a `re:` target takes that group's scheme over a class-name target, whatever the groups'
    order (compressed-tensors' rule, weights/compressed_tensors.py): the MLP's 8-bit matrices are held int8 (a byte a
    weight, a float32 scale per group), the attention's 4-bit ones packed."""
    def scheme(bits, group):
        return {"num_bits": bits, "type": "int", "strategy": "group", "group_size": group, "symmetric": True}

    mlp = {"targets": [r"re:.*mlp\..*"], "weights": scheme(8, 32)}
    attn = {"targets": ["Linear"], "weights": scheme(4, 32)}
    specs = [spec_from_config(dict(TINY, model_type="qwen3", quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups,
        "ignore": ["lm_head"]})) for groups in ({"mlp": mlp, "attn": attn}, {"attn": attn, "mlp": mlp})]
    layers = [next(g for g in spec.weight_groups if g.name == "layers") for spec in specs]
    assert layers[0] == layers[1]
    h, inter, layers_n = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"]
    attention = (4 * 16 + 2 * 2 * 16) * h + h * 4 * 16  # q, k, v, o
    mlp = 3 * h * inter
    # symmetric: a scale per group of 32 kept in the model's dtype (float32: TINY names none), no offset; the 8-bit
    # MLP a byte a weight and a float32 scale per group
    assert layers[0].quantized_bytes == layers_n * (attention // 2 + attention // 32 * 4 + mlp + mlp // 32 * 4)
    assert layers[0].float_params == layers[0].params - layers_n * (attention + mlp)


def test_bad_inputs(tmp_path):
    with pytest.raises(SpecError, match="model_type 'gpt2' is not supported: supported are llama, qwen3"):
        spec_from_config({"model_type": "gpt2"})
    with pytest.raises(SpecError, match="lacks 'linear_num_value_heads'"):
        spec_from_config(dict(TINY, model_type="qwen3_5_text"))
    with pytest.raises(SpecError, match="no such file"):
        spec_from_checkpoint(tmp_path / "missing")
    with pytest.raises(SpecError, match="needs a config.json"):
        spec_from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, model_type="llama")))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(SpecError, match="corrupt safetensors header length"):
        spec_from_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(SpecError, match="truncated"):
        spec_from_checkpoint(tmp_path)
    with pytest.raises(SpecError, match="not understood"):
        parse_quant("w5x")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(SpecError, match="not a readable GGUF"):
        spec_from_checkpoint(tmp_path / "bad.gguf")
