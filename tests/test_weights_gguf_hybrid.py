"""GGUF qwen35 (llama.cpp's converter output, tests/data/gguf, made by tests/data/make_gguf_fixtures.py) and the
4-bit GGUF blocks read as Int4Codes.

Oracles: gguf-py's own dequantize (bit-exact for the 4-bit codes); the converter's transformations, re-applied
here from its documented steps, reproducing the file's tensors from what we load; transformers' Qwen3.5 running
the weights we load (logits and greedy tokens)."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from deltaserve.models import build_model
from deltaserve.models.batch import allocate_caches, single_sequence_batch
from deltaserve.budget import spec_from_checkpoint
from deltaserve.weights import load_checkpoint
from deltaserve.weights.gguf_int4 import int4_codes

FIXTURE = Path(__file__).parent / "data" / "gguf" / "tiny-qwen35-q8_0.gguf"
STEPS = 12


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.IQ4_NL, Q.Q4_K, Q.IQ4_XS])
def test_int4_codes_equal_gguf_dequantize_bit_for_bit(kind):
    rng = np.random.default_rng(int(kind))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 16, 512
    blocks = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    # every float16 field: finite, both signs (the 6-bit sub-scales and codes stay random bits)
    for offset in {Q.Q4_1: (0, 2), Q.Q4_K: (0, 2)}.get(kind, (0,)):
        blocks[:, offset:offset + 2] = rng.uniform(-0.05, 0.05, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, kind).reshape(rows, cols).astype(np.float32)
    codes = int4_codes(raw, kind, (rows, cols))
    assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) <= 15
    np.testing.assert_array_equal(codes.dequantize().numpy(), expected)


@pytest.fixture(scope="module")
def loaded():
    return load_checkpoint(FIXTURE)


def converter_forward(config: dict, name: str, value: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter (Qwen3NextModel + _LinearAttentionVReorderBase) stores for an HF tensor."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]

    def tiled(x, axis, head_dim):  # [k_heads, v_per_k, head_dim] -> [v_per_k, k_heads, head_dim] along axis
        x = np.moveaxis(x, axis, 0)
        shape = x.shape
        x = x.reshape(k_heads, v_heads // k_heads, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
        return np.moveaxis(x, 0, axis)

    key_dim, v_dim = k_heads * config["linear_key_head_dim"], config["linear_value_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        value = value.reshape(value.shape[0], -1) if "conv1d" in name else value
        value = np.concatenate([value[:2 * key_dim], tiled(value[2 * key_dim:], 0, v_dim)])
    elif name.endswith("in_proj_z.weight"):
        value = tiled(value, 0, v_dim)
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias")):
        value = tiled(value, 0, 1)
    elif name.endswith("A_log"):
        value = -np.exp(tiled(value, 0, 1))
    elif name.endswith("out_proj.weight"):
        value = tiled(value, 1, v_dim)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + 1
    return value


def test_converter_transformations_undone(loaded):
    reader = gguf.GGUFReader(FIXTURE)
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
              for t in reader.tensors}
    names = {"blk.0.ssm_a": "model.layers.0.linear_attn.A_log",
             "blk.0.ssm_dt.bias": "model.layers.0.linear_attn.dt_bias",
             "blk.0.ssm_conv1d.weight": "model.layers.0.linear_attn.conv1d.weight",
             "blk.0.attn_qkv.weight": "model.layers.0.linear_attn.in_proj_qkv.weight",
             "blk.0.attn_gate.weight": "model.layers.0.linear_attn.in_proj_z.weight",
             "blk.0.ssm_alpha.weight": "model.layers.0.linear_attn.in_proj_a.weight",
             "blk.0.ssm_beta.weight": "model.layers.0.linear_attn.in_proj_b.weight",
             "blk.0.ssm_out.weight": "model.layers.0.linear_attn.out_proj.weight",
             "blk.0.ssm_norm.weight": "model.layers.0.linear_attn.norm.weight",
             "blk.1.attn_q_norm.weight": "model.layers.1.self_attn.q_norm.weight",
             "output_norm.weight": "model.norm.weight",
             "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight"}
    assert len(loaded.tensors) == len(stored)
    assert loaded.tensors["model.layers.0.linear_attn.conv1d.weight"].dim() == 3
    for gguf_name, hf in names.items():
        again = converter_forward(loaded.config, hf, loaded.tensors[hf].double().numpy())
        # A_log = log(-a) and norm - 1 round once in float32: a float32 ulp of the stored value each way
        np.testing.assert_allclose(again, stored[gguf_name], rtol=2 * np.finfo(np.float32).eps, atol=0, err_msg=hf)


def test_config_and_spec_from_metadata(loaded):
    config = loaded.config
    assert config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"]) == (2, 4)
    spec = spec_from_checkpoint(FIXTURE)
    assert (spec.gdn_layers, spec.attention_layers) == (1, 1)


def test_logits_and_greedy_equal_transformers(loaded):
    config = {k: v for k, v in loaded.config.items() if k not in ("architectures", "model_type")}
    ref = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in loaded.tensors.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    ours = build_model(loaded.config, loaded.tensors)
    ids = loaded.tokenizer.encode("Hello world, the quick brown fox")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    caches = allocate_caches(ours.geometry, len(ids) + STEPS, 1, torch.float32)
    slots = torch.arange(len(ids) + STEPS)
    with torch.inference_mode():
        logits = ours(single_sequence_batch(ids, 0, slots, all_logits=True), caches)
    # float32 sums over at most 512 terms per product, two layers: well under 1e-4 of the largest logit
    assert ((logits - expected).abs().max() / expected.abs().max()).item() <= 1e-4
    tokens, theirs = [], ref.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)[0, len(ids):]
    with torch.inference_mode():
        for step in range(STEPS):
            tokens.append(int(logits[-1].argmax()))
            logits = ours(single_sequence_batch([tokens[-1]], len(ids) + step, slots), caches)
    assert tokens == theirs.tolist()


@pytest.mark.parametrize("arch, tensor, fragments", [
    ("mamba2", np.zeros((2, 64), np.float32), ("mamba2", "qwen35", "qwen3next")),
    ("qwen35", np.zeros((2, 64), np.float32), ("qwen35.ssm.",)),  # a hybrid without its GDN metadata
])
def test_serve_refuses_unsupported_gguf_with_one_line(tmp_path, arch, tensor, fragments):
    import subprocess
    import sys

    from server_util import free_port
    from test_weights_gguf import write_gguf

    path = write_gguf(tmp_path / f"{arch}.gguf", {"blk.0.ffn_up.weight": tensor}, arch=arch)
    done = subprocess.run([sys.executable, "-m", "deltaserve.server.serve", "--log-level", "warning",
                           "--port", str(free_port()), "--model", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and all(f in errors[0] for f in fragments), done.stderr
