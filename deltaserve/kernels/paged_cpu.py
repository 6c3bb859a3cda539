"""Decode attention that reads the paged KV cache in place, on CPU: a small C++ kernel the engine builds at start.

The portable path gathers every decode sequence's K and V rows into fresh tensors before SDPA reads them again,
so each cached byte crosses memory three times per step; at 64 decodes of ~800 tokens that is most of a step.
This kernel walks each sequence's slots and reads each K and V row once, for all the query heads that share it
(grouped-query attention), in tiles of 32 rows with the softmax kept online in float32; head sizes 64, 128 and
256 run on 16-float vectors (AVX-512 here: 64 decodes of 700 tokens, 10 -> 4.8 ms per layer), others on a plain
loop. The cache may be float32 or 16-bit (float16, the CPU default, or bfloat16): rows are widened to float32 as
a tile is staged and all arithmetic stays float32; half the bytes to stream. Rows two tiles ahead are prefetched
(64 decodes of 800 tokens over cold pages: 7.3 -> 4.8-5.5 ms float32, 4.0 -> 2.6 ms float16 per layer). It needs
GCC or Clang (vector extensions) and is built by kernels/cpp_build.py; where that fails, `load()` returns None and
the caller keeps the portable path.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.cpp_build import VECTOR_PRELUDE, CompiledKernels

_SOURCE = VECTOR_PRELUDE + r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

constexpr int TILE = 32;    // cached rows scored together: their K and V rows stay in L1 between the passes
static_assert(TILE % 16 == 0, "softmax_step reads whole 16-float vectors of a tile");
constexpr int MAX_GROUP = 16;

// 16-bit caches (--kv-dtype bfloat16 / float16) widen to float32 on load; the arithmetic stays float32. These
// overloads join the prelude's float one (which they would otherwise hide inside this namespace).
using ::load16;
inline f16v load16(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const i16v wide = widen_u16(reinterpret_cast<const uint16_t*>(p)) << 16;
  f16v x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}
inline f16v load16(const at::Half* p) {
#if defined(__AVX512F__)  // one vcvtph2ps for 16 values
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  f16v r;
  std::memcpy(&r, &x, sizeof r);
  return r;
#elif defined(__F16C__)  // two 8-wide converts (AVX2 desktops)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  f16v r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  f16v x;
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(p[i]);
  return x;
#endif
}
// The K and V rows of the tile that starts at t (of L): they lie on other pages, where the hardware prefetcher
// cannot guess, so ask for them two tiles ahead (into L2; L1 holds the tile in use): they arrive meanwhile.
template <typename T>
inline void prefetch_tile(const T* kp, const T* vp, const int64_t* row_slots, int64_t t, int64_t L, int64_t Hkv,
                          int64_t h, int64_t D) {
  for (int64_t r = t; r < std::min<int64_t>(t + TILE, L); ++r) {
    const int64_t offset = (row_slots[r] * Hkv + h) * D;
    for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(T)); c += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kp + offset) + c, 0, 1);
      __builtin_prefetch(reinterpret_cast<const char*>(vp + offset) + c, 0, 1);
    }
  }
}

// The online softmax over one tile's n scores sg (replaced by their exp(score - new max)): the running max m and
// sum l move on; returns the factor the output accumulated so far is to be scaled by.
// sg holds TILE floats: lanes past n are read, their results dropped (and stored as 0).
inline float softmax_step(float* sg, int n, float& m, float& l) {
  float mx = m;
  for (int t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
  const float correction = std::exp(m - mx);
  f16v sums = f16v{};
  for (int t = 0; t < n; t += 16) {  // exp16: GCC calls the scalar expf per value in an `omp simd` loop here
    const f16v e = (LANES16 + t) < n ? exp16(load16(sg + t) - mx) : f16v{};
    store16(sg + t, e);
    sums += e;
  }
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) sum += sums[i];
  l = l * correction + sum;
  m = mx;
  return correction;
}

// One (sequence, kv head): its G query heads over L cached rows, softmax kept online over tiles of rows.
// Each tile's rows are first copied (a 16-bit cache's widened) into contiguous float32 scratch: scattered rows
// are read from memory once, and the G heads' passes over them run on L1 (measured: 5.5 -> 4.4 ms hot, float32).
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: 8-float __m256 values throughout. The generic version's arrays of 16-float values (accumulators, a tile's
// scores) compile to memory traffic through general registers here, as in the other kernels' tiles: SmolLM2's
// 9 heads over 128 cached rows took 48 us on two threads (3 GFLOP/s).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// v[0..7] -> their 8 horizontal sums, in order.
inline __m256 hsum8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

template <int V, typename T>
void attend(const float* __restrict qh, const T* __restrict kp, const T* __restrict vp,
            const int64_t* __restrict row_slots, int64_t L, int64_t Hkv, int64_t h, int64_t G, float scale,
            float* __restrict oh) {
  constexpr int D = 16 * V, W = D / 8, CH = W < 8 ? W : 8;  // W vectors a row; CH of them held at a time
  alignas(64) float s[MAX_GROUP * TILE];
  alignas(64) float tile_k[TILE * D];
  alignas(64) float tile_v[TILE * D];
  alignas(64) float q[MAX_GROUP * D];    // the queries, scaled
  alignas(64) float acc[MAX_GROUP * D];  // each head's unnormalised output
  float m[MAX_GROUP], l[MAX_GROUP];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = std::numeric_limits<float>::lowest();  // -ffast-math: no infinities
    l[g] = 0.f;
    for (int i = 0; i < W; ++i) {
      _mm256_store_ps(q + g * D + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(qh + g * D + 8 * i), _mm256_set1_ps(scale)));
      _mm256_store_ps(acc + g * D + 8 * i, _mm256_setzero_ps());
    }
  }
  for (int64_t t0 = 0; t0 < L; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, L - t0));
    prefetch_tile(kp, vp, row_slots, t0 + 2 * TILE, L, Hkv, h, D);
    for (int t = 0; t < n; ++t) {
      const int64_t offset = (row_slots[t0 + t] * Hkv + h) * D;
      for (int i = 0; i < W; ++i) {
        _mm256_store_ps(tile_k + t * D + 8 * i, load8(kp + offset + 8 * i));
        _mm256_store_ps(tile_v + t * D + 8 * i, load8(vp + offset + 8 * i));
      }
    }
    for (int64_t g = 0; g < G; ++g) {  // scores, 8 rows at a time
      const float* qg = q + g * D;
      for (int t1 = 0; t1 < n; t1 += 8) {
        __m256 x[8];
        for (int j = 0; j < 8; ++j) {
          if (t1 + j < n) {
            const float* kr = tile_k + (t1 + j) * D;
            __m256 y0 = _mm256_mul_ps(_mm256_load_ps(qg), _mm256_load_ps(kr)), y1 = _mm256_setzero_ps();
            for (int i = 1; i < W; i += 2) {
              y1 = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * i), _mm256_load_ps(kr + 8 * i), y1);
              if (i + 1 < W) y0 = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * i + 8), _mm256_load_ps(kr + 8 * i + 8), y0);
            }
            x[j] = _mm256_add_ps(y0, y1);
          } else {
            x[j] = _mm256_setzero_ps();
          }
        }
        _mm256_store_ps(s + g * TILE + t1, hsum8(x));
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * TILE;
      const float correction = softmax_step(sg, n, m[g], l[g]);
      for (int c = 0; c < W; c += CH) {  // the output CH vectors at a time, in registers over the tile's rows
        __m256 a[CH];
        const __m256 cv = _mm256_set1_ps(correction);
        for (int i = 0; i < CH; ++i) a[i] = _mm256_mul_ps(_mm256_load_ps(acc + g * D + 8 * (c + i)), cv);
        for (int t = 0; t < n; ++t) {
          const __m256 w = _mm256_set1_ps(sg[t]);
          for (int i = 0; i < CH; ++i) a[i] = _mm256_fmadd_ps(w, _mm256_load_ps(tile_v + t * D + 8 * (c + i)), a[i]);
        }
        for (int i = 0; i < CH; ++i) _mm256_store_ps(acc + g * D + 8 * (c + i), a[i]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / l[g]);
    for (int i = 0; i < W; ++i)
      _mm256_storeu_ps(oh + g * D + 8 * i, _mm256_mul_ps(_mm256_load_ps(acc + g * D + 8 * i), inv));
  }
}
#else
// D = 16 * V channels per head; a query head's accumulator sits in registers while the tile's V rows stream past.
template <int V, typename T>
void attend(const float* __restrict qh, const T* __restrict kp, const T* __restrict vp,
            const int64_t* __restrict row_slots, int64_t L, int64_t Hkv, int64_t h, int64_t G, float scale,
            float* __restrict oh) {
  constexpr int D = 16 * V;
  alignas(64) float s[MAX_GROUP * TILE];
  alignas(64) float tile_k[TILE * D];  // the tile's rows, contiguous and float32, in L1 for all G heads
  alignas(64) float tile_v[TILE * D];
  f16v acc[MAX_GROUP][V];
  float m[MAX_GROUP], l[MAX_GROUP];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = std::numeric_limits<float>::lowest();  // -ffast-math: no infinities
    l[g] = 0.f;
    for (int i = 0; i < V; ++i) acc[g][i] = f16v{};
  }
  for (int64_t t0 = 0; t0 < L; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, L - t0));
    prefetch_tile(kp, vp, row_slots, t0 + 2 * TILE, L, Hkv, h, D);
    for (int t = 0; t < n; ++t) {
      const int64_t offset = (row_slots[t0 + t] * Hkv + h) * D;
      for (int i = 0; i < V; ++i) {
        store16(tile_k + t * D + 16 * i, load16(kp + offset + 16 * i));
        store16(tile_v + t * D + 16 * i, load16(vp + offset + 16 * i));
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      f16v qv[V];
      for (int i = 0; i < V; ++i) qv[i] = load16(qh + g * D + 16 * i) * scale;
      for (int t1 = 0; t1 < n; t1 += 16) {
        f16v x[16];
        for (int j = 0; j < 16; ++j) {
          if (t1 + j < n) {
            const float* kr = tile_k + (t1 + j) * D;
            f16v y = qv[0] * load16(kr);
            for (int i = 1; i < V; ++i) y += qv[i] * load16(kr + 16 * i);
            x[j] = y;
          } else {
            x[j] = f16v{};
          }
        }
        store16(s + g * TILE + t1, sum16(x));
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * TILE;
      const float correction = softmax_step(sg, n, m[g], l[g]);
      f16v a[V];
      for (int i = 0; i < V; ++i) a[i] = acc[g][i] * correction;
      for (int t = 0; t < n; ++t) {
        const float w = sg[t];
        for (int i = 0; i < V; ++i) a[i] += w * load16(tile_v + t * D + 16 * i);
      }
      for (int i = 0; i < V; ++i) acc[g][i] = a[i];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    for (int i = 0; i < V; ++i) store16(oh + g * D + 16 * i, acc[g][i] * inv);
  }
}

#endif

// Any head size or group: scores for the whole context, then one pass over V.
template <typename T>
void attend_any(const float* qh, const T* kp, const T* vp, const int64_t* row_slots, int64_t L,
                int64_t Hkv, int64_t h, int64_t G, int64_t D, float scale, float* oh) {
  std::vector<float> p(L);
  for (int64_t g = 0; g < G; ++g) {
    const float* qr = qh + g * D;
    float mx = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < L; ++t) {
      const T* kr = kp + (row_slots[t] * Hkv + h) * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qr[d] * static_cast<float>(kr[d]);
      p[t] = s * scale;
      mx = std::max(mx, p[t]);
    }
    float total = 0.f;
    for (int64_t t = 0; t < L; ++t) { p[t] = std::exp(p[t] - mx); total += p[t]; }
    float* o = oh + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t t = 0; t < L; ++t) {
      const T* vr = vp + (row_slots[t] * Hkv + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p[t] * static_cast<float>(vr[d]);
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= total;
  }
}

template <typename T>
void decode_all(const float* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* lp, float* op,
                int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Lmax, float sc) {
  const int64_t G = Hq / Hkv;
  const bool grouped = G <= MAX_GROUP;
  #pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* qh = qp + (b * Hq + h * G) * D;
      const int64_t* rs = sp + b * Lmax;
      float* oh = op + (b * Hq + h * G) * D;
      if (grouped && D == 64) attend<4>(qh, kp, vp, rs, lp[b], Hkv, h, G, sc, oh);
      else if (grouped && D == 128) attend<8>(qh, kp, vp, rs, lp[b], Hkv, h, G, sc, oh);
      else if (grouped && D == 256) attend<16>(qh, kp, vp, rs, lp[b], Hkv, h, G, sc, oh);
      else attend_any(qh, kp, vp, rs, lp[b], Hkv, h, G, D, sc, oh);
    }
  }
}

}  // namespace

// q [B, Hq, D] float32; caches [S, Hkv, D] float32, bfloat16 or float16 (contiguous, one dtype);
// slots [B, Lmax] int64, lens [B] int64 -> [B, Hq, D] float32
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor slots, torch::Tensor lens, double scale) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == kv &&
              (kv == torch::kFloat32 || kv == torch::kBFloat16 || kv == torch::kHalf),
              "paged_decode: float32 queries over float32, bfloat16 or float16 caches only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              slots.is_contiguous() && lens.is_contiguous(), "paged_decode: contiguous tensors only");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1), Lmax = slots.size(1);
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0 && k_cache.size(2) == D, "paged_decode: head shapes do not match");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  if (kv == torch::kFloat32)
    decode_all(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, lp, op, B, Hq, Hkv, D, Lmax, sc);
  else if (kv == torch::kBFloat16)
    decode_all(qp, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), sp, lp, op, B, Hq, Hkv,
               D, Lmax, sc);
  else
    decode_all(qp, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), sp, lp, op, B, Hq, Hkv, D, Lmax,
               sc);
  return out;
}
"""

# The cache dtypes paged_decode reads (its TORCH_CHECK says the same); queries are always float32.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

KERNELS = CompiledKernels("deltaserve_paged_cpu", _SOURCE, ["paged_decode"], "paged CPU decode attention",
                           "the portable gather + SDPA path")


def declines(num_heads: int, num_kv_heads: int, cache_dtype: torch.dtype) -> str | None:
    """Why paged_decode cannot serve attention of these head counts over a cache of this dtype (its TORCH_CHECKs),
    or None."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}"
    if cache_dtype not in CACHE_DTYPES:
        return f"KV cache dtype {cache_dtype} not float32, bfloat16 or float16"
    return None


def load(log=None):
    """The compiled module (built once per machine into our kernel cache), or None when it cannot be built here."""
    return KERNELS.load(log)


def ready():
    """The module if `load()` built it already, else None: a forward step never waits for a compiler."""
    return KERNELS.module


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_slots: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] over each sequence's cached rows context_slots[b, :context_lens[b]]; [B, Hq, D] float32."""
    return KERNELS.module.paged_decode(q.contiguous(), k_cache, v_cache, context_slots.contiguous(),
                                        context_lens.contiguous(), scale)
