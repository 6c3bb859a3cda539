"""GGUF blocks straight into their held forms (weights/gguf_int4.packed_int4, gguf_int8.int8_rows), by the C++ block
kernels (kernels/gguf_blocks_cpu.py; native and AVX2 builds) and by their numpy twins: both bit for bit equal to packing the byte-a-code form
(pack(int4_codes)), and what they hold widens to gguf-py's own `dequantize` of the same bytes bit for bit. Random
blocks: every code and 6-bit sub-scale bit pattern, float16 super-scales of both signs."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from deltaserve.kernels import gguf_blocks_cpu
from deltaserve.kernels.cpp_build import cpu_features
from deltaserve.kernels.int4 import pack
from deltaserve.weights.gguf_int4 import int4_codes, packed_int4
from deltaserve.weights.gguf_int8 import int8_rows

ROWS, COLS = 24, 1024
HALVES = {Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # where float16 fields sit; else (0,)


def random_blocks(kind: Q, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """[rows, bytes a row] uint8: random bits, each float16 field a finite value of either sign."""
    rng = np.random.default_rng(int(kind))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    for at in HALVES.get(kind, (0,)):
        blocks[:, at:at + 2] = rng.uniform(-0.05, 0.05, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def avx2_blocks():
    """The block kernels built for AVX2 + FMA without AVX-512 (x86-64-v3): the vector width GCC picks differs."""
    if not {"avx2", "fma"} <= set(cpu_features().split()):
        pytest.skip("this CPU has no AVX2: the AVX2 build cannot run here")
    variant = gguf_blocks_cpu.KERNELS.variant("avx2")
    assert variant.load(print) is not None, variant.error
    return variant.module


@pytest.fixture(params=["native", "avx2", "numpy"])
def path(request):
    if request.param == "numpy":
        with gguf_blocks_cpu.disabled():
            yield request.param
        return
    if gguf_blocks_cpu.load() is None:
        pytest.skip(f"the block kernels cannot be built here: {gguf_blocks_cpu.KERNELS.error}")
    if request.param == "avx2":
        with gguf_blocks_cpu.KERNELS.using(request.getfixturevalue("avx2_blocks")):
            yield request.param
        return
    yield request.param


def held(t: torch.Tensor | None):
    return None if t is None else (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.IQ4_NL, Q.Q4_K, Q.IQ4_XS], ids=lambda k: k.name)
def test_packed_int4_is_pack_of_codes_and_gguf_dequantize(kind, path):
    raw = random_blocks(kind)
    got = packed_int4(raw, kind, (ROWS, COLS))
    want = pack(int4_codes(raw, kind, (ROWS, COLS)))
    for part in ("packed", "scales", "offsets", "lut"):
        assert held(getattr(got, part)) == held(getattr(want, part)), part
    expected = gguf.quants.dequantize(raw, kind).reshape(ROWS, COLS).astype(np.float32)
    np.testing.assert_array_equal(got.dequantize().numpy(), expected)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q6_K, Q.Q5_K], ids=lambda k: k.name)
def test_int8_rows_equal_numpy_and_gguf_dequantize(kind, path):
    raw = random_blocks(kind)
    got = int8_rows(raw, kind, (ROWS, COLS))
    with gguf_blocks_cpu.disabled():
        want = int8_rows(raw, kind, (ROWS, COLS))
    for part in ("codes", "scales", "offsets"):
        assert held(getattr(got, part)) == held(getattr(want, part)), part
    expected = gguf.quants.dequantize(raw, kind).reshape(ROWS, COLS).astype(np.float32)
    np.testing.assert_array_equal(got.dequantize().numpy(), expected)


def test_kernel_refuses_blocks_of_the_wrong_width():
    if gguf_blocks_cpu.load() is None:
        pytest.skip("the block kernels cannot be built here")
    with pytest.raises(RuntimeError, match=r"q6_k_codes: contiguous uint8 blocks \[count, 210\]"):
        gguf_blocks_cpu.KERNELS.module.q6_k_codes(torch.zeros(3, 208, dtype=torch.uint8))
