// Tiled prefill attention (kernels/prefill_cpu.py loads and wraps it).
#include "prelude.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// The register tiles are on the prelude's rvec (RW floats) and sized for 32 (AVX-512) and 16 (AVX2) registers.
constexpr int NV = RW == 16 ? 4 : 2;  // vectors across a score tile (64 keys) and an output tile (64 channels)

constexpr int BK = 64;        // keys a block
constexpr int MR = 6;         // query rows a register tile
constexpr int ROWS = 96;      // query rows (positions x grouped heads) a tile of work aims at
constexpr float LOWEST = -3.0e38f;  // a masked score (-ffast-math: no infinities)

// 2^x for x <= 0 (scores minus their row's max, in log2 units): 2^n e^r with r = (x - n) ln 2 (the prelude's
// exp_scaled, ~1 ulp). Below 2^-125 it stays 2^-125 (a weight 2e-38 of the largest), not 0.
inline rvec vexp2(rvec x) {
  x = x < -125.0f ? rset(-125.0f) : x;
  const rvec_i ni = __builtin_convertvector(x - 0.5f, rvec_i);  // x <= 0: truncating x - 0.5 rounds x to nearest
  return exp_scaled((x - __builtin_convertvector(ni, rvec)) * 0.693147180559945f, ni);
}

#if defined(__AVX512F__)
inline float hmax(rvec x) { __m512 y; std::memcpy(&y, &x, 64); return _mm512_reduce_max_ps(y); }
inline float hsum(rvec x) { __m512 y; std::memcpy(&y, &x, 64); return _mm512_reduce_add_ps(y); }
#else
inline float hmax(rvec x) { float m = x[0]; for (int i = 1; i < RW; ++i) m = std::max(m, x[i]); return m; }
inline float hsum(rvec x) { float s = 0.f; for (int i = 0; i < RW; ++i) s += x[i]; return s; }
#endif

// Scores (times sc) of MR query rows against W * RW keys of a transposed key tile kt [D][BK], into p [MR][BK];
// each row's max joins mx[r] when mx is given.
template <int W>
inline void score_tile(const float* const* qr, const float* kt, int64_t D, float sc, float* p, float* mx) {
  rvec acc[MR][W];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 4
    for (int n = 0; n < W; ++n) acc[r][n] = rvec{};
  for (int64_t d = 0; d < D; ++d) {
    rvec kv[W];
    #pragma GCC unroll 4
    for (int n = 0; n < W; ++n) kv[n] = rload(kt + d * BK + n * RW);
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const rvec qb = rset(qr[r][d]);
      #pragma GCC unroll 4
      for (int n = 0; n < W; ++n) acc[r][n] += qb * kv[n];
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    rvec m = rset(LOWEST);
    #pragma GCC unroll 4
    for (int n = 0; n < W; ++n) {
      acc[r][n] *= sc;
      rstore(p + r * BK + n * RW, acc[r][n]);
      m = m > acc[r][n] ? m : acc[r][n];
    }
    if (mx) mx[r] = std::max(mx[r], hmax(m));
  }
}

// o [MR][W * RW] (row stride D) = o * c[r] + p [MR][nk] @ the nk value rows at v (row stride vs).
template <int W>
inline void value_tile(const float* p, const float* v, int64_t vs, int nk, float* o, int64_t D, const float* c) {
  rvec acc[MR][W];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const rvec cv = rset(c[r]);
    #pragma GCC unroll 4
    for (int n = 0; n < W; ++n) acc[r][n] = rload(o + r * D + n * RW) * cv;
  }
  for (int j = 0; j < nk; ++j) {
    rvec vv[W];
    #pragma GCC unroll 4
    for (int n = 0; n < W; ++n) vv[n] = rload(v + j * vs + n * RW);
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const rvec pb = rset(p[r * BK + j]);
      #pragma GCC unroll 4
      for (int n = 0; n < W; ++n) acc[r][n] += pb * vv[n];
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 4
    for (int n = 0; n < W; ++n) rstore(o + r * D + n * RW, acc[r][n]);
}

struct Scratch {  // one thread's, sized for the largest tile
  std::vector<float> kt, p, o, m, l, c, mx, zero;
  std::vector<const float*> qr;
  std::vector<int64_t> pos;
  Scratch(int64_t rows, int64_t D)
      : kt(D * BK), p(rows * BK), o(rows * D), m(rows), l(rows), c(rows), mx(rows), zero(D), qr(rows), pos(rows) {}
};

struct Problem {
  const float *q, *k, *v;
  float* out;
  int64_t cached, Hq, Hkv, D, qs, ks, vs, os;  // row strides of q, k, v, out
  float scale;
};

// KV head h, positions a..b-1 of the chunk (keys 0..cached+b-1): rows r = i * G + g are position a + i, query head
// h * G + g. Rows past R up to a multiple of MR score a zero query and are dropped.
void attend_tile(const Problem& P, int64_t h, int64_t a, int64_t b, Scratch& s) {
  const int64_t D = P.D, G = P.Hq / P.Hkv, R = (b - a) * G, Rp = (R + MR - 1) / MR * MR;
  for (int64_t r = 0; r < Rp; ++r) {
    const int64_t i = std::min(r, R - 1) / G, g = r % G;
    s.qr[r] = r < R ? P.q + (a + i) * P.qs + (h * G + g) * D : s.zero.data();
    s.pos[r] = P.cached + a + i;
    s.m[r] = LOWEST;
    s.l[r] = 0.f;
  }
  std::fill(s.o.begin(), s.o.begin() + Rp * D, 0.f);
  const int64_t kend = P.cached + b, first = P.cached + a;
  const int64_t head = kend % BK == 0 ? BK : kend % BK;  // the first block's keys: the last block ends at kend
  const float sc = P.scale * 1.44269504088896341f;      // scores in log2 units: the softmax runs on 2^x
  float* kt = s.kt.data();
  float* p = s.p.data();
  float* mx = s.mx.data();
  rvec_i lane;
  for (int i = 0; i < RW; ++i) lane[i] = i;
  for (int64_t k0 = 0; k0 < kend; k0 += (k0 == 0 ? head : BK)) {
    const int nk = static_cast<int>(k0 == 0 ? head : BK), nv = (nk + RW - 1) / RW;
    for (int j = 0; j < nk; ++j) {
      const float* kr = P.k + (k0 + j) * P.ks + h * D;
      for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = kr[d];
    }
    if (nk < nv * RW)
      for (int64_t d = 0; d < D; ++d) std::fill(kt + d * BK + nk, kt + d * BK + nv * RW, 0.f);
    // masked: some row may not see every key of the block (the diagonal), or the block's last vector is padding
    const bool masked = k0 + nk - 1 > first || nk < nv * RW;
    for (int64_t r = 0; r < Rp; ++r) mx[r] = s.m[r];
    for (int64_t r0 = 0; r0 < Rp; r0 += MR) {
      const float* const* qr = s.qr.data() + r0;
      float* pr = p + r0 * BK;
      float* mr = masked ? nullptr : mx + r0;
#if defined(__AVX512F__)
      switch (nv) {
        case 1: score_tile<1>(qr, kt, D, sc, pr, mr); break;
        case 2: score_tile<2>(qr, kt, D, sc, pr, mr); break;
        case 3: score_tile<3>(qr, kt, D, sc, pr, mr); break;
        default: score_tile<4>(qr, kt, D, sc, pr, mr);
      }
#else
      int c = 0;
      for (; c + 2 <= nv; c += 2) score_tile<2>(qr, kt + c * RW, D, sc, pr + c * RW, mr);
      if (c < nv) score_tile<1>(qr, kt + c * RW, D, sc, pr + c * RW, mr);
#endif
    }
    for (int64_t r = 0; r < Rp; ++r) {
      float* pr = p + r * BK;
      const int limit = static_cast<int>(std::min<int64_t>(nk, s.pos[r] - k0 + 1));  // row r sees keys j < limit
      if (masked) {
        rvec m = rset(LOWEST);
        for (int j = 0; j < nv * RW; j += RW) {
          const rvec x = (lane + j) < limit ? rload(pr + j) : rset(LOWEST);
          m = m > x ? m : x;
        }
        mx[r] = std::max(s.m[r], hmax(m));
      }
      const float mnew = mx[r], corr = std::exp2(s.m[r] - mnew);
      const rvec mv = rset(mnew);
      rvec sum = rvec{};
      for (int j = 0; j < nv * RW; j += RW) {
        rvec e = vexp2(rload(pr + j) - mv);
        if (masked) e = (lane + j) < limit ? e : rvec{};
        rstore(pr + j, e);
        sum += e;
      }
      s.l[r] = s.l[r] * corr + hsum(sum);
      s.m[r] = mnew;
      s.c[r] = corr;
    }
    const float* vb = P.v + k0 * P.vs + h * D;
    for (int64_t r0 = 0; r0 < Rp; r0 += MR) {
      int64_t d0 = 0;
      for (; d0 + NV * RW <= D; d0 += NV * RW)
        value_tile<NV>(p + r0 * BK, vb + d0, P.vs, nk, s.o.data() + r0 * D + d0, D, s.c.data() + r0);
      for (; d0 < D; d0 += RW)
        value_tile<1>(p + r0 * BK, vb + d0, P.vs, nk, s.o.data() + r0 * D + d0, D, s.c.data() + r0);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / G, g = r % G;
    float* orow = P.out + (a + i) * P.os + (h * G + g) * D;
    const float inv = 1.f / s.l[r];
    for (int64_t d = 0; d < D; ++d) orow[d] = s.o[r * D + d] * inv;
  }
}

}  // namespace

// q [S, Hq, D] at positions cached..cached+S-1 over k, v [cached+S, Hkv, D] (float32; rows may be strided, each
// row's heads contiguous) -> [S, Hq, D] float32: row i attends keys 0..cached+i.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t cached, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "prefill_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: [rows, heads, head size] only");
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && v.size(1) == Hkv && k.size(2) == D && v.size(2) == D,
              "prefill_attention: head shapes do not match");
  TORCH_CHECK(D % RW == 0, "prefill_attention: head size must be a multiple of ", RW);
  TORCH_CHECK(cached >= 0 && k.size(0) == cached + S && v.size(0) == cached + S,
              "prefill_attention: keys must be the cached rows and the chunk's own");
  for (const auto& t : {q, k, v})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == D, "prefill_attention: each row's heads must be contiguous");
  auto out = torch::empty({S, Hq, D}, q.options());
  if (S == 0) return out;
  const Problem P{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), cached,
                  Hq, Hkv, D, q.stride(0), k.stride(0), v.stride(0), out.stride(0), static_cast<float>(scale)};
  const int64_t G = Hq / Hkv, positions = std::max<int64_t>(1, ROWS / G);
  const int64_t tiles = (S + positions - 1) / positions, rows = (positions * G + MR - 1) / MR * MR;
  #pragma omp parallel
  {
    Scratch s(rows, D);
    // the tiles with the most keys (the last positions) first, so the short ones even out the threads' ends
    #pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles * Hkv; ++t) {
      const int64_t tile = tiles - 1 - t / Hkv, a = tile * positions;
      attend_tile(P, t % Hkv, a, std::min(S, a + positions), s);
    }
  }
  return out;
}
