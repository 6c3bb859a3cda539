"""GGUF's 4-bit blocks read as Int4Codes (codes, per-32 scales and offsets, optional level table), or straight
into the packed layout (packed_int4, what the loader holds), never dequantized.

Block layouts (ggml-common.h): Q4_0 / Q4_1 and IQ4_NL hold 32 weights, byte j of the 16 code bytes holding code j
in its low nibble and code j + 16 in its high one. Q4_K and IQ4_XS hold 256 weights in 8 sub-blocks of 32: IQ4_XS
as 8 such 16-byte runs; Q4_K's code bytes come in 4 runs of 32, byte j of run r holding sub-block 2r's code j (low
nibble) and sub-block 2r+1's (high). Per sub-block: Q4_K w = d * sc * q - dmin * m (6-bit sc, m packed in 12 bytes); IQ4_XS w = d * (ls - 32) *
lut[q] (6-bit ls: 4 low bits in scales_l, 2 high in scales_h); IQ4_NL w = d * lut[q]. Every product here is the one
gguf-py's dequantize computes in float32, so Int4Codes.dequantize equals it bit for bit.
"""

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from deltaserve.kernels import gguf_blocks_cpu
from deltaserve.kernels.int4 import Int4Codes, PackedInt4

GROUP = 32  # weights per scale in every 4-bit GGUF type
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
TYPES = (Q.Q4_0, Q.Q4_1, Q.IQ4_NL, Q.Q4_K, Q.IQ4_XS)
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.IQ4_NL: 18, Q.Q4_K: 144, Q.IQ4_XS: 136}
CODES_AT = {Q.Q4_0: 2, Q.Q4_1: 4, Q.IQ4_NL: 2, Q.IQ4_XS: 8}  # where a block's code bytes start
NATIVE = {Q.Q4_K: "q4_k_packed", Q.IQ4_XS: "iq4_xs_packed"}  # kernels/gguf_blocks_cpu.py's function per type


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block [blocks, 1], kept float16."""
    return blocks[:, start:start + 2].copy().view(np.float16)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] code bytes -> [blocks, 32] codes: low nibbles then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _super_block_codes(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] code bytes of a 256-weight super-block -> [blocks, 256] codes in weight order."""
    runs = qs.reshape(-1, 4, 32)
    return np.stack([runs & 0x0F, runs >> 4], axis=2).reshape(-1, 256)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes -> (sc, m) [blocks, 8], 6 bits each (ggml's get_scale_min_k4)."""
    d, m, mh = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (mh & 0x0F) | ((d >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 0x3F, (mh >> 4) | ((m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _blocks(data: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, width)


def _scales_offsets(blocks: np.ndarray, kind: Q) -> tuple[np.ndarray, np.ndarray | None]:
    """(scales, offsets or None) [blocks, groups] of a 4-bit type's blocks (int4_codes's forms)."""
    if kind in (Q.Q4_0, Q.Q4_1, Q.IQ4_NL):
        return _half(blocks, 0), _half(blocks, 2) if kind == Q.Q4_1 else None
    if kind == Q.Q4_K:
        sc, mn = _k_scale_min(blocks[:, 4:16])
        return _f16(blocks, 0) * sc, -(_f16(blocks, 2) * mn)
    if kind == Q.IQ4_XS:
        high = blocks[:, 2:4].copy().view(np.uint16).astype(np.int32)
        low = blocks[:, 4:8]
        low = np.stack([low & 0x0F, low >> 4], axis=2).reshape(-1, 8).astype(np.int32)
        ls = low | (((high >> (2 * np.arange(8))) & 3) << 4)
        return _f16(blocks, 0) * (ls - 32).astype(np.float32), None
    raise ValueError(f"GGUF type {kind.name} is not a 4-bit type; 4-bit: {', '.join(t.name for t in TYPES)}")


def int4_codes(data: np.ndarray, kind: Q, shape: tuple[int, int]) -> Int4Codes:
    """The Int4Codes of a 4-bit GGUF matrix of HF-order `shape`, straight from its blocks: float16 scales (and
    offsets) where the block stores them so (Q4_0, Q4_1, IQ4_NL), float32 products of two scales (Q4_K, IQ4_XS);
    no offsets where the format is symmetric (Q4_0: w = d * (q - 8); IQ4: centred levels)."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind.name} is not a 4-bit type; 4-bit: {', '.join(t.name for t in TYPES)}")
    blocks = _blocks(data, BLOCK_BYTES[kind])
    scales, offsets = _scales_offsets(blocks, kind)
    if kind == Q.Q4_K:
        codes = _super_block_codes(blocks[:, 16:])
    elif kind == Q.IQ4_XS:
        codes = _split_nibbles(blocks[:, 8:].reshape(-1, 16)).reshape(-1, 256)
    else:
        codes = _split_nibbles(blocks[:, CODES_AT[kind]:])
    lut = IQ4_LEVELS if kind in (Q.IQ4_NL, Q.IQ4_XS) else None
    rows, groups = shape[0], shape[1] // GROUP

    def matrix(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values).reshape(rows, groups))

    return Int4Codes(torch.from_numpy(np.ascontiguousarray(codes).reshape(shape)), matrix(scales),
                     None if offsets is None else matrix(offsets), GROUP,
                     None if lut is None else torch.tensor(lut, dtype=torch.float32))


def packed_int4(data: np.ndarray, kind: Q, shape: tuple[int, int]) -> PackedInt4:
    """`pack(int4_codes(data, kind, shape))`, made straight from the blocks without a byte a code between: their
    code bytes are the packed layout already (Q4_0, Q4_1, IQ4_NL, IQ4_XS: copied) or one nibble swap from it (Q4_K:
    byte i of a packed group takes its low nibble from byte i of the run and its high one from byte i + 16). Q4_K
    and IQ4_XS by the C++ kernel where built (kernels/gguf_blocks_cpu.py), numpy otherwise; both give the same bytes."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind.name} is not a 4-bit type; 4-bit: {', '.join(t.name for t in TYPES)}")
    native = gguf_blocks_cpu.unpack(NATIVE[kind], data) if kind in NATIVE else None
    if native is not None:
        packed, scales, offsets = native if len(native) == 3 else (*native, None)
    else:
        blocks = _blocks(data, BLOCK_BYTES[kind])
        scales, offsets = (torch.from_numpy(np.ascontiguousarray(v)) if v is not None else None
                           for v in _scales_offsets(blocks, kind))
        packed = torch.from_numpy(_q4_k_packed(blocks[:, 16:]) if kind == Q.Q4_K else blocks[:, CODES_AT[kind]:].copy())
    rows, groups = shape[0], shape[1] // GROUP
    lut = torch.tensor(IQ4_LEVELS, dtype=torch.float32) if kind in (Q.IQ4_NL, Q.IQ4_XS) else None
    return PackedInt4(packed.reshape(rows, shape[1] // 2), scales.reshape(rows, groups),
                      None if offsets is None else offsets.reshape(rows, groups), GROUP, lut)


def _q4_k_packed(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] Q4_K code bytes -> [blocks, 128] packed bytes (packed_int4), written in place."""
    runs = qs.reshape(-1, 4, 2, 16)  # run r, its bytes 0-15 and 16-31
    first, second = runs[:, :, 0], runs[:, :, 1]
    out = np.empty_like(runs)
    np.bitwise_or(first & np.uint8(0x0F), second << np.uint8(4), out=out[:, :, 0])  # sub-block 2r
    np.bitwise_or(first >> np.uint8(4), second & np.uint8(0xF0), out=out[:, :, 1])  # sub-block 2r + 1
    return out.reshape(-1, 128)


def held_scales(kind: Q) -> tuple[int, bool]:
    """(bytes a scale, whether offsets are stored) of a packed matrix of this type (int4_codes's forms)."""
    return (2 if kind in (Q.Q4_0, Q.Q4_1, Q.IQ4_NL) else 4), kind in (Q.Q4_1, Q.Q4_K)
