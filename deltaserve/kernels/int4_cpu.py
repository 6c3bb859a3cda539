"""The packed 4-bit matmul on CPU (kernels/int4.py's layout), float32 arithmetic, a small C++ kernel.

Decode (1 to MAX_ROWS input rows, 16): each task takes NR weight rows; for every 32 columns it widens 16 packed bytes
per row into two 16-float vectors (mask and shift, the level table through one in-register permute), forms
w = scale * level + offset in float32 and runs every group of MR input rows past them, so each packed byte is read
from memory once per step and no float32 copy of the weight is ever written (on AVX2, from 4 input rows on, a task
widens its NR weight rows once into an L1 buffer that all the rows then read: the widening is most of a tile's
work). Prefill (more rows) runs `gemm`, a float32 GEMM of our own that reads the packed weight: each task widens a
panel of 64 weight rows once (32 or 16 where 64-row panels would not spread evenly over the threads), transposes it
into a K-major panel in registers (16 x 16 blocks, 8 x 8 on AVX2), and multiplies every 6 input rows past it, 96
columns of K at a time, from a 6 x 64 register tile (6 x 16 on AVX2). Until then prefill widened the whole matrix
into a float32 tensor and called oneDNN's linear, which packs a row-major [N, K] weight again on every call:
SmolLM2's 210 matrices at 528 rows took 549-568 ms that way, 530-534 this way, and 512-521 in oneDNN on weights
prepacked once (what vLLM's CPU build holds: float32, 8x the bytes); the panel's widening and transposition are ~12
ms of it (alternated, Zen 4, 2 threads).
AVX-512 and AVX2 through the same GCC/Clang vector extensions as linear_cpu.py; the one-row tile is AVX2 code that
AVX-512 builds take too.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.cpp_build import CSRC, CompiledKernels

# Rows the decode kernel takes; above it the widened tile's GEMM is the faster one (it re-widens the weight for every
# 2-row tile on AVX2: a 1536 x 576 matrix at 32 rows 1.10 ms vs 0.62 ms widened once, at 8 rows 0.36 vs 0.50 ms;
# 2 threads, AVX2 EPYC). Against `gemm` on AVX-512 (Zen 4, SmolLM2's 210 matrices, alternated): 16 rows 30.6 vs
# 35.3 ms, 20 rows 38.0 vs 38.7, 24 rows 44.8 vs 38.7. Decode-only steps of up to 64 rows take kernels/decode_cpu.py's
# blocks instead.
MAX_ROWS = 16
GEMM_K_MULTIPLE = 16  # `gemm` takes K a multiple of the vector width (16 floats AVX-512, 8 AVX2); 4-bit groups are 32

KERNELS = CompiledKernels("deltaserve_int4_cpu", CSRC / "int4.cpp",
                           ["int4_decode", "int4_widen", "int4_gemm", "int4_gemm_bf16", "int4_has_bf16"],
                           "CPU packed 4-bit kernel", "torch (widened weights)")


def load(log=None):
    """The compiled module (built once per machine, cached by torch), or None when it cannot be built here."""
    return KERNELS.load(log)


def disabled():
    """Inside the block the portable torch path serves (the built module is kept); for comparisons and tests."""
    return KERNELS.disabled()


def built() -> bool:
    """Whether the compiled module is loaded (never compiles)."""
    return KERNELS.module is not None


K_MULTIPLE = 32  # weight_of: a packed weight's input width and group, a packed run's columns


def declines(in_features: int, group_size: int) -> str | None:
    """Why the kernel cannot take a packed 4-bit weight of this input width and group size (weight_of's
    TORCH_CHECK; the GEMM's K % 16 follows from it), or None. kernels/int4.py's `packable`, which decides at load
    what is packed, is stricter (tests/test_kernel_capability.py)."""
    if in_features % K_MULTIPLE or group_size < K_MULTIPLE or group_size % K_MULTIPLE or in_features % group_size:
        return f"4-bit input width {in_features} and group {group_size} not multiples of {K_MULTIPLE}, the group " \
               f"dividing the width"
    return None


def serves(rows: torch.Tensor) -> bool:
    """Whether the decode kernel takes these float32 input rows [M, K]: built, on CPU, 1 to MAX_ROWS rows."""
    return built() and rows.device.type == "cpu" and 0 < rows.shape[0] <= MAX_ROWS


def decode(rows, packed, scales, offsets, lut, group_size: int) -> torch.Tensor:
    """rows [M, K] float32 @ W.T, reading the packed bytes (offsets: an empty tensor for a symmetric weight)."""
    return KERNELS.module.int4_decode(rows, packed, scales, offsets, lut, group_size)


def gemm(rows, packed, scales, offsets, lut, group_size: int) -> torch.Tensor:
    """rows [M, K] float32 (contiguous, K a multiple of 16) @ W.T, each panel of W widened once into the GEMM."""
    return KERNELS.module.int4_gemm(rows, packed, scales, offsets, lut, group_size)


def widen(packed, scales, offsets, lut, group_size: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of W widened to float32."""
    return KERNELS.module.int4_widen(packed, scales, offsets, lut, group_size, start, stop)


def has_bf16() -> bool:
    """Whether the built kernel has the bfloat16 prefill GEMM (compiled for a CPU with AVX512-BF16)."""
    return built() and KERNELS.module.int4_has_bf16()


def gemm_bf16(rows, packed, scales, offsets, lut, group_size: int) -> torch.Tensor:
    """rows [M, K] (any float dtype; rounded to bfloat16 here) @ W.T with W rounded to bfloat16, summed in float32."""
    return KERNELS.module.int4_gemm_bf16(rows.to(torch.bfloat16).contiguous(), packed, scales, offsets, lut,
                                         group_size)
