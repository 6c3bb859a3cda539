"""Prefill attention on CPU: a chunk's query rows over their cached prefix and themselves, causally, in one call.

torch's CPU flash kernel (what F.scaled_dot_product_attention runs on CPU) reached ~95-120 GFLOP/s on two Zen 4
cores for SmolLM2's 9 query and 3 KV heads of 64 at 528 rows, where its GEMMs run at ~220: it computes and masks
most of the causal square below 768 rows, scores each query head apart, and its softmax is a third of its time.
This kernel tiles the work the way a GEMM does, for each KV head and block of positions:

- the tile's rows are its positions times the query heads that share the KV head (grouped-query attention): ~96
  query rows, so each key block, transposed once into a [D][64] tile, serves all of them;
- scores come from a 6-row x 64-key register tile (AVX-512; 6 x 16 on AVX2), the weighted values from a 6-row x
  64-channel one, each read straight from the K / V rows;
- the softmax is online over key blocks of 64, in log2 units (one multiply folded into the scores' scale), with a
  vector 2^x (Cephes' polynomial, ~1 ulp) and the rows' maxima taken in the score tile's registers;
- key blocks end where the tile's last row does (the first block takes the remainder), so only the last block of
  each tile is cut by the diagonal: ~5% of the square computed and masked at 528 rows, not ~18%.

Measured on Zen 4, 2 threads, torch's kernel and ours alternated (ms a layer, 9 / 3 heads of 64 unless said; the
float64 oracle is in tests/test_kernels_prefill_cpu.py): 528 rows 4.40 -> 2.37, 512 rows after 200 cached 7.50 ->
3.76, after 4096 cached 43.1 -> 34.1, 2048 rows 40.3 -> 32.7, 16 / 2 heads of 256 at 512 rows 20.7 -> 14.9 (at
7b34055); an earlier run of the same code read 3.3 -> 2.1 at 528 rows. float32 only, head sizes a multiple of 16;
built by kernels/cpp_build.py like the others, and where it is not built the caller keeps torch's kernel.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.cpp_build import CSRC, CompiledKernels

KERNELS = CompiledKernels("deltaserve_prefill_cpu", CSRC / "prefill.cpp", ["prefill_attention"],
                           "CPU prefill attention",
                           "torch's flash attention")

HEAD_MULTIPLE = 16  # the AVX-512 build's vector; the AVX2 build takes multiples of 8


def load(log=None):
    """The compiled module (built once per machine into our kernel cache), or None when it cannot be built here."""
    return KERNELS.load(log)


def ready():
    """The module if `load()` built it already, else None: a forward step never waits for a compiler."""
    return KERNELS.module


def declines(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why prefill_attention cannot serve heads of these shapes (its TORCH_CHECKs: on AVX2 it takes multiples of 8,
    so the multiple of 16 asked here never admits a shape either build refuses), or None."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}"
    if head_dim % HEAD_MULTIPLE:
        return f"head dim {head_dim} not a multiple of {HEAD_MULTIPLE}"
    return None


def serves(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the built kernel takes these inputs [*, H, D]: float32 on CPU, head shapes it serves (declines)."""
    return (KERNELS.module is not None and q.device.type == "cpu" and q.dtype == k.dtype == torch.float32
            and declines(q.shape[-2], k.shape[-2], q.shape[-1]) is None)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float) -> torch.Tensor:
    """q [S, Hq, D] at positions cached..cached+S-1 over k, v [cached+S, Hkv, D]: [S, Hq, D] float32, causal."""
    q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (q, k, v))
    return KERNELS.module.prefill_attention(q, k, v, cached, scale)
