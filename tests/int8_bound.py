"""How far `--activation-dtype int8` may move a log-probability: the activations' rounding, propagated.

The int8 path (kernels/int4_int8.py) rounds each input row of a swapped layer per block of 32 columns (in the
weight's stored column order) to q = round(x / d), d = max|x| / 127: each input element moves by e with |e| <= d / 2,
and nothing else differs from the float32 path (the 4-bit product of the rounded input is exact up to float32
rounding, which tests/tolerance.py bounds). To first order a log-probability f moves by
    df = sum over swapped layers l, rows t, columns k of  (df / dx_ltk) e_ltk,
the gradient taken through the whole network (later layers included) at the oracle's own activations. The roundings
of different elements are independent and each e is uniform on [-d / 2, d / 2] (variance d^2 / 12), so by the same
probabilistic argument as tolerance.py (Higham and Mary 2019: a sum of independent bounded terms) |df| stays within
    LAMBDA * sqrt(sum (df / dx)^2 d^2 / 12)
with probability >= 1 - 2 exp(-LAMBDA^2 / 2) per log-probability (LAMBDA = 6: ~3e-8). The block's largest element
rounds exactly (e = 0); counting it anyway only widens the bound. Second-order terms are products of two roundings,
each ~1/254 of its activation: two orders below the first.

Computed here on the oracle (transformers on the same weights): a forward with a zero perturbation added to each
swapped layer's input, the block quanta from that input, and one batched backward for every checked log-probability.
"""

from __future__ import annotations

import math

import torch

from tests.tolerance import LAMBDA

QUANT_BLOCK = 32  # kernels/int4_int8.py's QUANT_BLOCK


def swapped_layers(model) -> dict[str, torch.Tensor | None]:
    """The engine model's layers that took int8 activations: name -> the input permutation they quantize in."""
    from deltaserve.models.layers import Int4Int8Linear

    return {name: module.perm for name, module in model.named_modules() if isinstance(module, Int4Int8Linear)}


def half_quanta(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """d / 2 for each element of x [..., K] (its block's quantum halved), in x's own column order."""
    k = x.shape[-1]
    rows = x.detach().reshape(-1, k).double()
    if perm is not None:
        rows = rows[:, perm]
    d = rows.view(rows.shape[0], k // QUANT_BLOCK, QUANT_BLOCK).abs().amax(-1) / 127
    half = (d / 2).repeat_interleave(QUANT_BLOCK, dim=1)
    if perm is not None:
        half = torch.empty_like(half).index_copy_(1, perm, half)
    return half.view(x.shape)


def logprob_bounds(ref, layers: dict[str, torch.Tensor | None], sequence: list[int], first: int,
                   tokens: list[list[int]]) -> list[list[float]]:
    """For positions first, first + 1, ... of `sequence` (each predicting the next token) and the token ids
    tokens[i] checked at position first + i: the bound above on how far the int8 path moves each log-probability.
    `layers` names the oracle's modules whose inputs the engine rounds (swapped_layers of the engine's model)."""
    modules = {name: ref.get_submodule(name) for name in layers}
    perturbations, quanta, hooks = {}, {}, []

    def make_hook(name):
        def hook(_module, args):
            x = args[0]
            eps = torch.zeros_like(x, requires_grad=True)
            perturbations[name], quanta[name] = eps, half_quanta(x, layers[name])
            return (x + eps,) + tuple(args[1:])
        return hook

    for name, module in modules.items():
        hooks.append(module.register_forward_pre_hook(make_hook(name)))
    try:
        with torch.enable_grad():
            logits = ref(torch.tensor([sequence]), use_cache=False).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    logprobs = logits.log_softmax(-1)
    directions = [(first + i, t) for i, ids in enumerate(tokens) for t in ids]
    if not directions or not perturbations:
        return [[0.0] * len(ids) for ids in tokens]
    names = list(perturbations)
    grad_outputs = torch.zeros((len(directions),) + logprobs.shape)
    for index, (position, token) in enumerate(directions):
        grad_outputs[index, position, token] = 1.0
    grads = torch.autograd.grad(logprobs, [perturbations[n] for n in names], grad_outputs, is_grads_batched=True,
                                allow_unused=True)
    variance = torch.zeros(len(directions), dtype=torch.float64)
    for name, grad in zip(names, grads):
        if grad is not None:
            variance += (grad.double() ** 2 * quanta[name] ** 2 / 3).flatten(1).sum(1)
    bounds = (LAMBDA * variance.sqrt()).tolist()
    out, at = [], 0
    for ids in tokens:
        out.append(bounds[at:at + len(ids)])
        at += len(ids)
    return out


def failure_probability() -> float:
    """Of one bound (module docstring)."""
    return 2 * math.exp(-LAMBDA ** 2 / 2)


def greedy_problems(ref, layers: dict[str, torch.Tensor | None], prompt: list[int], tokens: list[int],
                    chosen: list[float], rtol: float) -> tuple[list[str], int]:
    """The oracle `ref` (transformers) teacher-forced on the engine's greedy `tokens` after `prompt`, their
    log-probabilities as the engine reported them (`chosen`): each must lie within the float32 bound (rtol of
    tests/tolerance.py times max|logit|, twice: log-softmax) plus its own bound above, and each token's logit gap to
    the oracle's argmax within the float32 bound plus both tokens' bounds. Returns (the differences found, the
    positions where the oracle's top-2 margin exceeds what is allowed: where the greedy tokens must agree)."""
    sequence = prompt + tokens[:-1]
    with torch.no_grad():
        logits = ref(torch.tensor([sequence]), use_cache=False).logits[0, len(prompt) - 1:].double()
    expected, argmax = logits.log_softmax(-1), logits.argmax(-1).tolist()
    bounds = logprob_bounds(ref, layers, sequence, len(prompt) - 1, [[a, t] for a, t in zip(argmax, tokens)])
    float_error = 2 * rtol * float(logits.abs().max())
    problems, decided = [], 0
    for step, (token, value, (b_argmax, b_token)) in enumerate(zip(tokens, chosen, bounds)):
        off = abs(value - expected[step, token].item())
        if off > float_error + b_token:
            problems.append(f"step {step}: logprob of {token} off by {off:.3g} > {float_error + b_token:.3g}")
        allowed = float_error + b_argmax + b_token
        gap = (logits[step, argmax[step]] - logits[step, token]).item()
        if gap > allowed:
            problems.append(f"step {step}: greedy {token}, oracle's argmax {argmax[step]}: gap {gap:.3g} > "
                            f"{allowed:.3g}")
        top2 = logits[step].topk(2).values
        decided += (top2[0] - top2[1]).item() > allowed
    return problems, decided
