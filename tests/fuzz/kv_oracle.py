"""The oracle of a 16-bit KV cache: transformers with K (after the rotary) and V rounded to the cache's dtype where the
engine's cache rounds them (every attention read takes K and V as stored: kernels/attention.paged_attention), and
the two bounds around it: kv_rtol, the worst case of the rounding itself (a sanity ceiling against the exact oracle),
and the midpoint bounds, what the rounding can differ by between two float32 computations of K and V (an element
within float32 rounding of a midpoint between two 16-bit neighbours may round either way on either side)."""

from __future__ import annotations

import math
import sys

import torch

from tests.tolerance import LAMBDA

# unit roundoff of the KV cache's storage: round to nearest in a 16-bit float keeps 11 (float16) or 8 (bfloat16)
# significant bits; float32 storage rounds nothing the float32 arithmetic had not already
KV_UNIT_ROUNDOFF = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def kv_rtol(ref, sequence: list[int], kv_dtype: str) -> float:
    """Bound on the relative logit error (as tests/tolerance.py measures it: against max|oracle logits|) that storing
    each attention layer's K and V in `kv_dtype` adds, from the oracle's own q and k over `sequence`.

    Storing rounds each element: k~ = k (1 + d), v~ = v (1 + d'), |d|, |d'| <= u (u = 2^-11 for float16, 2^-8 for
    bfloat16; the cache holds K after the rotary, and nothing the models compute comes near float16's overflow or
    subnormal range). One head of one attention layer, one query q:
    - scores s_j = c q.k_j (c = head_dim^-0.5) move by |c sum_i q_i k_ji d_ji| <= u c sum_i |q_i k_ji|
      <= u c |q| |k_j| (Cauchy-Schwarz) <= D := u c max|q| max|k|, the norms per head over every position (the rotary
      turns pairs of coordinates, so |q| and |k| are the norms of q_proj's or q_norm's output);
    - softmax: p~_j = p_j exp(ds_j) / sum_l p_l exp(ds_l), so p~_j / p_j lies in [exp(-2D), exp(2D)] and
      |p~_j - p_j| <= (exp(2D) - 1) p_j;
    - the value sum: |sum_j p~_j v~_j - sum_j p_j v_j| <= sum_j |p~_j - p_j| |v~_j| + sum_j p_j |v_j| |d'_j|
      <= ((exp(2D) - 1)(1 + u) + u) max_j |v_j|: a relative error of the attention output on the scale of its values.
    That is one more stage error of the kind tolerance.py adds through the network (to first order the errors of
    successive stages add, the norms keep the scale), on our side only: the sum over the attention layers of
    (exp(2 D_layer) - 1)(1 + u) + u, D_layer with the largest q and k norms of any head. float32 storage adds 0."""
    u = KV_UNIT_ROUNDOFF[kv_dtype]
    if u == 0.0:
        return 0.0
    return sum((math.expm1(2 * u * span) * (1 + u) + u) for span in attention_spans(ref, sequence))


def attention_spans(ref, sequence: list[int]) -> list[float]:
    """Per attention layer of the oracle: c max|q| max|k| over heads and positions of `sequence` (kv_rtol's D / u),
    from q_norm / k_norm's outputs where the layer norms its heads, else q_proj / k_proj's."""
    norms: dict[str, list[float]] = {}
    hooks = []
    for name, module in ref.named_modules():
        if not (hasattr(module, "q_proj") and hasattr(module, "k_proj") and hasattr(module, "scaling")):
            continue  # GDN layers and everything else: not attention
        norms[name] = [0.0, 0.0, module.scaling]
        for index, part in enumerate(("q", "k")):
            source = getattr(module, f"{part}_norm", None) or getattr(module, f"{part}_proj")

            def record(_module, _args, out, name=name, index=index, head_dim=module.head_dim):
                largest = out.detach().double().reshape(-1, head_dim).norm(dim=-1).max().item()
                norms[name][index] = max(norms[name][index], largest)

            hooks.append(source.register_forward_hook(record))
    try:
        with torch.no_grad():
            ref(torch.tensor([sequence]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [scale * q * k for q, k, scale in norms.values()]


def kv_rounded_logits(ref, sequence: list[int], kv_dtype: str) -> torch.Tensor:
    """The oracle's logits [len(sequence), vocab] (float64) with every attention layer's K after the rotary and its V
    rounded to `kv_dtype`, as the engine's cache stores them (kv_rounded_oracle's first part)."""
    return kv_rounded_oracle(ref, sequence, kv_dtype, 0.0, 0, [])[0]


def kv_rounded_oracle(ref, sequence: list[int], kv_dtype: str, rtol: float, first: int,
                      tokens: list[list[int]]) -> tuple[torch.Tensor, list[list[float]]]:
    """(kv_rounded_logits, for positions first, first + 1, ... the midpoint bound of each log-probability of
    tokens[i]): each attention module's apply_rotary_pos_emb (looked up in its modeling module at call time) wrapped
    to round K after the rotary, and v_proj's output rounded, a zero perturbation added to each rounded tensor for
    the gradient.

    The midpoint bound: the engine's K and V differ from the oracle's before rounding by float32 rounding, each
    element by delta of standard deviation at most sigma = rtol / LAMBDA x max|K| (or |V|) of the layer (`rtol`:
    tests/tolerance.py's bound, a LAMBDA-sigma one, relative to the largest). Rounding both to the 16-bit grid, they
    land one ulp apart where a midpoint lies between them, with probability |delta| / ulp for an element at a random
    place on the grid, else on the same value: a jump e of +-ulp with E[e^2] <= ulp sigma. A log-probability moves by
    sum g e (g its gradient at the rounded K and V), independent rare jumps each at most M = max |g| ulp, whose
    variance is var = sum g^2 ulp sigma: bennett_bound."""
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[kv_dtype]
    attention = [m for m in ref.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "scaling")]
    modules = {sys.modules[type(m).__module__] for m in attention}
    originals = {module: module.apply_rotary_pos_emb for module in modules}
    jumps: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (zero perturbation, ulp, sigma) per rounded tensor

    def rounded(x: torch.Tensor) -> torch.Tensor:
        r = x.to(dtype).to(x.dtype)
        eps = torch.zeros_like(r, requires_grad=True)
        _, exponent = torch.frexp(r.detach().double())
        ulp = torch.ldexp(torch.full_like(exponent, torch.finfo(dtype).eps, dtype=torch.float64), exponent - 1)
        jumps.append((eps, ulp, rtol / LAMBDA * x.detach().abs().max().item()))
        return r + eps

    def wrap(original):
        def rounded_k(q, k, *args, **kwargs):
            q, k = original(q, k, *args, **kwargs)
            return q, rounded(k)
        return rounded_k

    hooks = [m.v_proj.register_forward_hook(lambda _m, _a, out: rounded(out)) for m in attention]
    try:
        for module, original in originals.items():
            module.apply_rotary_pos_emb = wrap(original)
        with torch.enable_grad():
            logits = ref(torch.tensor([sequence]), use_cache=False).logits[0].float()
    finally:
        for module, original in originals.items():
            module.apply_rotary_pos_emb = original
        for hook in hooks:
            hook.remove()
    directions = [(first + i, t) for i, ids in enumerate(tokens) for t in ids]
    if not directions or not rtol or not jumps:
        return logits.detach().double(), [[0.0] * len(ids) for ids in tokens]
    logprobs = logits.log_softmax(-1)
    grad_outputs = torch.zeros((len(directions),) + logprobs.shape)
    for index, (position, token) in enumerate(directions):
        grad_outputs[index, position, token] = 1.0
    grads = torch.autograd.grad(logprobs, [eps for eps, _, _ in jumps], grad_outputs, is_grads_batched=True,
                                allow_unused=True)
    variance = torch.zeros(len(directions), dtype=torch.float64)
    largest = torch.zeros(len(directions), dtype=torch.float64)
    for grad, (_, ulp, sigma) in zip(grads, jumps):
        if grad is not None:
            g, ulp = grad.double().flatten(1), ulp.flatten()
            variance += (g ** 2 * ulp).sum(1) * sigma
            largest = torch.maximum(largest, (g.abs() * ulp).amax(1))
    bounds = bennett_bound(variance, largest).tolist()
    out, at = [], 0
    for ids in tokens:
        out.append(bounds[at:at + len(ids)])
        at += len(ids)
    return logits.detach().double(), out


def bennett_bound(variance: torch.Tensor, largest: torch.Tensor) -> torch.Tensor:
    """t with P(|sum of independent zero-mean terms| > t) <= 2 exp(-LAMBDA^2 / 2) (the float32 bound's failure
    probability), the terms at most `largest` in size with `variance` in all (each a float64 tensor): Bennett's
    inequality, P(S > t) <= exp(-(var / M^2) h(M t / var)), h(x) = (1 + x) log(1 + x) - x, solved for t by bisection
    (h(x) >= c at x = max(c, 7)). Rare large jumps are why not Bernstein's: it charges LAMBDA^2 M / 3 = 12 M where
    Bennett's logarithm charges a few M."""
    target = LAMBDA ** 2 / 2
    var, m = variance.clamp_min(1e-300), largest
    c = target * m ** 2 / var
    low, high = torch.zeros_like(c), torch.maximum(c, torch.full_like(c, 7.0))
    for _ in range(100):
        mid = (low + high) / 2
        above = (1 + mid) * torch.log1p(mid) - mid >= c
        low, high = torch.where(above, low, mid), torch.where(above, mid, high)
    return torch.where(m > 0, high * var / m.clamp_min(1e-300), torch.zeros_like(m))
