// Paged decode attention (kernels/paged_cpu.py loads and wraps it).
#include "paged_attention.h"

using namespace pagedk;

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
