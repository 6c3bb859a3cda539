"""Packed 4-bit and int8 weights times int8 activations on CPU (`--activation-dtype int8`): integer dot products.

The C++ is kernels/csrc/int4_int8dot.cpp (its header says the arithmetic and the layout), its tiles in
int4_int8_tile.h, which decode.cpp's fused blocks compile too. Each input row is
quantized per block of 32 columns to int8 with one float32 scale (llama.cpp's Q8_0 / Q8_1 for Q4_0 / Q4_1: the
offsets enter through each block's sum, as Q8_1's), and the 4-bit codes multiply it by vpdpbusd (AVX-512 VNNI, or
AVX-VNNI's 256-bit form where a CPU has it without AVX-512, as Alder Lake and Raptor Lake do) or vpmaddubsw (AVX2;
the same bits as AVX-VNNI: every block's sum is an exact integer either way). The result is the dequantized weight
times the dequantized activations; against the float32 path it differs by the activations' rounding, at most half a
quantum (d / 2) a column: |dy| <= sum_k |w_k| d_k / 2.

`repack` moves a PackedInt4's bytes into 16-row panels (a permutation of the same bytes: a layer that holds the
panel form holds exactly the packed layout's bytes, so the ledger's weights line does not change; IQ4_NL / IQ4_XS's
16 integer levels ride along as 16 bytes, level + 128, which the kernel looks each code up in). `repack_int8` does
the same for an 8-bit weight (kernels/int8.Int8Rows: Q8_0, compressed-tensors INT8): each code q becomes q + 128, a
byte vpdpbusd takes unsigned, and the offset o - 128 s carries the shift (symmetric weights store none: the kernel
takes -128 s), so a code's byte and a scale per group are all it holds, as the Int8Rows' own codes and scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.kernels import fused_cpu
from deltaserve.kernels.cpp_build import CSRC, CompiledKernels
from deltaserve.kernels.int4 import BLOCK, PackedInt4
from deltaserve.kernels.int8 import Int8Rows

PANEL_ROWS = 16  # output rows interleaved in one panel
EMPTY_LEVELS = torch.empty(0, dtype=torch.uint8)  # no level table
QUANT_BLOCK = 32  # activation columns sharing one int8 scale

KERNELS = CompiledKernels("deltaserve_int4_int8dot", CSRC / "int4_int8dot.cpp",
                          ["int4_int8_linear", "int4_int8_quantize", "int4_int8_isa"],
                          "CPU 4-bit x int8 dot-product kernel", "the float32 packed 4-bit kernel")


def load(log=None):
    """The compiled module (built once per machine), or None when it cannot be built here."""
    return KERNELS.load(log)


def built() -> bool:
    """Whether the compiled module is loaded (never compiles)."""
    return KERNELS.module is not None


def declines(out_features: int, in_features: int, group_size: int, lut: torch.Tensor | None = None,
             offsets: bool = False, bits: int = 4) -> str | None:
    """Why the kernel cannot take a packed 4-bit or (`bits` 8) int8 weight of this shape and form (int4_int8_linear's
    TORCH_CHECKs and the layout's conditions; `lut`: a 4-bit weight's level table, `offsets`: whether it stores
    offsets), or None. 8-bit codes may come in groups of 16 (GGUF Q6_K): half a block of 32 each."""
    if lut is not None:
        if offsets:
            return "a level table with offsets (no format stores both)"
        if not bool(((lut == lut.round()) & (lut >= -128) & (lut <= 127)).all()):
            return "a level table whose levels are not integers in -128 .. 127 (the int8 dot product's bytes)"
    if out_features % PANEL_ROWS:
        return f"{out_features} output rows, not a multiple of the {PANEL_ROWS}-row panel"
    half_blocks = bits == 8 and group_size == QUANT_BLOCK // 2
    if in_features % QUANT_BLOCK or (group_size % QUANT_BLOCK and not half_blocks) or in_features % group_size:
        return f"input width {in_features} and group {group_size} not multiples of {QUANT_BLOCK} (or, 8-bit, a group" \
               f" of {QUANT_BLOCK // 2}), the group dividing the width"
    return None


@dataclass
class PanelWeight:
    """A 4- or 8-bit weight in the kernel's panel layout: codes [N / 16, K * bits * 2] uint8, scales and offsets
    [N / 16, K / group, 16] in the packed weight's dtype (offsets None: symmetric), the input permutation as packed."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    perm: torch.Tensor | None = None
    bits: int = 4
    levels: torch.Tensor | None = None  # 4-bit codes naming levels: uint8 [16], level + 128

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] * PANEL_ROWS, self.codes.shape[1] // (2 * self.bits)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets, self.levels)
                   if t is not None)


def repack(w: PackedInt4) -> PanelWeight:
    """The panel layout of a packed weight (csrc/int4_int8dot.cpp's header): byte i of a 32-column run holds columns
    i and i + 16 in both layouts, so the codes' bytes are only moved; the kernel must not decline it."""
    n, k = w.shape
    reason = declines(n, k, w.group_size, w.lut, w.offsets is not None)
    if reason:
        raise ValueError(f"int4_int8: cannot take a {n} x {k} weight in groups of {w.group_size}: {reason}")
    codes = w.packed.view(n // PANEL_ROWS, PANEL_ROWS, k // BLOCK, 4, 4).permute(0, 2, 3, 1, 4)
    levels = None if w.lut is None else (w.lut.round().to(torch.int16) + 128).to(torch.uint8).contiguous()
    return PanelWeight(codes.reshape(n // PANEL_ROWS, k * 8).contiguous(), _panel_params(w.scales),
                       _panel_params(w.offsets), w.group_size, w.perm, levels=levels)


PANELS_AT_ONCE = 256  # panels rearranged at a time by an in-place repack_int8 (16 rows each: 40 MiB at K = 5,120)


def repack_int8(w: Int8Rows, perm: torch.Tensor | None = None, in_place: bool = False) -> PanelWeight:
    """The panel layout of an 8-bit weight (module docstring, csrc/int4_int8dot.cpp's header): codes q + 128 with
    row r's columns 4L .. 4L + 3 of each 32-column block at bytes 4r .. 4r + 3 of its chunk L; offsets only where some
    are not zero (o - 128 s); the kernel must not decline it. `perm`: the input permutation the weight's columns
    follow (None: in order). `in_place`: the panels are made in the codes' own storage, PANELS_AT_ONCE at a time (a
    panel's 16 rows occupy the same bytes in both layouts), so a 248K-row head is never held twice; `w.codes` is
    overwritten (the caller's last use of it)."""
    n, k = w.shape
    reason = declines(n, k, w.group_size, bits=8)
    if reason:
        raise ValueError(f"int4_int8: cannot take a {n} x {k} 8-bit weight in groups of {w.group_size}: {reason}")
    rows = w.codes.view(torch.uint8).view(n // PANEL_ROWS, PANEL_ROWS, k // BLOCK, 8, 4)
    if in_place and w.codes.is_contiguous():
        codes = rows.view(n // PANEL_ROWS, k * 16)
        for start in range(0, n // PANEL_ROWS, PANELS_AT_ONCE):
            part = rows[start:start + PANELS_AT_ONCE]
            codes[start:start + PANELS_AT_ONCE] = part.permute(0, 2, 3, 1, 4).reshape(part.shape[0], k * 16)
    else:
        rows = rows.permute(0, 2, 3, 1, 4)
        codes = torch.empty(rows.shape, dtype=torch.uint8).copy_(rows).view(n // PANEL_ROWS, k * 16)
    codes ^= 0x80  # q + 128 as two's complement bytes read unsigned, in place: one copy of the codes at most
    scales = w.scales.to(torch.float32)
    offsets = None if not bool(w.offsets.any()) else _panel_params(w.offsets.to(torch.float32) - 128.0 * scales)
    return PanelWeight(codes, _panel_params(scales), offsets, w.group_size, perm, bits=8)


def gather_rows(w: PanelWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float rows `ids` [...] -> [..., K] of a symmetric 8-bit panel weight in input order (an embedding table whose
    codes are held once, as the tied vocabulary projection's panels): row t's codes lie in panel t // 16 at lane
    t % 16 of each chunk, columns 4L .. 4L + 3 of each 32-column block in chunk L; w = s (c - 128) = s q, the table's
    own rows exactly (an asymmetric one's s c + (o - 128 s) would round otherwise: not served)."""
    if w.bits != 8 or w.perm is not None or w.offsets is not None:
        raise ValueError("gather_rows: a symmetric 8-bit panel weight with its columns in order")
    n, k = w.shape
    flat = ids.reshape(-1)
    rows = fused_cpu.int8_panel_rows(w.codes, w.scales, flat)  # one native call where built
    if rows is not None:
        return rows.view(*ids.shape, k).to(dtype)
    panel, lane = flat // PANEL_ROWS, flat % PANEL_ROWS
    codes = w.codes.view(n // PANEL_ROWS, k // BLOCK, 8, PANEL_ROWS, 4)[panel, :, :, lane, :]  # [r, K / 32, 8, 4]
    codes = codes.reshape(flat.shape[0], k // w.group_size, w.group_size).to(torch.float32)
    scales = w.scales[panel, :, lane].to(torch.float32)[..., None]  # [r, K / group, 1]
    return ((codes - 128.0) * scales).view(*ids.shape, k).to(dtype)


def _panel_params(t: torch.Tensor | None) -> torch.Tensor | None:
    """Per-group scales or offsets [N, K / group] as the panels hold them: [N / 16, K / group, 16]."""
    if t is None:
        return None
    n, groups = t.shape
    return t.view(n // PANEL_ROWS, PANEL_ROWS, groups).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T with x's rows quantized to int8 per block of 32 (module docstring); the result in x's dtype."""
    from deltaserve.kernels.int4 import input_rows

    n, k = w.shape
    rows = input_rows(x, k, w.perm, torch.float32)
    offsets = torch.empty(0) if w.offsets is None else w.offsets
    levels = EMPTY_LEVELS if w.levels is None else w.levels
    y = KERNELS.module.int4_int8_linear(rows, w.codes, w.scales, offsets, w.group_size, levels)
    if bias is not None:
        y += bias
    return y.to(x.dtype).view(*x.shape[:-1], n)


def quantize(rows: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [M, K] float32 as the kernel quantizes them: (q [M, K] int8, d [M, K / 32], group sums [M, K / group])."""
    return tuple(KERNELS.module.int4_int8_quantize(rows.contiguous(), group_size))


def isa() -> str:
    """The dot product the loaded build uses: avx512_vnni, avx_vnni (256-bit, no AVX-512) or avx2."""
    return KERNELS.module.int4_int8_isa()


def swaps_tied_heads(build_isa: str | None = None) -> bool:
    """Whether the swap (models/int8_activations.py) takes a vocabulary projection tied to an int8 embedding: where
    the dot product (`build_isa`: isa()) is not AVX2 alone. None: the native build's, read from the CPU's flags as
    -march=native (kernels/cpp_build.py) sees them, so the ledger knows it without compiling; False where they
    cannot be read (the ledger then prices the larger, unswapped head)."""
    if build_isa is None:
        try:
            with open("/proc/cpuinfo") as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), ()))
        build_isa = ("avx512_vnni" if {"avx512f", "avx512_vnni"} <= flags else
                     "avx_vnni" if "avx_vnni" in flags else "avx2")
    return build_isa != "avx2"
