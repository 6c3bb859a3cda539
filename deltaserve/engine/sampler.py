"""Pick the next token of every sampling row of a step, in one batched pass.

Order (as vLLM and transformers): penalties and logit_bias on the logits, then greedy argmax or temperature -> top-k
-> top-p -> min-p -> a draw. Each request draws from its own torch.Generator, V exponentials per step (the exponential
race: argmax(p / e) is a sample from p), so the same seed gives the same tokens whatever else is in the batch.

A request with a grammar (tool_choice required / named, response_format) has its row masked by its own matcher
before the choice; the other rows of the batch are not touched.

Log-probabilities are those of the raw model distribution (log_softmax of the logits, before penalties and
temperature): what the OpenAI API documents, and vLLM's default (`raw_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deltaserve.engine.grammar import advance
from deltaserve.engine.request import SamplingParams


class SamplingRow(Protocol):
    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: object  # (Grammars, matcher) of a constrained request, else None


@dataclass
class Sampled:
    """One row's choice; `logprob` and `top` only when the request asked for logprobs."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[Sampled]:
    """logits [R, V] float32, one row per entry of `rows` -> one Sampled per row."""
    if not rows:
        return []
    raw = logits.float()
    x = _apply_logit_bias(_apply_penalties(raw, rows), rows)
    constrained = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
    if constrained:
        x = x.clone() if x is raw else x  # raw stays unmasked: logprobs are the model's own
        grammars = rows[constrained[0]].grammar[0]
        grammars.mask(x, constrained, [rows[i].grammar[1] for i in constrained])
    tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(greedy) == len(rows):  # all greedy (the common decode step): argmax over the logits where they lie
        tokens = x.argmax(-1)
    elif greedy:
        index = torch.tensor(greedy, device=x.device)
        tokens[index] = x.index_select(0, index).argmax(-1)
    if random:
        index = torch.tensor(random, device=x.device)
        probs = _filtered_probs(x.index_select(0, index), [rows[i].params for i in random])
        tokens[index] = _draw(probs, [rows[i].generator for i in random])
    if constrained:
        chosen = tokens.tolist()
        advance([rows[i].grammar[1] for i in constrained], [chosen[i] for i in constrained])
    return _with_logprobs(raw, tokens, rows)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Presence and frequency penalties count generated tokens; the repetition penalty sees prompt and output."""
    penalized = [i for i, r in enumerate(rows) if r.params.penalized]
    if not penalized:
        return logits
    x = logits.clone()
    vocab = x.shape[1]
    for i in penalized:
        p = rows[i].params
        out = torch.tensor(rows[i].output_ids, dtype=torch.long, device=x.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            seen[torch.tensor(rows[i].prompt_ids, dtype=torch.long, device=x.device)] = True
            seen[out] = True
            row = x[i]
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            x[i] = torch.where(seen, scaled, row)
        if (p.presence_penalty or p.frequency_penalty) and out.numel():
            counts = torch.bincount(out, minlength=vocab).to(x.dtype)
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's own biases added to its logits (before temperature, so greedy rows obey too)."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    x = logits.clone()
    for i in biased:
        ids, biases = zip(*rows[i].params.logit_bias)
        x[i].index_add_(0, torch.tensor(ids, device=x.device), torch.tensor(biases, dtype=x.dtype, device=x.device))
    return x


def _filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature, top-k, top-p and min-p, row by row settings, batched ops."""
    device = x.device
    vocab = x.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=device)
    x = x / temps.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k = torch.tensor(top_k, device=device)
        kth = x.topk(max(k for k in top_k if k < vocab), dim=-1).values
        kth = kth.gather(1, (k.clamp(max=kth.shape[1]) - 1).unsqueeze(1))
        x = torch.where((x < kth) & (k < vocab).unsqueeze(1), float("-inf"), x)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=device)
    if bool((top_p < 1).any()):
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop = ((sorted_p.cumsum(-1) - sorted_p) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False  # rows at top_p 1 are untouched: rounding can bring the cumsum to 1 early
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=device)
    if bool((min_p > 0).any()):
        floor = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each row from its own generator: argmax(p / Exp(1))."""
    noise = torch.empty_like(probs)
    for i, generator in enumerate(generators):
        noise[i].exponential_(generator=generator)
    # A zero draw would turn a zero probability into 0/0 = nan, which argmax would pick.
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(-1)


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[Sampled]:
    token_ids = tokens.tolist()
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out = [Sampled(t) for t in token_ids]
    if not wanted:
        return out
    index = torch.tensor(wanted, device=raw.device)
    logprobs = raw.index_select(0, index).log_softmax(-1)
    chosen = logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
    top_n = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())) if n else []
        out[i].logprob, out[i].top = chosen[j], top
    return out
