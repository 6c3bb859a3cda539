// The packed 4-bit weight and its few-row tiles; int4.cpp and decode.cpp compile them.
#pragma once

#include "prelude.h"
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace int4k {

namespace {

#if defined(__AVX512F__)
constexpr int MR_MAX = 4, NR_MAX = 4;  // 16 accumulators + 8 weight vectors + 1 input of 32 registers
#else
constexpr int MR_MAX = 2, NR_MAX = 2;  // a 16-float value takes two of AVX2's 16 registers
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: intrinsics (GCC lowers the generic version's byte -> 16 x int32 conversion to 32 scalar loads and stores per
// call, having no 512-bit registers to convert into).
// The levels of 8 codes held in int32 lanes (0..15): the codes themselves, or the level table through one permute.
inline __m256 levels(__m256i q, const __m256* table, bool lut) {
  if (!lut) return _mm256_cvtepi32_ps(q);
  const __m256 low = _mm256_permutevar8x32_ps(table[0], q), high = _mm256_permutevar8x32_ps(table[1], q);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_cmpgt_epi32(q, _mm256_set1_epi32(7))));
}

// 8 packed bytes -> their 16 codes in int32 lanes: low nibbles (columns c..c+7 of a 32-column run) and high ones
// (c+16..c+23). One widening load and two lane-wise ops: splitting the nibbles on 16 bytes first and widening each
// half after a byte shift cost two more shuffles per 8 codes, and shuffles share their pipes with the FMAs (Zen 3,
// one thread, a 3072 x 576 matrix at one row: 9.6 -> 13.9 G weights/s).
inline void codes16(const uint8_t* p, __m256i& low, __m256i& high) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  low = _mm256_and_si256(b, _mm256_set1_epi32(15));
  high = _mm256_srli_epi32(b, 4);
}
#else
// 16 packed bytes -> the codes of 32 columns as floats: low nibbles are columns 0..15, high ones 16..31.
template <bool LUT>
inline void widen32(const uint8_t* p, f16v table, f16v& lo, f16v& hi) {
  const i16v v = widen_u8(p);
  const i16v ql = v & 15, qh = v >> 4;
  if constexpr (LUT) {
#if defined(__clang__)
    for (int i = 0; i < 16; ++i) { lo[i] = table[ql[i]]; hi[i] = table[qh[i]]; }
#else
    lo = __builtin_shuffle(table, ql);
    hi = __builtin_shuffle(table, qh);
#endif
  } else {
    lo = __builtin_convertvector(ql, f16v);
    hi = __builtin_convertvector(qh, f16v);
  }
}
#endif

// Scales (and offsets, where stored) are float32, bfloat16 or float16, one dtype for both: a checkpoint's 16-bit
// scales are held as they came. Without stored offsets the weight is symmetric: offset = -8 * scale for the codes
// 0..15 (levels centred on 8), 0 with a level table (IQ4's levels are centred already). Either way every w formed in
// float32 is the float32 product the dequantized weight holds (a 16-bit scale times a 4-bit level is exact).
enum ScaleKind : int { F32 = 0, BF16 = 1, F16 = 2 };
constexpr int64_t CHUNK = 128;  // groups whose scales and offsets a tile converts at a time (a multiple of 8)

struct Weight {
  const uint8_t* packed;
  const void* scales;
  const void* offsets;  // nullptr: symmetric (above)
  ScaleKind kind;
  bool lut;
  f16v table;
  int64_t K, group;
  int64_t stored = 0;  // scales (and offsets) held: N * K / group; 0 where not known (then no read past a run)

  float at(const void* p, int64_t i) const {
    if (kind == F32) return static_cast<const float*>(p)[i];
    const uint16_t bits = static_cast<const uint16_t*>(p)[i];
    if (kind == BF16) return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
  float scale(int64_t i) const { return at(scales, i); }
  float offset(int64_t i, float s) const { return offsets ? at(offsets, i) : (lut ? 0.0f : -8.0f * s); }

  // Groups g0 .. g0 + count of row n as float32 scales s and offsets o, the dtype switched on once for the run
  // (per group, at group 32, the switch and the conversions cost the AVX2 tile ~30% of its time). s and o hold
  // count rounded up to a multiple of 8.
  void group_params(int64_t n, int64_t g0, int64_t count, float* s, float* o) const {
    const int64_t first = n * (K / group) + g0;
    // Whole 8-scale vectors where the array has them (past a row's end lies the next row's): one scalar 16-bit
    // conversion per group beyond the last full 8 cost the AVX2 tile ~7% at 18 groups a row (SmolLM2's K = 576).
    const int64_t whole = (count + 7) & ~int64_t{7};
    const int64_t span = first + whole <= stored ? whole : count;
    to_float(scales, first, span, s);
    if (offsets) to_float(offsets, first, span, o);
    else for (int64_t i = 0; i < count; ++i) o[i] = lut ? 0.0f : -8.0f * s[i];
  }
  void to_float(const void* p, int64_t first, int64_t count, float* out) const {
    const uint16_t* bits = static_cast<const uint16_t*>(p) + first;
    switch (kind) {
      case F32: std::memcpy(out, static_cast<const float*>(p) + first, count * sizeof(float)); break;
      case BF16:  // the top half of a float32
        for (int64_t i = 0; i < count; ++i) {
          const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
          std::memcpy(out + i, &wide, sizeof(float));
        }
        break;
      case F16: {
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= count; i += 8)
          _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
#endif
        for (; i < count; ++i) out[i] = static_cast<float>(c10::Half(bits[i], c10::Half::from_bits()));
        break;
      }
    }
  }
};

// y[m, n] for MR input rows and NR weight rows starting at row n0.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: 8-float __m256 accumulators. With arrays of 16-float values GCC keeps the tile in memory and moves each value
// through general registers at every step (linear_cpu.py measured 2.3-4.5x from the same change).
// GS: the group size when known at compile time (0: w.group). At 32 (GGUF's blocks) the column loop of a group is one
// step and GCC keeps the tile in registers: a 1536 x 576 matrix at one row, one thread, ~7% faster than with the size
// read at run time.
template <int MR, int NR, bool LUT, int GS>
inline void tile(const float* __restrict x, const Weight& w, int64_t n0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, group = GS ? GS : w.group, groups = K / group;
  __m256 table[2];
  if constexpr (LUT) std::memcpy(table, &w.table, 64);
  constexpr int A = MR == 1 ? 2 : 1;  // accumulators per output: one row's FMAs would otherwise wait on each other
  // Row pointers in locals: through `w` GCC reloaded them at every group (the scale arrays' stores may alias it).
  const uint8_t* rows[NR];
  for (int n = 0; n < NR; ++n) rows[n] = w.packed + (n0 + n) * (K / 2);
  __m256 acc[MR * NR][A];
  for (int i = 0; i < MR * NR; ++i)
    for (int a = 0; a < A; ++a) acc[i][a] = _mm256_setzero_ps();
  float gs[NR][CHUNK], go[NR][CHUNK];
  for (int64_t c0 = 0; c0 < groups; c0 += CHUNK) {
    const int64_t count = std::min(CHUNK, groups - c0);
    for (int n = 0; n < NR; ++n) w.group_params(n0 + n, c0, count, gs[n], go[n]);
    for (int64_t gi = 0; gi < count; ++gi) {
      __m256 s[NR], o[NR];
      for (int n = 0; n < NR; ++n) {
        s[n] = _mm256_set1_ps(gs[n][gi]);
        o[n] = _mm256_set1_ps(go[n][gi]);
      }
      const int64_t k0 = (c0 + gi) * group;
      for (int64_t k = k0; k < k0 + group; k += 32) {
        __m256 wv[NR][4];  // columns k..k+7, +8..15 (low nibbles), +16..23, +24..31 (high nibbles)
        for (int n = 0; n < NR; ++n) {
          const uint8_t* p = rows[n] + (k >> 1);
          __m256i q0, q2, q1, q3;
          codes16(p, q0, q2);
          codes16(p + 8, q1, q3);
          wv[n][0] = _mm256_fmadd_ps(levels(q0, table, LUT), s[n], o[n]);
          wv[n][1] = _mm256_fmadd_ps(levels(q1, table, LUT), s[n], o[n]);
          wv[n][2] = _mm256_fmadd_ps(levels(q2, table, LUT), s[n], o[n]);
          wv[n][3] = _mm256_fmadd_ps(levels(q3, table, LUT), s[n], o[n]);
        }
        for (int m = 0; m < MR; ++m) {
          const float* xr = x + m * K + k;
          __m256 xv[4];
          for (int j = 0; j < 4; ++j) xv[j] = _mm256_loadu_ps(xr + 8 * j);
          for (int n = 0; n < NR; ++n)
            for (int j = 0; j < 4; ++j)
              acc[m * NR + n][j % A] = _mm256_fmadd_ps(xv[j], wv[n][j], acc[m * NR + n][j % A]);
        }
      }
    }
  }
  for (int i = 0; i < MR * NR; ++i) {
    __m256 t = acc[i][0];
    for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[i][a]);
    y[i / NR * ldy + i % NR] = sum8(t);
  }
}

#else
template <int MR, int NR, bool LUT, int GS>
inline void tile(const float* __restrict x, const Weight& w, int64_t n0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, group = GS ? GS : w.group, groups = K / group;
  f16v acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = f16v{};
  for (int64_t g = 0; g < groups; ++g) {
    f16v s[NR], o[NR];
    for (int n = 0; n < NR; ++n) {
      const float sc = w.scale((n0 + n) * groups + g);
      s[n] = f16v{} + sc;
      o[n] = f16v{} + w.offset((n0 + n) * groups + g, sc);
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      f16v lo[NR], hi[NR];
      for (int n = 0; n < NR; ++n) {
        widen32<LUT>(w.packed + (n0 + n) * (K / 2) + k / 2, w.table, lo[n], hi[n]);
        lo[n] = lo[n] * s[n] + o[n];
        hi[n] = hi[n] * s[n] + o[n];
      }
      for (int m = 0; m < MR; ++m) {
        const f16v xl = load16(x + m * K + k), xh = load16(x + m * K + k + 16);
        for (int n = 0; n < NR; ++n) acc[m * NR + n] += xl * lo[n] + xh * hi[n];
      }
    }
  }
  store_tile_sums<MR, NR>(acc, y, ldy);
}
#endif

#if defined(__AVX2__)
// AVX-512 builds take this one-row tile too (8-float values; 32 registers): on Zen 4 a 1536 x 576 float16-scaled
// matrix at one row, two threads, 49 -> 25 us against the 16-float tile above, SmolLM2 decode 140 -> 146-151 tok/s.
// One input row, codes without a level table: no shifts, no byte widening. A run's 16 packed bytes are broadcast to
// both 128-bit halves, and each of four masks keeps one nibble per 32-bit lane: lanes 0-3 the low nibble of byte i
// of words 0-3 (columns 4j + i), lanes 4-7 its high nibble (columns 4j + i + 16), the code times a power of two,
// which vcvtdq2ps turns into a float exactly. The input row is prepared once per call (prepare_row): permuted to
// that lane order and scaled by the inverse powers, so each product equals code * x exactly (|x| >= 2^-102; below,
// x * 2^-24 is subnormal and rounds). A group's products are summed, then w = scale * code + offset enters as
// scale * sum + offset * (the group's sum of x). Per 32 columns and weight row: one load, one shift, 4 ands, 4
// conversions and 4 FMAs, where `tile` takes 2 widening loads, 2 ands, 2 shifts, 4 conversions and 8 FMAs: SmolLM2's
// matrices streamed from memory (Zen 3, 1 or 2 threads) ~4-5% faster at group 32, ~9-11% at group 64.
constexpr int Q_SHIFT[4] = {0, 8, 16, 20};  // the power of two of byte i's low nibble (byte 3: read after >> 4)

// x [K] -> xq [K + K / 4]: per 32 columns, x in the lane order above times 2^-Q_SHIFT[i] (low) or 2^-(Q_SHIFT[i] + 4)
// (high nibbles), then per 32 columns 8 lanes whose sum is the sum of those 32 x.
inline void prepare_row(const float* __restrict x, int64_t K, float* __restrict xq) {
  float* sums = xq + K;
  constexpr float low[4] = {1.0f, 0x1p-8f, 0x1p-16f, 0x1p-20f};  // 2^-Q_SHIFT[i], and 2^-4 times it (high)
  constexpr float high[4] = {0x1p-4f, 0x1p-12f, 0x1p-20f, 0x1p-24f};
  for (int64_t c = 0; c < K; c += 32) {
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        xq[c + 8 * i + j] = x[c + 4 * j + i] * low[i];
        xq[c + 8 * i + 4 + j] = x[c + 4 * j + i + 16] * high[i];
      }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(x + c + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(x + c + 16), _mm256_loadu_ps(x + c + 24)));
    _mm256_storeu_ps(sums + c / 4, s);
  }
}

template <int NR, int GS>
inline void tile_q(const float* __restrict xq, const Weight& w, int64_t n0, float* __restrict y) {
  const int64_t K = w.K, group = GS ? GS : w.group, groups = K / group;
  const float* sums = xq + K;
  const __m256i m0 = _mm256_setr_epi32(15, 15, 15, 15, 15 << 4, 15 << 4, 15 << 4, 15 << 4);
  const __m256i m1 = _mm256_slli_epi32(m0, Q_SHIFT[1]), m2 = _mm256_slli_epi32(m0, Q_SHIFT[2]);
  const __m256i m3 = _mm256_slli_epi32(m0, Q_SHIFT[3]);
  const uint8_t* rows[NR];
  for (int n = 0; n < NR; ++n) rows[n] = w.packed + (n0 + n) * (K / 2);
  __m256 acc[NR], acc_o[NR];
  for (int n = 0; n < NR; ++n) acc[n] = acc_o[n] = _mm256_setzero_ps();
  float gs[NR][CHUNK], go[NR][CHUNK];
  for (int64_t c0 = 0; c0 < groups; c0 += CHUNK) {
    const int64_t count = std::min(CHUNK, groups - c0);
    for (int n = 0; n < NR; ++n) w.group_params(n0 + n, c0, count, gs[n], go[n]);
    for (int64_t gi = 0; gi < count; ++gi) {
      const int64_t k0 = (c0 + gi) * group;
      __m256 part[NR][2], xsum = _mm256_setzero_ps();  // two chains a row: 4 dependent FMAs per 32 columns wait
      for (int n = 0; n < NR; ++n) part[n][0] = part[n][1] = _mm256_setzero_ps();
      for (int64_t k = k0; k < k0 + group; k += 32) {
        const float* xk = xq + k;
        xsum = _mm256_add_ps(xsum, _mm256_loadu_ps(sums + k / 4));
        for (int n = 0; n < NR; ++n) {
          const __m128i run = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[n] + k / 2));
          const __m256i b = _mm256_broadcastsi128_si256(run);
          __m256* p = part[n];
          p[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xk), _mm256_cvtepi32_ps(_mm256_and_si256(b, m0)), p[0]);
          p[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), _mm256_cvtepi32_ps(_mm256_and_si256(b, m1)), p[1]);
          p[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 16), _mm256_cvtepi32_ps(_mm256_and_si256(b, m2)), p[0]);
          p[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24),
                                 _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4), m3)), p[1]);
        }
      }
      for (int n = 0; n < NR; ++n) {
        acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(gs[n][gi]), _mm256_add_ps(part[n][0], part[n][1]), acc[n]);
        acc_o[n] = _mm256_fmadd_ps(_mm256_set1_ps(go[n][gi]), xsum, acc_o[n]);
      }
    }
  }
  for (int n = 0; n < NR; ++n) y[n] = sum8(_mm256_add_ps(acc[n], acc_o[n]));
}
#endif

inline void widen_row(const Weight& w, int64_t n, float* dst);

template <int NR, bool LUT, int GS>
inline void tiles(const float* x, int64_t M, const Weight& w, int64_t n0, float* y, int64_t ldy) {
  const int64_t K = w.K;
  int64_t m = 0;
  for (; m + MR_MAX <= M; m += MR_MAX) tile<MR_MAX, NR, LUT, GS>(x + m * K, w, n0, y + m * ldy, ldy);
  switch (M - m) {
    case 3: tile<3, NR, LUT, GS>(x + m * K, w, n0, y + m * ldy, ldy); break;
    case 2: tile<2, NR, LUT, GS>(x + m * K, w, n0, y + m * ldy, ldy); break;
    case 1: tile<1, NR, LUT, GS>(x + m * K, w, n0, y + m * ldy, ldy); break;
    default: break;
  }
}

// xq: x prepared by prepare_row where M is 1 (AVX2 or AVX-512, no level table), else nullptr.
template <int NR, bool LUT>
inline void rows_past(const float* x, int64_t M, const Weight& w, int64_t n0, float* y, int64_t ldy,
                      const float* xq = nullptr) {
#if defined(__AVX2__)
  if constexpr (!LUT) {
    if (xq != nullptr && M == 1) {
      if (w.group == 32) tile_q<NR, 32>(xq, w, n0, y);
      else tile_q<NR, 0>(xq, w, n0, y);
      return;
    }
  }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (M >= 4) {
    const int64_t K = w.K;
    // Two tiles' worth of rows or more: widen these NR weight rows once (into L1) for all M input rows, instead of
    // once per MR_MAX of them (the widening is most of a tile's work). A 1536 x 576 matrix at two threads: 4 rows
    // 144 -> 132 us, 8 rows 288 -> 207, 16 rows 571 -> 369; at 3 rows the two ways cost the same.
    thread_local std::vector<float> buffer;
    if (buffer.size() < static_cast<size_t>(NR * K)) buffer.resize(NR * K);
    float* wb = buffer.data();
    for (int n = 0; n < NR; ++n) widen_row(w, n0 + n, wb + n * K);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) f32_tile<4, NR>(x + m * K, wb, K, y + m * ldy, ldy);
    switch (M - m) {
      case 3: f32_tile<3, NR>(x + m * K, wb, K, y + m * ldy, ldy); break;
      case 2: f32_tile<2, NR>(x + m * K, wb, K, y + m * ldy, ldy); break;
      case 1: f32_tile<1, NR>(x + m * K, wb, K, y + m * ldy, ldy); break;
      default: break;
    }
    return;
  }
#endif
  if (w.group == 32) tiles<NR, LUT, 32>(x, M, w, n0, y, ldy);
  else tiles<NR, LUT, 0>(x, M, w, n0, y, ldy);
}

// Where the one-row masked tile serves (AVX2 or AVX-512, no level table): its prepared input, else nullptr. The input
// lives in the calling thread's buffer until its next call; the OpenMP team the caller then starts reads it.
inline const float* prepared(const float* x, int64_t M, const Weight& w) {
#if defined(__AVX2__)
  if (M == 1 && !w.lut) {
    thread_local std::vector<float> buffer;
    buffer.resize(w.K + w.K / 4);
    prepare_row(x, w.K, buffer.data());
    return buffer.data();
  }
#endif
  return nullptr;
}

template <bool LUT>
void decode_all(const float* x, int64_t M, const Weight& w, int64_t N, float* y) {
  const int64_t blocks = N / NR_MAX, row_bytes = w.K / 2;
  const float* xq = prepared(x, M, w);
  #pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 2 < blocks) {  // the packed rows two blocks on: in flight while these are used
      const char* ahead = reinterpret_cast<const char*>(w.packed + NR_MAX * (b + 2) * row_bytes);
      for (int64_t c = 0; c < NR_MAX * row_bytes; c += 64) __builtin_prefetch(ahead + c, 0, 1);
    }
    rows_past<NR_MAX, LUT>(x, M, w, NR_MAX * b, y + NR_MAX * b, N, xq);
  }
  for (int64_t n = NR_MAX * blocks; n < N; ++n) rows_past<1, LUT>(x, M, w, n, y + n, N, xq);
}

Weight weight_of(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& offsets,
                 const c10::optional<torch::Tensor>& lut, int64_t group) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2,
              "int4: packed codes must be contiguous uint8 [N, K / 2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(K % 32 == 0 && group >= 32 && group % 32 == 0 && K % group == 0,
              "int4: K and the group must be multiples of 32");
  const auto dtype = scales.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "int4: scales must be float32, bfloat16 or float16");
  const bool has_offsets = offsets.numel() > 0;
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK((t == &offsets && !has_offsets) || (t->scalar_type() == dtype && t->is_contiguous() && t->dim() == 2 &&
                t->size(0) == N && t->size(1) == K / group),
                "int4: scales (and offsets, or an empty tensor) must be contiguous [N, K / group] of one dtype");
  const ScaleKind kind = dtype == torch::kFloat32 ? F32 : dtype == torch::kBFloat16 ? BF16 : F16;
  Weight w{packed.data_ptr<uint8_t>(), scales.data_ptr(), has_offsets ? offsets.data_ptr() : nullptr, kind,
           lut.has_value(), f16v{}, K, group, N * (K / group)};
  if (lut.has_value()) {
    TORCH_CHECK(lut->scalar_type() == torch::kFloat32 && lut->numel() == 16, "int4: the level table is 16 float32");
    w.table = load16(lut->contiguous().data_ptr<float>());
  }
  return w;
}

// Row n of W widened to float32 into dst [K]: the tile a prefill GEMM multiplies.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: straight to __m256 stores (the generic 16-float version went through memory: a 1536 x 576 matrix took
// ~0.7 ms to widen on two threads, doubling the cost of a mixed prefill + decode step over float32 weights).
inline void widen_row(const Weight& w, int64_t n, float* dst) {
  const int64_t K = w.K, groups = K / w.group;
  __m256 table[2];
  if (w.lut) std::memcpy(table, &w.table, 64);
  const uint8_t* row = w.packed + n * (K / 2);
  for (int64_t g = 0; g < groups; ++g) {
    const float sc = w.scale(n * groups + g);
    const __m256 s = _mm256_set1_ps(sc), o = _mm256_set1_ps(w.offset(n * groups + g, sc));
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 32) {
      __m256i q0, q2, q1, q3;
      codes16(row + k / 2, q0, q2);
      codes16(row + k / 2 + 8, q1, q3);
      _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(levels(q0, table, w.lut), s, o));
      _mm256_storeu_ps(dst + k + 8, _mm256_fmadd_ps(levels(q1, table, w.lut), s, o));
      _mm256_storeu_ps(dst + k + 16, _mm256_fmadd_ps(levels(q2, table, w.lut), s, o));
      _mm256_storeu_ps(dst + k + 24, _mm256_fmadd_ps(levels(q3, table, w.lut), s, o));
    }
  }
}
#else
inline void widen_row(const Weight& w, int64_t n, float* dst) {
  const int64_t K = w.K, groups = K / w.group;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = w.scale(n * groups + g), o = w.offset(n * groups + g, s);
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 32) {
      f16v lo, hi;
      if (w.lut) widen32<true>(w.packed + n * (K / 2) + k / 2, w.table, lo, hi);
      else widen32<false>(w.packed + n * (K / 2) + k / 2, w.table, lo, hi);
      store16(dst + k, lo * s + o);
      store16(dst + k + 16, hi * s + o);
    }
  }
}
#endif

}  // namespace

}  // namespace int4k
