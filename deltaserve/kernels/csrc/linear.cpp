// Few-row float32 linears (kernels/linear_cpu.py loads and wraps them).
#include "linear_tile.h"

using namespace lineark;

// x [M, K] float32, w [N, K] float32 (both contiguous, K % 16 == 0) -> x @ w.T [M, N] float32
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "linear_rows: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_rows: contiguous x [M, K] and w [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "linear_rows: the input width must be a multiple of 16");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 1) {
    const int64_t blocks = (N + 63) / 64;  // 64 rows a unit, a contiguous range of them a thread
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
      one_row(xp, wp + 64 * b * K, K, std::min<int64_t>(64, N - 64 * b), yp + 64 * b);
    return y;
  }
  const int64_t blocks = N / NR_MAX;
  #pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 2 < blocks) {  // the weight rows two blocks on: in flight while these are used
      const char* ahead = reinterpret_cast<const char*>(wp + NR_MAX * (b + 2) * K);
      for (int64_t c = 0; c < NR_MAX * K * 4; c += 64) __builtin_prefetch(ahead + c, 0, 1);
    }
    rows_past<NR_MAX>(xp, M, wp + NR_MAX * b * K, K, yp + NR_MAX * b, N);
  }
  for (int64_t n = NR_MAX * blocks; n < N; ++n) rows_past<1>(xp, M, wp + n * K, K, yp + n, N);
  return y;
}
