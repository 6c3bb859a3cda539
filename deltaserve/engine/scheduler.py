"""Continuous batching: waiting and running queues, admission against the ledger, and one step's plan.

Each step feeds one token of every running request whose prompt is read (decode), plus chunks of the prompts
still being read, up to `prefill_chunk_tokens` in all (a prompt that would end within the decode rows the step
leaves unused ends in it); a long prompt is read over several steps, its GDN state carried in its slot. Admission
happens in `admit` (at submit: refuse or queue) and `start_waiting` (a waiting request starts only when its whole
reservation fits beside the running ones), both through engine/admission.py. Pages are allocated lazily as a
sequence grows, never past its reservation.

With a prefix cache, a request that starts takes its hit (shared pages, a loaded GDN checkpoint) and reads its
prompt from there. Its checkpoint positions do not cut its prefill chunks: a position inside a chunk gets a
checkpoint slot reserved before the forward, which writes the GDN state there (a snapshot), and one at a chunk's
end is copied from the request's state slot. A cut chunk would cost a whole step (every layer's fixed costs) for a
few tokens: at 9.6K tokens of history a turn's 1,700 new tokens took 6 steps instead of 4. Pages only the cache
holds count as free: they are evicted when a request grows into them, so the reservations alone still decide
admission.

With speculation (engine/speculative.py), a decode request that has drafts is fed them as a chunk of 1 + k rows
(`StepPlan.verify`), their rows taken from the step's chunk budget; `complete` keeps the tokens the verifier
accepted, advances the request by them alone and rolls its GDN state back to the last one kept.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from deltaserve.budget.lines import PROMPT_LOGPROB_ROWS
from deltaserve.cache.kv_pool import KVPool, PoolCorruption, PoolExhausted
from deltaserve.cache.prefix import PrefixCache
from deltaserve.cache.state_pool import StatePool
from deltaserve.engine.admission import AdmissionLedger, AdmissionPolicy, Reservation
from deltaserve.engine.errors import Refused
from deltaserve.engine.request import Request, TokenLogprob
from deltaserve.engine.sampler import Sampled
from deltaserve.engine.speculative import Speculation, SpecState, StepRows


class RequestRefused(Refused):
    """A request that can never run (longer than the context or the pool): 400."""

    def __init__(self, message: str, status: int = 400, reason: str = "invalid_request"):
        super().__init__(status, message, code=reason)
        self.reason = reason


class QueueFull(Refused):
    """The waiting queue is full: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(429, f"the server is busy: {message}", code="queue_full", retry_after_s=retry_after_s)


@dataclass
class StepPlan:
    """What one step feeds: decode requests first (one token each), then verifying requests (their last token and
    drafts), then prefill chunks (request, tokens)."""

    decode: list[Request]
    prefill: list[tuple[Request, int]]
    sampling: list[Request] | None = None  # filled in: decode, verifying, and prefills that read their prompt's end
    # GDN states to write in the middle of a prefill chunk: (request, prompt position, checkpoint slot)
    snapshots: list[tuple[Request, int, int]] = field(default_factory=list)
    verify: list[Request] = field(default_factory=list)  # decode requests fed drafts this step
    observe: bool = True  # an observing drafter (the MTP head) reads this step's rows (Speculation.observing_pays)
    drafts: dict[Request, list[int]] = field(default_factory=dict)  # of each verifying request
    # GDN states after each draft row of a verifying request: (request, rows read, slot in the snapshot tensors)
    draft_snapshots: list[tuple[Request, int, int]] = field(default_factory=list)
    # filled in by the runner: each prompt_logprobs request's scores of the prompt tokens after its chunk's rows,
    # as (logprob, top [(token id, logprob)]) per token, in prompt order
    prompt_scores: dict[Request, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sampling is None:
            self.sampling = self.decode + self.verify + [r for r, n in self.prefill
                                                          if r.num_cached + n >= r.prompt_len]

    @property
    def sequences(self) -> list[tuple[Request, int]]:
        return step_sequences(self.decode, self.verify, self.drafts, self.prefill)

    @property
    def requests(self) -> list[Request]:
        return self.decode + self.verify + [r for r, _ in self.prefill]


def step_sequences(decode: list[Request], verify: list[Request], drafts: dict[Request, list[int]],
                   prefill: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """(request, rows it feeds) in a step's order: decode rows, verifying rows (last token and drafts), prefill."""
    return [(r, 1) for r in decode] + [(r, 1 + len(drafts[r])) for r in verify] + prefill


class Scheduler:
    """Owns the queues; the only place requests are admitted, started, advanced and finished."""

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, policy: AdmissionPolicy, *,
                 prefill_chunk_tokens: int, token_names=None, prefix_cache: PrefixCache | None = None,
                 checkpoint_interval_tokens: int = 0, speculation: Speculation | None = None):
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.policy = policy
        self.ledger = AdmissionLedger(policy)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_cache = prefix_cache
        self.checkpoint_interval_tokens = checkpoint_interval_tokens  # 0: no periodic checkpoints
        self.speculation = speculation  # None: one token a step per decode request
        self.token_names = token_names or (lambda token_id: "")  # token id -> text, for logprobs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_by_reason: Counter[str] = Counter()
        self.refused_by_reason: Counter[str] = Counter()
        self.seconds_per_token = 0.05  # running estimate of one decode step, for Retry-After

    # -- admission --------------------------------------------------------------------------------------------

    def admit(self, prompt_tokens: int, max_tokens: int | None) -> Reservation:
        """The reservation of a new request, or RequestRefused (never fits) / QueueFull (wait and retry)."""
        refusal = self.policy.refusal(prompt_tokens, max_tokens)
        if refusal is not None:
            self.refused_by_reason[refusal.code] += 1
            raise RequestRefused(refusal.message, 400, refusal.code)
        self.start_waiting()  # a request that could start now is not waiting: only the rest count against the queue
        if self.policy.queue_full(len(self.waiting)):
            self.refused_by_reason["queue_full"] += 1
            retry = self.retry_after_s()
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (--max-queue "
                            f"{self.policy.max_queue}); retry in {retry:.0f} s", retry)
        return self.policy.reservation(prompt_tokens, max_tokens)

    def retry_after_s(self) -> float:
        """When a slot is likely to free up: the shortest remaining generation of a running request."""
        remaining = [r.max_new_tokens - len(r.output_ids) for r in self.running]
        return float(max(1, math.ceil(min(remaining, default=1) * self.seconds_per_token)))

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def start_waiting(self) -> None:
        """Move waiting requests (first come, first served) to running while their reservations fit."""
        while self.waiting:
            request = self.waiting[0]
            if not self.ledger.try_admit(request, request.reservation):
                return
            self.waiting.popleft()
            self.state_pool.take(request)
            self.running.append(request)
            if self.speculation is not None:
                request.speculative = SpecState()
            if self.prefix_cache is not None and request.params.prompt_logprobs is None:
                self._take_hit(request)  # a request scoring its prompt computes every position: no hit to skip them

    def _take_hit(self, request: Request) -> None:
        """Start the request from its cached prefix and pick where its prefill stores pages and GDN checkpoints."""
        cache = self.prefix_cache
        limit = request.prompt_len - 1  # the prompt's last token is computed here, for its logits
        hit, kv_depth = cache.lookup(request.cache_ids, limit)
        depth = cache.attach(request, hit, self.state_pool)
        request.num_cached = request.cached_tokens = depth
        # Where reuse comes (Marconi): the prompt's end less its last token (the deepest an identical prompt can hit,
        # and one token short of a prompt that extends it), its chat message boundaries (the server passes them:
        # the end of the last message before the generation prompt among them), where it branches off a cached
        # prompt (the next sibling hits there), and every N tokens of a long prefill. The end of the generation
        # is stored as the request finishes.
        positions = {request.prompt_len - 1, kv_depth, *request.boundaries}
        step = self.checkpoint_interval_tokens
        if step > 0:
            positions.update(range(step, request.prompt_len + 1, step))
        request.checkpoint_at = sorted(p for p in positions if depth < p <= request.prompt_len)

    # -- one step ---------------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> StepPlan | None:
        """Start what fits, pick this step's tokens and make sure their pages exist; None when idle."""
        self.start_waiting()
        decode = [r for r in self.running if r.prefilled]
        prefill = []
        budget = self.prefill_chunk_tokens
        drafts, observe = self._drafts(decode, budget)
        decode = [r for r in decode if not r.finished]  # a drafter's pages could not be had (_drafts)
        budget -= sum(map(len, drafts.values()))
        # The ledger prices a step of a chunk beside one decode row per state slot. A prompt whose rest fits in the
        # chunk plus the decode rows this step leaves unused ends in it: a step of its own for the last few tokens
        # reads every weight again.
        spare = self.policy.state_slots - len(decode)
        scored_rows = PROMPT_LOGPROB_ROWS  # prompt_logprobs rows this step may still return (the ledger's bound)
        for request in self.running:
            if budget <= 0:
                break
            if not request.prefilled:
                left = request.prompt_len - request.num_cached
                n = min(left, budget)
                if n < left <= budget + spare and self._scores_fit(request.num_cached, left):
                    n = left
                if request.images is not None:  # ... and before an image the tower has not encoded yet
                    n = min(n, request.images.ready_until(request.num_cached) - request.num_cached)
                    if n <= 0:
                        continue
                if request.params.prompt_logprobs is not None:
                    n = min(n, scored_rows)
                    if n <= 0:
                        continue
                    scored_rows -= n
                prefill.append((request, n))
                spare -= max(0, n - budget)
                budget -= n
        verify = [r for r in decode if r in drafts]
        decode = [r for r in decode if r not in drafts]
        # pages first (in the step's order), then the plan of what still runs: a growth can fail a request
        for request, n in step_sequences(decode, verify, drafts, prefill):
            self._grow(request, request.num_cached + n)
        verify = [r for r in verify if not r.finished]
        plan = StepPlan([r for r in decode if not r.finished], [(r, n) for r, n in prefill if not r.finished],
                        verify=verify, drafts={r: drafts[r] for r in verify})
        if self.prefix_cache is not None and self.prefix_cache.checkpoints is not None:
            plan.snapshots = self._reserve_snapshots(plan.prefill)
        if verify and self.speculation.snapshot_pool is not None:
            plan.draft_snapshots = [(r, j, self.speculation.snapshot_slot(self.state_pool.slot(r), j))
                                    for r in verify for j in range(1, len(drafts[r]) + 1)]
        plan.observe = observe or bool(plan.prefill)
        return plan if plan.decode or plan.prefill or plan.verify else None

    def _drafts(self, decode: list[Request], budget: int) -> tuple[dict[Request, list[int]], bool]:
        """Each decode request's drafts this step, within the chunk's rows and its own token budget (its last
        token and k drafts yield at most k + 1 tokens, so its KV never passes its reservation), each priced on this
        step: its decode rows so far, and whether a prompt chunk will ride in it. And whether an observing drafter
        (the MTP head) reads the step's rows (Speculation.observing_pays)."""
        drafts: dict[Request, list[int]] = {}
        if self.speculation is None:
            return drafts, True
        step = StepRows(len(decode), len(decode), any(not r.prefilled for r in self.running))
        self.speculation.step_gain = 0.0
        for request in decode:
            limit = min(self.speculation.max_tokens, request.max_new_tokens - len(request.output_ids) - 1, budget)
            proposed = self.speculation.propose(request, limit, step, grow=self._grow)
            if proposed:  # [] where its pages could not be had (propose)
                drafts[request] = proposed
                budget -= len(proposed)
                step.rows += len(proposed)
        return drafts, self.speculation.observing_pays(step)

    def _scores_fit(self, cached: int, rows: int) -> bool:
        """Whether `rows` prompt rows after `cached` stay within the attention workspace the ledger prices: the
        scores of one chunk over the longest context (budget/lines.py's attention line)."""
        return rows * (cached + rows) <= self.prefill_chunk_tokens * self.policy.context_length

    def _reserve_snapshots(self, prefill: list[tuple[Request, int]]) -> list[tuple[Request, int, int]]:
        """A checkpoint slot for each checkpoint position strictly inside a prefill chunk (the forward writes the
        GDN state there); positions whose slot cannot be had are stored without a checkpoint."""
        snapshots = []
        for request, n in prefill:
            for p in request.checkpoint_at:
                if request.num_cached < p < request.num_cached + n:
                    slot = self.prefix_cache.reserve_checkpoint((request, p))
                    if slot is not None:
                        snapshots.append((request, p, slot))
        return snapshots

    def _grow(self, request: Request, num_tokens: int) -> None:
        """Pages for `num_tokens` tokens, within the reservation; an allocation failure fails only this request."""
        try:
            if self.kv_pool.pages_for(num_tokens) > request.reserved_pages:
                raise PoolExhausted(f"request needs {self.kv_pool.pages_for(num_tokens)} pages, "
                                    f"beyond its reservation of {request.reserved_pages}")
            missing = self.kv_pool.pages_for(num_tokens) - len(self.kv_pool.pages(request))
            if self.prefix_cache is not None and missing > self.kv_pool.free_pages:
                self.prefix_cache.evict(missing - self.kv_pool.free_pages)
            self.kv_pool.ensure(request, num_tokens)
        except PoolExhausted as e:
            self.finish(request, "error", f"KV allocation failed: {e}")

    def complete(self, plan: StepPlan, sampled: list[Sampled | list[Sampled]]) -> list[tuple[Request, Exception]]:
        """Advance the caches' fill, append the sampled tokens, stream the deltas, finish what stopped.

        `sampled`: per request of plan.sampling, its token (engine/sampler.py's `sample`), or its tokens
        (engine/speculative.py's `verify_step`, in a step that verifies drafts).

        A request whose own token fails (decoding, a stop check) is returned with its error, for the engine to
        fail alone; the others in the step go on."""
        failures = []
        snapshots = {(r, p) for r, p, _ in plan.snapshots}
        for request, n in plan.sequences:
            # (not when ended early by an allocation failure at schedule time; a verifying request advances by
            # the tokens it keeps, below)
            if not request.finished and request not in plan.drafts:
                start = request.num_cached
                request.num_cached += n
                if request.images is not None:
                    request.images.release_read(request.num_cached)
                if self.prefix_cache is not None and start < request.prompt_len:
                    self._store_checkpoints(request, start, snapshots)
        self.prompt_tokens_total += sum(n for _, n in plan.prefill)
        for request, _ in plan.prefill:
            if request.params.prompt_logprobs is not None and not request.finished:
                self._add_prompt_logprobs(request, plan.prompt_scores.get(request, []))
        for request, choices in zip(plan.sampling, sampled):
            if request.finished:
                continue
            if request.max_new_tokens == 0:  # max_tokens 0: the prompt is scored, its sampled token dropped
                request.stream.put(request.finish_after_prompt())
                self._release(request, "length")
                continue
            choices = choices if isinstance(choices, list) else [choices]
            if request in plan.drafts:
                self._record_drafts(request, plan.drafts[request], choices)
            outputs = []
            for choice in choices:
                try:
                    outputs.append(request.append_token(choice.token_id, self._logprob(request, choice)))
                except Exception as e:
                    failures.append((request, e))
                    break
                if outputs[-1].finished:
                    break
            if request in plan.drafts and outputs:
                self._keep(request, len(outputs), len(plan.drafts[request]))
            self.generation_tokens_total += len(outputs)
            for output in outputs:
                request.stream.put(output)
            if outputs and outputs[-1].finished:
                self._release(request, outputs[-1].finish_reason)
        return failures

    def _record_drafts(self, request: Request, drafts: list[int], choices: list[Sampled]) -> None:
        accepted = 0
        while accepted < min(len(drafts), len(choices)) and choices[accepted].token_id == drafts[accepted]:
            accepted += 1
        request.speculative.record(len(drafts), accepted)
        self.speculation.drafted_total += len(drafts)
        self.speculation.accepted_total += accepted
        self.speculation.verify_steps_total += 1

    def _keep(self, request: Request, kept: int, drafted: int) -> None:
        """A verifying request keeps `kept` of its 1 + drafted rows fed (its last token and the accepted drafts
        before its newest token): the caches hold exactly those, its GDN state is the one after them."""
        request.num_cached += kept
        if kept < 1 + drafted and self.speculation.snapshot_pool is not None:
            self.speculation.roll_back(self.state_pool, self.state_pool.slot(request), kept)

    def _store_checkpoints(self, request: Request, start: int, snapshots: set) -> None:
        """Store the request's pages up to each checkpoint position this step read past, with the GDN state there:
        a snapshot inside the chunk, the request's own state slot at its end."""
        tokens = None
        for p in request.checkpoint_at:
            if start < p <= request.num_cached:
                tokens = tokens if tokens is not None else request.cache_ids
                if p == request.num_cached:
                    self.prefix_cache.store(request, tokens, p, self.state_pool)
                else:
                    key = (request, p)
                    self.prefix_cache.store(request, tokens, p, snapshot=key if key in snapshots else None)

    def _add_prompt_logprobs(self, request: Request, scores: list[tuple[float, list[tuple[int, float]]]]) -> None:
        """Name the scored prompt tokens (the ones after those already scored) and keep them for the first output."""
        if request.prompt_logprobs[0] is None:  # the first token, named, with no log-prob (nothing predicts it)
            request.prompt_logprobs[0] = TokenLogprob(request.prompt_ids[0], self.token_names(request.prompt_ids[0]),
                                                      None, None)
        first = len(request.prompt_logprobs)
        for token_id, (logprob, top) in zip(request.prompt_ids[first:], scores):
            request.prompt_logprobs.append(TokenLogprob(token_id, self.token_names(token_id), logprob,
                                                        [(t, self.token_names(t), lp) for t, lp in top]))

    def _logprob(self, request: Request, choice: Sampled) -> TokenLogprob | None:
        if request.params.logprobs is None or choice.logprob is None:
            return None
        top = [(t, self.token_names(t), lp) for t, lp in choice.top or []]
        return TokenLogprob(choice.token_id, self.token_names(choice.token_id), choice.logprob, top)

    # -- ending -----------------------------------------------------------------------------------------------

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request early (abort or error): free its pages and slot at once and close its stream.

        Only between steps: the engine defers aborts that arrive while a step holds the request."""
        if request.finished:
            return
        request.finish_reason = reason
        self._release(request, reason)
        request.stream.put(request.output(finish_reason=reason, error=error))

    def fail(self, requests: list[Request], error: str) -> None:
        for request in requests:
            self.finish(request, "error", error)

    def abort(self, request: Request) -> None:
        self.finish(request, "abort")

    def _release(self, request: Request, reason: str) -> None:
        self.finished_by_reason[reason] += 1
        if self.prefix_cache is not None and reason in ("stop", "length") and request in self.running:
            # the end of the generation: the state slot holds the state after exactly num_cached tokens, which the
            # next turn repeats when the client sends the answer back verbatim
            self.prefix_cache.store(request, request.cache_ids + request.output_ids, request.num_cached,
                                    self.state_pool)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(request)
            if self.prefix_cache.checkpoints is not None:
                for p in request.checkpoint_at:  # slots reserved for a step that failed before storing them
                    self.prefix_cache.checkpoints.release((request, p))
        if request in self.running:
            self.running.remove(request)
            self.ledger.release(request)
            self.state_pool.release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_pool.free(request)

    def check(self) -> None:
        """Raise PoolCorruption unless pools and ledger agree with the queues (tests and debugging)."""
        self.kv_pool.check()
        self.state_pool.check()
        running = set(self.running)
        problems = []
        if set(self.ledger.reservations) != running:
            problems.append("ledger and running queue differ")
        cache = self.prefix_cache
        if not {o for o in self.kv_pool.owners() if cache is None or not cache.owns(o)} <= running:
            problems.append("a page is held by a request that is not running")
        if self.state_pool.used_slots != len(running):
            problems.append(f"{self.state_pool.used_slots} state slots held by {len(running)} running requests")
        if any(self.kv_pool.capacity(r) > r.reserved_pages * self.kv_pool.page_size for r in self.running):
            problems.append("a request holds more pages than it reserved")
        if cache is not None:
            try:
                cache.check()
            except AssertionError as e:
                problems.append(f"prefix cache: {e}")
        if problems:
            raise PoolCorruption("scheduler: " + "; ".join(problems))
