// The fused CPU kernels: causal conv, the gated delta rule, norms and elementwise work (kernels/fused_cpu.py
// loads and wraps them).
#include "prelude.h"
#include "gdn.h"
#include "argmax.h"
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

using namespace fusedk;

namespace {

constexpr int64_t CONV_ROWS = 64;  // output rows per work item


// out = bias + sum_w weight_t[w] * src[w], then SiLU: one row of C channels, accumulated in place in L1.
inline void conv_row(float* __restrict out, const float* const* src, const float* __restrict weight_t,
                     const float* __restrict bias, int64_t W, int64_t C, bool act) {
  if (bias) std::copy(bias, bias + C, out); else std::fill(out, out + C, 0.0f);
  for (int64_t w = 0; w < W; ++w) {
    const float* __restrict s = src[w];
    const float* __restrict k = weight_t + w * C;
    #pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] += k[c] * s[c];
  }
  if (act) silu_times(out, nullptr, C);
}

}  // namespace

// on: denormal floats (|x| < 2^-126) read and written as zero (MXCSR's DAZ and FTZ bits) on the calling thread and
// on every thread of its OpenMP team, each thread's MXCSR kept; off: each thread's kept MXCSR back. A denormal
// operand costs x86 a microcode assist of ~100 cycles: the chunked gated delta rule's decays exp(G) of a strongly
// decaying head pass through that range on their way to 0, and the tiny hybrid's 512-token prefill ran its GDN 7x
// slower for it (36 vs 5.3 ms a layer). What it changes is below 2^-126 of a value: nothing the float32 bounds can
// see. Scoped (the engine sets it for a step and restores it after), since it is process state other code may rely
// on (hypothesis, in our own test process, refuses to run where subnormals are flushed).
namespace {
thread_local unsigned kept_csr = 0;
thread_local bool kept = false;

void flush_this_thread(bool on) {
  constexpr unsigned FTZ_DAZ = 0x8040;
  if (on && !kept) {
    kept_csr = _mm_getcsr();
    kept = true;
    _mm_setcsr(kept_csr | FTZ_DAZ);
  } else if (!on && kept) {
    _mm_setcsr(kept_csr);
    kept = false;
  }
}
}  // namespace

void flush_denormals(bool on) {
  flush_this_thread(on);
  #pragma omp parallel
  { flush_this_thread(on); }  // the calling thread is one of the team: its second call changes nothing
}

// x [T, C] packed sequences (cu_seqlens [N+1]); weight [C, W]; initial_state [N, C, W-1] or None (zeros).
// Returns y [T, C] and the final states [N, C, W-1] (the last W-1 inputs of each sequence, its history included).
std::vector<torch::Tensor> causal_conv1d(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                                         torch::Tensor cu_seqlens, c10::optional<torch::Tensor> initial_state,
                                         bool act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "causal_conv1d: x must be contiguous float32 [T, C]");
  const int64_t C = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) >= 1 &&
              weight.scalar_type() == torch::kFloat32, "causal_conv1d: weight must be float32 [C, W]");
  const int64_t W = weight.size(1), H = W - 1, HR = std::max<int64_t>(H, 1);
  auto cu = cu_seqlens.to(torch::kInt64).contiguous();
  const int64_t N = cu.numel() - 1;
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK(N >= 0 && (N == 0 || (cp[0] == 0 && cp[N] == x.size(0))), "causal_conv1d: bad cu_seqlens");
  auto weight_t = weight.t().contiguous();
  torch::Tensor b;
  if (bias && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  auto hist = torch::zeros({N, HR, C}, x.options());  // each sequence's history as rows (the state is [C, W-1])
  if (initial_state && initial_state->defined()) {
    TORCH_CHECK(initial_state->dim() == 3 && initial_state->size(0) == N && initial_state->size(1) == C &&
                initial_state->size(2) == H, "causal_conv1d: initial_state must be [N, C, W-1]");
    if (H) hist.copy_(initial_state->to(torch::kFloat32).transpose(1, 2));
  }
  auto y = torch::empty_like(x);
  auto fin = torch::empty({N, C, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight_t.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* hp = hist.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* fp = fin.data_ptr<float>();
  // Input row j of sequence n; j < 0 reads its history.
  auto row = [&](int64_t n, int64_t j) { return j >= 0 ? xp + (cp[n] + j) * C : hp + (n * HR + H + j) * C; };
  std::vector<int64_t> item_seq, item_lo;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(cp[n + 1] >= cp[n], "causal_conv1d: cu_seqlens must not decrease");
    for (int64_t lo = 0; lo < cp[n + 1] - cp[n]; lo += CONV_ROWS) { item_seq.push_back(n); item_lo.push_back(lo); }
  }
  const int64_t items = static_cast<int64_t>(item_seq.size());
  #pragma omp parallel for schedule(static) if (items > 1)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t n = item_seq[it], hi = std::min(cp[n + 1] - cp[n], item_lo[it] + CONV_ROWS);
    std::vector<const float*> src(W);
    for (int64_t r = item_lo[it]; r < hi; ++r) {
      for (int64_t w = 0; w < W; ++w) src[w] = row(n, r - H + w);
      conv_row(yp + (cp[n] + r) * C, src.data(), wp, bp, W, C, act);
    }
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const float* r = row(n, cp[n + 1] - cp[n] - H + h);
      for (int64_t c = 0; c < C; ++c) fp[(n * C + c) * H + h] = r[c];
    }
  return {y, fin};
}


struct GdnInputs {
  const float *q, *k, *v, *g, *beta;
  int64_t qk_token, qk_head, v_token, v_head;  // strides (the last dim is contiguous)
  int64_t Hv, ratio, Dk, C;
  float scale;
  bool l2norm;
};

// The chunked gated delta rule (kernels/gated_delta.py) for one sequence and one value head, chunk after chunk,
// with every chunk-local matrix in L1. With D_ij = exp(G_i - G_j) (j <= i):
//   A = strict_lower(beta_i (k_i . k_j) D_ij), P = lower((q_i . k_j) D_ij)
//   (I + A) U = beta V and (I + A) W = beta exp(G) K, by forward substitution
//   V_new = U - W S,   O = exp(G) Q S + P V_new,   S = exp(G_last) S + (exp(G_last - G) K)^T V_new
// Rows of K K^T, Q K^T and D are computed C at a time (vectorised over j, exp included) from K transposed.
template <int V>
void gdn_sequence_head(const GdnInputs& in, float* __restrict out, float* __restrict S, int64_t lo, int64_t len,
                       int64_t h) {
  constexpr int64_t Dv = 16 * V;
  const int64_t Dk = in.Dk, C = in.C, Hv = in.Hv, hk = h / in.ratio;
  std::vector<float> buf(4 * C * Dk + 2 * C * C + C * Dv + 4 * C + 2 * C);
  float *Qn = buf.data(), *Kn = Qn + C * Dk, *KT = Kn + C * Dk, *W = KT + C * Dk, *A = W + C * Dk, *P = A + C * C;
  float *U = P + C * C, *G = U + C * Dv, *B = G + C, *E = B + C, *tail = E + C, *kk = tail + C, *qk = kk + C;
  for (int64_t c0 = 0; c0 < len; c0 += C) {
    const int64_t L = std::min(C, len - c0);
    float cum = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      if (i >= L) {  // past the sequence's end: no key, no decay
        for (int64_t d = 0; d < Dk; ++d) KT[d * C + i] = 0.0f;
        G[i] = cum;
        continue;
      }
      const int64_t t = lo + c0 + i;
      const float* qr = in.q + t * in.qk_token + hk * in.qk_head;
      const float* kr = in.k + t * in.qk_token + hk * in.qk_head;
      const float fq = in.l2norm ? in.scale / std::sqrt(dot(qr, qr, Dk) + 1e-6f) : in.scale;
      const float fk = in.l2norm ? 1.0f / std::sqrt(dot(kr, kr, Dk) + 1e-6f) : 1.0f;
      for (int64_t d = 0; d < Dk; ++d) {
        Qn[i * Dk + d] = qr[d] * fq;
        Kn[i * Dk + d] = KT[d * C + i] = kr[d] * fk;
      }
      cum += in.g[t * Hv + h];
      G[i] = cum;
      B[i] = in.beta[t * Hv + h];
      E[i] = std::exp(cum);
    }
    for (int64_t i = 0; i < L; ++i) {  // rows i of A and P
      #pragma omp simd
      for (int64_t j = 0; j < C; ++j) { kk[j] = 0.0f; qk[j] = 0.0f; }
      for (int64_t d = 0; d < Dk; ++d) {
        const float a = Kn[i * Dk + d], b = Qn[i * Dk + d];
        const float* __restrict kt = KT + d * C;
        #pragma omp simd
        for (int64_t j = 0; j < C; ++j) { kk[j] += a * kt[j]; qk[j] += b * kt[j]; }
      }
      const float gi = G[i], bi = B[i];
      int64_t j = 0;
      for (; j + 16 <= C; j += 16) {  // 16 at a time: exp16, where GCC would call the scalar expf per element
        const i16v col = LANES16 + static_cast<int32_t>(j);
        const i16v below = col < static_cast<int32_t>(i), on_or_below = col <= static_cast<int32_t>(i);
        const f16v dec = exp16(gi - load16(G + j));  // G rises no further past i: only j <= i is used
        store16(A + i * C + j, below ? bi * load16(kk + j) * dec : f16v{});
        store16(P + i * C + j, on_or_below ? load16(qk + j) * dec : f16v{});
      }
      for (; j < C; ++j) {
        const float dec = std::exp(j <= i ? gi - G[j] : -1e30f);  // 0 above the diagonal, whatever g's sign
        A[i * C + j] = j < i ? bi * kk[j] * dec : 0.0f;
        P[i * C + j] = j <= i ? qk[j] * dec : 0.0f;
      }
    }
    for (int64_t i = 0; i < L; ++i) {  // forward substitution: row i of U and W
      const float* vr = in.v + (lo + c0 + i) * in.v_token + h * in.v_head;
      f16v acc[V];
      for (int v = 0; v < V; ++v) acc[v] = B[i] * load16(vr + 16 * v);
      for (int64_t m = 0; m < i; ++m)
        for (int v = 0; v < V; ++v) acc[v] -= A[i * C + m] * load16(U + m * Dv + 16 * v);
      for (int v = 0; v < V; ++v) store16(U + i * Dv + 16 * v, acc[v]);
      float* __restrict wr = W + i * Dk;
      const float bk = B[i] * E[i];
      #pragma omp simd
      for (int64_t d = 0; d < Dk; ++d) wr[d] = bk * Kn[i * Dk + d];
      for (int64_t m = 0; m < i; ++m) {
        const float a = A[i * C + m];
        const float* __restrict wm = W + m * Dk;
        #pragma omp simd
        for (int64_t d = 0; d < Dk; ++d) wr[d] -= a * wm[d];
      }
    }
    for (int64_t i = 0; i < L; ++i) {  // V_new = U - W S (in place of U), then O
      f16v nv[V], o[V];
      for (int v = 0; v < V; ++v) { nv[v] = load16(U + i * Dv + 16 * v); o[v] = f16v{}; }
      for (int64_t d = 0; d < Dk; ++d) {
        const float a = W[i * Dk + d], b = Qn[i * Dk + d];
        for (int v = 0; v < V; ++v) {
          const f16v s = load16(S + d * Dv + 16 * v);
          nv[v] -= a * s;
          o[v] += b * s;
        }
      }
      for (int v = 0; v < V; ++v) { store16(U + i * Dv + 16 * v, nv[v]); o[v] *= E[i]; }
      for (int64_t j = 0; j <= i; ++j)  // row j's V_new is final for j <= i
        for (int v = 0; v < V; ++v) o[v] += P[i * C + j] * load16(U + j * Dv + 16 * v);
      float* orow = out + (lo + c0 + i) * Hv * Dv + h * Dv;
      for (int v = 0; v < V; ++v) store16(orow + 16 * v, o[v]);
    }
    const float last = G[L - 1], decay = std::exp(last);
    #pragma omp simd
    for (int64_t i = 0; i < L; ++i) tail[i] = std::exp(last - G[i]);
    for (int64_t d = 0; d < Dk; ++d) {  // S = exp(G_last) S + (exp(G_last - G) K)^T V_new, row d of S
      f16v acc[V];
      for (int v = 0; v < V; ++v) acc[v] = decay * load16(S + d * Dv + 16 * v);
      for (int64_t i = 0; i < L; ++i) {
        const float a = tail[i] * KT[d * C + i];
        for (int v = 0; v < V; ++v) acc[v] += a * load16(U + i * Dv + 16 * v);
      }
      for (int v = 0; v < V; ++v) store16(S + d * Dv + 16 * v, acc[v]);
    }
  }
}

// q, k [T, Hk, Dk] and v [T, Hv, Dv] (strided rows, contiguous last dim), g and beta [T, Hv], packed sequences
// cu_seqlens [N+1], state [N, Hv, Dk, Dv] (updated in place). Returns o [T, Hv, Dv] float32.
torch::Tensor gdn_prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                          std::vector<int64_t> cu, torch::Tensor state, int64_t chunk, double scale, bool l2norm) {
  for (const auto& t : {q, k, v, g, beta, state})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.stride(-1) == 1, "gdn_prefill: float32, contiguous last dim");
  TORCH_CHECK(g.is_contiguous() && beta.is_contiguous() && state.is_contiguous(),
              "gdn_prefill: contiguous g, beta, state");
  const int64_t T = v.size(0), Hv = v.size(1), Dv = v.size(2), Hk = q.size(1), Dk = q.size(2);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(gdn_value_dim_ok(Dv), "gdn_prefill: value head size a multiple of 16 up to 128 only");
  TORCH_CHECK(k.sizes() == q.sizes() && k.strides() == q.strides() && Hk >= 1 && Hv % Hk == 0 && chunk >= 1 && N >= 1 &&
              cu[0] == 0 && cu[N] == T && state.size(0) == N && state.size(1) == Hv && state.size(2) == Dk &&
              state.size(3) == Dv, "gdn_prefill: shapes do not match");
  auto out = torch::empty({T, Hv, Dv}, v.options().memory_format(at::MemoryFormat::Contiguous));
  const GdnInputs in{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                     beta.data_ptr<float>(), q.stride(0), q.stride(1), v.stride(0), v.stride(1), Hv, Hv / Hk, Dk,
                     chunk, static_cast<float>(scale), l2norm};
  float* op = out.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  const int64_t pairs = N * Hv;
  #pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t n = p / Hv, h = p % Hv, lo = cu[n], len = cu[n + 1] - cu[n];
    float* S = sp + p * Dk * Dv;
    by_value_vectors(Dv, [&](auto V) { gdn_sequence_head<decltype(V)::value>(in, op, S, lo, len, h); });
  }
  return out;
}

// q, k [B, Hk, Dk], v [B, Hv, Dv] (contiguous last dims), g and beta [B, Hv]; the states of sequence b are
// states[slots[b]] ([S, Hv, Dk, Dv] float32), updated in place. Returns o [B, Hv, Dv] float32.
torch::Tensor gdn_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                         torch::Tensor states, torch::Tensor slots, double scale, bool l2norm) {
  for (const auto& t : {q, k, v, g, beta, states})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.stride(-1) == 1, "gdn_decode: float32, contiguous last dim");
  TORCH_CHECK(g.is_contiguous() && beta.is_contiguous() && states.is_contiguous() &&
              slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "gdn_decode: contiguous g, beta, states");
  const int64_t B = v.size(0), Hv = v.size(1), Dv = v.size(2), Hk = q.size(1), Dk = q.size(2);
  TORCH_CHECK(gdn_value_dim_ok(Dv), "gdn_decode: value head size a multiple of 16 up to 128 only");
  TORCH_CHECK(k.sizes() == q.sizes() && k.strides() == q.strides() && Hk >= 1 && Hv % Hk == 0 && slots.numel() == B &&
              states.size(1) == Hv && states.size(2) == Dk && states.size(3) == Dv, "gdn_decode: shapes do not match");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] < states.size(0), "gdn_decode: state slot out of range");
  auto out = torch::empty({B, Hv, Dv}, v.options().memory_format(at::MemoryFormat::Contiguous));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = states.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t ratio = Hv / Hk, pairs = B * Hv;
  const float sc = static_cast<float>(scale);
  #pragma omp parallel for schedule(static) if (pairs * Dk * Dv >= 65536)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t b = p / Hv, h = p % Hv, hk = h / ratio;
    const float* qr = qp + b * q.stride(0) + hk * q.stride(1);
    const float* kr = kp + b * k.stride(0) + hk * k.stride(1);
    const float* vr = vp + b * v.stride(0) + h * v.stride(1);
    float* S = sp + (sl[b] * Hv + h) * Dk * Dv;
    float* orow = op + p * Dv;
    by_value_vectors(Dv, [&](auto V) {
      gdn_step_head<decltype(V)::value>(qr, kr, vr, gp[p], bp[p], S, orow, Dk, sc, l2norm);
    });
  }
  return out;
}

// Rows of x [R, D] (row stride free, channels contiguous): y = x / rms(x) * (offset + weight), times SiLU(gate)
// when a gate is given. With a residual, s = x + residual is what is normed, and s is returned after y.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps, double offset,
                                    c10::optional<torch::Tensor> gate, c10::optional<torch::Tensor> residual) {
  auto rows_ok = [&](const torch::Tensor& t) {
    return t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.stride(1) == 1;
  };
  TORCH_CHECK(rows_ok(x), "rms_norm: x must be float32 [R, D] with contiguous rows");
  const int64_t R = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.numel() == D && weight.scalar_type() == torch::kFloat32, "rms_norm: weight must be float32 [D]");
  const bool gated = gate && gate->defined(), add = residual && residual->defined();
  TORCH_CHECK(!gated || (rows_ok(*gate) && gate->sizes() == x.sizes()), "rms_norm: gate must be shaped like x");
  TORCH_CHECK(!add || (rows_ok(*residual) && residual->sizes() == x.sizes()),
              "rms_norm: residual must be shaped like x");
  auto wc = weight.contiguous();
  auto y = torch::empty({R, D}, x.options());
  auto sum = add ? torch::empty({R, D}, x.options()) : torch::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* gp = gated ? gate->data_ptr<float>() : nullptr;
  const float* rp = add ? residual->data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), gs = gated ? gate->stride(0) : 0, rs = add ? residual->stride(0) : 0;
  float* sp = add ? sum.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  #pragma omp parallel for schedule(static) if (R * D >= 65536)
  for (int64_t r = 0; r < R; ++r) {
    const float* __restrict in = xp + r * xs;
    if (add) {
      float* __restrict s = sp + r * D;
      const float* __restrict res = rp + r * rs;
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) s[d] = in[d] + res[d];
      in = s;
    }
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int64_t d = 0; d < D; ++d) ss += in[d] * in[d];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + e);
    float* __restrict out = yp + r * D;
    if (gated) {
      const float* __restrict g = gp + r * gs;
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = in[d] * inv * (off + wp[d]);
      times_silu(out, g, D);
    } else {
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[d] = in[d] * inv * (off + wp[d]);
    }
  }
  if (add) return {y, sum};
  return {y};
}

// SwiGLU's product in place: gate [R, F] <- silu(gate) * up (float32 rows, channels contiguous). torch's silu_
// and mul_ took ~0.35 ms a SmolLM2 layer at 528 rows (2 threads) for what is one pass over two tensors.
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  auto rows_ok = [](const torch::Tensor& t) {
    return t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.stride(1) == 1;
  };
  TORCH_CHECK(rows_ok(gate) && rows_ok(up) && gate.sizes() == up.sizes(),
              "silu_mul: gate and up must be float32 [R, F] alike, channels contiguous");
  const int64_t R = gate.size(0), F = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  float* gp = gate.data_ptr<float>();
  const float* upp = up.data_ptr<float>();
  #pragma omp parallel for schedule(static) if (R * F >= 65536)
  for (int64_t r = 0; r < R; ++r) {
    float* g = gp + r * gs;
    const float* u = upp + r * us;
    silu_times(g, u, F);
  }
  return gate;
}

// Rotary embedding, rotate-half form: x [T, H, D] (each row's heads and channels contiguous), cos and sin [T, rd]
// (rd <= D, even; channels past rd pass through) -> [T, H, D]: the first rd channels become x * cos + (-x2, x1) * sin.
// apply_rotary's four torch ops (cat, neg, mul, addcmul) were ~0.3 ms a SmolLM2 layer at 528 rows.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope: x must be float32 [T, H, D], each row's heads and channels contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), rd = cos.size(1), half = rd / 2;
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == T && rd % 2 == 0 && rd <= D &&
              cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.stride(1) == 1 && sin.stride(1) == 1, "rope: cos and sin must be float32 [T, rd], rd even <= D");
  auto out = torch::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  #pragma omp parallel for schedule(static) if (T * H * D >= 65536)
  for (int64_t t = 0; t < T; ++t) {
    const float* __restrict c = cp + t * cs;
    const float* __restrict s = sp + t * ss;
    for (int64_t h = 0; h < H; ++h) {
      const float* __restrict in = xp + t * xs + h * D;
      float* __restrict o = op + (t * H + h) * D;
      #pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        o[i] = in[i] * c[i] - in[i + half] * s[i];
        o[i + half] = in[i + half] * c[i + half] + in[i] * s[i + half];
      }
      for (int64_t i = rd; i < D; ++i) o[i] = in[i];
    }
  }
  return out;
}

// The index of each row's largest value, x [R, V] float32 (rows contiguous) -> int64 [R], as torch.argmax
// (argmax.h: the first of equal maxima, the first NaN before any number). torch's CPU argmax over one 49,152-wide row
// took ~50 us (a scalar pass); this vectorised passes, a wide row cut into one piece a thread.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be float32 [R, V], V > 0, with contiguous rows");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
  argmaxk::rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), out.data_ptr<int64_t>());
  return out;
}

namespace {
// The row ids [R] a table gather reads, each checked against the table's N rows (the error names the kernel `what`).
const int64_t* table_ids(const torch::Tensor& ids, int64_t N, const char* what) {
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.is_contiguous() && ids.dim() == 1, what,
              ": ids must be contiguous int64 [R]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.size(0); ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < N, what, ": id ", id[r], " is outside the table's ", N, " rows");
  return id;
}
}  // namespace

// Rows ids of a symmetric int8 table widened to float32: out[i, k] = float(codes[ids[i], k]) * scales[ids[i], k / g],
// one rounding, the product kernels/int8.py's gather forms (a table with offsets takes that path instead). The
// gather there is ~10 small torch ops (~45 us a decode step's token, ~2x that between the step's big native calls).
torch::Tensor int8_rows(torch::Tensor codes, torch::Tensor scales, torch::Tensor ids) {
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.dim() == 2,
              "int8_rows: codes must be contiguous int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == N && scales.size(1) > 0 && K % scales.size(1) == 0,
              "int8_rows: scales must be contiguous float32 [N, K / group]");
  const int64_t* id = table_ids(ids, N, "int8_rows");
  const int64_t R = ids.size(0), G = scales.size(1), group = K / G;
  auto out = torch::empty({R, K}, scales.options());
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int8_t* q = codes.data_ptr<int8_t>() + id[r] * K;
    const float* s = scales.data_ptr<float>() + id[r] * G;
    for (int64_t g = 0; g < G; ++g) {
      const float sg = s[g];
      #pragma omp simd
      for (int64_t k = g * group; k < (g + 1) * group; ++k) o[r * K + k] = static_cast<float>(q[k]) * sg;
    }
  }
  return out;
}

// Rows ids of a symmetric 8- or 6-bit panel table (kernels/int4_int8.py repack_int8: an embedding whose codes are
// held once, in its tied vocabulary projection's panels) widened to float32: out[i, k] = (float(c) - z) * s, c the
// code (q + z, z 128 for 8 bits, 32 for 6) and s its group's scale, kernels/int4_int8.py gather_rows' arithmetic.
// 8-bit codes [N / 16, K * 16] uint8: row t's code of column 32b + 4L + i at byte 512b + 64L + 4(t % 16) + i of panel
// t / 16; 6-bit [N / 16, K * 12]: its low 4 bits in the nibble of byte 384b + 64(L % 4) + 4(t % 16) + i (low nibble
// for L < 4), the 2 above in byte 384b + 256 + 32(L % 4) + j at bit 2(j' / 32) + 4(L / 4), j' = 4(t % 16) + i, j = j'
// % 32 (int4_int8dot.cpp's header). Scales float32 [N / 16, K / g, 16], or int8 SUPER [N / 16, K / 256, 64 + 16 G]
// (per 256 columns the rows' float32 d, then the int8 sub-scales four groups a dword: s = d * sub). One call where
// gather_rows' torch indexing was six ops (~110 us of a SmolLM2 decode step between its native calls).
torch::Tensor int8_panel_rows(torch::Tensor codes, torch::Tensor scales, torch::Tensor ids, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2 &&
              (bits == 8 || bits == 6) && codes.size(1) % (64 * bits) == 0,
              "int8_panel_rows: codes must be contiguous uint8 [N / 16, K * 2 * bits], bits 8 or 6");
  const int64_t P = codes.size(0), K = codes.size(1) / (2 * bits), N = P * 16, block = 64 * bits;
  const bool super = scales.scalar_type() == torch::kInt8;
  int64_t G = 0, group = 0;
  if (super) {
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == P && K % 256 == 0 &&
                scales.size(1) == K / 256 && scales.size(2) > 64 && (scales.size(2) - 64) % 16 == 0 &&
                256 % ((scales.size(2) - 64) / 16) == 0,
                "int8_panel_rows: super scales must be contiguous int8 [N / 16, K / 256, 64 + 16 G]");
    G = (scales.size(2) - 64) / 16;
    group = 256 / G;
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 3 &&
                scales.size(0) == P && scales.size(2) == 16 && scales.size(1) > 0 && K % scales.size(1) == 0,
                "int8_panel_rows: scales must be contiguous float32 [N / 16, K / group, 16] or int8 super");
    G = scales.size(1);
    group = K / G;
  }
  const int64_t* id = table_ids(ids, N, "int8_panel_rows");
  const int64_t R = ids.size(0);
  const float zero = bits == 8 ? 128.0f : 32.0f;
  auto out = torch::empty({R, K}, codes.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int8_t* super_p = super ? scales.data_ptr<int8_t>() : nullptr;
  const float* float_p = super ? nullptr : scales.data_ptr<float>();
  #pragma omp parallel for schedule(static) if (R > 64)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t panel = id[r] / 16, lane = id[r] % 16;
    const uint8_t* c = cp + panel * K * 2 * bits;
    float* row = o + r * K;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t b = k / 32, col = k % 32, L = col % 16 / 4, i = col % 4, upper = col / 16;
      const int64_t t = 4 * lane + i;  // the code's byte in its 64-byte chunk
      float code;
      if (bits == 8) {
        code = static_cast<float>(c[block * b + 64 * (L + 4 * upper) + t]);
      } else {
        const uint8_t nibble = (c[block * b + 64 * L + t] >> (4 * upper)) & 0x0F;
        const uint8_t pair = (c[block * b + 256 + 32 * L + t % 32] >> (2 * (t / 32) + 4 * upper)) & 0x03;
        code = static_cast<float>(nibble | (pair << 4));
      }
      const int64_t g = k / group;
      float s;
      if (super) {
        const int8_t* at = super_p + (panel * (K / 256) + k / 256) * (64 + 16 * G);
        float d;
        std::memcpy(&d, at + 4 * lane, 4);
        s = d * static_cast<float>(at[64 + 64 * (g % G / 4) + 4 * lane + g % 4]);
      } else {
        s = float_p[(panel * G + g) * 16 + lane];
      }
      row[k] = (code - zero) * s;
    }
  }
  return out;
}
