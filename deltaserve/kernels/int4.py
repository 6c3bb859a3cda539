"""Group-wise 4-bit weights held packed, and their matmul.

A weight row is 4-bit codes q in 0..15, one scale and one offset per group of `group_size` inputs:
w = scale * q + offset. GGUF's Q4_1 blocks are exactly this (Q4_0 is offset = -8 * scale), so a checkpoint's
4-bit tensors are used as stored, not dequantized: a decode step then reads ~0.6 bytes per weight instead of 4,
and decode on a CPU is bound by exactly those bytes.

The CPU path is torch's int4pack kernel. It multiplies in bfloat16 with float32 accumulation (AVX-512 BF16 where
the CPU has it: as fast as a float32 GEMM for a prefill chunk, 2-4x faster for a decode step), so input rows are
rounded to bfloat16 on the way in and the float16 GGUF scales to bfloat16 when packed: errors of a GPU's bf16
compute, not of float32. Its float16 variant has no vectorized path on CPUs without AVX-512 FP16 (40x slower
here). Everything around the matmul (residual stream, norms, attention, GDN state) stays in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_COMPUTE_DTYPE = torch.bfloat16
_TORCH_CENTER = 8  # torch's int4pack form: w = (q - 8) * scale + zero


@dataclass
class Int4Codes:
    """A 4-bit weight as read from any checkpoint format: the one form every 4-bit loader produces.

    codes [N, K] uint8 in 0..15; scales and offsets [N, K / group_size] float; the weight is
    w = scale * lut[q] + offset per group, where `lut` is 16 float32 values (None: lut[q] = q, the affine formats:
    GGUF Q4_0/Q4_1/Q4_K, GPTQ, AWQ, compressed-tensors; a table: GGUF IQ4_NL/IQ4_XS's non-uniform levels).
    `perm` (activation-ordered groups, GPTQ's g_idx): None, or a permutation [K] such that stored column j is the
    checkpoint's input column perm[j] (columns sorted by group); a layer then multiplies x[..., perm].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    lut: torch.Tensor | None = None
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def levels(self) -> torch.Tensor:
        """The 16 float32 values a code stands for before its group's scale and offset."""
        return torch.arange(16, dtype=torch.float32) if self.lut is None else self.lut.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] in the checkpoint's column order: scale * lut[q] + offset, per group."""
        n, k = self.codes.shape
        q = self.levels()[self.codes.long()] if self.lut is not None else self.codes.to(torch.float32)
        groups = q.view(n, k // self.group_size, self.group_size)
        w = (groups * self.scales.float()[..., None] + self.offsets.float()[..., None]).view(n, k)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def rows(self, order: torch.Tensor) -> Int4Codes:
        """The same weight with its output rows reordered (llama.cpp's q/k row permutation, undone)."""
        return Int4Codes(self.codes[order], self.scales[order], self.offsets[order], self.group_size,
                         self.lut, self.perm)


def packable(shape: tuple[int, ...], group_size: int) -> bool:
    """Whether the CPU kernel takes a weight of this [N, K] shape and group size."""
    return (len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % group_size == 0
            and group_size in (32, 64, 128, 256))


def held_bytes(params: int, group_size: int) -> int:
    """Bytes `pack_int4` holds for `params` weights: half a byte each, plus a bf16 scale and zero per group."""
    return params // 2 + params // group_size * 2 * INT4_COMPUTE_DTYPE.itemsize


def pack_int4(w: Int4Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales_and_zeros [K / group, N, 2]) in the CPU kernel's layout."""
    if not packable(w.shape, w.group_size):
        raise ValueError(f"cannot pack a {w.shape} weight in groups of {w.group_size} as int4")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32).contiguous(), 1)
    scales = w.scales.float()
    zeros = w.offsets.float() + _TORCH_CENTER * scales
    scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(INT4_COMPUTE_DTYPE).contiguous()
    return packed, scales_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T with W packed by `pack_int4`; the result in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(INT4_COMPUTE_DTYPE)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, scales_zeros).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])
