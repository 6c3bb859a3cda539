"""Decode attention that reads the paged KV cache in place, on CPU: a small C++ kernel the engine builds at start.

The portable path gathers every decode sequence's K and V rows into fresh tensors before SDPA reads them again,
so each cached byte crosses memory three times per step; at 64 decodes of ~800 tokens that is most of a step.
This kernel walks each sequence's slots and reads each K and V row once, for all the query heads that share it
(grouped-query attention), with a two-pass softmax in float32 (-ffast-math lets the compiler vectorize the dot
products). It is compiled with torch's cpp_extension (ninja + the system C++ compiler) into torch's extension
cache; where that fails, `load()` returns None and the caller keeps the portable path.
"""

from __future__ import annotations

import os
import shutil
import threading

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <limits>
#include <vector>

// q [B, Hq, D], caches [S, Hkv, D] (float32, contiguous), slots [B, Lmax] int64, lens [B] int64 -> [B, Hq, D]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor slots, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode: float32 tensors only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              slots.is_contiguous() && lens.is_contiguous(), "paged_decode: contiguous tensors only");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1), Lmax = slots.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(2) == D, "paged_decode: head shapes do not match");
  const int64_t G = Hq / Hkv;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  #pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t L = lp[b];
      const int64_t* row_slots = sp + b * Lmax;
      const float* qh = qp + (b * Hq + h * G) * D;
      std::vector<float> p(G * L);
      std::vector<float> m(G, std::numeric_limits<float>::lowest());  // -ffast-math: no infinities
      for (int64_t t = 0; t < L; ++t) {
        const float* kr = kp + (row_slots[t] * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qh + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qr[d] * kr[d];
          s *= sc;
          p[g * L + t] = s;
          if (s > m[g]) m[g] = s;
        }
      }
      std::vector<float> total(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* pg = p.data() + g * L;
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { pg[t] = std::exp(pg[t] - m[g]); sum += pg[t]; }
        total[g] = sum;
      }
      std::vector<float> acc(G * D, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* vr = vp + (row_slots[t] * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * Hq + h * G + g) * D;
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  }
  return out;
}
"""

_lock = threading.Lock()
_module = None
_error: str | None = None


def load(log=None):
    """The compiled module (built once per machine, cached by torch), or None when it cannot be built here."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils.cpp_extension import load_inline

                _ninja_on_path()
                _module = load_inline("deltaserve_paged_cpu", cpp_sources=[_SOURCE], functions=["paged_decode"],
                                      extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                                      extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, no ninja, no headers: the portable path serves instead
                _error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if log:
                    log(f"paged CPU decode attention unavailable ({_error}); using the portable gather + SDPA path")
        return _module


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits in the venv's bin, which PATH may lack."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def ready():
    """The module if `load()` built it already, else None: a forward step never waits for a compiler."""
    return _module


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_slots: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] over each sequence's cached rows context_slots[b, :context_lens[b]]; [B, Hq, D] float32."""
    return _module.paged_decode(q.contiguous(), k_cache, v_cache, context_slots.contiguous(),
                                context_lens.contiguous(), scale)
