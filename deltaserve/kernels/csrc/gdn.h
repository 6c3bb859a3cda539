// The gated delta rule's one-token step and what it shares with the chunked one; fused.cpp and decode.cpp
// compile them.
#pragma once

#include "prelude.h"
#include <algorithm>
#include <cmath>
#include <type_traits>

namespace fusedk {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.0f;
  #pragma omp simd reduction(+:s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

constexpr int64_t GDN_MAX_VALUE_DIM = 128;  // 8 vectors of 16 a row of S: the registers a step holds

// Whether the GDN kernels are compiled for a value head size: any multiple of 16 up to GDN_MAX_VALUE_DIM.
inline bool gdn_value_dim_ok(int64_t Dv) { return Dv >= 16 && Dv <= GDN_MAX_VALUE_DIM && Dv % 16 == 0; }

// f(std::integral_constant<int, Dv / 16>{}): a value head's rows of Dv = 16 * V floats, V a compile-time constant.
template <typename F>
inline void by_value_vectors(int64_t Dv, F&& f) {
  switch (Dv / 16) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// One decode token per sequence, on its state in place: S = exp(g) S; delta = beta (v - k S); S += k^T delta;
// o = q S = q S_decayed + (q . k) delta. Two passes over S, rows of Dv = 16 * V values in registers.
template <int V>
void gdn_step_head(const float* __restrict qr, const float* __restrict kr, const float* __restrict vr, float g,
                   float beta, float* __restrict S, float* __restrict orow, int64_t Dk, float scale, bool l2norm) {
  constexpr int64_t Dv = 16 * V;
  const float fq = l2norm ? scale / std::sqrt(dot(qr, qr, Dk) + 1e-6f) : scale;
  const float fk = l2norm ? 1.0f / std::sqrt(dot(kr, kr, Dk) + 1e-6f) : 1.0f;
  const float decay = std::exp(g), qk = dot(qr, kr, Dk) * fq * fk;
  f16v ks[V], qs[V];
  for (int v = 0; v < V; ++v) { ks[v] = f16v{}; qs[v] = f16v{}; }
  for (int64_t d = 0; d < Dk; ++d) {
    const float a = kr[d] * fk, b = qr[d] * fq;
    for (int v = 0; v < V; ++v) {
      const f16v s = decay * load16(S + d * Dv + 16 * v);
      store16(S + d * Dv + 16 * v, s);
      ks[v] += a * s;
      qs[v] += b * s;
    }
  }
  f16v delta[V];
  for (int v = 0; v < V; ++v) {
    delta[v] = beta * (load16(vr + 16 * v) - ks[v]);
    store16(orow + 16 * v, qs[v] + qk * delta[v]);
  }
  for (int64_t d = 0; d < Dk; ++d) {
    const float a = kr[d] * fk;
    for (int v = 0; v < V; ++v) store16(S + d * Dv + 16 * v, load16(S + d * Dv + 16 * v) + a * delta[v]);
  }
}

}  // namespace fusedk
