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

from deltaserve.kernels.cpp_build import VECTOR_PRELUDE, CompiledKernels

# Rows at or below which the kernel serves: a decode step of up to 64 requests. Measured on cold weights (a step
# reads ~0.5 GB of them), calls alternated with MKL's in one process: 1.5-1.8x MKL at 8 rows on SmolLM2's decoder
# matrices and ~2.8x on its vocabulary projection; 1.0-1.2x at 32-62 rows (vocabulary 1.5-2x); in the engine,
# 62-row SmolLM2 decode steps spent ~137 ms in their linears instead of ~160 with MKL.
MAX_ROWS = 64

_SOURCE = VECTOR_PRELUDE + r"""
#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// Register tile: input rows x weight rows. AVX-512 (32 registers of 16 floats): 6 x 4. With AVX2 a 16-float value
// takes two of 16 registers, so 2 x 2 keeps the tile out of memory.
#if defined(__AVX512F__)
constexpr int MR_MAX = 6, NR_MAX = 4;
#else
constexpr int MR_MAX = 2, NR_MAX = 4;  // 8-float accumulators (below): 8 of them, 4 weight vectors and an input
#endif

// y[m, n] for MR input rows and NR weight rows: MR * NR dot products over K, kept as 16-float partial sums and
// summed across lanes once at the end (a transpose-and-add tree per 16 of them). 6 x 4: 24 accumulators, 4 weight
// vectors and one input vector fill 29 of AVX-512's 32 registers (5-10% over 4 x 4, measured here).
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: GCC keeps an array of 16-float values in memory here and moves each through general registers at every
// step (vmovq / vpinsrq); on 8-float __m256 accumulators the tile stays in ymm registers. Measured on this AVX2-only
// VM, SmolLM2's vocabulary projection on one thread: 18 -> 8 ms at 1 row (a sum of the same tensor: 6 ms), 68 ->
// 15 ms at 8 rows.
template <int MR, int NR>
inline void tile(const float* __restrict x, const float* __restrict w, int64_t K, float* __restrict y,
                 int64_t ldy) {
  f32_tile<MR, NR>(x, w, K, y, ldy);  // the prelude's
}
#else
template <int MR, int NR>
inline void tile(const float* __restrict x, const float* __restrict w, int64_t K, float* __restrict y,
                 int64_t ldy) {
  f16v acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = f16v{};
  for (int64_t k = 0; k < K; k += 16) {
    f16v wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load16(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const f16v xv = load16(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m * NR + n] += xv * wv[n];
    }
  }
  for (int i0 = 0; i0 < MR * NR; i0 += 16) {
    f16v part[16];
    for (int i = 0; i < 16; ++i) part[i] = i0 + i < MR * NR ? acc[i0 + i] : f16v{};
    const f16v sums = sum16(part);
    for (int i = 0; i < 16 && i0 + i < MR * NR; ++i) y[(i0 + i) / NR * ldy + (i0 + i) % NR] = sums[i];
  }
}
#endif

// One input row (a batch-1 decode step) past `rows` consecutive weight rows [rows, K], each read front to back before
// the next: one sequential stream a thread, which the hardware prefetcher follows best. The 4-row tile with software
// prefetch (rows_past, for more input rows) read the weights at ~30 GB/s on 2 threads of this AVX2-only VM (Zen 3),
// this at 30-36 (a plain sum of the same bytes: 35-40): the tiny hybrid's layers and vocabulary projection 3.4-3.9 ->
// 3.0-3.7 ms and 3.0-3.5 -> 2.7-3.2 ms (a standalone C++ study, alternated runs). Each row is the tile's own 1 x 1
// case, so every output is summed in the order the tile sums it for more input rows: a sequence's tokens do not
// depend on how many others share its step. AVX-512 builds too: on Zen 4 the tiny hybrid's batch-1 decode, engine
// runs alternated, 159-169 tok/s with the 4-row tile, 165-191 with this.
inline void one_row(const float* x, const float* w, int64_t K, int64_t rows, float* y) {
#if defined(__AVX512F__)
  // tile<1, 1>'s sums (lane j: the columns k = j mod 16, in order; then the same tree), read in 8-float halves.
  for (int64_t n = 0; n < rows; ++n) {
    const float* r = w + n * K;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(r + k), lo);
      hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(r + k + 8), hi);
    }
    f16v part[16] = {};
    std::memcpy(&part[0], &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&part[0]) + 32, &hi, 32);
    y[n] = sum16(part)[0];
  }
#else
  for (int64_t n = 0; n < rows; ++n) tile<1, 1>(x, w + n * K, K, y + n, 1);
#endif
}

template <int NR>
inline void rows_past(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + MR_MAX <= M; m += MR_MAX) tile<MR_MAX, NR>(x + m * K, w, K, y + m * ldy, ldy);
  switch (M - m) {  // fewer rows left than a tile's
    case 5: tile<5, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 4: tile<4, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 3: tile<3, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 2: tile<2, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 1: tile<1, NR>(x + m * K, w, K, y + m * ldy, ldy); break;
    default: break;
  }
}

}  // namespace

// x [M, K] float32, w [N, K] float32 (both contiguous, K % 16 == 0) -> x @ w.T [M, N] float32
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "linear_rows: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_rows: contiguous x [M, K] and w [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "linear_rows: the input width must be a multiple of 16");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 1) {
    const int64_t blocks = (N + 63) / 64;  // 64 rows a unit, a contiguous range of them a thread
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
      one_row(xp, wp + 64 * b * K, K, std::min<int64_t>(64, N - 64 * b), yp + 64 * b);
    return y;
  }
  const int64_t blocks = N / NR_MAX;
  #pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 2 < blocks) {  // the weight rows two blocks on: in flight while these are used
      const char* ahead = reinterpret_cast<const char*>(wp + NR_MAX * (b + 2) * K);
      for (int64_t c = 0; c < NR_MAX * K * 4; c += 64) __builtin_prefetch(ahead + c, 0, 1);
    }
    rows_past<NR_MAX>(xp, M, wp + NR_MAX * b * K, K, yp + NR_MAX * b, N);
  }
  for (int64_t n = NR_MAX * blocks; n < N; ++n) rows_past<1>(xp, M, wp + n * K, K, yp + n, N);
  return y;
}
"""

KERNELS = CompiledKernels("deltaserve_linear_cpu", _SOURCE, ["linear_rows"],
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
