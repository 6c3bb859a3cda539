// What every kernel source starts with (kernels/cpp_build.py compiles each csrc/*.cpp with this folder on the
// include path).
#pragma once

#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>

typedef float f16v __attribute__((vector_size(64)));
typedef float f16v_u __attribute__((vector_size(64), aligned(4)));
inline f16v load16(const float* p) { return *reinterpret_cast<const f16v_u*>(p); }
inline void store16(float* p, f16v x) { *reinterpret_cast<f16v_u*>(p) = x; }

// Two-input shuffles: Clang spells them __builtin_shufflevector, GCC (any version with vector extensions, 11 on
// Ubuntu 22.04 included) __builtin_shuffle with a mask vector.
typedef int32_t i16v __attribute__((vector_size(64)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i16v{__VA_ARGS__})
#endif

// 16 packed integers widened to 16 int32 lanes. GCC 12 lowers __builtin_convertvector from a 16- or 32-byte vector to
// a 64-byte one as 16 scalar loads and inserts, even with AVX-512 at hand: the packed 4-bit and int8 tiles ran 3-4x
// slower in the AVX-512 build than in the AVX2 one on the same Zen 4 (SmolLM2 decode 44 vs 130 tok/s); x86 takes the
// widening loads (vpmovzxbd / vpmovsxbd / vpmovzxwd) instead.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
typedef uint8_t u8x16_u __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16_u __attribute__((vector_size(16), aligned(1)));
typedef uint16_t u16x16_u __attribute__((vector_size(32), aligned(1)));
#if defined(__AVX512F__)
inline i16v widen_u8(const uint8_t* p) {
  return reinterpret_cast<i16v>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline i16v widen_i8(const int8_t* p) {
  return reinterpret_cast<i16v>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline i16v widen_u16(const uint16_t* p) {
  return reinterpret_cast<i16v>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#else
// AVX2 builds widen 4-bit and int8 codes in their own __m256 tiles; only the bfloat16 KV load takes widen_u16 there.
inline i16v widen_u8(const uint8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const u8x16_u*>(p), i16v);
}
inline i16v widen_i8(const int8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const i8x16_u*>(p), i16v);
}
#if defined(__AVX2__)
inline i16v widen_u16(const uint16_t* p) {  // two 8-lane widening loads
  const __m256i low = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  i16v r;
  std::memcpy(&r, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &high, 32);
  return r;
}
#else
inline i16v widen_u16(const uint16_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const u16x16_u*>(p), i16v);
}
#endif
#endif

// One register of floats at the build's widest vectors: 16 (AVX-512) or 8 (AVX2 and narrower; GCC lowers it to two
// SSE registers where there is no AVX). The GEMM-shaped register tiles (int4_cpu's prefill GEMM, the prefill
// attention) are written on it: 16-float values would take two AVX2 registers each and spill there.
#if defined(__AVX512F__)
constexpr int RW = 16;
#else
constexpr int RW = 8;
#endif
typedef float rvec __attribute__((vector_size(RW * 4)));
typedef float rvec_u __attribute__((vector_size(RW * 4), aligned(4)));
typedef int32_t rvec_i __attribute__((vector_size(RW * 4)));
inline rvec rload(const float* p) { return *reinterpret_cast<const rvec_u*>(p); }
inline void rstore(float* p, rvec x) { *reinterpret_cast<rvec_u*>(p) = x; }
inline rvec rset(float s) { return rvec{} + s; }

// 2^n e^r for |r| <= ln 2 / 2, on any float vector V and its int32 twin I: Cephes' degree-6 polynomial for e^r
// (~1 ulp), its exponent field moved by n. exp16 below and the prefill attention kernel's 2^x (its own width) use it.
template <typename V, typename I>
inline V exp_scaled(V r, I n) {
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  I bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += n << 23;
  std::memcpy(&p, &bits, sizeof bits);
  return p;
}

// e^x on 16 floats: 2^n p(r), r = x - n ln 2 (Cody-Waite), p Cephes' degree-6 polynomial (~1 ulp); x is clamped to
// [-87.3, 88.7], the normal range (below, ~1.2e-38 instead of a smaller number or 0). Written out because these
// builds keep -fno-finite-math-only, under which GCC calls the scalar expf for every element of an `omp simd` loop
// instead of glibc's vector one (~15-20 cycles a value).
const i16v LANES16 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline f16v exp16(f16v x) {
  const f16v lo = f16v{} - 87.3f, hi = f16v{} + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f16v t = x * 1.44269504088896341f;
  const i16v n = __builtin_convertvector(t + (t < 0.0f ? f16v{} - 0.5f : f16v{} + 0.5f), i16v);  // to nearest
  const f16v nf = __builtin_convertvector(n, f16v);
  f16v r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  return exp_scaled(r, n);
}

// SiLU by exp16, 16 values at a time (a plain loop of silu(x) = x / (1 + expf(-x)) calls the scalar expf per value
// in these builds: ~1.9 ns a value, 6.5 of the tiny hybrid's 100 ms prefill in its GDN convs alone).
// silu_times: x[i] <- silu(x[i]) * u[i] (u nullptr: silu(x[i])); times_silu: x[i] <- x[i] * silu(g[i]).
inline void silu_times(float* __restrict x, const float* __restrict u, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f16v a = load16(x + i), s = a / (1.0f + exp16(-a));
    store16(x + i, u ? s * load16(u + i) : s);
  }
  for (; i < n; ++i) {
    const float s = x[i] / (1.0f + std::exp(-x[i]));
    x[i] = u ? s * u[i] : s;
  }
}

inline void times_silu(float* __restrict x, const float* __restrict g, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f16v a = load16(g + i);
    store16(x + i, load16(x + i) * (a / (1.0f + exp16(-a))));
  }
  for (; i < n; ++i) x[i] *= g[i] / (1.0f + std::exp(-g[i]));
}

// Lane i of the result is the sum of x[i]'s 16 lanes: a transpose-and-add tree, 15 adds for 16 dot products
// where 16 separate horizontal sums would take 64.
inline f16v sum16(const f16v* x) {
  f16v b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = SHUFFLE(x[2 * j], x[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(x[2 * j], x[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    c[j] = SHUFFLE(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    d[j] = SHUFFLE(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// An MR x NR tile's accumulators (row-major) summed across their lanes into y: row m at y + m * ldy, columns 0..NR-1.
template <int MR, int NR>
inline void store_tile_sums(const f16v* acc, float* y, int64_t ldy) {
  for (int i0 = 0; i0 < MR * NR; i0 += 16) {
    f16v part[16];
    for (int i = 0; i < 16; ++i) part[i] = i0 + i < MR * NR ? acc[i0 + i] : f16v{};
    const f16v sums = sum16(part);
    for (int i = 0; i < 16 && i0 + i < MR * NR; ++i) y[(i0 + i) / NR * ldy + (i0 + i) % NR] = sums[i];
  }
}

#if defined(__AVX2__)
// The sum of v's 8 lanes.
inline float sum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 builds: the tiles use 8-float __m256 values (GCC keeps arrays of 16-float values in memory there and moves
// each through general registers at every step).

// y[m, n] = x[m] . w[n] for MR input rows x [MR, K] and NR float32 weight rows w [NR, K], K a multiple of 8
// (linear_cpu's few-row tile, and int4_cpu's weight rows once widened).
template <int MR, int NR>
inline void f32_tile(const float* __restrict x, const float* __restrict w, int64_t K, float* __restrict y,
                     int64_t ldy) {
  __m256 acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m * NR + n] = _mm256_fmadd_ps(xv, wv[n], acc[m * NR + n]);
    }
  }
  for (int i = 0; i < MR * NR; ++i) y[i / NR * ldy + i % NR] = sum8(acc[i]);
}
#endif
