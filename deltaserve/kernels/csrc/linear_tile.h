// The few-row float32 linear's register tiles; linear.cpp and decode.cpp compile them.
#pragma once

#include "prelude.h"
#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace lineark {

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
  store_tile_sums<MR, NR>(acc, y, ldy);
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

}  // namespace lineark
