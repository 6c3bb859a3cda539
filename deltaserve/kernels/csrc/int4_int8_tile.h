// The 4- and 8-bit x int8 dot-product tiles and the activation quantization (the arithmetic and the panel layouts:
// int4_int8dot.cpp's header); int4_int8dot.cpp and decode.cpp compile them. Three dot products: AVX-512 VNNI
// (vpdpbusd, 16 rows a register), AVX-VNNI without AVX-512 (VEX vpdpbusd, 8 rows: Alder Lake / Raptor Lake) and AVX2
// (vpmaddubsw + vpmaddwd, 8 rows); the last two share one tile, whose block sums are the same exact integers either
// way, so their results are the same bits.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace i8dotk {

namespace {

constexpr int QB = 32;          // columns per activation block (one int8 scale)
constexpr int RI = 16;          // weight rows per panel
constexpr int CHUNK = 64;       // bytes one load takes: 16 rows x 4 columns (8-bit), or x 8 columns (4-bit)
constexpr float INV127 = 1.0f / 127.0f;

// SUPER: int8 [N / 16, K / 256, 64 + 16 G], G = 256 / group (a multiple of 4): per panel and 256 columns, the 16 rows'
// float32 super scales, then G / 4 runs of 64 bytes of int8 sub-scales, run j's dword r holding row r's of groups 4j ..
// 4j + 3 (byte i: group 4j + i), a group's scale their product (GGUF K-quants' d x sc, held as the file holds it). A
// group's 16 are then one aligned load and two shifts within each dword: the byte-to-dword widening this replaced
// (vpmovsxbd, a lane-crossing shuffle per group) took a third of a 6-bit decode product's time here.
enum ScaleKind : int { F32 = 0, BF16 = 1, F16 = 2, SUPER = 3 };

// One row's quantization: q [K] int8, d [K / 32] block scales, gsum [K / group] = sum over a group's blocks of
// d * sum(q); a group of 16 (GGUF Q6_K's, 8-bit codes only) is half a block: its gsum is d * sum(q) over that half.
void quantize_row(const float* __restrict x, int64_t K, int64_t group, int8_t* __restrict q, float* __restrict d,
                  float* __restrict gsum) {
  const int64_t per_group = std::max<int64_t>(group / QB, 1);
  for (int64_t b = 0; b < K / QB; ++b) {
    const float* xb = x + b * QB;
    int32_t total, first;  // the block's sum of q, and its first half's
    float db;
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    db = amax * INV127;
    const float id = db > 0.0f ? 1.0f / db : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));  // to nearest even (MXCSR's)
    const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QB), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QB + 16), _mm512_cvtepi32_epi8(qc));
    first = _mm512_reduce_add_epi32(qa);
    total = first + _mm512_reduce_add_epi32(qc);
#else
    float amax = 0.0f;
    for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(xb[i]));
    db = amax * INV127;
    const float id = db > 0.0f ? 1.0f / db : 0.0f;
    total = first = 0;
    for (int i = 0; i < QB; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * id));
      q[b * QB + i] = static_cast<int8_t>(v);
      total += v;
      if (i < QB / 2) first += v;
    }
#endif
    d[b] = db;
    if (group == QB / 2) {
      gsum[2 * b] = db * static_cast<float>(first);
      gsum[2 * b + 1] = db * static_cast<float>(total - first);
      continue;
    }
    const float part = db * static_cast<float>(total);
    if (b % per_group == 0) gsum[b / per_group] = part;
    else gsum[b / per_group] += part;
  }
}

struct Act {  // quantized input rows
  const int8_t* q;
  const float* d;
  const float* gsum;
  int64_t K, groups;
};

// Bytes of one panel's block of 32 columns: 16 rows x 32 codes of `bits` bits
constexpr int64_t panel_block(int bits) { return 64 * bits; }

// What a panel's codes are: NIBBLES, 4-bit codes c (w = s c + o); BYTES, 8-bit codes c = q + 128; LEVELS, 4-bit
// codes naming one of 16 levels held as bytes l + 128 (IQ4_NL / IQ4_XS's integer levels: w = s l[c]); HALVES, 8-bit
// codes in groups of 16 (a scale per half block, the two halves being chunks 0-3 and 4-7); SIXES, 6-bit codes in
// groups of 16 (GGUF Q6_K, Q5_K: the 4-bit layout's low nibbles, then a 32-byte run a chunk of their high bit pairs,
// the halves being the low and high nibbles). BYTES, LEVELS and HALVES multiply bytes up to 255, with the offset
// -128 s where none is stored; SIXES bytes up to 63, with -32 s.
enum CodeMode : int { NIBBLES = 4, SIXES = 6, BYTES = 8, LEVELS = 16, HALVES = 24 };

struct Weight {
  const uint8_t* codes;  // [N / 16][K / 32][panel_block(bits)]
  const void* scales;    // [N / 16][K / group][16]
  const void* offsets;   // the same, or nullptr: symmetric (offset -8 s for NIBBLES, -32 s for SIXES, -128 s else)
  ScaleKind kind;
  int64_t K, group, groups;
  int bits;              // 4, 6 or 8
  const uint8_t* levels = nullptr;  // 4-bit codes through a table: 16 bytes, level + 128 (LEVELS)
  int super_shift = 0;   // SUPER: log2 of the groups in 256 columns (G)
};

// Where SUPER's 16 values of panel p, group g lie: the super-block's float32 row scales, and the group's int8 ones
inline const int8_t* super_at(const void* base, const Weight& w, int64_t p, int64_t g) {
  const int64_t G = int64_t{1} << w.super_shift;
  return static_cast<const int8_t*>(base) + (p * (w.groups >> w.super_shift) + (g >> w.super_shift)) * (64 + 16 * G);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// 16 scales (or offsets) of panel p, group g as float32
inline __m512 params16(const void* base, ScaleKind kind, int64_t i) {
  switch (kind) {
    case F32: return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    case BF16: {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    default:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i)));
  }
}

// Panel p's 16 scales (or offsets) of group g as float32; SUPER's the product of the two it holds (exact: the
// product was the checkpoint's scale, int4_int8.py's repack factors it only so)
inline __m512 param16(const void* base, const Weight& w, int64_t p, int64_t g) {
  if (w.kind != SUPER) return params16(base, w.kind, (p * w.groups + g) * RI);
  const int8_t* at = super_at(base, w, p, g);
  const int64_t j = g & ((int64_t{1} << w.super_shift) - 1);
  const __m512i run = _mm512_loadu_si512(at + 64 + 64 * (j >> 2));
  const __m512i q = _mm512_srai_epi32(_mm512_sll_epi32(run, _mm_cvtsi32_si128(24 - 8 * (j & 3))), 24);
  return _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(at)), _mm512_cvtepi32_ps(q));
}

// Codes in groups of 16 (HALVES, SIXES): a block's first 16 columns (8-bit: chunks 0-3; 6-bit: the low nibbles) and
// its last 16 (chunks 4-7; the high nibbles) summed apart, each scaled by its own group's scale (and offset, times
// the half's activation sum). 6-bit: chunk L's 32 bytes of high bit pairs hold, byte i, bits 0-1 over the low nibble
// of byte i, 2-3 over byte i + 32's, 4-5 over byte i's high nibble, 6-7 over byte i + 32's.
template <int MR, int NP, int MODE>
void halves_tile(const Act& a, int64_t m0, const Weight& w, int64_t p0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, blocks = K / QB;
  constexpr int64_t BLOCK_BYTES = panel_block(MODE == SIXES ? 6 : 8);
  constexpr float ZERO = MODE == SIXES ? -32.0f : -128.0f;
  [[maybe_unused]] const __m512i nib = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x03);
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i isum[MR][NP][2];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NP; ++n) isum[m][n][0] = isum[m][n][1] = _mm512_setzero_si512();
    for (int L = 0; L < 4; ++L) {
      __m512i lo[NP], hi[NP];
      for (int n = 0; n < NP; ++n) {
        const uint8_t* base = w.codes + ((p0 + n) * blocks + b) * BLOCK_BYTES;
        if constexpr (MODE == SIXES) {
          const __m512i z = _mm512_loadu_si512(base + CHUNK * L);
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 4 * CHUNK + 32 * L));
          const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
          lo[n] = _mm512_or_si512(_mm512_and_si512(z, nib), _mm512_slli_epi16(_mm512_and_si512(hh, pair), 4));
          hi[n] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(z, 4), nib),
                                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hh, 4), pair), 4));
        } else {
          lo[n] = _mm512_loadu_si512(base + CHUNK * L);
          hi[n] = _mm512_loadu_si512(base + CHUNK * (L + 4));
        }
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* qm = a.q + (m0 + m) * K + b * QB + 4 * L;
        int32_t xl, xh;
        std::memcpy(&xl, qm, 4);
        std::memcpy(&xh, qm + 16, 4);
        const __m512i vl = _mm512_set1_epi32(xl), vh = _mm512_set1_epi32(xh);
        for (int n = 0; n < NP; ++n) {
          isum[m][n][0] = _mm512_dpbusd_epi32(isum[m][n][0], lo[n], vl);
          isum[m][n][1] = _mm512_dpbusd_epi32(isum[m][n][1], hi[n], vh);
        }
      }
    }
    for (int n = 0; n < NP; ++n) {
      for (int h = 0; h < 2; ++h) {
        const int64_t g = 2 * b + h;
        const __m512 s = param16(w.scales, w, p0 + n, g);
        const __m512 o = w.offsets ? param16(w.offsets, w, p0 + n, g) : _mm512_mul_ps(s, _mm512_set1_ps(ZERO));
        for (int m = 0; m < MR; ++m) {
          const __m512 dm = _mm512_set1_ps(a.d[(m0 + m) * blocks + b]);
          acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m][n][h]), _mm512_mul_ps(s, dm), acc[m][n]);
          acc[m][n] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.gsum[(m0 + m) * w.groups + g]), acc[m][n]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) _mm512_storeu_ps(y + (m0 + m) * ldy + (p0 + n) * RI, acc[m][n]);
}

// y[m, 16 p + r] for MR input rows from m0 and NP panels from p0: int32 sums per block, scaled into float32.
// 4-bit codes: chunk L (0..3) holds columns 4L.. in its low nibbles and 16 + 4L.. in its high ones; 8-bit: chunk L
// (0..7) holds columns 4L.. (the header), so chunks L and L + 4 are the same two registers; levels: vpshufb looks
// each nibble up in the 16-byte table.
template <int MR, int NP, int MODE>
void tile(const Act& a, int64_t m0, const Weight& w, int64_t p0, float* __restrict y, int64_t ldy) {
  if constexpr (MODE == HALVES || MODE == SIXES) return halves_tile<MR, NP, MODE>(a, m0, w, p0, y, ldy);
  const int64_t K = w.K, blocks = K / QB, per_group = w.group / QB;
  constexpr int64_t BLOCK_BYTES = panel_block(MODE == BYTES ? 8 : 4);
  constexpr float ZERO = MODE == NIBBLES ? -8.0f : -128.0f;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  [[maybe_unused]] __m512i table = _mm512_setzero_si512();
  if constexpr (MODE == LEVELS)
    table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.levels)));
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 s[NP], o[NP];
    for (int n = 0; n < NP; ++n) {
      s[n] = param16(w.scales, w, p0 + n, g);
      o[n] = w.offsets ? param16(w.offsets, w, p0 + n, g) : _mm512_mul_ps(s[n], _mm512_set1_ps(ZERO));
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m512i isum[MR][NP];
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NP; ++n) isum[m][n] = _mm512_setzero_si512();
      for (int L = 0; L < 4; ++L) {
        __m512i lo[NP], hi[NP];
        for (int n = 0; n < NP; ++n) {
          const uint8_t* base = w.codes + ((p0 + n) * blocks + b) * BLOCK_BYTES + CHUNK * L;
          if constexpr (MODE != BYTES) {
            const __m512i z = _mm512_loadu_si512(base);
            lo[n] = _mm512_and_si512(z, nib);
            hi[n] = _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
            if constexpr (MODE == LEVELS) {
              lo[n] = _mm512_shuffle_epi8(table, lo[n]);
              hi[n] = _mm512_shuffle_epi8(table, hi[n]);
            }
          } else {
            lo[n] = _mm512_loadu_si512(base);
            hi[n] = _mm512_loadu_si512(base + 4 * CHUNK);
          }
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* qm = a.q + (m0 + m) * K + b * QB + 4 * L;
          int32_t xl, xh;
          std::memcpy(&xl, qm, 4);
          std::memcpy(&xh, qm + 16, 4);
          const __m512i vl = _mm512_set1_epi32(xl), vh = _mm512_set1_epi32(xh);
          for (int n = 0; n < NP; ++n) {
            isum[m][n] = _mm512_dpbusd_epi32(isum[m][n], lo[n], vl);
            isum[m][n] = _mm512_dpbusd_epi32(isum[m][n], hi[n], vh);
          }
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 dm = _mm512_set1_ps(a.d[(m0 + m) * blocks + b]);
        for (int n = 0; n < NP; ++n)
          acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m][n]), _mm512_mul_ps(s[n], dm), acc[m][n]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 gm = _mm512_set1_ps(a.gsum[(m0 + m) * w.groups + g]);
      for (int n = 0; n < NP; ++n) acc[m][n] = _mm512_fmadd_ps(o[n], gm, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) _mm512_storeu_ps(y + (m0 + m) * ldy + (p0 + n) * RI, acc[m][n]);
}
constexpr int MR_MAX = 4, NP_MAX = 2;  // 8 int32 + 8 float32 accumulators, 4 code registers, 4 scale / offset

#else
// AVX2 (and AVX-VNNI): a panel as two halves of 8 rows (bytes 0-31 and 32-63 of each chunk); NP counts halves here.
inline __m256 params8(const void* base, ScaleKind kind, int64_t i) {
  switch (kind) {
    case F32: return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    case BF16: {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
    default:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  }
}

// Half h (8 rows) of panel p's 16 scales (or offsets) of group g as float32 (param16's, 8 lanes)
inline __m256 param8(const void* base, const Weight& w, int64_t p, int64_t g, int64_t h) {
  if (w.kind != SUPER) return params8(base, w.kind, (p * w.groups + g) * RI + 8 * h);
  const int8_t* at = super_at(base, w, p, g);
  const int64_t j = g & ((int64_t{1} << w.super_shift) - 1);
  const __m256i run = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 64 + 64 * (j >> 2) + 32 * h));
  const __m256i q = _mm256_srai_epi32(_mm256_sll_epi32(run, _mm_cvtsi32_si128(24 - 8 * (j & 3))), 24);
  return _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(at) + 8 * h), _mm256_cvtepi32_ps(q));
}

// Codes in groups of 16 (HALVES, SIXES), as the AVX-512 halves_tile: each half block summed apart (on AVX2 each
// code's low 4 bits and the bits above apart too, joined lo + 16 hi in int32: the same exact integers as
// AVX-VNNI's). A 6-bit half panel (rows 8h ..) takes bits 2h, 2h + 1 (low nibbles) and 4 + 2h, 5 + 2h (high ones) of
// its chunk's 32 bytes of high bit pairs.
template <int MR, int NP, int MODE>
void halves_tile(const Act& a, int64_t m0, const Weight& w, int64_t h0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, blocks = K / QB;
  constexpr int64_t BLOCK_BYTES = panel_block(MODE == SIXES ? 6 : 8);
  constexpr float ZERO = MODE == SIXES ? -32.0f : -128.0f;
  const __m256i nib = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x03);
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i isum[MR][NP][2];  // AVX-VNNI: int32 per row, per half; AVX2: the low nibbles' int16 pairs
    [[maybe_unused]] __m256i isum_hi[MR][NP][2];  // AVX2: the high nibbles' int16 pairs
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NP; ++n)
        for (int h = 0; h < 2; ++h) isum[m][n][h] = isum_hi[m][n][h] = _mm256_setzero_si256();
    for (int L = 0; L < 4; ++L) {
      __m256i low[NP][2], high[NP][2];  // each code's low 4 bits, and the bits above them
      for (int n = 0; n < NP; ++n) {
        const int64_t hh = h0 + n;
        const uint8_t* base = w.codes + ((hh / 2) * blocks + b) * BLOCK_BYTES;
        if constexpr (MODE == SIXES) {
          const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + CHUNK * L + 32 * (hh % 2)));
          __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 4 * CHUNK + 32 * L));
          if (hh % 2) pairs = _mm256_srli_epi16(pairs, 2);
          low[n][0] = _mm256_and_si256(z, nib);
          low[n][1] = _mm256_and_si256(_mm256_srli_epi16(z, 4), nib);
          high[n][0] = _mm256_and_si256(pairs, pair);
          high[n][1] = _mm256_and_si256(_mm256_srli_epi16(pairs, 4), pair);
        } else {
          for (int h = 0; h < 2; ++h) {
            const __m256i z = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(base + CHUNK * (L + 4 * h) + 32 * (hh % 2)));
            low[n][h] = _mm256_and_si256(z, nib);
            high[n][h] = _mm256_and_si256(_mm256_srli_epi16(z, 4), nib);
          }
        }
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* qm = a.q + (m0 + m) * K + b * QB + 4 * L;
        int32_t xv[2];
        std::memcpy(&xv[0], qm, 4);
        std::memcpy(&xv[1], qm + 16, 4);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_set1_epi32(xv[h]);
          for (int n = 0; n < NP; ++n) {
#if defined(__AVXVNNI__)
            const __m256i code = _mm256_or_si256(low[n][h], _mm256_slli_epi16(high[n][h], 4));
            isum[m][n][h] = _mm256_dpbusd_avx_epi32(isum[m][n][h], code, v);
#else
            isum[m][n][h] = _mm256_add_epi16(isum[m][n][h], _mm256_maddubs_epi16(low[n][h], v));
            isum_hi[m][n][h] = _mm256_add_epi16(isum_hi[m][n][h], _mm256_maddubs_epi16(high[n][h], v));
#endif
          }
        }
      }
    }
    for (int n = 0; n < NP; ++n) {
      const int64_t hh = h0 + n;
      for (int h = 0; h < 2; ++h) {
        const int64_t g = 2 * b + h;
        const __m256 s = param8(w.scales, w, hh / 2, g, hh % 2);
        const __m256 o = w.offsets ? param8(w.offsets, w, hh / 2, g, hh % 2) : _mm256_mul_ps(s, _mm256_set1_ps(ZERO));
        for (int m = 0; m < MR; ++m) {
#if defined(__AVXVNNI__)
          const __m256i block = isum[m][n][h];
#else
          const __m256i block = _mm256_add_epi32(_mm256_madd_epi16(isum[m][n][h], ones),
                                                 _mm256_slli_epi32(_mm256_madd_epi16(isum_hi[m][n][h], ones), 4));
#endif
          const __m256 dm = _mm256_set1_ps(a.d[(m0 + m) * blocks + b]);
          acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block), _mm256_mul_ps(s, dm), acc[m][n]);
          acc[m][n] = _mm256_fmadd_ps(o, _mm256_set1_ps(a.gsum[(m0 + m) * w.groups + g]), acc[m][n]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) _mm256_storeu_ps(y + (m0 + m) * ldy + (h0 + n) * 8, acc[m][n]);
}

// Bytes (8-bit codes, looked-up levels) on AVX2: vpmaddubsw's pairs of 255 x 127 would saturate int16, so each byte
// is split into its nibbles, summed apart (each sum at most 8 x 2 x 15 x 127 = 30480 < 2^15, as the 4-bit codes')
// and joined as lo + 16 hi in int32: the same exact integer vpdpbusd sums.
template <int MR, int NP, int MODE>
void tile(const Act& a, int64_t m0, const Weight& w, int64_t h0, float* __restrict y, int64_t ldy) {
  if constexpr (MODE == HALVES || MODE == SIXES) return halves_tile<MR, NP, MODE>(a, m0, w, h0, y, ldy);
  const int64_t K = w.K, blocks = K / QB, per_group = w.group / QB;
  constexpr int64_t BLOCK_BYTES = panel_block(MODE == BYTES ? 8 : 4);
  constexpr float ZERO = MODE == NIBBLES ? -8.0f : -128.0f;
  constexpr bool WIDE = MODE != NIBBLES;  // bytes up to 255
  const __m256i nib = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] __m256i table = _mm256_setzero_si256();
  if constexpr (MODE == LEVELS)
    table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.levels)));
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 s[NP], o[NP];
    for (int n = 0; n < NP; ++n) {
      const int64_t h = h0 + n;
      s[n] = param8(w.scales, w, h / 2, g, h % 2);
      o[n] = w.offsets ? param8(w.offsets, w, h / 2, g, h % 2) : _mm256_mul_ps(s[n], _mm256_set1_ps(ZERO));
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m256i isum[MR][NP];  // AVX-VNNI: int32 per row; AVX2: int16 pairs (8 chunks' sums stay below 2^15: header)
      [[maybe_unused]] __m256i isum_hi[MR][NP];  // AVX2, 8 bits: the high nibbles' int16 pairs
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NP; ++n) isum[m][n] = isum_hi[m][n] = _mm256_setzero_si256();
      for (int L = 0; L < 4; ++L) {
        __m256i lo[NP], hi[NP];
        for (int n = 0; n < NP; ++n) {
          const int64_t h = h0 + n;
          const uint8_t* base = w.codes + ((h / 2) * blocks + b) * BLOCK_BYTES + CHUNK * L + 32 * (h % 2);
          if constexpr (MODE != BYTES) {
            const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base));
            lo[n] = _mm256_and_si256(z, nib);
            hi[n] = _mm256_and_si256(_mm256_srli_epi16(z, 4), nib);
            if constexpr (MODE == LEVELS) {
              lo[n] = _mm256_shuffle_epi8(table, lo[n]);
              hi[n] = _mm256_shuffle_epi8(table, hi[n]);
            }
          } else {
            lo[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base));
            hi[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 4 * CHUNK));
          }
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* qm = a.q + (m0 + m) * K + b * QB + 4 * L;
          int32_t xl, xh;
          std::memcpy(&xl, qm, 4);
          std::memcpy(&xh, qm + 16, 4);
          const __m256i vl = _mm256_set1_epi32(xl), vh = _mm256_set1_epi32(xh);
          for (int n = 0; n < NP; ++n) {
#if defined(__AVXVNNI__)
            isum[m][n] = _mm256_dpbusd_avx_epi32(isum[m][n], lo[n], vl);
            isum[m][n] = _mm256_dpbusd_avx_epi32(isum[m][n], hi[n], vh);
#else
            if constexpr (!WIDE) {
              isum[m][n] = _mm256_add_epi16(isum[m][n], _mm256_add_epi16(_mm256_maddubs_epi16(lo[n], vl),
                                                                           _mm256_maddubs_epi16(hi[n], vh)));
            } else {
              const __m256i ll = _mm256_and_si256(lo[n], nib), hl = _mm256_and_si256(hi[n], nib);
              const __m256i lh = _mm256_and_si256(_mm256_srli_epi16(lo[n], 4), nib);
              const __m256i hh = _mm256_and_si256(_mm256_srli_epi16(hi[n], 4), nib);
              isum[m][n] = _mm256_add_epi16(isum[m][n], _mm256_add_epi16(_mm256_maddubs_epi16(ll, vl),
                                                                           _mm256_maddubs_epi16(hl, vh)));
              isum_hi[m][n] = _mm256_add_epi16(isum_hi[m][n], _mm256_add_epi16(_mm256_maddubs_epi16(lh, vl),
                                                                                 _mm256_maddubs_epi16(hh, vh)));
            }
#endif
            // keep each running sum in its register: integer adds reassociate freely, and GCC otherwise computed
            // every product of the block first, spilling them (24 stores and reloads a block at 2 x 2 rows on
            // Zen 3, 2 threads, 12288 x 576: 1 row 160 -> 95 us, 4 rows 410 -> 251 us)
            __asm__("" : "+x"(isum[m][n]));
            if constexpr (WIDE) __asm__("" : "+x"(isum_hi[m][n]));
          }
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 dm = _mm256_set1_ps(a.d[(m0 + m) * blocks + b]);
        for (int n = 0; n < NP; ++n) {
#if defined(__AVXVNNI__)
          const __m256i block = isum[m][n];
#else
          __m256i block = _mm256_madd_epi16(isum[m][n], ones);
          if constexpr (WIDE)
            block = _mm256_add_epi32(block, _mm256_slli_epi32(_mm256_madd_epi16(isum_hi[m][n], ones), 4));
#endif
          acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block), _mm256_mul_ps(s[n], dm), acc[m][n]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 gm = _mm256_set1_ps(a.gsum[(m0 + m) * w.groups + g]);
      for (int n = 0; n < NP; ++n) acc[m][n] = _mm256_fmadd_ps(o[n], gm, acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) _mm256_storeu_ps(y + (m0 + m) * ldy + (h0 + n) * 8, acc[m][n]);
}
constexpr int MR_MAX = 2, NP_MAX = 2;  // (halves) 4 int16 (int32) + 4 float32 accumulators, 4 code registers, of 16
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int UNIT_ROWS = 16;  // weight rows one register holds
#else
constexpr int UNIT_ROWS = 8;
#endif

// Rows m0 .. m0 + left (left < MR_MAX) of units u0 .. u0 + NP
template <int NP, int MODE, int R = MR_MAX - 1>
void tail(const Act& a, int64_t m0, int64_t left, const Weight& w, int64_t u0, float* y, int64_t ldy) {
  if constexpr (R >= 1) {
    if (left == R) tile<R, NP, MODE>(a, m0, w, u0, y, ldy);
    else tail<NP, MODE, R - 1>(a, m0, left, w, u0, y, ldy);
  }
}

template <int NP, int MODE>
void column_of(const Act& a, int64_t m_begin, int64_t m_end, const Weight& w, int64_t u0, float* y, int64_t ldy) {
  int64_t m0 = m_begin;
  for (; m0 + MR_MAX <= m_end; m0 += MR_MAX) tile<MR_MAX, NP, MODE>(a, m0, w, u0, y, ldy);
  if (m0 < m_end) tail<NP, MODE>(a, m0, m_end - m0, w, u0, y, ldy);
}

// Input rows m_begin .. m_end times units u0 .. u0 + NP (a task: its codes stay in L1 while the rows pass)
template <int NP>
void column(const Act& a, int64_t m_begin, int64_t m_end, const Weight& w, int64_t u0, float* y, int64_t ldy) {
#if !defined(__AVX512F__) && !defined(__AVXVNNI__)
  // AVX2 on bytes (8-bit codes, looked-up levels): a unit at a time. Their nibble-split sums take twice the
  // registers, and two units' worth of them spilled from AVX2's 16 (the units share only the activations' broadcasts):
  // Zen 3, 2 threads, 12288 x 576, 8-bit: 4 rows 1005 -> 501 us, 512 rows 71 -> 53 ms; IQ4 levels, 512 rows 89 -> 64
  if (NP > 1 && (w.bits != 4 || w.levels)) {
    for (int n = 0; n < NP; ++n) column<1>(a, m_begin, m_end, w, u0 + n, y, ldy);
    return;
  }
#endif
  if (w.bits == 6) column_of<NP, SIXES>(a, m_begin, m_end, w, u0, y, ldy);
  else if (w.bits == 8 && w.group == QB / 2) column_of<NP, HALVES>(a, m_begin, m_end, w, u0, y, ldy);
  else if (w.bits == 8) column_of<NP, BYTES>(a, m_begin, m_end, w, u0, y, ldy);
  else if (w.levels) column_of<NP, LEVELS>(a, m_begin, m_end, w, u0, y, ldy);
  else column_of<NP, NIBBLES>(a, m_begin, m_end, w, u0, y, ldy);
}

// Rows per task of a many-row product: their int8 rows (64 x K bytes) stay in L2 while every panel passes them; a
// task over all of a 512-row prompt's rows read them from L3 (SmolLM2's 576 x 1536 down projection ran at 1.2x the
// float32 GEMM that way, not the 2.5x of its other shapes).
constexpr int64_t ROW_CHUNK = 64;

ScaleKind kind_of(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return F32;
  if (t.scalar_type() == torch::kBFloat16) return BF16;
  if (t.scalar_type() == torch::kInt8) return SUPER;
  TORCH_CHECK(t.scalar_type() == torch::kFloat16,
              "int4_int8: scales must be float32, bfloat16, float16 or int8 (super)");
  return F16;
}

// The panel weight of these tensors (int4_int8dot.cpp's header), checked for `who`'s messages: codes [N / 16, K * 8,
// K * 12 or K * 16] uint8 (4-, 6-, 8-bit), scales [N / 16, K / group, 16] float32 / bfloat16 / float16 or SUPER int8
// [N / 16, K / 256, 64 + 16 * 256 / group], offsets shaped and typed as the scales or empty, levels uint8 [16] beside
// 4-bit codes or empty. Groups of 16 with 6- or 8-bit codes only.
Weight panel_weight(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& offsets,
                    const torch::Tensor& levels, int64_t group, int64_t K, const char* who) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2 && K > 0 &&
              K % QB == 0 && (codes.size(1) == K * 8 || codes.size(1) == K * 12 || codes.size(1) == K * 16),
              who, ": panel codes must be [N / 16, K * 8, K * 12 or K * 16] uint8, K a multiple of 32");
  const int bits = static_cast<int>(codes.size(1) / (2 * K));
  TORCH_CHECK(group > 0 && K % group == 0 && (group % QB == 0 || (group == QB / 2 && bits != 4)), who,
              ": the group must divide K and be a multiple of 32 (or 16, with 6- or 8-bit codes)");
  TORCH_CHECK(bits != 6 || group == QB / 2, who, ": 6-bit codes come in groups of 16");
  const ScaleKind kind = kind_of(scales);
  int shift = 0;
  if (kind == SUPER) {
    TORCH_CHECK(64 % group == 0 && K % 256 == 0, who,
                ": super scales take groups of 16, 32 or 64, K a multiple of 256");
    while ((int64_t{1} << shift) * group < 256) ++shift;
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == codes.size(0) &&
                scales.size(1) == K / 256 && scales.size(2) == 64 + 16 * (int64_t{1} << shift),
                who, ": super scales must be int8 [N / 16, K / 256, 64 + 16 * 256 / group]");
  } else {
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == codes.size(0) &&
                scales.size(1) * group == K && scales.size(2) == RI, who,
                ": panel scales must be [N / 16, K / group, 16]");
  }
  const bool symmetric = offsets.numel() == 0;
  TORCH_CHECK(symmetric || (offsets.sizes() == scales.sizes() && offsets.scalar_type() == scales.scalar_type() &&
                            offsets.is_contiguous()), who, ": panel offsets must be shaped and typed as the scales");
  TORCH_CHECK(levels.numel() == 0 || (levels.scalar_type() == torch::kUInt8 && levels.numel() == 16 &&
                                      levels.is_contiguous() && bits == 4),
              who, ": panel levels must be uint8 [16] beside 4-bit codes, or empty");
  return Weight{codes.data_ptr<uint8_t>(), scales.data_ptr(), symmetric ? nullptr : offsets.data_ptr(), kind, K,
                group, K / group, bits, levels.numel() ? levels.data_ptr<uint8_t>() : nullptr, shift};
}

}  // namespace

}  // namespace i8dotk
