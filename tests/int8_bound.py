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
    from deltaserve.models.layers import Int8DotLinear

    return {name: module.perm for name, module in model.named_modules() if isinstance(module, Int8DotLinear)}


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
                    logprobs: list, rtol: float) -> tuple[list[str], int]:
    """The oracle `ref` (transformers) teacher-forced on the engine's greedy `tokens` after `prompt`, the engine's
    log-probabilities of them (`logprobs`, TokenLogprob) held by `differences` within the float32 bound (`rtol` of
    tests/tolerance.py) plus each checked id's bound above. Returns (the differences found, the positions where the
    oracle's top-2 margin exceeds what is allowed there: where the greedy tokens must agree)."""
    sequence = prompt + tokens[:-1]
    with torch.no_grad():
        logits = ref(torch.tensor([sequence]), use_cache=False).logits[0, len(prompt) - 1:].double()
    checked = [[int(logits[step].argmax()), token] + [tid for tid, _, _ in lp.top]
               for step, (token, lp) in enumerate(zip(tokens, logprobs))]
    bounds = logprob_bounds(ref, layers, sequence, len(prompt) - 1, checked)
    decided = 0
    for step, row in enumerate(logits):
        top2 = row.topk(2).values
        decided += (top2[0] - top2[1]).item() > 2 * rtol * row.abs().max().item() + bounds[step][0] + bounds[step][1]
    return differences(logits, tokens, logprobs, rtol, bounds), decided


def differences(logits: torch.Tensor, tokens: list[int], logprobs: list, bound: float,
                int8: list[list[float]]) -> list[str]:
    """The checks of an engine's greedy run against one oracle's logits (float64, a row per generated position):
    each token's logit gap to the oracle's argmax, and the log-probabilities of the token and of its reported top ids,
    within `bound` (relative to the row's largest logit, twice: log-softmax) plus `int8[step]`'s bounds for
    [argmax, token, top ids...] (zeros on float32 activations)."""
    expected = logits.log_softmax(-1)
    problems = []
    for step, (token, lp) in enumerate(zip(tokens, logprobs)):
        logit_error = bound * logits[step].abs().max().item()
        gap = (logits[step].max() - logits[step, token]).item()
        allowed = 2 * logit_error + int8[step][0] + int8[step][1]
        if gap > allowed:
            problems.append(f"step {step}: greedy token {token} is not the oracle's argmax "
                            f"{int(logits[step].argmax())} (logit gap {gap:.3g}, allowed {allowed:.3g})")
        for (tid, value), extra in zip([(token, lp.logprob)] + [(tid, value) for tid, _, value in lp.top],
                                       int8[step][1:]):
            off = abs(value - expected[step, tid].item())
            if off > 2 * logit_error + extra:
                problems.append(f"step {step}: logprob of {tid} off by {off:.3g} > bound "
                                f"{2 * logit_error + extra:.3g} (rtol {bound:.3g}, int8 and KV midpoint rounding "
                                f"{extra:.3g})")
                break
    return problems


def engine_greedy_problems(engine, ref, prompt: list[int], steps: int, rtol: float) -> tuple[list[str], int]:
    """greedy_problems of `engine`'s greedy answer to `prompt` (`steps` tokens, EOS ignored, its log-probabilities
    reported) against the oracle `ref`, the swapped layers read from the engine's model."""
    from test_engine_support import run_all, tokens_of

    from deltaserve.engine.request import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=0)
    out = run_all(engine, [(prompt, params)])[0]
    logprobs = [lp for o in out for lp in o.logprobs]
    return greedy_problems(ref, swapped_layers(engine.runner.model), prompt, tokens_of(out), logprobs, rtol)
