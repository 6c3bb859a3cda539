"""Group-wise 4-bit weights held packed, and their matmul in float32 arithmetic.

Every 4-bit format (GGUF Q4_0/Q4_1/IQ4, GPTQ, AWQ, compressed-tensors) arrives as `Int4Codes` and is repacked at
load into one layout, `PackedInt4`, that one C++ kernel (kernels/int4_cpu.py) multiplies:

- codes nibble-packed [N, K / 2] uint8, row-major. Within each run of 32 columns, byte i holds column i in its low
  nibble and column i + 16 in its high one (GGUF's own Q4 block order): 16 bytes widen into two 16-float vectors
  with one load, a mask and a shift, no shuffles.
- scales [N, K / group] in the checkpoint's own dtype where that holds them (float16 GGUF Q4_0 / Q4_1 / IQ4_NL,
  bfloat16 compressed-tensors), float32 otherwise (Q4_K's and IQ4_XS's products of two scales, which float16 cannot
  hold); offsets [N, K / group] in the same dtype, or none for a symmetric weight (offset -8 * scale, or 0 with a
  level table). The field's W4A16 (bfloat16 scales, symmetric) is held at its checkpoint's 2 bytes a group; an
  asymmetric or Q4_K weight at 8 (0.25 extra bytes per weight at group 32, 0.06 at group 128).
- the 16 float32 levels (`lut`) of a non-uniform format (IQ4_NL / IQ4_XS), or none (levels 0..15).
- the column permutation of activation-ordered groups: the input's columns are permuted once per call.

The weight is w = scale * lut[q] + offset, formed in float32 and multiplied in float32, so a layer's result equals the
dequantized float32 weight's product to float32 rounding (only the summation order differs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32  # columns per packed run (16 bytes)


@dataclass
class Int4Codes:
    """A 4-bit weight as read from any checkpoint format: the one form every 4-bit loader produces.

    codes [N, K] uint8 in 0..15; scales and offsets [N, K / group_size] float; the weight is
    w = scale * lut[q] + offset per group, where `lut` is 16 float32 values (None: lut[q] = q, the affine formats:
    GGUF Q4_0/Q4_1/Q4_K, GPTQ, AWQ, compressed-tensors; a table: GGUF IQ4_NL/IQ4_XS's non-uniform levels).
    offsets None: a symmetric weight, offset = -8 * scale without a table (w = scale * (q - 8)), 0 with one.
    `perm` (activation-ordered groups, GPTQ's g_idx): None, or a permutation [K] such that stored column j is the
    checkpoint's input column perm[j] (columns sorted by group); a layer then multiplies x[..., perm].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    lut: torch.Tensor | None = None
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def offset_values(self) -> torch.Tensor:
        """The offsets as float32, stored or implied (symmetric)."""
        return _offsets(self.scales, self.offsets, self.lut)

    def levels(self) -> torch.Tensor:
        """The 16 float32 values a code stands for before its group's scale and offset."""
        return torch.arange(16, dtype=torch.float32) if self.lut is None else self.lut.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in the checkpoint's column order: scale * lut[q] + offset, per group."""
        n, k = self.codes.shape
        q = self.levels()[self.codes.long()] if self.lut is not None else self.codes.to(torch.float32)
        groups = q.view(n, k // self.group_size, self.group_size)
        w = (groups * self.scales.float()[..., None] + self.offset_values()[..., None]).view(n, k)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def rows(self, order: torch.Tensor) -> Int4Codes:
        """The same weight with its output rows reordered (llama.cpp's q/k row permutation, undone)."""
        return Int4Codes(self.codes[order], self.scales[order], None if self.offsets is None else self.offsets[order],
                         self.group_size, self.lut, self.perm)


def packable(shape: tuple[int, ...], group_size: int) -> bool:
    """Whether the packed layout takes a weight of this [N, K] shape and group size (group = K: per channel)."""
    return (len(shape) == 2 and shape[1] % BLOCK == 0 and group_size % BLOCK == 0 and shape[1] % group_size == 0
            and (group_size in (32, 64, 128, 256) or group_size == shape[1]))


def held_bytes(params: int, group_size: int, lut: bool = False, scale_bytes: int = 4, offsets: bool = True) -> int:
    """Bytes `pack` holds for `params` weights: half a byte each, a scale (`scale_bytes`: 4 float32, 2 a 16-bit
    checkpoint scale) and, unless symmetric, an offset of the same size per group, and the 16 float32 levels when
    the format has a table."""
    return params // 2 + params // group_size * scale_bytes * (2 if offsets else 1) + (16 * 4 if lut else 0)


def held_scale_dtype(scales: torch.dtype, offsets: torch.dtype | None) -> torch.dtype:
    """The dtype `pack` holds scales (and offsets) in: a 16-bit checkpoint dtype both share, else float32."""
    if scales in (torch.bfloat16, torch.float16) and offsets in (None, scales):
        return scales
    return torch.float32


def _offsets(scales: torch.Tensor, offsets: torch.Tensor | None, lut: torch.Tensor | None) -> torch.Tensor:
    if offsets is not None:
        return offsets.float()
    return torch.zeros_like(scales, dtype=torch.float32) if lut is not None else -8 * scales.float()


@dataclass
class PackedInt4:
    """A 4-bit weight in the kernel's layout (module docstring): what a layer holds."""

    packed: torch.Tensor  # [N, K / 2] uint8
    scales: torch.Tensor  # [N, K / group] float32, bfloat16 or float16
    offsets: torch.Tensor | None  # [N, K / group] the scales' dtype; None: symmetric (Int4Codes)
    group_size: int
    lut: torch.Tensor | None = None  # [16] float32
    perm: torch.Tensor | None = None  # [K] int64

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def nbytes(self) -> int:
        """The bytes held (the ledger's number; the permutation is an index, not weights, and not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.offsets, self.lut)
                   if t is not None)

    def rows(self, order: torch.Tensor) -> PackedInt4:
        """The same weight with its output rows reordered (Int4Codes.rows, on the packed bytes; index_select copies a
        row at a time, ~2x indexing's speed on a 27B's GDN projections)."""
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, order)

        return PackedInt4(take(self.packed), take(self.scales), take(self.offsets), self.group_size, self.lut, self.perm)

    def codes(self) -> torch.Tensor:
        """The codes [N, K] uint8 in stored column order (the inverse of `pack`'s nibble packing)."""
        n, half = self.packed.shape
        runs = self.packed.view(n, half // (BLOCK // 2), BLOCK // 2)
        return torch.cat([runs & 0x0F, runs >> 4], dim=-1).view(n, half * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in the checkpoint's column order (Int4Codes.dequantize of what was packed)."""
        w = self.widened()
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def gather(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of the float weight [len(ids), K] (an embedding lookup): only those rows are widened."""
        ids = ids.reshape(-1).to(device=self.packed.device, dtype=torch.long)
        part = PackedInt4(self.packed.index_select(0, ids), self.scales.index_select(0, ids),
                          None if self.offsets is None else self.offsets.index_select(0, ids), self.group_size,
                          self.lut, self.perm)
        return part.dequantize(dtype)

    def widened(self) -> torch.Tensor:
        """The float32 weight [N, K] in stored column order (inputs permuted by `perm` multiply it)."""
        n, k = self.shape
        q = self.codes()
        levels = q.to(torch.float32) if self.lut is None else self.lut[q.long()]
        groups = levels.view(n, k // self.group_size, self.group_size)
        offsets = _offsets(self.scales, self.offsets, self.lut)
        return (groups * self.scales.float()[..., None] + offsets[..., None]).view(n, k)


@dataclass
class PackedTable(PackedInt4):
    """A 4-bit embedding table the loader holds packed (an untied GGUF token_embd): looked up by rows
    (models/layers.Int4Embedding), never widened whole."""


def pack(w: Int4Codes) -> PackedInt4:
    """Repack a checkpoint's codes into the kernel's layout (module docstring)."""
    if not packable(w.shape, w.group_size):
        raise ValueError(f"cannot pack a {w.shape} 4-bit weight in groups of {w.group_size}: the input width must be "
                         f"a multiple of {BLOCK} and the group 32, 64, 128, 256 or the whole row")
    n, k = w.shape
    runs = w.codes.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    packed = (runs[..., :BLOCK // 2] | (runs[..., BLOCK // 2:] << 4)).reshape(n, k // 2).contiguous()
    lut = None if w.lut is None else w.lut.to(torch.float32).contiguous()
    perm = None if w.perm is None else w.perm.to(torch.int64).contiguous()
    dtype = held_scale_dtype(w.scales.dtype, None if w.offsets is None else w.offsets.dtype)
    offsets = None if w.offsets is None else w.offsets.to(dtype).contiguous()
    return PackedInt4(packed, w.scales.to(dtype).contiguous(), offsets, w.group_size, lut, perm)


# Rows of the weight widened to float32 at a time for a prefill GEMM: ~4 MiB, so a tile is written and read back
# from cache while MKL multiplies it at the float32 GEMM rate.
WIDEN_FLOATS = 1 << 20


_DECODE_LEAD = 0  # rows at the head of every input that are decode rows (decode_rows_first); 0 outside a step


@contextlib.contextmanager
def decode_rows_first(count: int):
    """Inside the block the first `count` rows of each int4_linear input are decode rows (the runner's decode-first
    order, models/batch.py): with `bf16_gemm` they stay in float32, so a request's tokens do not depend on whether a
    prefill chunk shared its step, and a prompt's rows are rounded the same way whatever decodes ran beside it."""
    global _DECODE_LEAD
    kept, _DECODE_LEAD = _DECODE_LEAD, count
    try:
        yield
    finally:
        _DECODE_LEAD = kept


def int4_linear(x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None = None,
                bf16_gemm: bool = False) -> torch.Tensor:
    """x [..., K] @ W.T in float32 arithmetic, W packed; the result in x's dtype.

    Up to int4_cpu.MAX_ROWS rows (decode) the C++ kernel reads the packed bytes; more rows (prefill) take its GEMM,
    which widens each panel of W as it multiplies it. Without a compiler, and on other devices (CUDA), a tile of W
    at a time is widened (by torch ops where the kernel is not built) and multiplied by linear_cpu.gemm.
    `bf16_gemm` (--prefill-dtype bfloat16): the GEMM's rows (not the decode rows at their head: decode_rows_first)
    and weights rounded to bfloat16 and multiplied by AVX512-BF16 dot products summed in float32, where the kernel
    has them."""
    from deltaserve.kernels import int4_cpu

    n, k = w.shape
    rows = input_rows(x, k, w.perm, torch.float32)
    lead = min(_DECODE_LEAD, rows.shape[0])
    if bf16_gemm and int4_cpu.has_bf16() and rows.device.type == "cpu" and rows.shape[0] - lead > int4_cpu.MAX_ROWS:
        y = _product(rows[lead:], w, bf16=True)
        if lead:
            y = torch.cat([_product(rows[:lead], w), y])
    else:
        y = _product(rows, w)
    if bias is not None:
        y += bias
    return y.to(x.dtype).view(*x.shape[:-1], n)


def input_rows(x: torch.Tensor, k: int, perm: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] as contiguous rows [M, K] in `dtype`, its columns in the weight's stored order (`perm`)."""
    rows = x.reshape(-1, k).to(dtype)
    return (rows if perm is None else rows[:, perm]).contiguous()


def _product(rows: torch.Tensor, w: PackedInt4, bf16: bool = False) -> torch.Tensor:
    """rows [M, K] float32 contiguous @ W.T (int4_linear's paths; bf16: the bfloat16 GEMM, which the caller checked)."""
    from deltaserve.kernels import int4_cpu, linear_cpu

    n, k = w.shape
    if rows.shape[0] == 0:  # e.g. the head of a prefill chunk that ends no prompt: nothing to widen W for
        return rows.new_empty((0, n))
    if bf16:
        return int4_cpu.gemm_bf16(rows, w.packed, w.scales, _stored(w.offsets), w.lut, w.group_size)
    if int4_cpu.serves(rows):
        return int4_cpu.decode(rows, w.packed, w.scales, _stored(w.offsets), w.lut, w.group_size)
    if int4_cpu.built() and rows.device.type == "cpu" and k % int4_cpu.GEMM_K_MULTIPLE == 0:
        return int4_cpu.gemm(rows, w.packed, w.scales, _stored(w.offsets), w.lut, w.group_size)
    step = max(16, WIDEN_FLOATS // k)
    tiles = [linear_cpu.gemm(rows, _widened_rows(w, start, min(start + step, n))) for start in range(0, n, step)]
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)  # one tile (all of SmolLM2's): no copy


def _widened_rows(w: PackedInt4, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of the float32 weight: by the C++ kernel on CPU where built, else by torch ops (any device)."""
    from deltaserve.kernels import int4_cpu

    if int4_cpu.built() and w.packed.device.type == "cpu":
        return int4_cpu.widen(w.packed, w.scales, _stored(w.offsets), w.lut, w.group_size, start, stop)
    part = PackedInt4(w.packed[start:stop], w.scales[start:stop],
                      None if w.offsets is None else w.offsets[start:stop], w.group_size, w.lut)
    return part.widened()


def _stored(offsets: torch.Tensor | None) -> torch.Tensor:
    """The offsets as the C++ kernel takes them: an empty tensor for a symmetric weight."""
    return torch.empty(0) if offsets is None else offsets
