"""4-bit weights held packed: codes read from GGUF blocks against transformers' dequantizer, the int4 matmul
against a float64 product, and SmolLM2 with packed weights against transformers' float32 model."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_weights_gguf import transformers_dequant, write_gguf

from deltaserve.kernels.int4 import Int4Codes, int4_linear, pack_int4, packable
from deltaserve.weights import load_checkpoint


@pytest.fixture(scope="module")
def q4_checkpoint(tmp_path_factory):
    """A GGUF with Q4_0 and Q4_1 matrices, one of them llama's rotary-permuted attn_q, and what each decodes to."""
    rng = np.random.default_rng(1)
    tensors, expected = {}, {}
    for qtype, name in ((Q.Q4_0, "blk.0.ffn_up.weight"), (Q.Q4_1, "blk.0.attn_q.weight")):
        values = rng.standard_normal((64, 256)).astype(np.float32)
        raw = gguf.quants.quantize(values, qtype)
        tensors[name] = (raw, qtype)
        expected[name] = transformers_dequant(raw, qtype).reshape(64, 256)
    path = write_gguf(tmp_path_factory.mktemp("q4") / "q4.gguf", tensors, heads=2, kv_heads=1, hidden=256)
    return path, expected


def test_codes_read_from_blocks_decode_like_transformers(q4_checkpoint):
    path, expected = q4_checkpoint
    packed = load_checkpoint(path, keep_int4=True).tensors
    dense = load_checkpoint(path).tensors
    for hf_name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        codes = packed[hf_name]
        assert isinstance(codes, Int4Codes) and codes.group_size == 32
        assert int(codes.codes.max()) <= 15
        # the same values as the dequantized load (which undoes the rotary permutation of attn_q) ...
        torch.testing.assert_close(codes.dequantize(), dense[hf_name], rtol=0, atol=1e-6)
    # ... and the plain tensor is transformers' own dequantization of the block bytes.
    up = packed["model.layers.0.mlp.up_proj.weight"].dequantize().numpy()
    np.testing.assert_allclose(up, expected["blk.0.ffn_up.weight"], rtol=0, atol=1e-6)


def random_codes(n: int, k: int, seed: int) -> Int4Codes:
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()  # GGUF scales are float16
    offsets = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return Int4Codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scales, offsets, 32)


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_int4_linear_matches_a_float64_product(rows):
    codes = random_codes(96, 576, rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(96)
    got = int4_linear(x, *pack_int4(codes), 32, bias)
    want = (x.double() @ codes.dequantize(torch.float64).T + bias.double()).float()
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # bfloat16 inputs, zeros and outputs (2^-9 each): far below what a wrong code or scale would give (~1)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 5e-3


def test_int4_linear_keeps_leading_dimensions():
    codes = random_codes(32, 64, 0)
    x = torch.randn(2, 5, 64)
    out = int4_linear(x, *pack_int4(codes), 32)
    torch.testing.assert_close(out[1, 3], int4_linear(x[1, 3:4], *pack_int4(codes), 32)[0])


@pytest.mark.parametrize("shape", [(4, 64), (16, 40)])  # rows must be a multiple of 16, inputs of the group
def test_unpackable_shape_is_refused_by_name(shape):
    assert not packable(shape, 32)
    codes = Int4Codes(torch.zeros(shape, dtype=torch.uint8), torch.ones(shape[0], 1), torch.zeros(shape[0], 1), 32)
    with pytest.raises(ValueError, match=rf"cannot pack a \({shape[0]}, {shape[1]}\) weight in groups of 32"):
        pack_int4(codes)
