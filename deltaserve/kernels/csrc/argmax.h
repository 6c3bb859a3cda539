// The index of each row's largest value, as torch.argmax: the first of equal maxima, and a NaN counts as larger
// than every number (the first NaN wins); fused.cpp's argmax_rows and decode.cpp's LM head compile it. Two vectorised
// passes a piece: the largest value (and whether any is NaN), then the first block of 64 that holds it, searched one
// by one (a NaN: the first, one by one). A wide row is cut into one contiguous piece a thread, merged in order (the
// same answer for any cut): logits a decode step's head wrote lie in the cache of the thread that wrote them, cut the
// same way (its static schedule over the vocabulary), where one thread's pass over a 49,152-wide row read half of it
// from the other core.
#pragma once

#include "prelude.h"
#include <algorithm>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace argmaxk {

struct Piece {
  float best;
  int64_t at;   // the first index of best in the piece
  int64_t nan;  // the first NaN's index, or -1
};

inline Piece piece(const float* __restrict v, int64_t begin, int64_t end) {
  constexpr int64_t BLOCK = 64;
  float best = v[begin];
  int nan = 0;
  #pragma omp simd reduction(max:best) reduction(|:nan)
  for (int64_t i = begin; i < end; ++i) {
    best = v[i] > best ? v[i] : best;
    nan |= v[i] != v[i];
  }
  if (nan) {  // rare (a broken model): the first NaN, one by one
    int64_t at = begin;
    while (v[at] == v[at]) ++at;
    return {best, at, at};
  }
  for (int64_t b = begin; b < end; b += BLOCK) {  // the first block with a match, then the match within it
    const int64_t stop = std::min(end, b + BLOCK);
    int hit = 0;
    #pragma omp simd reduction(|:hit)
    for (int64_t i = b; i < stop; ++i) hit |= v[i] == best;
    if (hit) {
      int64_t at = b;
      while (v[at] != best) ++at;
      return {best, at, -1};
    }
  }
  return {best, begin, -1};  // unreachable: best is one of the values
}

constexpr int64_t PIECE_MIN = 8192;  // narrower pieces: a parallel region would cost more than the pass

// out[r] = argmax of row r of x [R, V] (row stride `stride` floats, V > 0).
inline void rows(const float* x, int64_t R, int64_t V, int64_t stride, int64_t* out) {
#ifdef _OPENMP
  const int64_t threads = omp_get_max_threads();
#else
  const int64_t threads = 1;
#endif
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(threads, V / PIECE_MIN));
  std::vector<Piece> pieces(R * P);
  #pragma omp parallel for schedule(static) if (P > 1)
  for (int64_t t = 0; t < R * P; ++t) {
    const int64_t r = t / P, p = t % P;
    pieces[t] = piece(x + r * stride, V * p / P, V * (p + 1) / P);
  }
  for (int64_t r = 0; r < R; ++r) {
    Piece m = pieces[r * P];
    for (int64_t p = 1; p < P && m.nan < 0; ++p) {
      const Piece& q = pieces[r * P + p];
      if (q.nan >= 0 || q.best > m.best) m = q;  // equal maxima: the earlier piece's index stays
    }
    out[r] = m.nan >= 0 ? m.nan : m.at;
  }
}

}  // namespace argmaxk
