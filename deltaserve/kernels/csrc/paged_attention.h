// Paged decode attention's inner loops; paged.cpp and decode.cpp compile them.
#pragma once

#include "prelude.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedk {

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
                          int64_t h, int64_t D, int64_t heads) {
  for (int64_t r = t; r < std::min<int64_t>(t + TILE, L); ++r) {
    const int64_t offset = (row_slots[r] * Hkv + h) * D;
    for (int64_t c = 0; c < heads * D * static_cast<int64_t>(sizeof(T)); c += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kp + offset) + c, 0, 1);
      __builtin_prefetch(reinterpret_cast<const char*>(vp + offset) + c, 0, 1);
    }
  }
}

// The max and the sum of a vector's 16 lanes: one instruction sequence each on AVX-512 (a loop over the lanes compiled
// to scalar loads, maxes and stores through the stack: ~1/10 of a 4-row verifying run's attention), a tree else.
inline float lane_max(f16v v) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return _mm512_reduce_max_ps(x);
#else
  const f16v a = SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7), b = a > v ? a : v;
  float lanes[16];
  std::memcpy(lanes, &b, sizeof lanes);
  return std::max(std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3])),
                  std::max(std::max(lanes[4], lanes[5]), std::max(lanes[6], lanes[7])));
#endif
}
inline float lane_sum(f16v v) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return _mm512_reduce_add_ps(x);
#else
  const f16v a = v + SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  float lanes[16];
  std::memcpy(lanes, &a, sizeof lanes);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
}

// The online softmax over one tile's n scores sg (replaced by their exp(score - new max)): the running max m and
// sum l move on; returns the factor the output accumulated so far is to be scaled by.
// sg holds TILE floats: lanes past n are read, their results dropped (and stored as 0).
inline float softmax_step(float* sg, int n, float& m, float& l) {
  // the tile's max 16 lanes at a time (a scalar loop is one dependent max a score: ~1/8 of a 5-row verifying step's
  // attention went there), then a tree over the lanes
  f16v mv = f16v{} + m;
  for (int t = 0; t < n; t += 16) {
    const f16v x = load16(sg + t);
    const f16v in = (LANES16 + t) < n ? x : mv;
    mv = in > mv ? in : mv;
  }
  const float mx = lane_max(mv);
  const float correction = std::exp(m - mx);
  f16v sums = f16v{};
  for (int t = 0; t < n; t += 16) {  // exp16: GCC calls the scalar expf per value in an `omp simd` loop here
    const f16v e = (LANES16 + t) < n ? exp16(load16(sg + t) - mx) : f16v{};
    store16(sg + t, e);
    sums += e;
  }
  l = l * correction + lane_sum(sums);
  m = mx;
  return correction;
}

// Of a tile of n rows from t0, those a query over the first `len` rows sees (0 to n); the others' scores count as 0.
inline int visible(int64_t len, int64_t t0, int n) {
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, len - t0)));
}

// One (sequence, kv head): its G query heads over cached rows t_begin .. L, softmax kept online over tiles of rows.
// `lens` (or nullptr: all L): query head g sees the first lens[g] rows only (the rows of one verifying request, each
// over its context up to itself, decode_all). `ml` nullptr: oh gets each head's output; else (a split of the
// context, decode_all) its unnormalised sum, and ml[2g], ml[2g + 1] the head's running max and sum of exponentials.
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
            const int64_t* __restrict row_slots, int64_t t_begin, int64_t L, int64_t Hkv, int64_t h, int64_t G,
            float scale, float* __restrict oh, const int64_t* __restrict lens, float* __restrict ml,
            int64_t pf_heads = 1) {
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
  for (int64_t t0 = t_begin; t0 < L; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, L - t0));
    if (pf_heads) prefetch_tile(kp, vp, row_slots, t0 + 2 * TILE, L, Hkv, h, D, pf_heads);
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
      const int seen = lens ? visible(lens[g], t0, n) : n;
      const float correction = softmax_step(sg, seen, m[g], l[g]);
      for (int t = seen; t < n; ++t) sg[t] = 0.f;  // rows past this query's own: no weight
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
    const __m256 inv = _mm256_set1_ps(ml ? 1.f : 1.f / l[g]);
    for (int i = 0; i < W; ++i)
      _mm256_storeu_ps(oh + g * D + 8 * i, _mm256_mul_ps(_mm256_load_ps(acc + g * D + 8 * i), inv));
    if (ml) ml[2 * g] = m[g], ml[2 * g + 1] = l[g];
  }
}
#else
// D = 16 * V channels per head; a query head's accumulator sits in registers while the tile's V rows stream past.
template <int V, typename T>
void attend(const float* __restrict qh, const T* __restrict kp, const T* __restrict vp,
            const int64_t* __restrict row_slots, int64_t t_begin, int64_t L, int64_t Hkv, int64_t h, int64_t G,
            float scale, float* __restrict oh, const int64_t* __restrict lens, float* __restrict ml,
            int64_t pf_heads = 1) {
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
  for (int64_t t0 = t_begin; t0 < L; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, L - t0));
    if (pf_heads) prefetch_tile(kp, vp, row_slots, t0 + 2 * TILE, L, Hkv, h, D, pf_heads);
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
      const int seen = lens ? visible(lens[g], t0, n) : n;
      const float correction = softmax_step(sg, seen, m[g], l[g]);
      for (int t = seen; t < n; ++t) sg[t] = 0.f;  // rows past this query's own: no weight
      f16v a[V];
      for (int i = 0; i < V; ++i) a[i] = acc[g][i] * correction;
      if constexpr (V <= 4) {
        // D = 64: even rows into a, odd ones into a second set of sums, joined at the tile's end: 8 FMA chains (4
        // waited on their latency: a quarter of a 5-row verifying step's attention, 1 thread). A row lands in the
        // same set whatever n is (a tile's rows past a query's own weigh 0), so a row alone and in a verifying run
        // get the same bits.
        f16v a2[V];
        for (int i = 0; i < V; ++i) a2[i] = f16v{};
        int t = 0;
        for (; t + 1 < n; t += 2) {
          const float w0 = sg[t], w1 = sg[t + 1];
          for (int i = 0; i < V; ++i) {
            a[i] += w0 * load16(tile_v + t * D + 16 * i);
            a2[i] += w1 * load16(tile_v + (t + 1) * D + 16 * i);
          }
        }
        if (t < n)
          for (int i = 0; i < V; ++i) a[i] += sg[t] * load16(tile_v + t * D + 16 * i);
        for (int i = 0; i < V; ++i) a[i] += a2[i];
      } else {
        for (int t = 0; t < n; ++t) {
          const float w = sg[t];
          for (int i = 0; i < V; ++i) a[i] += w * load16(tile_v + t * D + 16 * i);
        }
      }
      for (int i = 0; i < V; ++i) acc[g][i] = a[i];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = ml ? 1.f : 1.f / l[g];
    for (int i = 0; i < V; ++i) store16(oh + g * D + 16 * i, acc[g][i] * inv);
    if (ml) ml[2 * g] = m[g], ml[2 * g + 1] = l[g];
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

// Contexts longer than SPLIT rows are attended in splits of SPLIT rows (flash-decoding), each split a task (all its
// KV heads), their partial softmaxes merged after: a step with fewer (sequence, kv head) tasks than threads x a few
// left threads idle (SmolLM2, 3 kv heads on 2 threads: one thread took two heads, the other one). The splits depend on
// a row's own context length alone, never on the batch, so a row's attention is the same bits alone or beside others
// (greedy output with and without speculation is compared token for token): a split past a row's length, or the part of
// one, adds exact zeros. Measured (SmolLM2's 9 / 3 heads of 64, 30 layers of a float16 cache over scattered pages,
// 2 threads, Sapphire Rapids): 5,000 cached rows, 1 row 15.1 -> 9.8-10.9 ms, a 5-row verifying run 31.5 -> 23.3 ms.
// 128 rows against 256: at 850-1,286 rows 1 row 1.23-1.57 ms against 1.34-2.0 and 4 rows 3.0-3.9 against 3.1-4.5;
// at 4,096 within 5% of each other.
constexpr int64_t SPLIT = 4 * TILE;

template <typename T>
void decode_all(const float* qp, const T* kp, const T* vp, const int64_t* sp, const int64_t* lp, float* op,
                int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Lmax, float sc) {
  const int64_t G = Hq / Hkv;
  const bool grouped = G <= MAX_GROUP, tiled = grouped && (D == 64 || D == 128 || D == 256);
  // Runs of rows whose contexts extend each other by one row (a verifying request's 1 + k rows as decode rows,
  // models/batch.py as_decode_rows): attended together, every K/V row read once for all of them, each query over its
  // own length. Up to MAX_GROUP query heads a pass.
  const int64_t per_run = tiled ? MAX_GROUP / G : 1;
  std::vector<int64_t> first{0};
  for (int64_t b = 1; b < B; ++b)
    if (!(b - first.back() < per_run && lp[b] == lp[b - 1] + 1 &&
          std::memcmp(sp + b * Lmax, sp + (b - 1) * Lmax, lp[b - 1] * sizeof(int64_t)) == 0))
      first.push_back(b);
  const int64_t runs = static_cast<int64_t>(first.size());
  first.push_back(B);
  // A task: run r, kv heads h0 .. h1 over context rows t0 .. t1; head h's output goes to `partial` slot part + h - h0
  // (part -1: straight to op). A split task takes every kv head of its rows, one after another: the first pass
  // prefetches the rows' K and V for all of them (a slot's heads lie side by side), so the others read them from L2.
  struct Task { int64_t r, h0, h1, t0, t1, part; };
  struct Merge { int64_t r, h, part, stride, splits; };  // head h's splits: slots part + s x stride
  std::vector<Task> tasks;
  std::vector<Merge> merges;
  int64_t parts = 0;
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t L = lp[first[r + 1] - 1];  // the run's longest context
    if (!tiled || L <= SPLIT) {
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({r, h, h + 1, 0, L, -1});
      continue;
    }
    const int64_t splits = (L + SPLIT - 1) / SPLIT;
    for (int64_t h = 0; h < Hkv; ++h) merges.push_back({r, h, parts + h, Hkv, splits});
    for (int64_t t0 = 0; t0 < L; t0 += SPLIT, parts += Hkv) {
      tasks.push_back({r, 0, Hkv, t0, std::min(t0 + SPLIT, L), parts});
    }
  }
  int64_t heads_max = 0;  // the most query heads a task holds
  for (int64_t r = 0; r < runs; ++r) heads_max = std::max(heads_max, (first[r + 1] - first[r]) * G);
  const int64_t part_size = heads_max * (D + 2);  // a split's outputs, then (max, sum) per head
  std::unique_ptr<float[]> partial(parts ? new float[parts * part_size] : nullptr);  // every value written first
  const int64_t n_tasks = static_cast<int64_t>(tasks.size()), n_merges = static_cast<int64_t>(merges.size());
  #pragma omp parallel
  {
    #pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tasks; ++i) {
      const Task task = tasks[i];
      const int64_t b0 = first[task.r], rows = first[task.r + 1] - b0, b = b0 + rows - 1;
      const int64_t* rs = sp + b * Lmax;  // the longest context's slots (the others' are its prefixes)
      const int64_t heads = rows * G;
      for (int64_t h = task.h0; h < task.h1; ++h) {
        alignas(64) float q[MAX_GROUP * 256];  // a run's query heads of this kv head, one after another
        alignas(64) float o[MAX_GROUP * 256];
        int64_t lens[MAX_GROUP];
        const float* qh = qp + (b * Hq + h * G) * D;
        const int64_t* lensp = nullptr;
        if (rows > 1) {
          for (int64_t j = 0; j < rows; ++j)
            for (int64_t g = 0; g < G; ++g) {
              std::memcpy(q + (j * G + g) * D, qp + ((b0 + j) * Hq + h * G + g) * D, D * sizeof(float));
              lens[j * G + g] = lp[b0 + j];
            }
          qh = q;
          lensp = lens;
        }
        const int64_t part = task.part < 0 ? -1 : task.part + h - task.h0;
        float* oh = part >= 0 ? partial.get() + part * part_size : rows > 1 ? o : op + (b * Hq + h * G) * D;
        float* ml = part >= 0 ? oh + heads_max * D : nullptr;
        // prefetching: a one-head task its head's rows; a task of all heads every head's rows in its first pass
        const int64_t pf = task.h1 - task.h0 == 1 ? 1 : h == task.h0 ? Hkv : 0;
        if (D == 64 && tiled) attend<4>(qh, kp, vp, rs, task.t0, task.t1, Hkv, h, heads, sc, oh, lensp, ml, pf);
        else if (D == 128 && tiled) attend<8>(qh, kp, vp, rs, task.t0, task.t1, Hkv, h, heads, sc, oh, lensp, ml, pf);
        else if (D == 256 && tiled) attend<16>(qh, kp, vp, rs, task.t0, task.t1, Hkv, h, heads, sc, oh, lensp, ml, pf);
        else attend_any(qh, kp, vp, rs, task.t1, Hkv, h, G, D, sc, oh);  // rows == 1 here (per_run 1)
        if (part < 0 && rows > 1)
          for (int64_t j = 0; j < rows; ++j)
            std::memcpy(op + ((b0 + j) * Hq + h * G) * D, o + j * G * D, G * D * sizeof(float));
      }
    }
    // each head's splits: outputs weighted by exp(split max - overall max), over the weighted sums of exponentials
    // (a split past a head's own length has max `lowest` and sum 0: weight 0)
    #pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_merges; ++i) {
      const Merge merge = merges[i];
      const int64_t b0 = first[merge.r], rows = first[merge.r + 1] - b0;
      for (int64_t j = 0; j < rows * G; ++j) {
        float mx = std::numeric_limits<float>::lowest();
        for (int64_t s = 0; s < merge.splits; ++s)
          mx = std::max(mx, partial[(merge.part + s * merge.stride) * part_size + heads_max * D + 2 * j]);
        float total = 0.f;
        float* out = op + ((b0 + j / G) * Hq + merge.h * G + j % G) * D;
        std::fill(out, out + D, 0.f);
        for (int64_t s = 0; s < merge.splits; ++s) {
          const float* part = partial.get() + (merge.part + s * merge.stride) * part_size;
          const float w = std::exp(part[heads_max * D + 2 * j] - mx);
          total += w * part[heads_max * D + 2 * j + 1];
          for (int64_t d = 0; d < D; ++d) out[d] += w * part[j * D + d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) out[d] *= inv;
      }
    }
  }
}

}  // namespace

}  // namespace pagedk
