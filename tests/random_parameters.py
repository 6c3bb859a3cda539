"""Tiny random models with no constant parameter: transformers initialises biases to 0 (and norms to 0 or 1), and a
parameter left at its initial constant proves nothing about how a loader reads it."""

from __future__ import annotations

import torch

# A constant parameter's draw: on the scale of the projections' own weights (initializer_range 0.1), so a bias moves
# each projection output by ~10% of its size (dropping one moves the fuzz cases' logits by 3-60% of the largest,
# against a float32 bound of ~1e-4) and logits stay O(1)
CONSTANT_PARAMETER_STD = 0.1


def draw_constant_parameters_(model: torch.nn.Module) -> list[str]:
    """Draw every parameter of `model` that holds one value throughout (biases at 0, and any other constant) as that
    value plus N(0, CONSTANT_PARAMETER_STD^2) per element, from torch's global generator. Returns the names drawn."""
    drawn = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() and bool((p == p.reshape(-1)[0]).all()):
                p.add_(torch.randn_like(p) * CONSTANT_PARAMETER_STD)
                drawn.append(name)
    return drawn
