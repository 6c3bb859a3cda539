"""A request's life in the engine: what the client asked for, its state between steps, and its output stream."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import torch

from deltaserve.engine.multimodal import PromptImages
from deltaserve.text.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop. temperature 0 is greedy."""

    max_tokens: int | None = None  # None: the server's default (a setting), capped by --max-new-tokens-cap
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: drawn from the engine's seed
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the chosen token only; n: plus the top n
    skip_special_tokens: bool = True
    grammar: str | None = None  # an llguidance grammar (from a JSON schema) the output must follow
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); OpenAI's range is [-100, 100]
    # None: off; n: each prompt token's log-probability and the top n (the first token's is None); with it
    # max_tokens may be 0: the prompt is scored and nothing generated
    prompt_logprobs: int | None = None
    # the ids that close a thinking block (`</think>`): the output is thinking until they come; (): it does not think
    reasoning_end: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and self.max_tokens < least:
            problems.append(f"max_tokens {self.max_tokens} must be at least {least}"
                            + ("" if least == 0 else " (0 only with prompt_logprobs)"))
        if self.temperature < 0:
            problems.append(f"temperature {self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            problems.append(f"top_k {self.top_k} must be >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p {self.min_p} must be in [0, 1]")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty {self.repetition_penalty} must be > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs {self.logprobs} must be in 0..20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            problems.append(f"prompt_logprobs {self.prompt_logprobs} must be in 0..20")
        bias = dict(self.logit_bias)
        bad_bias = next(((t, b) for t, b in bias.items() if t < 0 or not -100 <= b <= 100), None)
        if bad_bias is not None:
            problems.append(f"logit_bias {{{bad_bias[0]}: {bad_bias[1]}}}: token ids must be >= 0 and biases in "
                            f"[-100, 100]")
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "reasoning_end", tuple(self.reasoning_end))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass
class TokenLogprob:
    """Log-probability of a chosen token under the raw model distribution, and the `top` most likely ones (both None
    for a prompt's first token: nothing predicts it)."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] | None


@dataclass
class RequestOutput:
    """One event of a request's stream: the delta since the previous one."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    cached_tokens: int = 0  # of prompt_tokens, how many came from the prefix cache
    speculative: dict[str, int] | None = None  # {"drafted", "accepted"} so far, when the engine speculates
    stop: str | int | None = None  # what ended a "stop": the stop string matched, or the stop / EOS token id
    # with the request's first output when it asked for prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # of completion_tokens, those before params.reasoning_end (all of them while it has not come); 0: no thinking
    reasoning_tokens: int = 0


class RequestStream:
    """The outputs of one request, read either blocking (`for out in stream`) or from asyncio (`async for`).

    The engine thread calls `put`; an async reader binds the stream to the loop that iterates it.
    """

    def __init__(self, request_id: str, prompt_tokens: int = 0):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens  # as the engine counts them (images widened)
        self._cond = threading.Condition()
        self._items: deque[RequestOutput] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_items: asyncio.Queue | None = None
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        """Deliver one output (engine side, any thread)."""
        with self._cond:
            self.finished = self.finished or output.finished
            if self._loop is None:
                self._items.append(output)
                self._cond.notify_all()
                return
            try:
                self._loop.call_soon_threadsafe(self._async_items.put_nowait, output)
            except RuntimeError:
                pass  # the reader's loop has closed: nobody is listening any more

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                output = self._items.popleft()
            yield output
            if output.finished:
                return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        with self._cond:
            self._loop = asyncio.get_running_loop()
            self._async_items = asyncio.Queue()
            for output in self._items:
                self._async_items.put_nowait(output)
            self._items.clear()
        while True:
            output = await self._async_items.get()
            yield output
            if output.finished:
                return

    def drain(self) -> list[RequestOutput]:
        """Every output delivered so far and not yet read (blocking readers only)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
        return items


@dataclass(eq=False)  # identity hash: a Request is the owner key in the pools
class Request:
    """A request inside the engine: its tokens, how far the caches hold them, and how it stops."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # the reservation's new-token budget; the request can never use more
    reserved_pages: int  # KV pages its reservation holds in the ledger
    stream: RequestStream
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    generator: torch.Generator
    arrival_s: float
    reservation: object = None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V (and GDN state) the caches hold
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    checkpoint_at: list[int] = field(default_factory=list)  # prompt positions where pages and GDN state are stored
    boundaries: tuple[int, ...] = ()  # prompt positions where chat messages end (from the chat template)
    finish_reason: str | None = None
    first_token_s: float | None = None
    grammar: object = None  # (Grammars, its matcher) when params.grammar is set
    images: PromptImages | None = None  # the prompt's images (engine/multimodal.py), when it has any
    speculative: object = None  # engine/speculative.py SpecState, when the engine speculates
    # the prompt's log-probabilities scored so far (params.prompt_logprobs), until the first output carries them
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reasoning_tokens: int = 0  # generated tokens before params.reasoning_end (RequestOutput.reasoning_tokens)
    detokenizer: IncrementalDetokenizer = field(init=False)
    stop_matcher: StopStringMatcher = field(init=False)

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_ids,
                                                  skip_special_tokens=self.params.skip_special_tokens)
        self.stop_matcher = StopStringMatcher(list(self.params.stop))
        self._thinking = bool(self.params.reasoning_end)  # until the output ends with params.reasoning_end
        self._stop_ids = frozenset(self.params.stop_token_ids) | (
            frozenset() if self.params.ignore_eos else self.eos_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has nothing before it to be predicted from

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end the request (its stop_token_ids, and EOS unless ignored)."""
        return self._stop_ids

    @property
    def cache_ids(self) -> list[int]:
        """The prompt as the prefix cache keys it (an image's tokens stand for its pixels)."""
        return self.prompt_ids if self.images is None else self.images.cache_ids(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefilled(self) -> bool:
        """The whole prompt is in the caches; each step now feeds the last sampled token."""
        return self.num_cached >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, text: str = "", token_ids: list[int] | None = None, logprobs=None,
               finish_reason: str | None = None, error: str | None = None,
               stop: str | int | None = None) -> RequestOutput:
        spec = self.speculative
        prompt, self.prompt_logprobs = self.prompt_logprobs, None  # sent once, with the first output
        return RequestOutput(self.request_id, text, token_ids or [], logprobs, finish_reason is not None,
                             finish_reason, self.prompt_len, len(self.output_ids), error, self.cached_tokens,
                             None if spec is None else {"drafted": spec.drafted, "accepted": spec.accepted}, stop,
                             prompt, self.reasoning_tokens)

    def finish_after_prompt(self) -> RequestOutput:
        """End a request of max_tokens 0 once its prompt is read: "length", no token generated."""
        self.finish_reason = "length"
        return self.output(finish_reason="length")

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Add a sampled token; decide whether the request stops; return the stream's delta.

        A stop token's text and a stop string are not returned; text that may begin a stop string is held back
        until it is clear, and released when the request ends.
        """
        self.output_ids.append(token_id)
        if self._thinking:
            self._count_reasoning()
        reason = stop = None
        text = ""
        if token_id in self._stop_ids:
            reason, stop = "stop", token_id
        else:
            text, hit = self.stop_matcher.push(self.detokenizer.push(token_id))
            reason, stop = ("stop", self.stop_matcher.matched) if hit else (None, None)
        if reason is None and len(self.output_ids) >= self.max_new_tokens:
            reason = "length"
        if reason is not None:
            tail, _ = self.stop_matcher.push(self.detokenizer.flush())
            text += tail + self.stop_matcher.flush()
            self.finish_reason = reason
        return self.output(text, [token_id], [logprob] if logprob is not None else None, reason, stop=stop)

    def _count_reasoning(self) -> None:
        """Count the new token as thinking, or end the thinking when the output now ends with its closing ids."""
        end = self.params.reasoning_end
        if self.output_ids[-len(end):] == list(end):
            self._thinking = False
            self.reasoning_tokens = len(self.output_ids) - len(end)
        else:
            self.reasoning_tokens = len(self.output_ids)
