"""What a GGUF tensor kept packed is held in once the int8-activation swap (models/int8_activations.py,
kernels/int4_int8.py: on CPU with --activation-dtype int8) has made its panels: the ledger's weights line there
(budget/headers.py).

The swap takes a packed 4-bit or 8-bit linear the kernel does not decline (int4_int8.declines), and a vocabulary
projection tied to an 8-bit embedding only where the dot product is not AVX2 alone (int4_int8.swaps_tied_heads;
then the embedding reads its rows from the panels: the table is held once, in them). With --compact-weights it
holds GGUF's K-quants as compactly as the file holds them: codes at their own width (Q5_K's and Q6_K's in 6 bits) and, per 16-row panel and
256-column super-block, 16 float32 super-scales then G x 16 int8 sub-scales (G = 256 / group; Q5_K's per-32 scales
held per 16, each repeated), offsets where the type has them the same again; so per row and super-block 4 + G bytes
of scales (and as many of offsets):
- Q4_K: N K / 2 + 2 N (K / 256)(4 + 8); IQ4_XS: N K / 2 + N (K / 256)(4 + 8) + 16 (its level table);
- Q6_K: N K 3 / 4 + N (K / 256)(4 + 16); Q5_K: N K 3 / 4 + 2 N (K / 256)(4 + 16).
Every other type (Q4_0, Q4_1, IQ4_NL, Q8_0), and every tensor the swap leaves, keeps the bytes of its packed form.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from deltaserve.kernels import int4_int8
from deltaserve.weights.gguf import LUT_TYPES
from deltaserve.weights.gguf_int4 import GROUP, IQ4_LEVELS, held_scales
from deltaserve.weights.gguf_int8 import GROUPS

SUPER = int4_int8.SUPER_COLUMNS  # columns of a K-quant super-block: one float32 super-scale per row and block
CODE_BITS = {Q.Q4_K: 4, Q.IQ4_XS: 4, Q.Q6_K: 6, Q.Q5_K: 6}  # the compact forms' code widths
SUB_SCALES = {Q.Q4_K: 8, Q.IQ4_XS: 8, Q.Q6_K: 16, Q.Q5_K: 16}  # G: int8 sub-scales per row and super-block
WITH_OFFSETS = (Q.Q4_K, Q.Q5_K)
LEVEL_TABLE_BYTES = 16  # IQ4's 16 levels, a byte each


def compact_bytes(kind: Q, n: int, k: int) -> int:
    """Bytes the swap holds an [n, k] matrix of K-quant `kind` in (module docstring)."""
    if kind not in CODE_BITS or k % SUPER:
        raise ValueError(f"no compact panel form for a {n} x {k} {kind.name} matrix: "
                         f"{', '.join(t.name for t in CODE_BITS)} with a width a multiple of {SUPER}")
    scales = n * (k // SUPER) * (4 + SUB_SCALES[kind])
    table = LEVEL_TABLE_BYTES if kind == Q.IQ4_XS else 0
    return n * k * CODE_BITS[kind] // 8 + scales * (2 if kind in WITH_OFFSETS else 1) + table


def int4_panel_bytes(kind: Q, gguf_name: str, shape: tuple[int, ...], packed: int) -> int:
    """Bytes a 4-bit tensor kept packed (`packed` of them; HF-order `shape`, stacked experts [experts, out, in]) is
    held in after the swap: the compact form of each matrix the kernel takes, else as packed. An embedding is
    looked up from its packed table (models/layers.Int4Embedding), never swapped."""
    n, k = shape[-2:]
    lut = torch.tensor(IQ4_LEVELS, dtype=torch.float32) if kind in LUT_TYPES else None
    if (gguf_name.startswith("token_embd") or kind not in CODE_BITS or k % SUPER
            or int4_int8.declines(n, k, GROUP, lut, held_scales(kind)[1]) is not None):
        return packed
    return (shape[0] if len(shape) == 3 else 1) * compact_bytes(kind, n, k)


def int8_panel_bytes(kind: Q, gguf_name: str, shape: tuple[int, int], packed: int, tied: bool,
                     tied_heads: bool | None = None) -> int:
    """Bytes an 8-bit tensor kept packed (`packed` of them, HF-order [N, K]) is held in after the swap: a linear the
    kernel takes in the compact form; an embedding only where its `tied` head is swapped (`tied_heads`, None: this
    CPU's answer; the head's panels then hold the table; an asymmetric Q5_K table's head stays as it is), else as
    packed."""
    n, k = shape
    if gguf_name.startswith("token_embd"):
        if not tied or kind in WITH_OFFSETS:
            return packed
        if not (int4_int8.swaps_tied_heads() if tied_heads is None else tied_heads):
            return packed
    if kind not in CODE_BITS or k % SUPER or int4_int8.declines(n, k, GROUPS[kind], bits=8) is not None:
        return packed
    return compact_bytes(kind, n, k)
