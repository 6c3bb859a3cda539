// Packed 4-bit weights times int8 activations by integer dot products (issue 41): llama.cpp's Q8_0 / Q8_1 scheme
// for Q4_0 / Q4_1, on the repacked layout kernels/int4_int8.py makes at load.
//
// Activations: each row's blocks of 32 columns are quantized to int8 with one float32 scale, d = max|x| / 127 and
// q = round-half-even(x / d) (computed as x * (1 / d), the scale as max|x| * fl(1/127): the reference in the tests
// rounds the same float32 operations). Per weight group g the row also carries sum over its blocks of d * sum(q),
// which multiplies the group's offset (Q8_1's block sum): w = s * c + o with c the 4-bit code gives
//   y = sum_blocks s_g * d_b * (c . q)_b + sum_groups o_g * (sum_{b in g} d_b * sum(q_b)),
// the dequantized weight times the dequantized activations, with every c . q an exact integer.
//
// Weights: 16 output rows interleaved (a "panel"). For panel p and block b (32 columns) the 256 bytes are four
// 64-byte chunks L = 0..3; byte 4r + i of chunk L holds row 16p + r's code of column 32b + 4L + i in its low nibble
// and of column 32b + 16 + 4L + i in its high nibble: the packed layout's own bytes (GGUF's nibble order), moved.
// One 64-byte load, an and and a shift give two registers of 16 rows x 4 codes; vpdpbusd multiplies each by the
// same 4 int8 activations broadcast to every lane and sums into one int32 per row: no horizontal sums anywhere.
// Scales (and offsets) are held [N / 16, K / group, 16] in the checkpoint's dtype (float32, bfloat16, float16).
// AVX-512 VNNI builds take 16 rows a register; AVX2 builds 8 (the two halves of each chunk) with vpmaddubsw
// (u8 x s8 pairs summed to int16: at most 2 * 15 * 127 = 3810 per pair, 8 of them 30480 < 2^15, so the block's
// int16 sums never saturate) and vpmaddwd by ones to int32.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

constexpr int QB = 32;          // columns per activation block (one int8 scale)
constexpr int RI = 16;          // weight rows per panel
constexpr int PANEL_BLOCK = 256;  // bytes of one panel's block: 16 rows x 32 codes
constexpr float INV127 = 1.0f / 127.0f;

enum ScaleKind : int { F32 = 0, BF16 = 1, F16 = 2 };

// One row's quantization: q [K] int8, d [K / 32] block scales, gsum [K / group] = sum over a group's blocks of
// d * sum(q).
void quantize_row(const float* __restrict x, int64_t K, int64_t group, int8_t* __restrict q, float* __restrict d,
                  float* __restrict gsum) {
  const int64_t per_group = group / QB;
  for (int64_t b = 0; b < K / QB; ++b) {
    const float* xb = x + b * QB;
    int32_t total;
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
    total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
#else
    float amax = 0.0f;
    for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(xb[i]));
    db = amax * INV127;
    const float id = db > 0.0f ? 1.0f / db : 0.0f;
    total = 0;
    for (int i = 0; i < QB; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * id));
      q[b * QB + i] = static_cast<int8_t>(v);
      total += v;
    }
#endif
    d[b] = db;
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

struct Weight {
  const uint8_t* codes;  // [N / 16][K / 32][256]
  const void* scales;    // [N / 16][K / group][16]
  const void* offsets;   // the same, or nullptr: symmetric (offset = -8 * scale)
  ScaleKind kind;
  int64_t K, group, groups;
};

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

// y[m, 16 p + r] for MR input rows from m0 and NP panels from p0: int32 sums per block, scaled into float32.
template <int MR, int NP>
void tile(const Act& a, int64_t m0, const Weight& w, int64_t p0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, blocks = K / QB, per_group = w.group / QB;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 s[NP], o[NP];
    for (int n = 0; n < NP; ++n) {
      const int64_t at = ((p0 + n) * w.groups + g) * RI;
      s[n] = params16(w.scales, w.kind, at);
      o[n] = w.offsets ? params16(w.offsets, w.kind, at) : _mm512_mul_ps(s[n], _mm512_set1_ps(-8.0f));
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m512i isum[MR][NP];
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NP; ++n) isum[m][n] = _mm512_setzero_si512();
      for (int L = 0; L < 4; ++L) {
        __m512i lo[NP], hi[NP];
        for (int n = 0; n < NP; ++n) {
          const __m512i z = _mm512_loadu_si512(w.codes + ((p0 + n) * blocks + b) * PANEL_BLOCK + 64 * L);
          lo[n] = _mm512_and_si512(z, nib);
          hi[n] = _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
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
// AVX2: a panel as two halves of 8 rows (bytes 0-31 and 32-63 of each chunk); NP counts halves here.
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

template <int MR, int NP>
void tile(const Act& a, int64_t m0, const Weight& w, int64_t h0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, blocks = K / QB, per_group = w.group / QB;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 s[NP], o[NP];
    for (int n = 0; n < NP; ++n) {
      const int64_t h = h0 + n, at = ((h / 2) * w.groups + g) * RI + (h % 2) * 8;
      s[n] = params8(w.scales, w.kind, at);
      o[n] = w.offsets ? params8(w.offsets, w.kind, at) : _mm256_mul_ps(s[n], _mm256_set1_ps(-8.0f));
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m256i isum[MR][NP];  // int16 pairs: 8 chunks' sums stay below 2^15 (header)
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NP; ++n) isum[m][n] = _mm256_setzero_si256();
      for (int L = 0; L < 4; ++L) {
        __m256i lo[NP], hi[NP];
        for (int n = 0; n < NP; ++n) {
          const int64_t h = h0 + n;
          const __m256i z = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w.codes + ((h / 2) * blocks + b) * PANEL_BLOCK + 64 * L + 32 * (h % 2)));
          lo[n] = _mm256_and_si256(z, nib);
          hi[n] = _mm256_and_si256(_mm256_srli_epi16(z, 4), nib);
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* qm = a.q + (m0 + m) * K + b * QB + 4 * L;
          int32_t xl, xh;
          std::memcpy(&xl, qm, 4);
          std::memcpy(&xh, qm + 16, 4);
          const __m256i vl = _mm256_set1_epi32(xl), vh = _mm256_set1_epi32(xh);
          for (int n = 0; n < NP; ++n)
            isum[m][n] = _mm256_add_epi16(isum[m][n], _mm256_add_epi16(_mm256_maddubs_epi16(lo[n], vl),
                                                                         _mm256_maddubs_epi16(hi[n], vh)));
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 dm = _mm256_set1_ps(a.d[(m0 + m) * blocks + b]);
        for (int n = 0; n < NP; ++n)
          acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(isum[m][n], ones)),
                                      _mm256_mul_ps(s[n], dm), acc[m][n]);
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
constexpr int MR_MAX = 2, NP_MAX = 2;  // (halves) 4 int16 + 4 float32 accumulators, 4 code registers, of 16
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int UNIT_ROWS = 16;  // weight rows one register holds
#else
constexpr int UNIT_ROWS = 8;
#endif

// Rows m0 .. m0 + left (left < MR_MAX) of units u0 .. u0 + NP
template <int NP, int R = MR_MAX - 1>
void tail(const Act& a, int64_t m0, int64_t left, const Weight& w, int64_t u0, float* y, int64_t ldy) {
  if constexpr (R >= 1) {
    if (left == R) tile<R, NP>(a, m0, w, u0, y, ldy);
    else tail<NP, R - 1>(a, m0, left, w, u0, y, ldy);
  }
}

// Input rows m_begin .. m_end times units u0 .. u0 + NP (a task: its codes stay in L1 while the rows pass)
template <int NP>
void column(const Act& a, int64_t m_begin, int64_t m_end, const Weight& w, int64_t u0, float* y, int64_t ldy) {
  int64_t m0 = m_begin;
  for (; m0 + MR_MAX <= m_end; m0 += MR_MAX) tile<MR_MAX, NP>(a, m0, w, u0, y, ldy);
  if (m0 < m_end) tail<NP>(a, m0, m_end - m0, w, u0, y, ldy);
}

// Rows per task of a many-row product: their int8 rows (64 x K bytes) stay in L2 while every panel passes them; a
// task over all of a 512-row prompt's rows read them from L3 (SmolLM2's 576 x 1536 down projection ran at 1.2x the
// float32 GEMM that way, not the 2.5x of its other shapes).
constexpr int64_t ROW_CHUNK = 64;

ScaleKind kind_of(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return F32;
  if (t.scalar_type() == torch::kBFloat16) return BF16;
  TORCH_CHECK(t.scalar_type() == torch::kFloat16, "int4_int8: scales must be float32, bfloat16 or float16");
  return F16;
}

}  // namespace

// x [M, K] float32 -> (q [M, K] int8, d [M, K / 32] float32, gsum [M, K / group] float32): the quantized rows.
std::vector<torch::Tensor> int4_int8_quantize(torch::Tensor x, int64_t group) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "int4_int8: float32 x [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QB == 0 && group % QB == 0 && group > 0 && K % group == 0,
              "int4_int8: K and the group multiples of 32, the group dividing K");
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({M, K / QB}, x.options());
  auto gsum = torch::empty({M, K / group}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *gp = gsum.data_ptr<float>();
  #pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, group, qp + m * K, dp + m * (K / QB), gp + m * (K / group));
  return {q, d, gsum};
}

// x [M, K] float32 @ W.T [M, N] with W in the panel layout (header): codes [N / 16, K * 8] uint8, scales and
// offsets [N / 16, K / group, 16] (offsets empty: symmetric).
torch::Tensor int4_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                               int64_t group) {
  const int64_t M = x.size(0), K = x.dim() == 2 ? x.size(1) : 0, panels = codes.size(0), N = panels * RI;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2 &&
              codes.size(1) == K * 8, "int4_int8_linear: codes [N / 16, K * 8] uint8 for x [M, K]");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == panels && scales.size(2) == RI &&
              scales.size(1) * group == K, "int4_int8_linear: scales [N / 16, K / group, 16]");
  const bool symmetric = offsets.numel() == 0;
  TORCH_CHECK(symmetric || (offsets.sizes() == scales.sizes() && offsets.scalar_type() == scales.scalar_type() &&
                            offsets.is_contiguous()), "int4_int8_linear: offsets shaped and typed as the scales");
  auto parts = int4_int8_quantize(x, group);
  const Act a{parts[0].data_ptr<int8_t>(), parts[1].data_ptr<float>(), parts[2].data_ptr<float>(), K, K / group};
  const Weight w{codes.data_ptr<uint8_t>(), scales.data_ptr(), symmetric ? nullptr : offsets.data_ptr(),
                 kind_of(scales), K, group, K / group};
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  float* yp = y.data_ptr<float>();
  const int64_t units = N / UNIT_ROWS, pairs = (units + NP_MAX - 1) / NP_MAX;
  const int64_t chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < chunks * pairs; ++t) {
    const int64_t m_begin = t / pairs * ROW_CHUNK, m_end = std::min(M, m_begin + ROW_CHUNK), u0 = t % pairs * NP_MAX;
    if (u0 + NP_MAX <= units) column<NP_MAX>(a, m_begin, m_end, w, u0, yp, N);
    else column<1>(a, m_begin, m_end, w, u0, yp, N);
  }
  return y;
}

// Which dot product this build multiplies with
std::string int4_int8_isa() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#else
  return "avx2";
#endif
}
