"""Pick the next token of every sampling row of a step, in one batched pass.

Order (as vLLM and transformers): penalties and logit_bias on the logits, then greedy argmax or temperature -> top-k
-> top-p -> min-p -> a draw. Each request draws one uniform number per step from its own torch.Generator and takes
the first token whose cumulative probability passes it (inverse transform sampling), so the same seed gives the same
tokens whatever else is in the batch.

On CPU the top-k and top-p thresholds come from numpy's partition and sort of the row's values (top-p first looks at
the 256 largest), not from torch's CPU sort of a whole vocabulary-wide row, and one uniform draw replaces V
exponentials a row; greedy rows take the fused argmax (fused_cpu.argmax). Why, in numbers: the lab notes in
bench/results/2026-12-05T0000Z-lab-notes-sampler.json.

A request with a grammar (tool_choice required / named, response_format) has its row masked by its own matcher
before the choice; the other rows of the batch are not touched.

Log-probabilities are those of the raw model distribution (log_softmax of the logits, before penalties and
temperature): what the OpenAI API documents, and vLLM's default (`raw_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from deltaserve.engine.grammar import advance
from deltaserve.engine.request import SamplingParams
from deltaserve.kernels import fused_cpu


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


def sample(logits: torch.Tensor, rows: list[SamplingRow], argmax: torch.Tensor | None = None) -> list[Sampled]:
    """logits [R, V] float32, one row per entry of `rows` -> one Sampled per row. `argmax` [R] int64: each row's
    argmax of these logits where the model computed it with them (the greedy tokens of rows nothing adjusts), or
    None."""
    if not rows:
        return []
    raw = logits.float()
    x = _apply_logit_bias(_apply_penalties(raw, rows), rows)
    constrained = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
    if constrained:
        x = x.clone() if x is raw else x  # raw stays unmasked: logprobs are the model's own
        grammars = rows[constrained[0]].grammar[0]
        grammars.mask(x, constrained, [rows[i].grammar[1] for i in constrained])
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(greedy) == len(rows):  # all greedy (the common decode step): argmax over the logits where they lie
        tokens = argmax if argmax is not None and x is raw else fused_cpu.argmax(x)
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
    if greedy and random:
        index = torch.tensor(greedy, device=x.device)
        tokens[index] = fused_cpu.argmax(x.index_select(0, index))
    if random:
        index = torch.tensor(random, device=x.device)
        probs = _filtered_probs(x.index_select(0, index), [rows[i].params for i in random])
        tokens[index] = _draw(probs, [rows[i].generator for i in random])
    if constrained:
        chosen = tokens.tolist()
        advance([rows[i].grammar[1] for i in constrained], [chosen[i] for i in constrained])
    return _with_logprobs(raw, tokens, rows)


def distribution(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The probabilities [V] a sampled (not greedy) row draws its token from, from its logits [V]: penalties,
    logit_bias, the grammar mask (the matcher is not advanced), temperature, top-k, top-p, min-p; what `sample`
    draws from (engine/speculative.py verifies drafts against it). Not normalized after min-p, as in `sample`."""
    x = _apply_logit_bias(_apply_penalties(logits.float()[None], [row]), [row])
    if row.grammar is not None:
        x = x.clone()
        row.grammar[0].mask(x, [0], [row.grammar[1]])
    return _filtered_probs(x, [row.params])[0]


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [R, V] (need not sum to 1), each from its own generator: `sample`'s draw."""
    return _draw(probs, generators)


def with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[Sampled]:
    """Sampled choices of `tokens`, with the raw log-probabilities of the rows that ask for them."""
    return _with_logprobs(raw.float(), tokens, rows)


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
    """Softmax after temperature, top-k, top-p and min-p, row by row settings."""
    device = x.device
    vocab = x.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=device)
    x = x / temps.unsqueeze(1)  # a new tensor: the filters below write -inf into it
    for i, p in enumerate(params):
        if 0 < p.top_k < vocab or p.top_p < 1:
            _top_k_top_p(x[i], p)
    probs = x.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=device)
    if bool((min_p > 0).any()):
        floor = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


TOP_P_CANDIDATES = 256  # the largest logits top-p looks at first; the whole row only when their mass falls short


def _top_k_top_p(row: torch.Tensor, p: SamplingParams) -> None:
    """-inf, in place, on the logits below the k-th largest (ties with it stay), then past the smallest set of the
    most likely tokens whose probability reaches top_p (the most likely token always stays; so do ties with the
    last one kept)."""
    vocab = row.shape[0]
    kth = None
    if 0 < p.top_k < vocab:
        kth = _largest(row, p.top_k)[-1]
        row.masked_fill_(row < kth, float("-inf"))
    if p.top_p < 1:
        # what top-p chooses among: the row, or the values top-k kept (a partition of a row of mostly -inf is slow)
        values = row if kth is None else row[row >= kth]
        size = values.shape[0]
        top = values.max()
        total = _exp_below(values, top).sum()  # the softmax's denominator
        for n in (min(TOP_P_CANDIDATES, size), size):
            ordered = _largest(values, n)
            probs = _exp_below(ordered, top) / total
            mass = probs.cumsum(-1)
            # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
            # Candidates short of the row: the token after them too (the mass before it is all of theirs).
            before = torch.cat([(mass - probs)[1:], mass[-1:]]) if n < size else (mass - probs)[1:]
            reached = before >= p.top_p
            if bool(reached.any()):
                last_kept = ordered[int(reached.int().argmax())]  # the token before the first dropped one
                row.masked_fill_(row < last_kept, float("-inf"))
                return


def _exp_below(values: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """exp(values - top), the differences clamped at -87: a result below float32's smallest normal number (exp(-87.3))
    takes the CPU's slow path (denormals); a token that far below the top weighs under 1e-37 next to its 1."""
    return (values - top).clamp_(min=-87.0).exp_()


def _largest(row: torch.Tensor, n: int) -> torch.Tensor:
    """The n largest values of a row, largest first. On CPU numpy's partition and sort, which beat torch's CPU sort of
    a vocabulary-wide row (the timings: bench/results/2026-12-05T0000Z-lab-notes-sampler.json)."""
    if row.device.type != "cpu":
        return row.topk(n).values
    values = row.numpy()
    part = values if n == values.shape[0] else np.partition(values, values.shape[0] - n)[values.shape[0] - n:]
    return torch.from_numpy(np.sort(part)[::-1].copy())


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each row from its own generator: the first token whose cumulative probability (float64)
    passes u times the row's total, u uniform in [0, 1). A token of probability 0 adds nothing to the sum, so it is
    never the first to pass it."""
    cdf = probs.double().cumsum(-1)
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=probs.device) for g in generators])
    total = cdf[:, -1]
    # below the total even where u * total rounds up to it: the last token of nonzero probability then passes it
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # (a row of NaN, from a broken model, passes nothing: its last token, not an index past the vocabulary)
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


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


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int],
                    top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of `logits` [rows, vocab] (float32, the row before each token; overwritten), the log-probability of
    its next prompt token and the top_n most likely tokens: in place, so the rows cost one more [rows, vocab] pass
    (budget/lines.py PROMPT_LOGPROB_PASSES), never a copy per row."""
    logprobs = logits.sub_(logits.logsumexp(-1, keepdim=True))
    index = torch.tensor(next_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    if not top_n:
        return [(lp, []) for lp in chosen]
    values, ids = logprobs.topk(top_n, dim=-1)
    return [(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]
