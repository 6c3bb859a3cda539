"""Group-wise 8-bit weights held as int8: an INT8 embedding table stays 8-bit, only looked-up rows are widened.

w = scale * q + offset per group of `group_size` inputs, q a signed int8 (compressed-tensors' INT8 schemes,
symmetric: offset 0; asymmetric: offset = -zero_point * scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Rows:
    """An 8-bit weight [N, K]: codes int8, scales and offsets [N, K / group_size] float32; `perm`: stored column j
    multiplies input j's perm[j] (a GGUF hybrid's reordered value heads), None in order."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def gather(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float rows `ids` [...] -> [..., K]: only these rows are widened."""
        flat = ids.reshape(-1)
        rows = self._widen(self.codes[flat], self.scales[flat], self.offsets[flat])
        return rows.view(*ids.shape, self.codes.shape[1]).to(dtype)

    def rows(self, index: torch.Tensor) -> "Int8Rows":
        """Output rows `index` (a reorder or a subset), the input permutation kept."""
        return Int8Rows(self.codes[index], self.scales[index], self.offsets[index], self.group_size, self.perm)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole float weight [N, K], its columns in input order."""
        w = self._widen(self.codes, self.scales, self.offsets)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def nbytes(self) -> int:
        """Bytes held: the int8 codes plus the float32 scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def _widen(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        groups = codes.to(torch.float32).view(n, k // self.group_size, self.group_size)
        return (groups * scales[..., None] + offsets[..., None]).view(n, k)
