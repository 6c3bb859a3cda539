"""torch's own int4 matmul (the "tinygemm" kernel: `_weight_int4pack_mm` on CUDA, `_weight_int4pack_mm_for_cpu` on
CPU) fed from the packed layout of kernels/int4.py: what a 4-bit matrix becomes on CUDA when the model computes in
bfloat16.

The kernel computes w = (q - 8) * scale + zero per group, with the activations, the scale and the zero in bfloat16
and the products summed in float32. Our layout's w = scale * q + offset is the same weight with
zero = offset + 8 * scale (exactly 0 for a symmetric weight, whose offset is -8 * scale). So the result is the
dequantized weight's product to bfloat16 rounding of the inputs, scales and zeros, not to float32 rounding as the
CPU kernel's: the precision of the bfloat16 model it serves. float32 models (and float16 ones: the CUDA kernel takes
bfloat16 only) keep kernels/int4.py's path, which widens tiles to float32.

Taken: affine weights (no level table: IQ4_NL / IQ4_XS keep the packed layout), groups of 32, 64, 128 or 256 (not per
channel), N a multiple of 16 (the CUDA kernel's tile is 8 rows, its CPU form's 16: one rule for both). Held: the
codes, half a byte a weight, and per group a bfloat16 scale and zero (4 bytes, the kernel's [K / group, N, 2]
operand), or for a symmetric weight the bfloat16 scale alone (2 bytes, as the field's W4A16 checkpoint stores it: its
zeros are all 0, and the operand is made per call, one small kernel and a transient 4 bytes a group, so torch's layout
costs the card no byte more than the packed one). `held_bytes` is the price the ledger uses (weights/held.py,
budget/headers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.config import torch_int4_layout
from deltaserve.kernels.int4 import PackedInt4, _offsets, input_rows

GROUPS = (32, 64, 128, 256)


def serves(device: torch.device | str, dtype: torch.dtype | str) -> bool:
    """Whether a model's 4-bit matrices take torch's kernel: on CUDA, computing in bfloat16 (config.py's rule,
    which the ledger asks too)."""
    return torch_int4_layout(torch.device(device).type, dtype)


def takes(shape: tuple[int, int], group_size: int, lut: bool = False) -> bool:
    """Whether torch's int4 kernel takes an [N, K] 4-bit weight in groups of `group_size` (module docstring)."""
    n, k = shape
    return not lut and group_size in GROUPS and k % group_size == 0 and k % 32 == 0 and n % 16 == 0 and n > 0


def held_bytes(n: int, k: int, group_size: int, symmetric: bool) -> int:
    """Bytes an [N, K] weight is held in for torch's kernel: the codes and per group a bfloat16 scale and zero, or
    the scale alone for a symmetric weight."""
    return n * k // 2 + n * (k // group_size) * 2 * (1 if symmetric else 2)


def inner_k_tiles(k: int) -> int:
    """The kernel's K tiles per inner step (2, 4 or 8 of 16 columns): the widest that divides K."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


@dataclass
class TorchInt4:
    """A 4-bit weight in torch's int4 layout: what a layer holds on CUDA in bfloat16."""

    weight: torch.Tensor  # CUDA: int32 [N / 8, K / (16 t), 32, t / 2]; CPU: uint8 [N, K / 2] (torch's own forms)
    scales_and_zeros: torch.Tensor  # [K / group, N, 2] bfloat16, or [K / group, N] for a symmetric weight
    group_size: int
    shape: tuple[int, int]
    perm: torch.Tensor | None = None  # [K] int64: inputs permuted as for PackedInt4

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_and_zeros))

    def operand(self) -> torch.Tensor:
        """The kernel's [K / group, N, 2] scale-and-zero operand (a symmetric weight's zeros made here: all 0)."""
        sz = self.scales_and_zeros
        return sz if sz.dim() == 3 else F.pad(sz[..., None], (0, 1))


def convert(w: PackedInt4, device: torch.device | str) -> TorchInt4:
    """The packed weight in torch's int4 layout on `device` (the layer's bytes move there once, at load)."""
    n, k = w.shape
    if not takes((n, k), w.group_size, w.lut is not None):
        raise ValueError(f"torch's int4 kernel does not take a {(n, k)} weight in groups of {w.group_size}"
                         f"{' with a level table' if w.lut is not None else ''}")
    scales = w.scales.float()
    if w.offsets is None:  # symmetric: zero = -8 * scale + 8 * scale = 0
        sz = scales.t().contiguous().to(torch.bfloat16).to(device)
    else:
        zeros = _offsets(w.scales, w.offsets, None) + 8 * scales
        sz = torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16).to(device)
    codes = w.codes().to(device)  # [N, K] in stored column order
    tiles = inner_k_tiles(k)
    if torch.device(device).type == "cpu":
        weight = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), tiles)
    else:  # two codes a byte, the even column in the high nibble
        weight = torch._convert_weight_to_int4pack((codes[:, ::2] << 4) | codes[:, 1::2], tiles)
    perm = None if w.perm is None else w.perm.to(device)
    return TorchInt4(weight, sz, w.group_size, (n, k), perm)


def int4_linear(x: torch.Tensor, w: TorchInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T by torch's int4 kernel, in bfloat16 (module docstring); the result in x's dtype."""
    n, k = w.shape
    rows = input_rows(x, k, w.perm, torch.bfloat16)
    if rows.shape[0] == 0:
        y = rows.new_empty((0, n))
    elif rows.device.type == "cpu":
        y = torch._weight_int4pack_mm_for_cpu(rows, w.weight, w.group_size, w.operand())
    else:
        y = torch._weight_int4pack_mm(rows, w.weight, w.group_size, w.operand())
    if bias is not None:
        y = y.float() + bias  # the bias added in float32 (the layer holds it so), rounded once below
    return y.to(x.dtype).view(*x.shape[:-1], n)
