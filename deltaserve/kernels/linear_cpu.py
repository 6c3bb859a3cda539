"""Linear layers for the few rows of a decode step, on CPU: a small C++ kernel the engine builds at start.

A decode step multiplies a handful of rows (one per running request) by every weight matrix, so the step reads
all the weights once and does little arithmetic per byte. The BLAS torch ships (MKL) reads them at 5-10 GB/s in
that shape on this Zen 4 CPU (8 rows times SmolLM2's vocabulary projection: 6 GB/s, where a plain sum of the same
tensor reads 53 GB/s), so a step with few requests left was bound by that, not by memory. This kernel keeps the
weight's own layout ([out, in], what nn.Linear holds): each task takes 4 weight rows (in L1, the next ones already
on their way) and runs every group of 6 input rows past them as 24 dot products on 16-float vectors, so each weight
byte is read from memory once per step. Above `MAX_ROWS` rows (prefill chunks) a blocked GEMM is the better one
and serves (`gemm`: oneDNN's float32 linear, which torch ships, else MKL's through F.linear). float32 only, input
widths a multiple of 16; everything else takes F.linear.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from deltaserve.kernels.cpp_build import CSRC, CompiledKernels

# Rows at or below which the kernel serves: a decode step of up to 64 requests. Measured on cold weights (a step
# reads ~0.5 GB of them), calls alternated with MKL's in one process: 1.5-1.8x MKL at 8 rows on SmolLM2's decoder
# matrices and ~2.8x on its vocabulary projection; 1.0-1.2x at 32-62 rows (vocabulary 1.5-2x); in the engine,
# 62-row SmolLM2 decode steps spent ~137 ms in their linears instead of ~160 with MKL.
MAX_ROWS = 64

KERNELS = CompiledKernels("deltaserve_linear_cpu", CSRC / "linear.cpp", ["linear_rows"],
                           "CPU decode linear kernel", "torch's F.linear")


def load(log=None):
    """The compiled module (built once per machine into our kernel cache), or None when it cannot be built here."""
    return KERNELS.load(log)


def disabled():
    """Inside the block every linear takes F.linear (the built module is kept); for comparisons."""
    return KERNELS.disabled()


K_MULTIPLE = 16  # linear_rows: the input width, a vector of the few-row tile


def declines(in_features: int) -> str | None:
    """Why linear_rows cannot take a float32 weight of this input width (its TORCH_CHECK), or None."""
    if in_features % K_MULTIPLE:
        return f"input width {in_features} not a multiple of {K_MULTIPLE}"
    return None


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the built kernel takes x [..., K] @ weight [N, K].T: float32 on CPU, 1 to MAX_ROWS rows, a width it
    serves (declines); never waits for a compiler."""
    if KERNELS.module is None or x.device.type != "cpu" or not x.dtype == weight.dtype == torch.float32:
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 0 < rows <= MAX_ROWS and declines(x.shape[-1]) is None and weight.is_contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel where `serves` says it takes the inputs, else `gemm`."""
    if not serves(x, weight):
        return gemm(x, weight, bias)
    y = KERNELS.module.linear_rows(x.reshape(-1, x.shape[-1]).contiguous(), weight)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


# Prefill GEMMs (float32, CPU) through oneDNN's linear, which torch ships (`torch.ops.mkldnn._linear_pointwise`, the
# op torch.compile's CPU backend emits), rather than F.linear's MKL sgemm. Measured on AMD Zen 4 (AVX-512), 2 threads,
# SmolLM2's shapes: 205-223 vs 180-204 GFLOP/s at 512-2048 rows (MKL 138-152 at some 1024-2048 row shapes), 106-170
# vs 85-131 at 17-32 rows, the 49,152-row vocabulary at 17-256 rows 83-197 vs 43-131; in the engine a 512-token
# SmolLM2 prompt's GEMMs took 0.60-0.64 s instead of 0.68-0.72 (alternated). The same float32 arithmetic: only the
# order of the sums differs (both within float32 rounding of a float64 product; tests/test_kernels_linear_cpu.py).
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for many rows: oneDNN's float32 linear on CPU where torch has it (`ONEDNN`), else
    F.linear (MKL on CPU, cuBLAS on CUDA, any dtype)."""
    if not (ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and x.numel() and (bias is None or bias.dtype == torch.float32)):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def mkl_gemm():
    """Inside the block `gemm` takes F.linear (MKL on CPU); for comparisons and tests of both."""
    global ONEDNN
    kept, ONEDNN = ONEDNN, False
    try:
        yield
    finally:
        ONEDNN = kept
