"""Tolerances from the arithmetic: how far two float32 computations of the same network may differ.

Both sides (ours and the oracle) compute in float32 with unit roundoff u = 2^-24 but in different orders (blocking,
chunk sizes, AVX-512 or AVX2 lanes, -ffast-math reassociation), so neither is "exact" and their difference is what
rounding allows. A dot product or sum of n terms carries a relative error of at most n*u in the worst case, and of
about lambda*sqrt(n)*u with probability >= 1 - 2*exp(-lambda^2 / 2) when the roundings are independent (Higham and
Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019); lambda = 6 leaves a
failure probability of ~3e-8 per product. A decoder layer chains about three such reductions (the attention or GDN
block, its projections, the MLP), to first order the errors of successive stages add (the norms keep the scale), and
each side rounds on its own: hence 2 * stages * lambda * sqrt(n) * u for logits, relative to the largest logit.

The reduction length n is the longest one a layer does: the hidden or intermediate width, the GDN chunk's
forward substitution (chunk length times key head size), or the attention's context.
"""

from __future__ import annotations

import math

UNIT_ROUNDOFF = 2.0 ** -24
LAMBDA = 6.0
STAGES_PER_LAYER = 3


def logits_rtol(layers: int, reduction: int) -> float:
    """Bound on max|ours - oracle| / max|oracle| over the logits of a float32 network `layers` deep whose longest
    reduction has `reduction` terms."""
    return 2 * STAGES_PER_LAYER * layers * LAMBDA * math.sqrt(reduction) * UNIT_ROUNDOFF


def config_rtol(config, context: int, gdn_chunk: int = 64) -> float:
    """`logits_rtol` for a transformers config (dense or hybrid) read over `context` tokens."""
    text = getattr(config, "text_config", None) or config
    widths = [text.hidden_size, getattr(text, "intermediate_size", 0) or 0, context,
              getattr(text, "moe_intermediate_size", 0) or 0]
    key_dim = getattr(text, "linear_key_head_dim", 0) or 0
    widths.append(gdn_chunk * key_dim)
    return logits_rtol(text.num_hidden_layers, max(widths))
