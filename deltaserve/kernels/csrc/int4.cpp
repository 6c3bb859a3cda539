// The packed 4-bit kernels: few-row products and the prefill GEMM (kernels/int4_cpu.py loads and wraps them).
#include "int4_tile.h"

using namespace int4k;

// x [M, K] float32 contiguous -> x @ W.T [M, N] float32, W packed (kernels/int4.py's layout)
torch::Tensor int4_decode(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                          c10::optional<torch::Tensor> lut, int64_t group) {
  const Weight w = weight_of(packed, scales, offsets, lut, group);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) == w.K,
              "int4_decode: contiguous float32 x [M, K]");
  const int64_t M = x.size(0), N = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (lut.has_value()) decode_all<true>(x.data_ptr<float>(), M, w, N, y.data_ptr<float>());
  else decode_all<false>(x.data_ptr<float>(), M, w, N, y.data_ptr<float>());
  return y;
}

// rows start:stop of W as float32 [stop - start, K]: the tile a prefill GEMM multiplies
torch::Tensor int4_widen(torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                         c10::optional<torch::Tensor> lut, int64_t group, int64_t start, int64_t stop) {
  const Weight w = weight_of(packed, scales, offsets, lut, group);
  TORCH_CHECK(0 <= start && start <= stop && stop <= packed.size(0), "int4_widen: rows out of range");
  const int64_t K = w.K, groups = K / group;
  auto out = torch::empty({stop - start, K}, packed.options().dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  #pragma omp parallel for schedule(static)
  for (int64_t n = start; n < stop; ++n) widen_row(w, n, op + (n - start) * K);
  return out;
}
namespace {

// The prefill GEMM: x [M, K] @ W.T with W packed. A task takes a panel of PW = NV vectors of weight rows, widens
// them once (float32, row-major, L2) and transposes them into a K-major panel bp [K][PW]; then every MR input rows
// multiply it in GKC-deep steps from a register tile of MR x NV vectors (the panel's step stays in L1 meanwhile).
constexpr int64_t GKC = 96;

// dst[c][r] = src[r][c] for a RW x RW block (row strides lds, ldd)
inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4a + b] holds, in each 128-bit lane L, element b of rows 4a..4a+3 at column 4L + b
  for (int b = 0; b < 4; ++b) {
    t[b] = _mm512_shuffle_f32x4(r[b], r[4 + b], 0x88);       // lanes 0, 2 of rows 0-3 | 4-7
    t[4 + b] = _mm512_shuffle_f32x4(r[b], r[4 + b], 0xdd);   // lanes 1, 3
    t[8 + b] = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], 0x88);
    t[12 + b] = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], 0xdd);
  }
  for (int b = 0; b < 4; ++b) {
    _mm512_storeu_ps(dst + (0 + b) * ldd, _mm512_shuffle_f32x4(t[b], t[8 + b], 0x88));      // column b
    _mm512_storeu_ps(dst + (8 + b) * ldd, _mm512_shuffle_f32x4(t[b], t[8 + b], 0xdd));      // column 8 + b
    _mm512_storeu_ps(dst + (4 + b) * ldd, _mm512_shuffle_f32x4(t[4 + b], t[12 + b], 0x88)); // column 4 + b
    _mm512_storeu_ps(dst + (12 + b) * ldd, _mm512_shuffle_f32x4(t[4 + b], t[12 + b], 0xdd));
  }
#elif defined(__AVX__)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int b = 0; b < 4; ++b) {
    _mm256_storeu_ps(dst + b * ldd, _mm256_permute2f128_ps(r[b], r[4 + b], 0x20));
    _mm256_storeu_ps(dst + (4 + b) * ldd, _mm256_permute2f128_ps(r[b], r[4 + b], 0x31));
  }
#else
  for (int i = 0; i < RW; ++i)
    for (int j = 0; j < RW; ++j) dst[j * ldd + i] = src[i * lds + j];
#endif
}

// rows ar[0..MR) (their k0..k0+kc slice) times bp [kc][NV * RW]: into cr[r][0..NV*RW), added to it when acc.
// MR x NV accumulators + NV panel vectors + 1 broadcast: 29 of AVX-512's 32 registers (6 x 4), 15 of AVX2's 16.
template <int MR, int NV>
inline void gemm_tile(const float* const* ar, const float* bp, int64_t kc, float* const* cr, bool acc) {
  constexpr int PW = NV * RW;
  rvec c[MR][NV];
  #pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) c[r][n] = rvec{};
  for (int64_t k = 0; k < kc; ++k) {
    rvec b[NV];
    #pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) b[n] = rload(bp + k * PW + n * RW);
    #pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const rvec a = rset(ar[r][k]);
      #pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) c[r][n] += a * b[n];
    }
  }
  #pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) rstore(cr[r] + n * RW, acc ? rload(cr[r] + n * RW) + c[r][n] : c[r][n]);
}

#if defined(__AVX512BF16__)
// The bfloat16 variant (opt-in: --prefill-dtype bfloat16): the same panels, each widened float32 weight rounded to
// bfloat16 once and stored as K-pairs [K / 2][PW] (one 32-bit lane holds w[k], w[k + 1] of one output column), the
// input rows rounded to bfloat16 by the caller; vdpbf16ps multiplies two pairs a lane exactly and sums into float32,
// so a step of the 6 x 64 tile covers two columns of K for the FMA loop's one.
template <int MR, int NV>
inline void gemm_tile_bf16(const uint32_t* const* ar, const uint32_t* bp, int64_t kp, float* const* cr, bool acc) {
  constexpr int PW = NV * 16;
  __m512 c[MR][NV];
  #pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) c[r][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    __m512bh b[NV];
    #pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) b[n] = (__m512bh)_mm512_loadu_si512(bp + k * PW + n * 16);
    #pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)ar[r][k]);
      #pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) c[r][n] = _mm512_dpbf16_ps(c[r][n], a, b[n]);
    }
  }
  #pragma GCC unroll 12
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) {
      float* o = cr[r] + n * 16;
      _mm512_storeu_ps(o, acc ? _mm512_add_ps(_mm512_loadu_ps(o), c[r][n]) : c[r][n]);
    }
}

// bp [K][PW] float32 (K-major) -> bq [K / 2][PW] pairs of bfloat16 (round to nearest even)
inline void pair_panel(const float* bp, int64_t K, int PW, uint32_t* bq) {
  for (int64_t k = 0; k < K; k += 2)
    for (int j = 0; j < PW; j += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(bp + k * PW + j)));
      const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(bp + (k + 1) * PW + j)));
      _mm512_storeu_si512(bq + (k / 2) * PW + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

#endif

// Both GEMMs, panel by panel: a task widens PW weight rows (float32, row-major, L2) and transposes them K-major into
// bp [K][PW] (BF16: then into bfloat16 K-pairs bq [K / 2][PW]); every MR input rows (float32, or BF16 pairs of
// bfloat16) multiply the panel GKC steps at a time (a float32 column or a bfloat16 pair a step).
template <int MR, int NV, bool BF16>
void gemm_all(const void* xv, int64_t M, const Weight& w, int64_t N, float* y) {
  using A = std::conditional_t<BF16, uint32_t, float>;
  constexpr int PW = NV * RW;
  const int64_t K = w.K, steps = BF16 ? K / 2 : K, panels = (N + PW - 1) / PW;
  const A* x = static_cast<const A*>(xv);
  #pragma omp parallel
  {
    std::vector<float> rows(PW * K), bp(K * PW), edge(N % PW ? M * PW : 0), dummy(PW);
    std::vector<uint32_t> bq(BF16 ? steps * PW : 0);
    std::vector<A> zero(steps, A{});
    #pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * PW, width = std::min<int64_t>(PW, N - n0);
      for (int j = 0; j < PW; ++j) {
        if (j < width) widen_row(w, n0 + j, rows.data() + j * K);
        else std::fill(rows.data() + j * K, rows.data() + (j + 1) * K, 0.f);
      }
      for (int j = 0; j < PW; j += RW)
        for (int64_t k = 0; k < K; k += RW) transpose_block(rows.data() + j * K + k, K, bp.data() + k * PW + j, PW);
#if defined(__AVX512BF16__)
      if constexpr (BF16) pair_panel(bp.data(), K, PW, bq.data());
#endif
      // a last panel narrower than PW lands in `edge` [M][PW] first
      float* out = width == PW ? y + n0 : edge.data();
      const int64_t ldo = width == PW ? N : PW;
      for (int64_t k0 = 0; k0 < steps; k0 += GKC) {  // GKC pairs: twice the columns of a float step, the same bytes
        const int64_t kc = std::min(GKC, steps - k0);
        const A* ar[MR];
        float* cr[MR];
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
          for (int r = 0; r < MR; ++r) {
            const bool in = m0 + r < M;
            ar[r] = in ? x + (m0 + r) * steps + k0 : zero.data();
            cr[r] = in ? out + (m0 + r) * ldo : dummy.data();
          }
#if defined(__AVX512BF16__)
          if constexpr (BF16) gemm_tile_bf16<MR, NV>(ar, bq.data() + k0 * PW, kc, cr, k0 > 0);
          else
#endif
          gemm_tile<MR, NV>(ar, bp.data() + k0 * PW, kc, cr, k0 > 0);
        }
      }
      if (width < PW)
        for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, edge.data() + m * PW, width * sizeof(float));
    }
  }
}

// Either GEMM with the widest panel whose count spreads evenly over the threads (or is many times their number)
template <bool BF16>
void gemm_panels(const void* x, int64_t M, const Weight& w, int64_t N, float* y) {
  const int64_t threads = at::get_num_threads();
  auto even = [&](int64_t pw) { const int64_t p = (N + pw - 1) / pw; return p % threads == 0 || p >= 8 * threads; };
#if defined(__AVX512F__)
  if (even(4 * RW)) gemm_all<6, 4, BF16>(x, M, w, N, y);
  else if (even(2 * RW)) gemm_all<12, 2, BF16>(x, M, w, N, y);
  else gemm_all<24, 1, BF16>(x, M, w, N, y);
#else
  if (even(2 * RW)) gemm_all<6, 2, BF16>(x, M, w, N, y);
  else gemm_all<12, 1, BF16>(x, M, w, N, y);
#endif
}

}  // namespace

// Whether this build has the bfloat16 GEMM (AVX512-BF16: Zen 4, Sapphire Rapids and later)
bool int4_has_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 contiguous -> x @ W.T [M, N] float32, W rounded to bfloat16 (prefill, opt-in)
torch::Tensor int4_gemm_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                             c10::optional<torch::Tensor> lut, int64_t group) {
  const Weight w = weight_of(packed, scales, offsets, lut, group);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2 && x.size(1) == w.K,
              "int4_gemm_bf16: contiguous bfloat16 x [M, K]");
  TORCH_CHECK(w.K % 16 == 0, "int4_gemm_bf16: K must be a multiple of 16");
  const int64_t M = x.size(0), N = packed.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  if (M == 0 || N == 0) return y;
#if defined(__AVX512BF16__)
  gemm_panels<true>(x.data_ptr<at::BFloat16>(), M, w, N, y.data_ptr<float>());  // read as pairs of bfloat16
#else
  TORCH_CHECK(false, "int4_gemm_bf16: this build has no AVX512-BF16 instructions");
#endif
  return y;
}

// x [M, K] float32 contiguous -> x @ W.T [M, N] float32 (prefill; K a multiple of the vector width)
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                        c10::optional<torch::Tensor> lut, int64_t group) {
  const Weight w = weight_of(packed, scales, offsets, lut, group);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) == w.K,
              "int4_gemm: contiguous float32 x [M, K]");
  TORCH_CHECK(w.K % RW == 0, "int4_gemm: K must be a multiple of ", RW);
  const int64_t M = x.size(0), N = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  gemm_panels<false>(x.data_ptr<float>(), M, w, N, y.data_ptr<float>());
  return y;
}
