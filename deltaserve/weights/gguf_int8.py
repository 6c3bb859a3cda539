"""GGUF's Q8_0, Q6_K and Q5_K blocks read as Int8Rows (an 8-bit code, a float32 scale and offset per group), never
dequantized: what a Q4_K_M or IQ4_XS file keeps beside its 4-bit tensors (the output matrix or tied embedding, about
half of ffn_down / attn_v) stays about as small as stored.

Block layouts (ggml-common.h), each code exactly an int8 and each product the one gguf-py's dequantize computes in
float32, so Int8Rows.dequantize equals it bit for bit:
- Q8_0, 32 weights: a float16 d, 32 signed codes; w = d * q.
- Q6_K, 256 weights in 16 groups of 16: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit sub-block
  scales, a float16 d; w = (d * sc) * (q - 32) with q - 32 in -32 .. 31: the code, a scale per 16, no offset.
- Q5_K, 256 weights in 8 groups of 32: float16 d and dmin, Q4_K's 12 bytes of 6-bit (sc, m), 32 bytes of fifth bits,
  128 of low nibbles; w = (d * sc) * q - dmin * m with q in 0 .. 31: the code, a scale and an offset per 32.
"""

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from deltaserve.kernels import gguf_blocks_cpu
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.weights.gguf_int4 import _k_scale_min

TYPES = (Q.Q8_0, Q.Q6_K, Q.Q5_K)
GROUPS = {Q.Q8_0: 32, Q.Q6_K: 16, Q.Q5_K: 32}  # weights per scale
BLOCK_BYTES = {Q.Q8_0: 34, Q.Q6_K: 210, Q.Q5_K: 176}
SUPER = 256  # weights per K-quant block


def held_bytes(params: int, kind: Q) -> int:
    """Bytes an Int8Rows of `params` weights of this type holds in a layer: a byte a weight, a float32 scale per
    group and, Q5_K only (the symmetric types hold none: models/layers.Int8Linear), a float32 offset per group."""
    groups = params // GROUPS[kind]
    return params + groups * (8 if kind == Q.Q5_K else 4)


def int8_rows(data, kind: Q, shape: tuple[int, int]) -> Int8Rows:
    """The Int8Rows of a Q8_0 / Q6_K / Q5_K matrix of HF-order `shape` [N, K], straight from its blocks (Q6_K and
    Q5_K by the C++ kernel where built, kernels/gguf_blocks_cpu.py; numpy otherwise, the same values)."""
    n, k = shape
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, BLOCK_BYTES[kind])
    if kind == Q.Q8_0:
        scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        codes, offsets = blocks[:, 2:].copy().view(np.int8), None
    elif kind == Q.Q6_K:
        codes, scales = gguf_blocks_cpu.unpack("q6_k_codes", blocks) or _q6_k(blocks)
        offsets = None
    elif kind == Q.Q5_K:
        codes, scales, offsets = gguf_blocks_cpu.unpack("q5_k_codes", blocks) or _q5_k(blocks)
    else:
        raise ValueError(f"GGUF type {kind.name} is not read as 8-bit codes; 8-bit: {', '.join(t.name for t in TYPES)}")
    groups = k // GROUPS[kind]
    scales = _tensor(scales).reshape(n, groups)
    # a symmetric type's zero offsets: one value expanded, not a tensor of the scales' size (127 MB for a 248K table)
    offsets = torch.zeros((), dtype=scales.dtype).expand(n, groups) if offsets is None else \
        _tensor(offsets).reshape(n, groups)
    return Int8Rows(_tensor(codes).reshape(n, k), scales, offsets, GROUPS[kind])


def _tensor(values) -> torch.Tensor:
    """A kernel's tensor as it is, a numpy array's values as a tensor (shared, not copied)."""
    return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(values))


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes q - 32 int8 [blocks, 256], scales d * sc float32 [blocks, 16]) of Q6_K blocks. Each half block's 128
    codes are 4 runs of 32: the low nibbles of its first and second 32 low bytes, then their high nibbles, each with
    bits 2r, 2r + 1 of its 32 high bytes above (ggml's dequantize_row_q6_K); written run by run into one array (the
    broadcast form gguf-py uses took 5x as long on a 248K-row embedding)."""
    count = blocks.shape[0]
    ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:210]
    scales = d.copy().view(np.float16).astype(np.float32) * sc.view(np.int8).astype(np.float32)
    codes = np.empty((count, SUPER), dtype=np.uint8)
    for half in range(2):
        low, high = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32]
        for run in range(4):
            nibbles = low[:, 32 * (run % 2):32 * (run % 2) + 32]
            nibbles = nibbles & np.uint8(0x0F) if run < 2 else nibbles >> np.uint8(4)
            np.bitwise_or(nibbles, ((high >> np.uint8(2 * run)) & np.uint8(3)) << np.uint8(4),
                          out=codes[:, 128 * half + 32 * run:128 * half + 32 * run + 32])
    codes = codes.view(np.int8)
    codes -= np.int8(32)
    return codes, scales


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes q int8 [blocks, 256], scales d * sc and offsets -(dmin * m) float32 [blocks, 8]) of Q5_K blocks."""
    count = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _k_scale_min(blocks[:, 4:16])
    qh, qs = blocks[:, 16:48], blocks[:, 48:176]
    low = (qs.reshape(count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (qh.reshape(count, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    codes = (low.reshape(count, SUPER) | (high.reshape(count, SUPER) << np.uint8(4))).view(np.int8)
    return codes, d * sc, -(dmin * m)
