"""Decode attention that reads the paged KV cache in place, on CPU: a small C++ kernel the engine builds at start.

The portable path gathers every decode sequence's K and V rows into fresh tensors before SDPA reads them again,
so each cached byte crosses memory three times per step; at 64 decodes of ~800 tokens that is most of a step.
This kernel walks each sequence's slots and reads each K and V row once, for all the query heads that share it
(grouped-query attention), in tiles of 32 rows with the softmax kept online in float32; head sizes 64, 128 and
256 run on 16-float vectors (AVX-512 here: 64 decodes of 700 tokens, 10 -> 4.8 ms per layer), others on a plain
loop. The cache may be float32 or 16-bit (float16, the CPU default, or bfloat16): rows are widened to float32 as
a tile is staged and all arithmetic stays float32; half the bytes to stream. Rows two tiles ahead are prefetched
(64 decodes of 800 tokens over cold pages: 7.3 -> 4.8-5.5 ms float32, 4.0 -> 2.6 ms float16 per layer). A context
longer than 128 rows is attended in splits, one task each, merged after (flash-decoding: a batch-1 step has only as
many tasks as KV heads otherwise); the splits follow each row's own length, so a row's result does not depend on
the batch it is in. It needs
GCC or Clang (vector extensions) and is built by kernels/cpp_build.py; where that fails, `load()` returns None and
the caller keeps the portable path.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.cpp_build import CSRC, CompiledKernels

# The cache dtypes paged_decode reads (its TORCH_CHECK says the same); queries are always float32.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

KERNELS = CompiledKernels("deltaserve_paged_cpu", CSRC / "paged.cpp", ["paged_decode"],
                           "paged CPU decode attention",
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
