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
maximizes its expected tokens per unit of what they cost (`draft_len`), priced on the step being planned
(`Speculation.draft_costs`, from step times measured while serving, `StepCosts`): a request's plain token costs its
share of a decode step of B requests, t(B) / B; k drafts add t(R + k) - t(R) to a decode-only step of R rows; in a
step that carries a prompt chunk (run per op, not as decode rows) a verifying request costs more than it gains, so
none drafts there. A draft row is cheap beside a lone request's step, so drafting pays there, and costs nearly a
request's share of a crowded CPU step (a decode step of many rows is arithmetic, not weight reads), so it almost never
does there (the numbers: bench/results/2026-12-07T1900Z-lab-notes-engine-models.json). A request
at k = 0 probes with one draft now and then, so an estimate that recovers is seen. A drafter that reads every
step's rows (the MTP head) costs a pass a step even where nobody drafts; where that pass costs more than drafts
could gain in the step (`Speculation.observing_pays`: a crowded CPU step), the step's requests are retired from it.

Not speculated (they decode plainly, one token a step): requests with images (their rotary positions come from
the image grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.engine.grammar import advance
from deltaserve.engine.sampler import Sampled, distribution, draw, sample, with_logprobs

# The longest suffix looked up; shorter ones are tried when it does not occur. 4 as llama.cpp's lookup decoding
# (LLAMA_NGRAM_MAX): replayed over SmolLM2's greedy answers to three code-editing prompts (int8 and float32), a
# 4-gram never drafted worse than a 3-gram, and one answer went from 2.42 to 2.62 tokens a verifying step (k = 3).
NGRAM_MAX = 4
NGRAM_MIN = 1
ACCEPTANCE_SMOOTHING = 0.3  # weight of the newest verification in a request's acceptance estimate
ACCEPTANCE_PRIOR = 0.6  # the estimate before a request's first verification
# A decode step of R rows (decode rows and draft rows alike: a verifying request's rows run as decode rows of the
# native one-call path, models/batch.py as_decode_rows) costs about STEP_FIXED_ROWS + R rows' worth until measured
# (the prior's source, SmolLM2's step times by rows: bench/results/2026-12-07T1900Z-lab-notes-engine-models.json).
STEP_FIXED_ROWS = 4.5
STEP_TIME_SMOOTHING = 0.1  # weight of the newest step in the running step times
STALE_STEPS = 256  # decode steps after which a row count's running time no longer prices drafts
PROBE_EVERY = 16  # decode steps at k = 0 before a one-draft probe
PROBE_RATE = 0.8  # ... taken only where one draft accepted at this rate would pay


@dataclass
class SpecState:
    """One request's speculation: its counters and acceptance estimate."""

    drafted: int = 0
    accepted: int = 0
    rate: float = ACCEPTANCE_PRIOR
    idle_steps: int = 0
    prompt: np.ndarray | None = None  # the prompt as an array, made once for the n-gram search
    retired: bool = False  # its drafter stopped reading its rows (a crowded step, `observing_pays`): no drafts again

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rate += ACCEPTANCE_SMOOTHING * (accepted / drafted - self.rate)


@dataclass
class StepRows:
    """The step being planned, as the drafting decision sees it."""

    requests: int = 1  # decode requests in it (plain and verifying)
    rows: int = 1  # its decode rows so far: one per decode request and the drafts already given
    prefill: bool = False  # it carries a prompt chunk (the drafts take that chunk's rows)


def draft_len(rate: float, costs: list[float]) -> int:
    """The number of drafts (0..len(costs)) with the most expected tokens per unit of cost, when each draft is
    accepted with probability `rate` independently: E[tokens] = 1 + rate + .. + rate^k for 1 + costs[k - 1], a plain
    token costing 1."""
    return draft_choice(rate, costs)[0]


def draft_choice(rate: float, costs: list[float]) -> tuple[int, float]:
    """(draft_len's k, its expected tokens per unit of cost: 1 at k = 0)."""
    best, best_value = 0, 1.0
    for k, cost in enumerate(costs, 1):
        value = sum(rate ** i for i in range(k + 1)) / (1 + cost)
        if value > best_value:
            best, best_value = k, value
    return best, best_value


class StepCosts:
    """Running wall times of decode-only steps (verifying ones included), by their rows; a step's time runs from its
    planning on, so that a drafter's own work (the MTP head's chained passes) is priced with the rows it drafts."""

    def __init__(self):
        self.decode_s: dict[int, float] = {}  # rows -> running seconds
        self.last: dict[int, int] = {}  # rows -> the step count when one was last observed
        self.steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        """One decode step's wall time. The first step of each row count is not kept: it carries one-time costs
        (arguments built lazily for that shape, first touches), and a count measured slow once and then never drafted
        again would keep a draft looking dear (seen with the MTP head's first steps)."""
        self.steps += 1
        first = rows not in self.last
        self.last[rows] = self.steps
        if first:
            return
        old = self.decode_s.get(rows)
        self.decode_s[rows] = seconds if old is None else old + STEP_TIME_SMOOTHING * (seconds - old)

    def decode_line(self, low: float, high: float) -> tuple[float, float]:
        """(fixed, per row): a decode step of R rows between `low` and `high` costs fixed + per_row x R, fitted to the
        measured row counts there (least squares: one noisy count cannot make a row look free); with one measured
        count, or none there, the nearest scaled by the prior shape STEP_FIXED_ROWS + R; before any, the prior. A
        count not measured in the last STALE_STEPS steps is left out: what was measured then may no longer hold
        (the policy stopped choosing it), and the prior's shape lets drafts be tried again."""
        points = [(r, t) for r, t in self.decode_s.items()
                  if low <= r <= high and self.steps - self.last[r] <= STALE_STEPS]
        if len({r for r, _ in points}) >= 2:
            mean_r = sum(r for r, _ in points) / len(points)
            mean_t = sum(t for _, t in points) / len(points)
            slope = (sum((r - mean_r) * (t - mean_t) for r, t in points)
                     / sum((r - mean_r) ** 2 for r, _ in points))
            if slope > 0 and mean_t - slope * mean_r > -slope:  # a step of one row costs something
                return mean_t - slope * mean_r, slope
        if not self.decode_s:
            return STEP_FIXED_ROWS, 1.0
        mid = (low + high) / 2
        near = min(self.decode_s, key=lambda r: abs(r - mid))
        per_row = self.decode_s[near] / (STEP_FIXED_ROWS + near)
        return STEP_FIXED_ROWS * per_row, per_row


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

    writes_ahead = False  # it writes no K/V (mtp_drafter.py's does)

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
    costs: StepCosts = field(default_factory=StepCosts)
    # A drafter that reads every step's rows (the MTP head: `observes`) costs a pass a step whether anyone drafts:
    # its running seconds a decode-only step, and what this step's drafts could gain, in plain tokens, were they
    # accepted at PROBE_RATE (propose adds each request's, the scheduler zeroes it as it plans a step)
    observe_s: float | None = None
    step_gain: float = 0.0

    def draft_costs(self, step: StepRows, k_max: int) -> list[float]:
        """What 1..k_max drafts of one request add to the step, in units of that request's plain token (its share of
        a decode step of step.requests rows). In a step that carries a prompt chunk the step runs per op, not as
        decode rows, and a verifying request there costs more than its rows at the chunk's rate: priced as not
        paying."""
        if step.prefill:
            return [math.inf] * k_max
        fixed, per_row = self.costs.decode_line(step.requests / 2, step.rows + k_max)
        share = fixed / step.requests + per_row
        return [k * per_row / share for k in range(1, k_max + 1)]

    def observe(self, plan, seconds: float) -> None:
        """Fold one step's wall time into the running step costs (steps with a prompt chunk say nothing here)."""
        if not plan.prefill:
            self.costs.observe(len(plan.decode) + sum(1 + len(plan.drafts[r]) for r in plan.verify), seconds)

    def propose(self, request, limit: int, step: StepRows | None = None, grow=None) -> list[int]:
        """Drafts for a decode request this step (at most `limit`); [] when it decodes plainly. `step`: the step being
        planned (None: a decode step of this request alone). `grow(request, tokens)`: makes the request's pages hold
        `tokens` tokens, called before a drafter that writes its draft rows' K/V ahead (the MTP head) drafts."""
        state = request.speculative
        if request.images is not None or limit <= 0 or state.retired:
            return []
        k_max = min(self.max_tokens, limit)
        costs = self.draft_costs(step or StepRows(), k_max)
        if getattr(self.drafter, "observes", False):  # what drafts could gain here: observing_pays
            self.step_gain += draft_choice(PROBE_RATE, costs)[1] - 1
        k = draft_len(state.rate, costs) if self.adaptive else k_max
        if k == 0:
            state.idle_steps += 1
            # a probe only where drafts that mostly hit would pay: in a crowded step even it is a loss
            if state.idle_steps < PROBE_EVERY or draft_len(PROBE_RATE, costs[:1]) == 0:
                return []
            k = 1
        state.idle_steps = 0
        if grow is not None and k > 1 and getattr(self.drafter, "writes_ahead", False):
            grow(request, request.num_cached + k - 1)
            if request.finished:  # its pages could not be had (the scheduler failed it)
                return []
        return self.drafter.propose(request, k)[:k]

    def observed(self, seconds: float) -> None:
        """The drafter's pass after a decode-only step took `seconds` (the MTP head over the kept rows)."""
        old = self.observe_s
        self.observe_s = seconds if old is None else old + STEP_TIME_SMOOTHING * (seconds - old)

    def observing_pays(self, step: StepRows) -> bool:
        """Whether a drafter that reads every step's rows should read this one's: its pass (observe_s) costs less
        than what the step's drafts could gain (step_gain plain tokens, drafts accepted at PROBE_RATE, each token a
        1 / requests share of a plain step of this many requests, priced from the measured step times). A question
        of load, not of one request's luck: a request whose drafts miss drafts nothing (draft_len) but stays read.
        Where it does not pay (a crowded step on a CPU, where a draft row costs nearly a request's share), the
        step's requests are retired from drafting: a request the head skipped has holes in the head's K/V, so it is
        not drafted for again (requests that start later are). Not decided before both costs were measured, nor in
        a step with a prompt chunk (drafts never ride there, and the chunk passes soon)."""
        if not self.adaptive or self.observe_s is None or step.prefill or not self.costs.decode_s:
            return True
        fixed, per_row = self.costs.decode_line(step.requests / 2, step.rows)
        plain_s = fixed + per_row * step.requests
        return self.step_gain * plain_s / step.requests >= self.observe_s

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


def verify_step(logits: torch.Tensor, plan, argmax: torch.Tensor | None = None) -> list[list[Sampled]]:
    """The tokens each of `plan.sampling` gets in a step that verifies drafts (one for a plain row, sampled by
    engine/sampler.py's `sample`; 1..k+1 for a verifying request, by `verify`), from logits rows in the runner's
    order: one per plain request, 1 + k per verifying request (`argmax`: each row's argmax where the model computed
    it, else None). A step without drafts calls `sample` itself (Engine._run)."""
    drafts = plan.drafts
    plain_rows, spans, row = [], [], 0
    for request in plan.sampling:
        n = 1 + len(drafts.get(request, ()))
        spans.append((row, n))
        if n == 1:
            plain_rows.append(row)
        row += n
    plain = [r for r in plan.sampling if r not in drafts]
    picked = iter(sample(logits[plain_rows], plain, None if argmax is None else argmax[plain_rows]) if plain else [])
    out = []
    for request, (first, n) in zip(plan.sampling, spans):
        out.append([next(picked)] if n == 1 else verify(logits[first:first + n], request, drafts[request],
                                                         None if argmax is None else argmax[first:first + n]))
    return out


def verify(logits: torch.Tensor, request, drafts: list[int], argmax: torch.Tensor | None = None) -> list[Sampled]:
    """The tokens a request keeps from logits [1 + k, V] of its rows (`argmax`: each row's, where the model computed
    it): the accepted drafts and one of its own. Stops early at a stop token or the token budget (the tokens after it
    would never be kept)."""
    out: list[Sampled] = []
    stops = request.stop_ids
    room = request.max_new_tokens - len(request.output_ids)
    for j in range(len(drafts) + 1):
        row = _Row(request.params, request.generator, request.prompt_ids,
                   request.output_ids + [s.token_id for s in out], request.grammar)
        draft = drafts[j] if j < len(drafts) else None
        if request.params.greedy or draft is None:
            choice = sample(logits[j:j + 1], [row], None if argmax is None else argmax[j:j + 1])[0]
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
