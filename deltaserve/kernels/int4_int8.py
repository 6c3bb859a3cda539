"""Packed 4-bit and int8 weights times int8 activations on CPU (`--activation-dtype int8`): integer dot products.

The C++ is kernels/csrc/int4_int8dot.cpp (its header says the arithmetic and the layout), its tiles in
int4_int8_tile.h, which decode.cpp's fused blocks compile too. Each input row is
quantized per block of 32 columns to int8 with one float32 scale (llama.cpp's Q8_0 / Q8_1 for Q4_0 / Q4_1: the
offsets enter through each block's sum, as Q8_1's), and the 4-bit codes multiply it by vpdpbusd (AVX-512 VNNI, or
AVX-VNNI's 256-bit form where a CPU has it without AVX-512, as Alder Lake and Raptor Lake do) or vpmaddubsw (AVX2;
the same bits as AVX-VNNI: every block's sum is an exact integer either way). The result is the dequantized weight
times the dequantized activations; against the float32 path it differs by the activations' rounding, at most half a
quantum (d / 2) a column: |dy| <= sum_k |w_k| d_k / 2.

`repack` moves a PackedInt4's codes into 16-row panels (a permutation of the same bytes; the scales as held or in
the super form below, which the ledger's weights line counts: weights/gguf_panels.py; IQ4_NL / IQ4_XS's
16 integer levels ride along as 16 bytes, level + 128, which the kernel looks each code up in). `repack_int8` does
the same for an 8-bit weight (kernels/int8.Int8Rows: Q8_0, compressed-tensors INT8): each code q becomes q + 128, a
byte vpdpbusd takes unsigned, and the offset o - 128 s carries the shift (symmetric weights store none: the kernel
takes -128 s), so a code's byte and a scale per group are all it holds, as the Int8Rows' own codes and scales.

With `compact` (--compact-weights) GGUF's K-quants are held as compactly as their file holds them (a Q4_K_M's 1,211 MiB
file is 1,723 MiB of packed panels, 1,243 compact; the one-row product is slower so here): scales (and offsets) that are
exactly a float32 per 256 columns times an int8 per group (Q4_K / Q5_K's d x sc and dmin x m, IQ4_XS's d x (ls - 32),
Q6_K's d x sc: products of a float16 and a small integer, so exact in float32) are held as those two (`int4_int8_super`
finds them: per 256 columns, the greatest common divisor of the scales' significands; a scale that does not factor so
keeps the float form), and 8-bit codes that fit in 6 bits with such scales (Q6_K's q - 32, Q5_K's q) as 6-bit codes in
groups of 16 (a Q5_K group of 32 is two): the kernel multiplies the same scales by the same codes (a 4-bit result is the
same bits as the float form's; a 6-bit one sums c = q + 32 where the 8-bit panels sum q + 128: within the same bound,
not the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.kernels import fused_cpu
from deltaserve.kernels.cpp_build import CSRC, CompiledKernels, cpu_features
from deltaserve.kernels.int4 import BLOCK, PackedInt4
from deltaserve.kernels.int8 import Int8Rows

PANEL_ROWS = 16  # output rows interleaved in one panel
EMPTY_LEVELS = torch.empty(0, dtype=torch.uint8)  # no level table
QUANT_BLOCK = 32  # activation columns sharing one int8 scale
SUPER_COLUMNS = 256  # columns sharing one float32 super-scale (a GGUF K-quant's block)

KERNELS = CompiledKernels("deltaserve_int4_int8dot", CSRC / "int4_int8dot.cpp",
                          ["int4_int8_linear", "int4_int8_quantize", "int4_int8_isa", "int4_int8_pack6",
                           "int4_int8_super"],
                          "CPU 4-bit x int8 dot-product kernel", "the float32 packed 4-bit kernel")


def load(log=None):
    """The compiled module (built once per machine), or None when it cannot be built here."""
    return KERNELS.load(log)


def built() -> bool:
    """Whether the compiled module is loaded (never compiles)."""
    return KERNELS.module is not None


def declines(out_features: int, in_features: int, group_size: int, lut: torch.Tensor | None = None,
             offsets: bool = False, bits: int = 4) -> str | None:
    """Why the kernel cannot take a packed 4-bit or (`bits` 8, or 6 as held) int8 weight of this shape and form
    (int4_int8_linear's TORCH_CHECKs and the layout's conditions; `lut`: a 4-bit weight's level table, `offsets`:
    whether it stores offsets), or None. 6- and 8-bit codes may come in groups of 16 (GGUF Q6_K): half a block each."""
    if lut is not None:
        if offsets:
            return "a level table with offsets (no format stores both)"
        if not bool(((lut == lut.round()) & (lut >= -128) & (lut <= 127)).all()):
            return "a level table whose levels are not integers in -128 .. 127 (the int8 dot product's bytes)"
    if out_features % PANEL_ROWS:
        return f"{out_features} output rows, not a multiple of the {PANEL_ROWS}-row panel"
    half_blocks = bits in (6, 8) and group_size == QUANT_BLOCK // 2
    if in_features % QUANT_BLOCK or (group_size % QUANT_BLOCK and not half_blocks) or in_features % group_size:
        return f"input width {in_features} and group {group_size} not multiples of {QUANT_BLOCK} (or, 6-/8-bit, a " \
               f"group of {QUANT_BLOCK // 2}), the group dividing the width"
    return None


@dataclass
class PanelWeight:
    """A 4-, 6- or 8-bit weight in the kernel's panel layout: codes [N / 16, K * bits * 2] uint8, scales and offsets
    [N / 16, K / group, 16] in the packed weight's dtype, or int8 super scales [N / 16, K / 256, 64 + 16 * 256 /
    group] (module docstring; offsets None: symmetric), the input permutation as packed."""

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


def repack(w: PackedInt4, compact: bool = True) -> PanelWeight:
    """The panel layout of a packed weight (csrc/int4_int8dot.cpp's header): byte i of a 32-column run holds columns
    i and i + 16 in both layouts, so the codes' bytes are only moved; the kernel must not decline it. `compact`: the
    scales (and offsets) in the super form where they factor exactly (module docstring)."""
    n, k = w.shape
    reason = declines(n, k, w.group_size, w.lut, w.offsets is not None)
    if reason:
        raise ValueError(f"int4_int8: cannot take a {n} x {k} weight in groups of {w.group_size}: {reason}")
    codes = w.packed.view(n // PANEL_ROWS, PANEL_ROWS, k // BLOCK, 4, 4).permute(0, 2, 3, 1, 4)
    levels = None if w.lut is None else (w.lut.round().to(torch.int16) + 128).to(torch.uint8).contiguous()
    factored = _super_params(w.scales, w.offsets, w.group_size, k) if compact and w.group_size == QUANT_BLOCK else None
    scales, offsets = factored or (_panel_params(w.scales), _panel_params(w.offsets))
    return PanelWeight(codes.reshape(n // PANEL_ROWS, k * 8).contiguous(), scales, offsets, w.group_size, w.perm,
                       levels=levels)


PANELS_AT_ONCE = 256  # panels rearranged at a time by an in-place repack_int8 (16 rows each: 40 MiB at K = 5,120)


def repack_int8(w: Int8Rows, perm: torch.Tensor | None = None, in_place: bool = False,
                compact: bool = True) -> PanelWeight:
    """The panel layout of an 8-bit weight (module docstring, csrc/int4_int8dot.cpp's header): codes q + 128 with
    row r's columns 4L .. 4L + 3 of each 32-column block at bytes 4r .. 4r + 3 of its chunk L; offsets only where some
    are not zero (o - 128 s); the kernel must not decline it. `perm`: the input permutation the weight's columns
    follow (None: in order). `in_place`: the panels are made in the codes' own storage, PANELS_AT_ONCE at a time (a
    panel's 16 rows occupy the same bytes in both layouts), so a 248K-row head is never held twice; `w.codes` is
    overwritten (the caller's last use of it). `compact`: in 6 bits where the codes and scales allow (module
    docstring; never in place)."""
    n, k = w.shape
    reason = declines(n, k, w.group_size, bits=8)
    if reason:
        raise ValueError(f"int4_int8: cannot take a {n} x {k} 8-bit weight in groups of {w.group_size}: {reason}")
    six = _six_bits(w) if compact else None
    if six is not None:
        return PanelWeight(*six, QUANT_BLOCK // 2, perm, bits=6)
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


def _super_params(scales: torch.Tensor, offsets: torch.Tensor | None, group: int,
                  k: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(scales, offsets) [N, K / group] float32 in the super form (module docstring), or None where either does not
    factor exactly, is not float32 or K is not a multiple of 256."""
    if scales.dtype != torch.float32 or k % SUPER_COLUMNS or (SUPER_COLUMNS // 4) % group:
        return None
    held = []
    for t in (scales, offsets):
        factored = None if t is None else KERNELS.module.int4_int8_super(t.contiguous(), group)
        if t is not None and not factored.numel():
            return None
        held.append(factored)
    return held[0], held[1]


def _six_bits(w: Int8Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(codes, scales, offsets) of an 8-bit weight held in 6 bits, or None: its codes fit (q - 32 .. 31 without
    offsets, stored as q + 32; 0 .. 63 with, stored as q) and its scales and offsets take the super form (in groups
    of 16: a group of 32 is two). A symmetric group of 32 (Q8_0, compressed-tensors INT8) keeps its bytes: its scales
    are free floats."""
    n, k = w.shape
    symmetric = not bool(w.offsets.any())
    if w.group_size not in (QUANT_BLOCK // 2, QUANT_BLOCK) or (symmetric and w.group_size == QUANT_BLOCK):
        return None
    scales, offsets = w.scales.to(torch.float32), None if symmetric else w.offsets.to(torch.float32)
    if w.group_size == QUANT_BLOCK:
        scales, offsets = scales.repeat_interleave(2, 1), offsets.repeat_interleave(2, 1)
    compact = _super_params(scales, offsets, QUANT_BLOCK // 2, k)
    if compact is None:
        return None
    codes = KERNELS.module.int4_int8_pack6(w.codes.contiguous(), 32 if symmetric else 0)
    return (codes, *compact) if codes.numel() else None


def panel_values(w: PanelWeight, panels: torch.Tensor | None = None) -> torch.Tensor:
    """The weight values of panels `panels` (all: None), float32 [len, 16, K] in the panels' column order: s c + o per
    group where offsets are stored, else s (c - z) (z 8, 32 or 128; 0 for a code through its IQ4 level), so a
    symmetric or K-quant weight's are its format's own dequantized values. Torch ops, for gather_rows without its
    native call and for the tests."""
    codes = _panel_codes(w, panels)
    count, k = codes.shape[0], codes.shape[2]
    groups = k // w.group_size
    panels = torch.arange(w.codes.shape[0]) if panels is None else panels
    scales = _panel_group_params(w.scales, panels, groups)[..., None]
    codes = codes.view(count, PANEL_ROWS, groups, w.group_size)
    if w.offsets is None:
        zero = 0.0 if w.levels is not None else {4: 8.0, 6: 32.0, 8: 128.0}[w.bits]
        return ((codes - zero) * scales).view(count, PANEL_ROWS, k)
    offsets = _panel_group_params(w.offsets, panels, groups)[..., None]
    return (codes * scales + offsets).view(count, PANEL_ROWS, k)


def _panel_codes(w: PanelWeight, panels: torch.Tensor | None) -> torch.Tensor:
    """Panels' codes (an IQ4 code as its level) as float32 [len, 16, K], columns in the panels' order."""
    p_all, k = w.codes.shape[0], w.shape[1]
    panels = torch.arange(p_all) if panels is None else panels
    blocks, count = k // BLOCK, panels.shape[0]
    if w.bits == 8:
        codes = w.codes.view(p_all, blocks, 8, PANEL_ROWS, 4)[panels].permute(0, 3, 1, 2, 4)
    else:
        z = w.codes.view(p_all, blocks, 64 * w.bits)[panels]
        chunks = z[..., :256].view(count, blocks, 4, 64)
        halves = [chunks & 0x0F, chunks >> 4]  # the first 16 columns, the last 16
        if w.bits == 6:
            pairs = z[..., 256:].view(count, blocks, 4, 32)
            for h in range(2):
                high = torch.cat([(pairs >> (4 * h)) & 3, (pairs >> (4 * h + 2)) & 3], dim=-1)
                halves[h] = halves[h] | (high << 4)
        codes = torch.stack([c.view(count, blocks, 4, PANEL_ROWS, 4) for c in halves], dim=2)
        codes = codes.permute(0, 4, 1, 2, 3, 5)  # [count, 16, blocks, half, L, i]
    codes = codes.reshape(count, PANEL_ROWS, k)
    if w.levels is not None:
        return (w.levels.to(torch.float32) - 128.0)[codes.long()]
    return codes.to(torch.float32)


def _panel_group_params(t: torch.Tensor, panels: torch.Tensor, groups: int) -> torch.Tensor:
    """Panels' scales (or offsets) per row and group, float32 [len, 16, groups], from either held form."""
    if t.dtype != torch.int8:
        return t[panels].to(torch.float32).transpose(1, 2)
    held = t[panels]  # [len, K / 256, 64 + 16 G]
    count, supers = held.shape[:2]
    d = held[..., :64].contiguous().view(torch.float32)  # [len, supers, 16]
    per = groups // supers  # runs of 64 bytes: dword r holds row r's sub-scales of 4 groups
    sub = held[..., 64:].reshape(count, supers, per // 4, PANEL_ROWS, 4).transpose(3, 4).reshape(
        count, supers, per, PANEL_ROWS).to(torch.float32)
    return (d[:, :, None, :] * sub).reshape(count, groups, PANEL_ROWS).transpose(1, 2)


def gather_rows(w: PanelWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float rows `ids` [...] -> [..., K] of a symmetric 8- or 6-bit panel weight in input order (an embedding
    table whose codes are held once, as the tied vocabulary projection's panels): row t lies in panel t // 16 at lane
    t % 16; w = s (c - z) = s q (z 128 or 32), the table's own rows exactly (an asymmetric one's s c + o' would round
    otherwise: not served)."""
    if w.bits == 4 or w.perm is not None or w.offsets is not None:
        raise ValueError("gather_rows: a symmetric 8- or 6-bit panel weight with its columns in order")
    k = w.shape[1]
    flat = ids.reshape(-1)
    rows = fused_cpu.int8_panel_rows(w.codes, w.scales, flat, w.bits)  # one native call where built
    if rows is None:
        rows = panel_values(w, flat // PANEL_ROWS)[torch.arange(flat.shape[0]), flat % PANEL_ROWS]
    return rows.view(*ids.shape, k).to(dtype)


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
        flags = set(cpu_features().split())  # a platform name where there is no /proc/cpuinfo: "avx2" below
        build_isa = ("avx512_vnni" if {"avx512f", "avx512_vnni"} <= flags else
                     "avx_vnni" if "avx_vnni" in flags else "avx2")
    return build_isa != "avx2"
