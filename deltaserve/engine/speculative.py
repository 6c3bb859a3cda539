"""Speculative decoding: draft tokens per request, verified as extra rows of the normal step, lossless.

A decode request with drafts d1..dk is fed [last token, d1, .., dk] as one small chunk of the step (a prefill of
1 + k rows beside the other requests' decode and prefill rows); row j's logits score d(j+1). The verifier takes
the longest prefix of drafts the target agrees with, plus one token of its own (the correction at the first
rejection, or the bonus after the last draft):
- greedy rows: each row's token is what `sample` picks for it (penalties, logit_bias, the grammar mask, argmax),
  with the drafts accepted so far as output; a draft is accepted when it equals that token. The tokens are those
  plain decoding picks, row by row, so greedy output is unchanged.
- sampled rows (rejection sampling; an n-gram draft's distribution is a point mass): draft d is accepted with
  probability p(d), p being the distribution `sample` would draw from there; at a rejection the token is drawn
  from the residual max(0, p - onehot(d)), normalized. Output tokens follow p exactly; the request's generator
  draws differently from plain decoding, so a seed's tokens differ (their distribution does not).

Rollback of rejected drafts. Attention: the KV written for rejected rows lies past `num_cached` and is simply
overwritten later. GDN layers (hybrid models): per-draft snapshots. The forward writes the conv and recurrent
state after each of the first k rows into k snapshot slots of the request (the mechanism the prefix cache's
mid-chunk checkpoints use, ForwardBatch.snapshots), the state after all 1 + k rows into its own slot; keeping m
tokens copies snapshot m into the slot (nothing when all were kept). Chosen over replaying from one checkpoint
(1 slot instead of 1 + k) because replay costs a second pass over the accepted rows (another step's fixed cost,
or the next step's rows recomputed) and its state is rounded differently from the one the verifier's logits came
from; snapshots cost only memory, which the ledger prices (speculative_states: max_running_requests x k states)
and which admission holds by construction: snapshot slots s*k .. s*k+k-1 belong to state slot s, so a request
that holds a state slot holds its snapshots.

When drafting does not pay: each request keeps a running estimate of its acceptance rate and drafts the k that
maximizes expected tokens per unit of step cost (`draft_len`), the cost of a verifying step measured against a plain
one while serving; a request at k = 0 probes with one draft now and then, so an estimate that recovers is seen.

Not speculated (they decode plainly, one token a step): requests with images (their rotary positions come from
the image grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.engine.grammar import advance
from deltaserve.engine.sampler import Sampled, distribution, draw, sample, with_logprobs

NGRAM_MAX = 3  # the longest suffix looked up; shorter ones are tried when it does not occur
NGRAM_MIN = 1
ACCEPTANCE_SMOOTHING = 0.3  # weight of the newest verification in a request's acceptance estimate
ACCEPTANCE_PRIOR = 0.6  # the estimate before a request's first verification
# The cost of a verifying step relative to a plain decode step: a fixed part plus each draft row. Since a verifying
# request's rows run as decode rows of the native one-call path (models/batch.py as_decode_rows), the fixed part is
# small (the chunk's batch, one sampler call per row) and each row costs what a decode row does: its projections'
# arithmetic (the weights are read once for all rows) and its attention over the context. Measured on SmolLM2 (int4
# projections, int8 head, 900-token context, 2 threads on a shared 2-core machine, 2026-12-06): a step of 1 + k rows
# took 1.15, 1.3, 1.7, 1.55 and 2.5 plain steps for k = 1, 2, 3, 4 and 8 (noisy: load 10), about 0.18 a row; before,
# on the per-op path, 1.3 to 3.8. The fixed part is also measured while serving (`Speculation.observe`: decode-only
# steps against steps with drafts and no prompt chunk, less DRAFT_ROW_COST a draft); this is its value before then.
STEP_FIXED_COST = 0.05
DRAFT_ROW_COST = 0.18
STEP_TIME_SMOOTHING = 0.1  # weight of the newest step in the running step times
PROBE_EVERY = 16  # decode steps at k = 0 before a one-draft probe


@dataclass
class SpecState:
    """One request's speculation: its counters and acceptance estimate."""

    drafted: int = 0
    accepted: int = 0
    rate: float = ACCEPTANCE_PRIOR
    idle_steps: int = 0
    prompt: np.ndarray | None = None  # the prompt as an array, made once for the n-gram search

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rate += ACCEPTANCE_SMOOTHING * (accepted / drafted - self.rate)


def draft_len(rate: float, k_max: int, fixed_cost: float = STEP_FIXED_COST) -> int:
    """The number of drafts (0..k_max) with the most expected tokens per unit of step cost, when each draft is
    accepted with probability `rate` independently: E[tokens] = 1 + rate + .. + rate^k, and a step with k drafts
    costs 1 + fixed_cost + DRAFT_ROW_COST x k plain decode steps."""
    best, best_value = 0, 1.0
    for k in range(1, k_max + 1):
        tokens = sum(rate ** i for i in range(k + 1))
        value = tokens / (1 + fixed_cost + DRAFT_ROW_COST * k)
        if value > best_value:
            best, best_value = k, value
    return best


def ngram_drafts(tokens: np.ndarray, k: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n = NGRAM_MAX down to NGRAM_MIN, the longest that occurs first); [] when none occurs."""
    size = tokens.shape[0]
    for n in range(min(NGRAM_MAX, size - 1), NGRAM_MIN - 1, -1):
        suffix = tokens[size - n:]
        # candidate starts i < size - n whose n tokens equal the suffix
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramDrafter:
    """Drafts from the request's own prompt and output."""

    def propose(self, request, k: int) -> list[int]:
        state = request.speculative
        if state.prompt is None:
            state.prompt = np.asarray(request.prompt_ids, dtype=np.int64)
        tokens = np.concatenate([state.prompt, np.asarray(request.output_ids, dtype=np.int64)])
        return ngram_drafts(tokens, k)


@dataclass
class Speculation:
    """The engine's speculation: a drafter, the most drafts a step verifies, and the GDN snapshot slots."""

    drafter: object  # .propose(request, k) -> list[int]
    max_tokens: int
    snapshot_pool: object = None  # cache.state_pool.StatePool (a view) of state_slots x max_tokens slots; None: dense
    adaptive: bool = True  # False: always max_tokens drafts (tests that force rejections at chosen positions)
    drafted_total: int = 0
    accepted_total: int = 0
    verify_steps_total: int = 0
    plain_step_s: float | None = None  # running wall time of a decode-only step
    verify_step_s: float | None = None  # ... of a step with drafts and no prompt chunk
    verify_drafts: float = 0.0  # running drafts per verifying request of those steps

    @property
    def fixed_cost(self) -> float:
        """What a verifying step costs beyond a plain one and its draft rows (DRAFT_ROW_COST each), in plain steps, as
        measured (the prior until both are)."""
        if self.plain_step_s is None or self.verify_step_s is None:
            return STEP_FIXED_COST
        return max(0.0, self.verify_step_s / self.plain_step_s - 1 - DRAFT_ROW_COST * self.verify_drafts)

    def observe(self, plan, seconds: float) -> None:
        """Fold one step's wall time into the running step times (steps with a prompt chunk say nothing here)."""
        if plan.prefill:
            return
        name = "verify_step_s" if plan.verify else "plain_step_s"
        old = getattr(self, name)
        setattr(self, name, seconds if old is None else old + STEP_TIME_SMOOTHING * (seconds - old))
        if plan.verify:
            drafts = sum(map(len, plan.drafts.values())) / len(plan.verify)
            self.verify_drafts = drafts if old is None else self.verify_drafts + STEP_TIME_SMOOTHING * (
                drafts - self.verify_drafts)

    def propose(self, request, limit: int) -> list[int]:
        """Drafts for a decode request this step (at most `limit`); [] when it decodes plainly."""
        if request.images is not None or limit <= 0:
            return []
        state = request.speculative
        k = min(draft_len(state.rate, self.max_tokens, self.fixed_cost) if self.adaptive else self.max_tokens,
                limit)
        if k == 0:
            state.idle_steps += 1
            if state.idle_steps < PROBE_EVERY:
                return []
            k = 1
        state.idle_steps = 0
        return self.drafter.propose(request, k)[:k]

    def snapshot_slot(self, state_slot: int, read: int) -> int:
        """Where the state after `read` (1..k) rows of a verifying request goes, in the snapshot tensors."""
        return self.snapshot_pool.offset + state_slot * self.max_tokens + read - 1

    def roll_back(self, state_pool, state_slot: int, kept: int) -> None:
        """Make the request's state the one after `kept` rows (1..k, where k < the rows fed)."""
        self.snapshot_pool.copy_into(state_slot * self.max_tokens + kept - 1, state_pool, state_slot)


@dataclass
class _Row:
    """A request as the sampler sees it at one verification row: its output extended by the tokens before."""

    params: object
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: object


def sample_step(logits: torch.Tensor, plan) -> list[list[Sampled]]:
    """The tokens each of `plan.sampling` gets this step (one for a plain row, 1..k+1 for a verifying request),
    from logits rows in the runner's order: one per plain request, 1 + k per verifying request."""
    drafts = plan.drafts
    if not drafts:
        return [[s] for s in sample(logits, plan.sampling)]
    plain_rows, spans, row = [], [], 0
    for request in plan.sampling:
        n = 1 + len(drafts.get(request, ()))
        spans.append((row, n))
        if n == 1:
            plain_rows.append(row)
        row += n
    plain = [r for r in plan.sampling if r not in drafts]
    picked = iter(sample(logits[plain_rows], plain) if plain else [])
    out = []
    for request, (first, n) in zip(plan.sampling, spans):
        out.append([next(picked)] if n == 1 else verify(logits[first:first + n], request, drafts[request]))
    return out


def verify(logits: torch.Tensor, request, drafts: list[int]) -> list[Sampled]:
    """The tokens a request keeps from logits [1 + k, V] of its rows: the accepted drafts and one of its own.
    Stops early at a stop token or the token budget (the tokens after it would never be kept)."""
    out: list[Sampled] = []
    stops = request.stop_ids
    room = request.max_new_tokens - len(request.output_ids)
    for j in range(len(drafts) + 1):
        row = _Row(request.params, request.generator, request.prompt_ids,
                   request.output_ids + [s.token_id for s in out], request.grammar)
        draft = drafts[j] if j < len(drafts) else None
        if request.params.greedy or draft is None:
            choice = sample(logits[j:j + 1], [row])[0]
        else:
            choice = _accept_or_resample(logits[j], row, draft)
        out.append(choice)
        if choice.token_id != draft or choice.token_id in stops or len(out) >= room:
            break
    return out


def _accept_or_resample(logits: torch.Tensor, row: _Row, draft: int) -> Sampled:
    """Rejection sampling against a point-mass draft: keep it with probability p(draft), else draw from p with the
    draft's mass removed. The grammar advances by the token kept."""
    p = distribution(logits, row)
    u = torch.rand((), dtype=torch.float64, generator=row.generator, device=p.device)
    if float(u) < float(p[draft]) / float(p.sum()):
        token = draft
    else:
        residual = p.clone()
        residual[draft] = 0
        if float(residual.sum()) <= 0:  # p was all on the draft (rounding): it is the token
            token = draft
        else:
            token = int(draw(residual[None], [row.generator])[0])
    if row.grammar is not None:
        advance([row.grammar[1]], [token])
    return with_logprobs(logits[None], torch.tensor([token]), [row])[0]
