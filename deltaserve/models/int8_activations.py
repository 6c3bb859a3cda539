"""`--activation-dtype int8`: the packed 4-bit linears (affine codes or IQ4's integer levels) and the int8 ones
(Q8_0, compressed-tensors INT8) whose shapes kernels/int4_int8.py serves take their input rows quantized to int8 per
block of 32 and multiplied by integer dot products; the rest keep their float32 paths.

The swap moves each weight's bytes into the kernel's 16-row panels (the same bytes: the ledger's weights line does
not change) and makes each layer an Int8DotLinear (models/layers.py). A vocabulary projection tied to an int8
embedding keeps multiplying the embedding's codes in float32 (a panel copy would hold them twice). The fused decode
blocks (kernels/decode_cpu.py) take those layers too (projection_parts): a block quantizes its normed input once for
all the projections reading it, so a decode step stays one native call.
"""

from __future__ import annotations

from torch import nn

from deltaserve.kernels import int4_int8
from deltaserve.kernels.int4 import PackedInt4
from deltaserve.models.layers import FusedParts, Int4Linear, Int8DotLinear, Int8Linear


def use_int8_activations(model: nn.Module) -> tuple[int, list[str]]:
    """Swap every Int4Linear and untied Int8Linear the kernel serves (int4_int8.declines, asked per layer) for an
    Int8DotLinear; the number swapped and a log line per distinct refusal. The caller loaded the kernel
    (int4_int8.built())."""
    swapped, refusals = 0, {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Int4Linear:
                reason = int4_int8.declines(child.out_features, child.in_features, child.group_size, child.lut,
                                            child.offsets is not None)
            elif type(child) is Int8Linear and not child.tied:
                reason = int4_int8.declines(child.out_features, child.in_features, child.group_size)
            else:
                continue
            if reason:
                kind = "packed 4-bit" if type(child) is Int4Linear else "int8"
                refusals.setdefault((reason, kind), 0)
                refusals[(reason, kind)] += 1
                continue
            if type(child) is Int4Linear:
                packed = PackedInt4(child.packed, child.scales, child.offsets, child.group_size, child.lut, child.perm)
                panel = int4_int8.repack(packed)
            else:
                panel = int4_int8.repack_int8(child.rows(), child.perm)
            setattr(parent, name, Int8DotLinear(panel, child.bias))
            swapped += 1
    for module in model.modules():  # fused decode parts built before the swap would still hold the old tensors
        fused = getattr(module, "fused", None)
        if isinstance(fused, FusedParts):
            fused.key = None
    lines = [f"int4_int8 (kernels/int4_int8): {reason}: the float32 {kind} kernel serves {count} layers"
             for (reason, kind), count in refusals.items()]
    return swapped, lines
