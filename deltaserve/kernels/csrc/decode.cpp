// Whole decode-step blocks in one native call (kernels/decode_cpu.py loads and wraps them); the few-row linear,
// packed 4-bit, paged attention and GDN step pieces come from their modules' headers, one namespace each.
// One file over 500 lines on purpose: the blocks share their argument unpacking and the whole-stack loop.
#include "prelude.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "int4_tile.h"
#include "linear_tile.h"
#include "paged_attention.h"
#include "gdn.h"
#include "int4_int8_tile.h"
#include "argmax.h"

namespace {

// One projection: float32 weight [N, K] (group 0), packed 4-bit (int4_cpu's layout, group > 0) or 4-, 6- or 8-bit codes
// in int4_int8's 16-row panels times int8 activations (group < 0: --activation-dtype int8), and an optional bias.
struct Lin {
  int64_t N = 0, K = 0, group = 0;
  const float* w = nullptr;
  int4k::Weight q4{};
  i8dotk::Weight p8{};
  bool lut = false, i8 = false;
  const float* bias = nullptr;
};

// t[i .. i + 4]: weight or packed codes, scales, offsets, level table, bias (empty tensors where absent).
Lin lin_of(const std::vector<torch::Tensor>& t, size_t i, int64_t group, int64_t K) {
  Lin l;
  l.group = group;
  if (group < 0) {
    l.p8 = i8dotk::panel_weight(t[i], t[i + 1], t[i + 2], t[i + 3], -group, K, "decode block");
    l.i8 = true;
    l.N = t[i].size(0) * i8dotk::RI;
  } else if (group == 0) {
    const auto& w = t[i];
    TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.dim() == 2 && w.size(1) == K &&
                K % 16 == 0, "decode block: a float32 weight must be contiguous [N, K], K a multiple of 16");
    l.w = w.data_ptr<float>();
    l.N = w.size(0);
  } else {
    c10::optional<torch::Tensor> lut;
    if (t[i + 3].numel()) lut = t[i + 3];
    l.q4 = int4k::weight_of(t[i], t[i + 1], t[i + 2], lut, group);
    l.lut = lut.has_value();
    l.N = t[i].size(0);
    TORCH_CHECK(l.q4.K == K, "decode block: a packed weight's input width does not match");
  }
  l.K = K;
  const auto& b = t[i + 4];
  if (b.numel()) {
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.is_contiguous() && b.numel() == l.N,
                "decode block: a bias must be float32 [N]");
    l.bias = b.data_ptr<float>();
  }
  return l;
}

// One projection's output: y [M, N] = x [M, K] @ W.T (+ bias).
struct Out {
  const Lin* l;
  float* y;
};

inline int64_t block_rows(const Lin& l) {
  return l.i8 ? i8dotk::NP_MAX * i8dotk::UNIT_ROWS : l.group ? int4k::NR_MAX : lineark::NR_MAX;
}

// Units of one projection past its full blocks: rows one at a time, or a panel weight's UNIT_ROWS at a time.
inline int64_t tail_units(const Lin& l) {
  const int64_t left = l.N % block_rows(l);
  return l.i8 ? left / i8dotk::UNIT_ROWS : left;
}

// Whether one input row meets this projection's float32 weight rows one after another (lineark::one_row), read with
// no software prefetch.
inline bool one_row_stream(const Lin& l, int64_t M) { return !l.group && M == 1; }

// Rows [n0, n0 + rows) of one projection's output: `rows` is its block, or 1 past its last full block (a panel
// weight: UNIT_ROWS). xq: x prepared for the packed one-row tile (int4k::prepared), or nullptr; a8: x quantized to
// int8 blocks in this panel weight's groups.
inline void rows_of(const Lin& l, const float* x, int64_t M, int64_t n0, int64_t rows, float* y, const float* xq,
                    const i8dotk::Act* a8) {
  const int64_t N = l.N, K = l.K;
  if (l.i8) {
    const int64_t u0 = n0 / i8dotk::UNIT_ROWS;
    if (rows == i8dotk::NP_MAX * i8dotk::UNIT_ROWS) i8dotk::column<i8dotk::NP_MAX>(*a8, 0, M, l.p8, u0, y, N);
    else i8dotk::column<1>(*a8, 0, M, l.p8, u0, y, N);
  } else if (l.group) {
    constexpr int NR = int4k::NR_MAX;
    if (l.lut) rows == NR ? int4k::rows_past<NR, true>(x, M, l.q4, n0, y + n0, N)
                          : int4k::rows_past<1, true>(x, M, l.q4, n0, y + n0, N);
    else rows == NR ? int4k::rows_past<NR, false>(x, M, l.q4, n0, y + n0, N, xq)
                    : int4k::rows_past<1, false>(x, M, l.q4, n0, y + n0, N, xq);
  } else if (one_row_stream(l, M)) {
    lineark::one_row(x, l.w + n0 * K, K, rows, y + n0);
  } else {
    constexpr int NR = lineark::NR_MAX;
    if (rows == NR) lineark::rows_past<NR>(x, M, l.w + n0 * K, K, y + n0, N);
    else lineark::rows_past<1>(x, M, l.w + n0 * K, K, y + n0, N);
  }
}

// The weight bytes of rows [n0, n0 + rows), fetched ahead while earlier rows are multiplied.
// A panel weight's rows lie in 16-row panels of K / 2 (K) bytes a row: a block's rows are as contiguous as packed ones.
inline void prefetch_rows(const Lin& l, int64_t n0, int64_t rows) {
  const int64_t row_bytes = l.i8 ? l.K * l.p8.bits / 8 : l.group ? l.K / 2 : l.K * 4;
  const char* p = l.i8 ? reinterpret_cast<const char*>(l.p8.codes)
                : l.group ? reinterpret_cast<const char*>(l.q4.packed) : reinterpret_cast<const char*>(l.w);
  for (int64_t c = 0; c < rows * row_bytes; c += 64) __builtin_prefetch(p + n0 * row_bytes + c, 0, 1);
}

// x [M, K] quantized to int8 per block of 32 for the panel weights in groups of `group` (int4_int8_quantize's rows,
// the same quantize_row), once for every projection that reads x.
struct Quantized {
  int64_t group = 0;
  std::vector<int8_t> q;
  std::vector<float> d, gsum;
  i8dotk::Act act{};

  void of(const float* x, int64_t M, int64_t K, int64_t g) {
    using i8dotk::QB;
    group = g;
    q.resize(M * K);
    d.resize(M * (K / QB));
    gsum.resize(M * (K / g));
    for (int64_t m = 0; m < M; ++m)
      i8dotk::quantize_row(x + m * K, K, g, q.data() + m * K, d.data() + m * (K / QB), gsum.data() + m * (K / g));
    act = i8dotk::Act{q.data(), d.data(), gsum.data(), K, K / g};
  }
};

// Projections of the same input x [M, K] (q / k / v, gate / up, a GDN mixer's four) in one parallel loop over all
// their row blocks: one OpenMP region and one barrier for them all, where one each made a step of SmolLM2 ~240
// regions, each a sync point of the threads. Panel weights (int8 activations) share x's quantization.
void matmuls(const float* x, int64_t M, std::initializer_list<Out> outs) {
  constexpr int MAX_OUTS = 4;
  TORCH_CHECK(outs.size() <= MAX_OUTS, "decode block: at most 4 projections share a loop");
  const Out* o = outs.begin();
  const int n_outs = static_cast<int>(outs.size());
  int64_t start[MAX_OUTS + 1] = {0}, full[MAX_OUTS], block[MAX_OUTS];
  for (int j = 0; j < n_outs; ++j) {  // projection j's units: its full blocks, then one per row past them
    block[j] = block_rows(*o[j].l);
    full[j] = o[j].l->N / block[j];
    start[j + 1] = start[j] + full[j] + tail_units(*o[j].l);
  }
  const float* xq = nullptr;  // x as the packed one-row tile reads it, prepared once for all the projections
  for (int j = 0; j < n_outs && xq == nullptr; ++j)
    if (o[j].l->group > 0) xq = int4k::prepared(x, M, o[j].l->q4);
  Quantized quantized[MAX_OUTS];  // x in int8 blocks, one per distinct group size of the panel weights
  const i8dotk::Act* a8[MAX_OUTS] = {nullptr};
  for (int j = 0, n_q = 0; j < n_outs; ++j) {
    if (!o[j].l->i8) continue;
    const int64_t g = o[j].l->p8.group;
    int k = 0;
    while (k < n_q && quantized[k].group != g) ++k;
    if (k == n_q) quantized[n_q++].of(x, M, o[j].l->K, g);
    a8[j] = &quantized[k].act;
  }
  #pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < start[n_outs]; ++u) {
    int j = 0;
    while (u >= start[j + 1]) ++j;
    const Lin& l = *o[j].l;
    const int64_t i = u - start[j];
    if (i < full[j]) {
      if (i + 2 < full[j] && !one_row_stream(l, M))  // two blocks on: in flight meanwhile
        prefetch_rows(l, (i + 2) * block[j], block[j]);
      rows_of(l, x, M, i * block[j], block[j], o[j].y, xq, a8[j]);
    } else if (l.i8) {
      rows_of(l, x, M, full[j] * block[j] + (i - full[j]) * i8dotk::UNIT_ROWS, i8dotk::UNIT_ROWS, o[j].y, xq, a8[j]);
    } else {
      rows_of(l, x, M, full[j] * block[j] + (i - full[j]), 1, o[j].y, xq, a8[j]);
    }
  }
  for (const Out& out : outs)
    if (out.l->bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < out.l->N; ++n) out.y[m * out.l->N + n] += out.l->bias[n];
}

inline void matmul(const Lin& l, const float* x, int64_t M, float* y) { matmuls(x, M, {{&l, y}}); }

// y = x / rms(x) * (offset + weight) over D channels (fused_cpu's rms_norm, the same arithmetic)
inline void rms_row(const float* __restrict x, const float* __restrict w, float off, float eps, int64_t D,
                    float* __restrict y) {
  float ss = 0.0f;
  #pragma omp simd reduction(+:ss)
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  #pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] = x[d] * inv * (off + w[d]);
}

// Rotate-half RoPE of the first rd channels: x * cos + rotate_half(x) * sin, in place.
inline void rope_row(float* __restrict x, const float* __restrict c, const float* __restrict s, int64_t rd) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] + (-b) * s[i];
    x[i + half] = b * c[i + half] + a * s[i + half];
  }
}

template <typename T>
inline void store_row(T* __restrict dst, const float* __restrict src, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
}

template <typename T>
void write_and_attend(const float* q, const float* k, const float* v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                      const int64_t* slot, const int64_t* ctx, const int64_t* lens, int64_t B, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t Lmax, float scale, float* out) {
  T* kc = reinterpret_cast<T*>(k_cache.data_ptr());
  T* vc = reinterpret_cast<T*>(v_cache.data_ptr());
  for (int64_t b = 0; b < B; ++b) {
    store_row(kc + slot[b] * Hkv * D, k + b * Hkv * D, Hkv * D);
    store_row(vc + slot[b] * Hkv * D, v + b * Hkv * D, Hkv * D);
  }
  pagedk::decode_all<T>(q, kc, vc, ctx, lens, out, B, Hq, Hkv, D, Lmax, scale);
}

// The cached K and V rows the attention below will read (the weights streamed since the last step evicted them),
// fetched while the projections run: up to PREFETCH_CONTEXT_BYTES of them, a sequence's first rows first (the
// attention fetches ahead as it goes past them).
constexpr int64_t PREFETCH_CONTEXT_BYTES = 256 << 10;
void prefetch_context(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int64_t* ctx,
                      const int64_t* lens, int64_t B, int64_t Lmax) {
  const int64_t row = k_cache.size(1) * k_cache.size(2) * k_cache.element_size();
  const char* kc = static_cast<const char*>(k_cache.data_ptr());
  const char* vc = static_cast<const char*>(v_cache.data_ptr());
  int64_t budget = PREFETCH_CONTEXT_BYTES;
  for (int64_t b = 0; b < B && budget > 0; ++b)
    for (int64_t t = 0; t < lens[b] - 1 && budget > 0; ++t, budget -= 2 * row) {  // the last row is this step's
      const int64_t slot = ctx[b * Lmax + t];
      for (int64_t c = 0; c < row; c += 64) {
        __builtin_prefetch(kc + slot * row + c, 0, 2);
        __builtin_prefetch(vc + slot * row + c, 0, 2);
      }
    }
}

void check_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "decode block: x must be contiguous float32 [B, hidden]");
}

const float* vec(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n, what);
  return t.data_ptr<float>();
}

}  // namespace

// x [B, hidden] float32, updated in place: x += o_proj(attention(norm(x))), the new K/V rows stored at
// slot_mapping. t: input norm [hidden], q_norm [D] or empty, k_norm [D] or empty, then q, k, v, o projections
// (5 tensors each, see lin_of). meta: Hq, Hkv, D, gated (q_proj yields [q | gate] per head), and the 4 group sizes
// (0: float32 weight; negative: a panel weight on int8 activations). cos / sin [B, rd]; caches [slots, Hkv, D];
// context_slots [B, Lmax]; context_lens [B].
torch::Tensor attention_block(torch::Tensor x, std::vector<torch::Tensor> t, std::vector<int64_t> meta,
                              torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor slot_mapping, torch::Tensor context_slots, torch::Tensor context_lens,
                              double eps, double offset, double scale) {
  check_rows(x);
  TORCH_CHECK(t.size() == 23 && meta.size() == 8, "attention_block: 23 tensors and 8 sizes");
  const int64_t B = x.size(0), H = x.size(1), Hq = meta[0], Hkv = meta[1], D = meta[2];
  const bool gated = meta[3] != 0;
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "attention_block: query heads must be a multiple of KV heads");
  const Lin lq = lin_of(t, 3, meta[4], H), lk = lin_of(t, 8, meta[5], H), lv = lin_of(t, 13, meta[6], H);
  const Lin lo = lin_of(t, 18, meta[7], Hq * D);
  const int64_t qw = Hq * D * (gated ? 2 : 1);
  TORCH_CHECK(lq.N == qw && lk.N == Hkv * D && lv.N == Hkv * D && lo.N == H, "attention_block: shapes do not match");
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.dim() == 3 && k_cache.size(1) == Hkv && k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(),
              "attention_block: caches must be contiguous [slots, Hkv, D], one dtype");
  for (const auto* s : {&slot_mapping, &context_slots, &context_lens})
    TORCH_CHECK(s->scalar_type() == torch::kInt64 && s->is_contiguous(), "attention_block: int64 contiguous slots");
  TORCH_CHECK(slot_mapping.numel() == B && context_slots.dim() == 2 && context_slots.size(0) == B &&
              context_lens.numel() == B, "attention_block: one slot row and length per sequence");
  const int64_t rd = cos.size(1);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(0) == B &&
              rd <= D && rd % 2 == 0 && cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "attention_block: cos / sin must be float32 [B, rd]");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t S = k_cache.size(0), Lmax = context_slots.size(1);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < S && lens[b] >= 1 && lens[b] <= Lmax, "attention_block: slot out of range");
  const float* wn = vec(t[0], H, "attention_block: the input norm must be float32 [hidden]");
  const float* qn = t[1].numel() ? vec(t[1], D, "attention_block: q_norm must be float32 [D]") : nullptr;
  const float* kn = t[2].numel() ? vec(t[2], D, "attention_block: k_norm must be float32 [D]") : nullptr;
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);

  auto scratch = torch::empty({B * (H + qw + 2 * Hkv * D + 2 * Hq * D + H)}, x.options());
  float* xn = scratch.data_ptr<float>();
  float* qr = xn + B * H;      // q_proj's output [B, qw]
  float* kr = qr + B * qw;     // [B, Hkv * D]
  float* vr = kr + B * Hkv * D;
  float* q = vr + B * Hkv * D; // [B, Hq, D]: normed and rotated queries
  float* att = q + B * Hq * D; // [B, Hq, D]
  float* o = att + B * Hq * D; // [B, H]
  float* xp = x.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) rms_row(xp + b * H, wn, off, e, H, xn + b * H);
  prefetch_context(k_cache, v_cache, context_slots.data_ptr<int64_t>(), lens, B, Lmax);
  matmuls(xn, B, {{&lq, qr}, {&lk, kr}, {&lv, vr}});
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      float* dst = q + (b * Hq + h) * D;
      const float* src = qr + b * qw + h * D * (gated ? 2 : 1);
      if (qn) rms_row(src, qn, off, e, D, dst);
      else std::copy(src, src + D, dst);
      rope_row(dst, cp + b * rd, sp + b * rd, rd);
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      float* row = kr + (b * Hkv + h) * D;
      if (kn) rms_row(row, kn, off, e, D, row);
      rope_row(row, cp + b * rd, sp + b * rd, rd);
    }
  }
  const int64_t* ctx = context_slots.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  if (kv == torch::kFloat32)
    write_and_attend<float>(q, kr, vr, k_cache, v_cache, slot, ctx, lens, B, Hq, Hkv, D, Lmax, sc, att);
  else if (kv == torch::kHalf)
    write_and_attend<at::Half>(q, kr, vr, k_cache, v_cache, slot, ctx, lens, B, Hq, Hkv, D, Lmax, sc, att);
  else if (kv == torch::kBFloat16)
    write_and_attend<at::BFloat16>(q, kr, vr, k_cache, v_cache, slot, ctx, lens, B, Hq, Hkv, D, Lmax, sc, att);
  else
    TORCH_CHECK(false, "attention_block: caches must be float32, float16 or bfloat16");
  if (gated)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h) {
        const float* gate = qr + b * qw + h * 2 * D + D;
        float* row = att + (b * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) row[d] *= 1.0f / (1.0f + std::exp(-gate[d]));
      }
  matmul(lo, att, B, o);
  for (int64_t i = 0; i < B * H; ++i) xp[i] += o[i];
  return x;
}

// x [B, hidden] float32, updated in place: x += down(silu(gate(norm(x))) * up(norm(x))). t: the norm [hidden], then
// gate, up, down projections (5 tensors each); groups: their group sizes (as attention_block's meta).
torch::Tensor mlp_block(torch::Tensor x, std::vector<torch::Tensor> t, std::vector<int64_t> groups, double eps,
                        double offset) {
  check_rows(x);
  TORCH_CHECK(t.size() == 16 && groups.size() == 3, "mlp_block: 16 tensors and 3 group sizes");
  const int64_t B = x.size(0), H = x.size(1);
  const Lin lg = lin_of(t, 1, groups[0], H), lu = lin_of(t, 6, groups[1], H);
  const int64_t I = lg.N;
  const Lin ld = lin_of(t, 11, groups[2], I);
  TORCH_CHECK(lu.N == I && ld.N == H, "mlp_block: shapes do not match");
  const float* wn = vec(t[0], H, "mlp_block: the norm must be float32 [hidden]");
  auto scratch = torch::empty({B * (H + 2 * I + H)}, x.options());
  float* xn = scratch.data_ptr<float>();
  float* g = xn + B * H;
  float* u = g + B * I;
  float* d = u + B * I;
  float* xp = x.data_ptr<float>();
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  for (int64_t b = 0; b < B; ++b) rms_row(xp + b * H, wn, off, e, H, xn + b * H);
  matmuls(xn, B, {{&lg, g}, {&lu, u}});
  silu_times(g, u, B * I);
  matmul(ld, g, B, d);
  for (int64_t i = 0; i < B * H; ++i) xp[i] += d[i];
  return x;
}

namespace {

// ---- int8 weights (kernels/int8.py's Int8Rows: w = scale * q + offset per group), a tied vocabulary projection ----
// OFF: the weight has offsets (asymmetric); without (a GGUF's Q8_0, symmetric INT8) w = scale * q, and the offsets
// array, a fifth of the bytes of a table in groups of 32, is never read.
struct Int8W {
  const int8_t* codes;
  const float *scales, *offsets;
  int64_t K, group;
};

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: 8-float __m256 accumulators, as in int4_cpu's and linear_cpu's tiles (GCC keeps an array of 16-float values in
// memory and moves each through general registers at every step: SmolLM2's vocabulary at one row took 30 ms, not 5),
// and 8 codes widened a load at a time (vpmovsxbd + vcvtdq2ps; GCC's generic int8 -> float conversion is scalar).
constexpr int I8_MR = 2, I8_NR = 4;  // 8 accumulators, 4 scales, 2 input vectors and a weight vector of 16 registers

inline __m256 widen8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// y[m, n0 + n] for MR input rows and NR weight rows.
template <int MR, int NR, bool OFF>
inline void i8_tile(const float* __restrict x, const Int8W& w, int64_t n0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, groups = K / w.group;
  __m256 acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm256_setzero_ps();
  if constexpr (MR == 1 && !OFF) {
    // One row of a symmetric table: each group's codes meet x unscaled and its scale multiplies their sum once
    // (s * sum(q x) = sum((s q) x); one multiply fewer per 8 codes). SmolLM2's 49152 x 576 on two threads: 1.16 ->
    // 0.90 ms with the two sums per row below.
    const int8_t* rows[NR];
    for (int n = 0; n < NR; ++n) rows[n] = w.codes + (n0 + n) * K;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 part[NR][2];  // two sums per row (even / odd 8 columns): one chain of FMAs would wait on itself
      for (int n = 0; n < NR; ++n) part[n][0] = part[n][1] = _mm256_setzero_ps();
      for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int n = 0; n < NR; ++n) {
          part[n][0] = _mm256_fmadd_ps(x0, widen8_i8(rows[n] + k), part[n][0]);
          part[n][1] = _mm256_fmadd_ps(x1, widen8_i8(rows[n] + k + 8), part[n][1]);
        }
      }
      for (int n = 0; n < NR; ++n)
        acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(w.scales[(n0 + n) * groups + g]),
                                 _mm256_add_ps(part[n][0], part[n][1]), acc[n]);
    }
  } else
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s[NR], o[NR];
    for (int n = 0; n < NR; ++n) {
      s[n] = _mm256_set1_ps(w.scales[(n0 + n) * groups + g]);
      if constexpr (OFF) o[n] = _mm256_set1_ps(w.offsets[(n0 + n) * groups + g]);
    }
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 8) {
      __m256 xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) {
        const __m256 q = widen8_i8(w.codes + (n0 + n) * K + k);
        __m256 wv;
        if constexpr (OFF) wv = _mm256_fmadd_ps(q, s[n], o[n]);
        else wv = _mm256_mul_ps(q, s[n]);
        for (int m = 0; m < MR; ++m) acc[m * NR + n] = _mm256_fmadd_ps(xv[m], wv, acc[m * NR + n]);
      }
    }
  }
  for (int i = 0; i < MR * NR; ++i) y[i / NR * ldy + n0 + i % NR] = sum8(acc[i]);
}
#else
constexpr int I8_MR = int4k::MR_MAX, I8_NR = int4k::NR_MAX;

inline f16v widen16_i8(const int8_t* p) {
  return __builtin_convertvector(widen_i8(p), f16v);
}

// y[m, n0 + n] for MR input rows and NR weight rows, widened 16 columns at a time (int4_cpu's tile, 8-bit codes).
template <int MR, int NR, bool OFF>
inline void i8_tile(const float* __restrict x, const Int8W& w, int64_t n0, float* __restrict y, int64_t ldy) {
  const int64_t K = w.K, groups = K / w.group;
  f16v acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = f16v{};
  if constexpr (MR == 1 && !OFF) {
    // One row of a symmetric table, as the AVX2 tile: a group's codes meet x unscaled, its scale multiplies their sum
    // once. SmolLM2's 49152 x 576 on Zen 4, two threads: 0.95 -> 0.82 ms (the memory rate).
    for (int64_t g = 0; g < groups; ++g) {
      f16v part[NR];
      for (int n = 0; n < NR; ++n) part[n] = f16v{};
      for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 16) {
        const f16v xv = load16(x + k);
        for (int n = 0; n < NR; ++n) part[n] += xv * widen16_i8(w.codes + (n0 + n) * K + k);
      }
      for (int n = 0; n < NR; ++n) acc[n] += part[n] * w.scales[(n0 + n) * groups + g];
    }
  } else
  for (int64_t g = 0; g < groups; ++g) {
    f16v s[NR], o[NR];
    for (int n = 0; n < NR; ++n) {
      s[n] = f16v{} + w.scales[(n0 + n) * groups + g];
      o[n] = f16v{} + (OFF ? w.offsets[(n0 + n) * groups + g] : 0.0f);
    }
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 16) {
      f16v wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = widen16_i8(w.codes + (n0 + n) * K + k) * s[n] + o[n];
      for (int m = 0; m < MR; ++m) {
        const f16v xv = load16(x + m * K + k);
        for (int n = 0; n < NR; ++n) acc[m * NR + n] += xv * wv[n];
      }
    }
  }
  store_tile_sums<MR, NR>(acc, y + n0, ldy);
}
#endif

template <int NR, bool OFF>
inline void i8_rows(const float* x, int64_t M, const Int8W& w, int64_t n0, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + I8_MR <= M; m += I8_MR) i8_tile<I8_MR, NR, OFF>(x + m * w.K, w, n0, y + m * N, N);
  for (; m < M; ++m) i8_tile<1, NR, OFF>(x + m * w.K, w, n0, y + m * N, N);
}

// Weight rows [n0, n0 + rows) widened to float32 [rows, K] (the dequantized weight's own values).
template <bool OFF>
inline void i8_widen(const Int8W& w, int64_t n0, int64_t rows, float* out) {
  const int64_t K = w.K, groups = K / w.group;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t g = 0; g < groups; ++g) {
      const float s = w.scales[(n0 + n) * groups + g], o = OFF ? w.offsets[(n0 + n) * groups + g] : 0.0f;
      const int8_t* q = w.codes + (n0 + n) * K + g * w.group;
      float* dst = out + n * K + g * w.group;
#if defined(__AVX2__) && !defined(__AVX512F__)
      const __m256 sv = _mm256_set1_ps(s), ov = _mm256_set1_ps(o);
      for (int64_t k = 0; k < w.group; k += 8)
        _mm256_storeu_ps(dst + k, OFF ? _mm256_add_ps(_mm256_mul_ps(widen8_i8(q + k), sv), ov)
                                      : _mm256_mul_ps(widen8_i8(q + k), sv));
#else
      for (int64_t k = 0; k < w.group; k += 16) {
        const f16v v = widen16_i8(q + k) * s + o;
        std::memcpy(dst + k, &v, sizeof v);
      }
#endif
    }
}

// Up to I8_MR rows: each code widened in registers where it is used. More: each block of weight rows widened once
// into a buffer the float32 few-row kernel (linear_cpu's tile) reads for every input row, not once per I8_MR rows.
template <bool OFF>
void i8_all(const float* xp, int64_t M, const Int8W& w, int64_t N, float* yp) {
  const int64_t K = w.K;
  if (M <= I8_MR) {
    const int64_t blocks = N / I8_NR;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      if (b + 2 < blocks) {  // the rows two blocks on: in flight while these are used
        const char* ahead = reinterpret_cast<const char*>(w.codes + I8_NR * (b + 2) * K);
        for (int64_t c = 0; c < I8_NR * K; c += 64) __builtin_prefetch(ahead + c, 0, 1);
      }
      i8_rows<I8_NR, OFF>(xp, M, w, I8_NR * b, yp, N);
    }
    for (int64_t n = I8_NR * blocks; n < N; ++n) i8_rows<1, OFF>(xp, M, w, n, yp, N);
    return;
  }
  constexpr int NR = lineark::NR_MAX;
  const int64_t blocks = N / NR;
  #pragma omp parallel
  {
    std::vector<float> buf(NR * K);
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      i8_widen<OFF>(w, NR * b, NR, buf.data());
      lineark::rows_past<NR>(xp, M, buf.data(), K, yp + NR * b, N);
    }
  }
  std::vector<float> row(K);
  for (int64_t n = NR * blocks; n < N; ++n) {
    i8_widen<OFF>(w, n, 1, row.data());
    lineark::rows_past<1>(xp, M, row.data(), K, yp + n, N);
  }
}

}  // namespace

// x [M, K] float32 @ W.T -> [M, N] float32, W int8 codes [N, K] with float32 scales and offsets [N, K / group]
// (offsets empty: all zero)
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                          int64_t group) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "int8_linear: float32 x [M, K]");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.dim() == 2 &&
              codes.size(1) == x.size(1), "int8_linear: contiguous int8 codes [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group >= 16 && group % 16 == 0 && K % group == 0,
              "int8_linear: the group must be a multiple of 16 dividing K");
  const bool off = offsets.numel() != 0;
  for (const auto* t : off ? std::vector<const torch::Tensor*>{&scales, &offsets}
                           : std::vector<const torch::Tensor*>{&scales})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                t->size(1) == K / group, "int8_linear: scales and offsets must be contiguous float32 [N, K / group]");
  auto y = torch::empty({M, N}, x.options());
  const Int8W w{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), off ? offsets.data_ptr<float>() : nullptr, K,
                group};
  if (off) i8_all<true>(x.data_ptr<float>(), M, w, N, y.data_ptr<float>());
  else i8_all<false>(x.data_ptr<float>(), M, w, N, y.data_ptr<float>());
  return y;
}

// x [B, hidden] float32, updated in place: x += out_proj(gated_norm(delta_rule(conv(in_proj_qkv(norm(x)))), z)),
// Qwen3.5's Gated DeltaNet mixer for one token per sequence, its conv and recurrent states (float32, [S, C, W - 1]
// and [S, Hv, Dk, Dv]) updated in place at state_slots. t: input norm [hidden], conv weight [C, W], A_log [Hv],
// dt_bias [Hv], the gated norm's weight [Dv], then in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj (5
// tensors each). meta: Hk, Hv, Dk, Dv and the 5 group sizes.
// Rows that share a state slot (a verifying request's 1 + k rows, models/batch.py as_decode_rows) must be adjacent:
// they run in order, each from the state the row before left. row_snapshots [B] int64 (or empty): per row, the slot
// in snap_conv / snap_states ([S', C, W - 1] and [S', Hv, Dk, Dv]) where its state after it is copied, or -1.
torch::Tensor gdn_block(torch::Tensor x, std::vector<torch::Tensor> t, std::vector<int64_t> meta,
                        torch::Tensor conv_states, torch::Tensor states, torch::Tensor state_slots, double eps,
                        double offset, double norm_eps, torch::Tensor snap_conv, torch::Tensor snap_states,
                        torch::Tensor row_snapshots) {
  check_rows(x);
  TORCH_CHECK(t.size() == 30 && meta.size() == 9, "gdn_block: 30 tensors and 9 sizes");
  const int64_t B = x.size(0), H = x.size(1), Hk = meta[0], Hv = meta[1], Dk = meta[2], Dv = meta[3];
  const int64_t C = 2 * Hk * Dk + Hv * Dv, ratio = Hv / Hk;
  TORCH_CHECK(Hk >= 1 && Hv % Hk == 0 && fusedk::gdn_value_dim_ok(Dv), "gdn_block: head shapes");
  const Lin lqkv = lin_of(t, 5, meta[4], H), lz = lin_of(t, 10, meta[5], H), lb = lin_of(t, 15, meta[6], H);
  const Lin la = lin_of(t, 20, meta[7], H), lo = lin_of(t, 25, meta[8], Hv * Dv);
  TORCH_CHECK(lqkv.N == C && lz.N == Hv * Dv && lb.N == Hv && la.N == Hv && lo.N == H, "gdn_block: shapes do not match");
  const auto& cw = t[1];
  TORCH_CHECK(cw.scalar_type() == torch::kFloat32 && cw.is_contiguous() && cw.dim() == 2 && cw.size(0) == C,
              "gdn_block: conv weight must be float32 [C, W]");
  const int64_t W = cw.size(1), Hs = W - 1;
  TORCH_CHECK(W >= 2 && conv_states.scalar_type() == torch::kFloat32 && conv_states.is_contiguous() &&
              conv_states.dim() == 3 && conv_states.size(1) == C && conv_states.size(2) == Hs,
              "gdn_block: conv states must be contiguous float32 [S, C, W - 1]");
  TORCH_CHECK(states.scalar_type() == torch::kFloat32 && states.is_contiguous() && states.dim() == 4 &&
              states.size(1) == Hv && states.size(2) == Dk && states.size(3) == Dv,
              "gdn_block: recurrent states must be contiguous float32 [S, Hv, Dk, Dv]");
  TORCH_CHECK(state_slots.scalar_type() == torch::kInt64 && state_slots.is_contiguous() && state_slots.numel() == B,
              "gdn_block: one int64 state slot per sequence");
  const int64_t* sl = state_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] < states.size(0) && sl[b] < conv_states.size(0), "gdn_block: slot out of range");
  // runs of adjacent rows on one state slot: run r is rows [run[r], run[r + 1]); no slot in two runs
  std::vector<int64_t> run;
  for (int64_t b = 0; b < B; ++b)
    if (b == 0 || sl[b] != sl[b - 1]) {
      for (int64_t r : run) TORCH_CHECK(sl[r] != sl[b], "gdn_block: rows on one state slot must be adjacent");
      run.push_back(b);
    }
  const int64_t runs = static_cast<int64_t>(run.size());
  run.push_back(B);
  const int64_t* snap = nullptr;
  if (row_snapshots.numel()) {
    TORCH_CHECK(row_snapshots.scalar_type() == torch::kInt64 && row_snapshots.is_contiguous() &&
                row_snapshots.numel() == B, "gdn_block: one int64 snapshot slot (or -1) per row");
    TORCH_CHECK(snap_conv.scalar_type() == torch::kFloat32 && snap_conv.is_contiguous() &&
                snap_states.scalar_type() == torch::kFloat32 && snap_states.is_contiguous() &&
                snap_conv.dim() == 3 && snap_conv.size(1) == conv_states.size(1) &&
                snap_conv.size(2) == conv_states.size(2) && snap_states.dim() == 4 &&
                snap_states.size(1) == Hv && snap_states.size(2) == Dk && snap_states.size(3) == Dv,
                "gdn_block: snapshot states must be contiguous float32, shaped as the states");
    snap = row_snapshots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(snap[b] >= -1 && snap[b] < snap_conv.size(0) && snap[b] < snap_states.size(0),
                  "gdn_block: snapshot slot out of range");
  }
  const float* wn = vec(t[0], H, "gdn_block: the input norm must be float32 [hidden]");
  const float* A_log = vec(t[2], Hv, "gdn_block: A_log must be float32 [Hv]");
  const float* dt_bias = vec(t[3], Hv, "gdn_block: dt_bias must be float32 [Hv]");
  const float* gw = vec(t[4], Dv, "gdn_block: the gated norm must be float32 [Dv]");
  auto scratch = torch::empty({B * (H + C + Hv * Dv + 2 * Hv + Hv * Dv + H)}, x.options());
  float* xn = scratch.data_ptr<float>();
  float* mixed = xn + B * H;
  float* z = mixed + B * C;
  float* bb = z + B * Hv * Dv;
  float* aa = bb + B * Hv;
  float* o = aa + B * Hv;       // [B, Hv, Dv]
  float* y = o + B * Hv * Dv;   // [B, H]
  float* xp = x.data_ptr<float>();
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  for (int64_t b = 0; b < B; ++b) rms_row(xp + b * H, wn, off, e, H, xn + b * H);
  matmuls(xn, B, {{&lqkv, mixed}, {&lz, z}, {&lb, bb}, {&la, aa}});
  const float* wp = cw.data_ptr<float>();
  float* cs = conv_states.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {  // the causal conv's one new row from each state, then the state moves on
    float* row = mixed + b * C;
    float* st = cs + sl[b] * C * Hs;
    for (int64_t c = 0; c < C; ++c) {
      float* sc = st + c * Hs;
      const float* wc = wp + c * W;
      float acc = 0.0f;
      for (int64_t w = 0; w < Hs; ++w) acc += wc[w] * sc[w];
      acc += wc[Hs] * row[c];
      for (int64_t w = 0; w + 1 < Hs; ++w) sc[w] = sc[w + 1];
      sc[Hs - 1] = row[c];
      row[c] = acc;
    }
    silu_times(row, nullptr, C);
    if (snap && snap[b] >= 0) std::copy(st, st + C * Hs, snap_conv.data_ptr<float>() + snap[b] * C * Hs);
  }
  float* sp = states.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk)), ne = static_cast<float>(norm_eps);
  const int64_t pairs = runs * Hv;  // (run, head): a run's rows one after another on the head's state
  #pragma omp parallel for schedule(static) if (B * Hv * Dk * Dv >= 65536)
  for (int64_t rp = 0; rp < pairs; ++rp)
  for (int64_t b = run[rp / Hv]; b < run[rp / Hv + 1]; ++b) {
    const int64_t h = rp % Hv, hk = h / ratio, p = b * Hv + h;
    const float* row = mixed + b * C;
    const float a = aa[p] + dt_bias[h];
    const float softplus = a > 20.0f ? a : std::log1p(std::exp(a));
    const float g = -std::exp(A_log[h]) * softplus, beta = 1.0f / (1.0f + std::exp(-bb[p]));
    const float* qr = row + hk * Dk;
    const float* kr = row + Hk * Dk + hk * Dk;
    const float* vr = row + 2 * Hk * Dk + h * Dv;
    float* S = sp + (sl[b] * Hv + h) * Dk * Dv;
    float* orow = o + p * Dv;
    fusedk::by_value_vectors(Dv, [&](auto V) {
      fusedk::gdn_step_head<decltype(V)::value>(qr, kr, vr, g, beta, S, orow, Dk, scale, true);
    });
    if (snap && snap[b] >= 0) std::copy(S, S + Dk * Dv, snap_states.data_ptr<float>() + (snap[b] * Hv + h) * Dk * Dv);
    rms_row(orow, gw, 0.0f, ne, Dv, orow);  // the gated norm: plain weight, times silu(z)
    const float* zr = z + p * Dv;
    times_silu(orow, zr, Dv);
  }
  matmul(lo, o, B, y);
  for (int64_t i = 0; i < B * H; ++i) xp[i] += y[i];
  return x;
}

// The model's final norm and its LM head over the logits rows of x [B, H]: logits [R, V] = head(norm(x[rows])). t: the
// norm's weight, then the head's 5 tensors (lin_of); offset + weight scales the norm (1: zero-centred). `normed`
// [B, H] (or empty): every row's norm(x) written there too (what an MTP head reads). `argmax` int64 [R] (or empty):
// each logits row's argmax (argmax.h) while the logits lie in the caches of the threads that wrote them: the sampler's
// greedy tokens without a pass of its own after the call (~50 us of a step, most of it a cold interpreter).
void head_block(const torch::Tensor& x, const std::vector<torch::Tensor>& t, int64_t group, double eps, double offset,
                const torch::Tensor& rows, const torch::Tensor& logits, const torch::Tensor& normed,
                const torch::Tensor& argmax) {
  TORCH_CHECK(t.size() == 6, "head_block: the norm and the head's 5 tensors");
  const int64_t B = x.size(0), H = x.size(1);
  const Lin lh = lin_of(t, 1, group, H);
  const float* wn = vec(t[0], H, "head_block: the norm must be float32 [hidden]");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.is_contiguous() && rows.dim() == 1,
              "head_block: the logits rows must be int64 [R]");
  const int64_t R = rows.size(0);
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() && logits.dim() == 2 &&
              logits.size(0) == R && logits.size(1) == lh.N, "head_block: logits must be float32 [rows, vocab]");
  const int64_t* r = rows.data_ptr<int64_t>();
  auto picked = torch::empty({R, H}, x.options());
  float* np = picked.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  float* all = nullptr;
  if (normed.numel()) {
    TORCH_CHECK(normed.scalar_type() == torch::kFloat32 && normed.is_contiguous() && normed.dim() == 2 &&
                normed.size(0) == B && normed.size(1) == H, "head_block: normed rows must be float32 [rows, hidden]");
    all = normed.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) rms_row(xp + b * H, wn, off, e, H, all + b * H);
  }
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < B, "head_block: a logits row out of range");
    if (all)
      std::copy(all + r[i] * H, all + (r[i] + 1) * H, np + i * H);
    else
      rms_row(xp + r[i] * H, wn, off, e, H, np + i * H);
  }
  matmul(lh, np, R, logits.data_ptr<float>());
  if (argmax.numel()) {
    TORCH_CHECK(argmax.scalar_type() == torch::kInt64 && argmax.is_contiguous() && argmax.numel() == R,
                "head_block: argmax must be int64 [rows]");
    if (lh.N > 0) argmaxk::rows(logits.data_ptr<float>(), R, lh.N, lh.N, argmax.data_ptr<int64_t>());
  }
}

// Every layer of a decode step in one call: x [B, hidden] updated in place, layer by layer, by the blocks above.
// Per layer, from the three flat lists in order: a token mixer, then an MLP (each optional).
//   ints: the mixer's kind (0 none, 1 attention, 2 GDN) and its sizes (8 or 9: the meta above), then the MLP's
//         kind (0 none, 1 SwiGLU) and its 3 group sizes;
//   tensors: attention's 23 and k / v caches, or GDN's 30, conv / recurrent states and their snapshot tensors (empty
//            where none); the MLP's 16;
//   floats: attention's eps, offset, scale, or GDN's eps, offset, norm_eps; the MLP's eps, offset.
// Optionally last, kind 3: the final norm and the LM head (head_block: 6 tensors, its group size, eps and offset),
// writing logits [R, V] for the rows `logits_rows` of x (both empty when the step has no head entry), and every row's
// normed hidden state into `normed` where it is not empty, and each logits row's argmax into `logits_argmax` where it
// is not empty.
// A step of SmolLM2 made 60 calls from Python (~0.6 ms of a ~9 ms step in the interpreter and in argument
// conversion, the other thread waiting meanwhile); now one.
torch::Tensor decode_stack(torch::Tensor x, std::vector<torch::Tensor> tensors, std::vector<int64_t> ints,
                           std::vector<double> floats, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor slot_mapping, torch::Tensor context_slots, torch::Tensor context_lens,
                           torch::Tensor state_slots, torch::Tensor row_snapshots, torch::Tensor logits_rows,
                           torch::Tensor logits, torch::Tensor normed, torch::Tensor logits_argmax) {
  size_t ti = 0, ii = 0, fi = 0;
  auto take = [&](size_t n) {
    TORCH_CHECK(ti + n <= tensors.size(), "decode_stack: fewer tensors than the layers' kinds need");
    std::vector<torch::Tensor> part(tensors.begin() + ti, tensors.begin() + ti + n);
    ti += n;
    return part;
  };
  auto sizes = [&](size_t n) {
    TORCH_CHECK(ii + n <= ints.size(), "decode_stack: fewer sizes than the layers' kinds need");
    std::vector<int64_t> part(ints.begin() + ii, ints.begin() + ii + n);
    ii += n;
    return part;
  };
  auto reals = [&](size_t n) {
    TORCH_CHECK(fi + n <= floats.size(), "decode_stack: fewer floats than the layers' kinds need");
    fi += n;
    return floats.data() + fi - n;
  };
  while (ii < ints.size()) {
    const int64_t mixer = ints[ii++];
    if (mixer == 1) {
      auto t = take(23);
      const auto caches = take(2);
      const auto meta = sizes(8);
      const double* f = reals(3);
      attention_block(x, t, meta, cos, sin, caches[0], caches[1], slot_mapping, context_slots, context_lens, f[0], f[1],
                      f[2]);
    } else if (mixer == 2) {
      auto t = take(30);
      const auto pools = take(4);
      const auto meta = sizes(9);
      const double* f = reals(3);
      gdn_block(x, t, meta, pools[0], pools[1], state_slots, f[0], f[1], f[2], pools[2], pools[3], row_snapshots);
    } else if (mixer == 3) {
      const auto t = take(6);
      const auto group = sizes(1);
      const double* f = reals(2);
      TORCH_CHECK(ii == ints.size(), "decode_stack: the head is the last entry");
      head_block(x, t, group[0], f[0], f[1], logits_rows, logits, normed, logits_argmax);
      break;
    } else {
      TORCH_CHECK(mixer == 0, "decode_stack: a kind must be 0, 1, 2 or 3");
    }
    TORCH_CHECK(ii < ints.size(), "decode_stack: a layer without its MLP kind");
    const int64_t mlp = ints[ii++];
    if (mlp == 1) {
      auto t = take(16);
      const auto groups = sizes(3);
      const double* f = reals(2);
      mlp_block(x, t, groups, f[0], f[1]);
    } else {
      TORCH_CHECK(mlp == 0, "decode_stack: an MLP kind must be 0 or 1");
    }
  }
  TORCH_CHECK(ti == tensors.size() && fi == floats.size(), "decode_stack: more tensors or floats than the layers use");
  return x;
}
