"""`--activation-dtype int8`: the packed 4-bit linears (affine codes or IQ4's integer levels) and the int8 ones
(Q8_0, compressed-tensors INT8) whose shapes kernels/int4_int8.py serves take their input rows quantized to int8 per
block of 32 and multiplied by integer dot products; the rest keep their float32 paths.

The swap moves each weight's bytes into the kernel's 16-row panels (the same bytes, but GGUF's K-quants, held as
compactly as their file holds them: kernels/int4_int8.py; the ledger's weights line counts the panels,
weights/gguf_panels.py) and makes each layer an Int8DotLinear (models/layers.py). A vocabulary projection tied to an int8
embedding takes the panels too where the CPU has a dot-product instruction (AVX-512 VNNI, AVX-VNNI), and the
embedding becomes a PanelEmbedding reading its rows from them, so the table is held once, as before. On AVX2 alone,
where vpmaddubsw takes a byte a nibble at a time, the float32 path is as fast or faster, so a tied head stays there
(the timings: bench/results/2026-12-07T1900Z-lab-notes-engine-models.json). The fused decode
blocks (kernels/decode_cpu.py) take those layers too (projection_parts): a block quantizes its normed input once for
all the projections reading it, so a decode step stays one native call.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from deltaserve.kernels import int4_int8
from deltaserve.kernels.int4 import PackedInt4
from deltaserve.models.layers import FusedParts, Int4Linear, Int8DotLinear, Int8Embedding, Int8Linear, PanelEmbedding

RELEASE_EVERY = 32 << 20  # bytes swapped between two calls of `release`


def use_int8_activations(model: nn.Module, tied_heads: bool | None = None, release=None,
                        in_place: bool = False, compact: bool = False) -> tuple[int, list[str]]:
    """Swap every Int4Linear and Int8Linear the kernel serves (int4_int8.declines, asked per layer) for an
    Int8DotLinear (a tied one, where `tied_heads`, with its embedding for a PanelEmbedding over the same panels;
    None: where the build has a dot-product instruction, the module docstring); the number swapped and a log line
    per distinct refusal. The caller loaded the kernel (int4_int8.built()). Each layer's old weight is freed as its
    panels replace it; `release()`, called after every RELEASE_EVERY bytes swapped, gives the freed pages back to the
    OS (the allocator keeps them otherwise, and the swap would peak near twice the weights). `in_place`: nothing
    outside the model holds its weights (a fresh load), so an 8-bit layer's panels are made in its codes' own storage
    where no other module reads them (a 248K-row head is not held twice). `compact` (--compact-weights): GGUF's
    K-quants in the compact panels (kernels/int4_int8.py), else their packed bytes moved."""
    if tied_heads is None:
        tied_heads = int4_int8.swaps_tied_heads(int4_int8.isa())
    forget_fused(model)  # parts built before the swap would hold every old weight until its end
    swapped, refusals, moved = 0, {}, 0
    embeddings = {(m.codes.data_ptr(), m.codes.shape): (parent, name) for parent in model.modules()
                  for name, m in parent.named_children() if type(m) is Int8Embedding}
    # (parent, name) of each candidate, no reference to the layer itself: a swapped layer's weight is freed at once
    slots = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if type(child) in (Int4Linear, Int8Linear)]
    holders = Counter(t.data_ptr() for _, m in model.named_modules(remove_duplicate=False)
                      for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)
    for parent, name in slots:
        child = getattr(parent, name)
        if type(child) is Int4Linear:
            reason = int4_int8.declines(child.out_features, child.in_features, child.group_size, child.lut,
                                        child.offsets is not None)
        elif type(child) is Int8Linear and (tied_heads or not child.tied):
            reason = int4_int8.declines(child.out_features, child.in_features, child.group_size, bits=8)
            table = embeddings.get((child.codes.data_ptr(), child.codes.shape)) if child.tied else None
            if child.tied and table is None:
                reason = "a tied vocabulary projection whose embedding is not an int8 table here"
            elif child.tied and not child.symmetric:
                # its lookups from the panels would round s c + (o - 128 s) where the table's give s q + o
                reason = "a tied vocabulary projection over an asymmetric table (its lookups stay exact)"
        else:
            continue
        if reason:
            kind = "packed 4-bit" if type(child) is Int4Linear else "int8"
            refusals.setdefault((reason, kind), 0)
            refusals[(reason, kind)] += 1
            continue
        if type(child) is Int4Linear:
            panel = int4_int8.repack(PackedInt4(child.packed, child.scales, child.offsets, child.group_size, child.lut,
                                                child.perm), compact=compact)
        else:
            # in the codes' own storage where nothing but this layer (and the table it replaces) reads them
            alone = in_place and holders[child.codes.data_ptr()] == (2 if child.tied else 1)
            panel = int4_int8.repack_int8(child.rows(), child.perm, in_place=alone, compact=compact)
        head = Int8DotLinear(panel, child.bias)
        setattr(parent, name, head)
        if type(child) is Int8Linear and child.tied:
            owner, attr = table
            setattr(owner, attr, PanelEmbedding(head, getattr(owner, attr).dtype))
        swapped += 1
        moved += sum(t.numel() * t.element_size() for t in head.buffers())
        del child, panel, head  # the old layer's tensors go now, not at the end of the loop
        if release is not None and moved >= RELEASE_EVERY:
            release()
            moved = 0
    if release is not None:
        release()
    forget_fused(model)
    lines = [f"int4_int8 (kernels/int4_int8): {reason}: the float32 {kind} kernel serves {count} layers"
             for (reason, kind), count in refusals.items()]
    return swapped, lines


def forget_fused(model: nn.Module) -> None:
    """Drop the fused decode parts every layer built (they hold its weights): rebuilt at the next step."""
    for module in model.modules():
        fused = getattr(module, "fused", None)
        if isinstance(fused, FusedParts):
            fused.forget()
