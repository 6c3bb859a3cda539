"""The engine requests behind one HTTP request (prompts × n choices), whatever API it came by: its SamplingParams
checked, submitted through the engine's door, read on the event loop as one stream of engine outputs, counted, and
collected whole or relayed as the API's server-sent events (EventStream). It knows no API's bodies: each API's
adapter renders the outputs, results and counts (openai_stream.py, anthropic_stream.py, responses_stream.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from deltaserve.engine.door import Refused, Submission
from deltaserve.engine.engine import Engine
from deltaserve.engine.errors import internal_error
from deltaserve.engine.request import RequestOutput, RequestStream, SamplingParams, TokenLogprob
from deltaserve.server.drain import REFUSED, RETRY_AFTER_S
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.protocol import ProtocolError
from deltaserve.server.state import ApiError, ServerState, refused_error

DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks that its client is still there


@dataclass
class ChoiceResult:
    """One finished choice, in engine terms."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    reasoning: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # an echoed prompt's (SamplingParams.prompt_logprobs)
    tool_calls: list | None = None  # text.tool_parsers.ToolCall


@dataclass(frozen=True)
class TokenCounts:
    """A request's token counts, which every API's usage is rendered from."""

    prompt_tokens: int  # each prompt once, as the engine counts it (images widened)
    completion_tokens: int  # over all choices
    cached_tokens: int = 0  # of prompt_tokens, what the prefix cache supplied
    speculative: dict[str, int] | None = None  # {"drafted", "accepted"} draft tokens, only where speculating
    reasoning_tokens: int = 0  # of completion_tokens, those before the think-end marker, as the engine counted them


class GenerationFailed(Exception):
    """The engine ended a request with an error (or aborted it on its own): that request fails, nothing else."""

    def __init__(self, message: str, status: int = 500, code: str = "internal_error"):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


class Generation:
    """Choice i is engine request `streams[i]` on prompt `prompts[choice_prompt[i]]`."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, prompts: list[list[int]], choice_prompt: list[int],
                 streams: list[RequestStream], received_s: float, log: Callable[[str], None]):
        self.engine, self.metrics, self.log = engine, metrics, log
        self.prompts, self.choice_prompt, self.streams = prompts, choice_prompt, streams
        self.received_s = received_s
        count = len(streams)
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.logprobs: list[list[TokenLogprob] | None] = [None] * count
        self.prompt_logprobs: list[list[TokenLogprob] | None] = [None] * count  # echoed prompts' scores
        self.finish_reasons: list[str | None] = [None] * count
        self.completion_tokens = [0] * count
        self.token_ids: list[list[int]] = [[] for _ in range(count)]  # each choice's output ids (stop reasons)
        self.stops: list[str | int | None] = [None] * count  # what ended each "stop": a stop string or token id
        self.cached_tokens = [0] * count  # prompt tokens each choice took from the prefix cache
        self.speculative: list[dict[str, int] | None] = [None] * count  # each choice's draft counts (--speculative)
        self.reasoning_tokens = [0] * count  # each choice's thinking tokens (RequestOutput.reasoning_tokens)
        # each choice's prompt as the engine counts it (an image's placeholder widened into its tokens)
        self.engine_prompt_tokens = [stream.prompt_tokens for stream in streams]
        self._seen_token = [False] * count
        self._closed = False
        self.failed = False
        self._cut_message: str | None = None  # why the server ended it (shutting down), told to the client

    @property
    def closed(self) -> bool:
        """Its response has ended (or is ending): nothing more reaches the client."""
        return self._closed

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return all(reason is not None for reason in self.finish_reasons)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output delta) as they arrive from any choice; raises GenerationFailed on an engine error."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out, None))
            except Exception as e:  # delivered to the reader, which fails this request
                queue.put_nowait((i, None, e))
            queue.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            open_streams = len(tasks)
            while open_streams:
                i, out, error = await queue.get()
                if error is not None:
                    self.failed = True
                    raise GenerationFailed(internal_error(self.log, "reading an engine stream failed", error))
                if out is None:
                    open_streams -= 1
                    if self.finish_reasons[i] is None:
                        self.failed = True
                        raise GenerationFailed("the engine ended this request's stream without finishing it")
                    continue
                self._record(i, out)
                yield i, out
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The output deltas of an API with one choice (Anthropic, Responses); raises as `events` does."""
        async with aclosing(self.events()) as events:
            async for _, out in events:
                yield out

    def _record(self, i: int, out: RequestOutput) -> None:
        now_s = time.monotonic()
        if out.token_ids and not self._seen_token[i]:
            self._seen_token[i] = True
            self.metrics.time_to_first_token.observe(now_s - self.received_s)
        self.texts[i].append(out.text)
        self.token_ids[i] += out.token_ids
        if out.logprobs:
            self.logprobs[i] = (self.logprobs[i] or []) + list(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[i] = out.prompt_logprobs
        self.completion_tokens[i] = max(self.completion_tokens[i], out.completion_tokens)
        self.cached_tokens[i] = max(self.cached_tokens[i], out.cached_tokens)
        self.reasoning_tokens[i] = out.reasoning_tokens  # the latest: a partly matched marker counted until it ends
        if out.speculative is not None:
            self.speculative[i] = out.speculative
        if not out.finished:
            return
        self.finish_reasons[i], self.stops[i] = out.finish_reason, out.stop
        self.metrics.request_duration.observe(now_s - self.received_s)
        self.failed = self.failed or out.finish_reason in ("error", "abort")
        if out.finish_reason == "error":
            raise GenerationFailed(f"generation failed: {out.error or 'unknown engine error'}")
        if out.finish_reason == "abort" and self._cut_message is not None:
            raise GenerationFailed(self._cut_message, 503, "shutting_down")
        if out.finish_reason == "abort":
            raise GenerationFailed("the request was aborted by the server (shutting down?)", 503, "aborted")

    def results(self) -> list[ChoiceResult]:
        """Each finished choice's whole text, reason and logprobs."""
        return [ChoiceResult(i, "".join(self.texts[i]), self.finish_reasons[i], self.logprobs[i],
                             prompt_logprobs=self.prompt_logprobs[i])
                for i in range(len(self.streams))]

    def counts(self) -> TokenCounts:
        """Prompt tokens count once per prompt (not per choice); completion tokens add up over choices.

        A prompt's cached tokens are its first choice's (the choices of one prompt are computed once each)."""
        first_choice = {}
        for i, p in enumerate(self.choice_prompt):
            first_choice.setdefault(p, i)
        cached = sum(self.cached_tokens[i] for i in first_choice.values())
        prompt_tokens = sum(self.prompt_len(i) for i in first_choice.values())
        counted = [s for s in self.speculative if s is not None]
        speculative = {k: sum(s[k] for s in counted) for k in ("drafted", "accepted")} if counted else None
        return TokenCounts(prompt_tokens, sum(self.completion_tokens), cached, speculative,
                           sum(self.reasoning_tokens))

    def prompt_len(self, i: int) -> int:
        """Choice i's prompt tokens as the engine counts them (image tokens included)."""
        return self.engine_prompt_tokens[i] or len(self.prompts[self.choice_prompt[i]])

    def cut(self, message: str) -> None:
        """End every unfinished choice now, the client told `message` with a 503 (a stream: as its error event)."""
        self._cut_message = message
        for stream, reason in zip(self.streams, self.finish_reasons):
            if reason is None:
                self.engine.abort(stream.request_id)

    def close(self) -> None:
        """Abort every choice that has not finished (the client left, or the request failed); idempotent."""
        if self._closed:
            return
        self._closed = True
        for stream, reason in zip(self.streams, self.finish_reasons):
            if reason is None:
                self.engine.abort(stream.request_id)


def choice_params(build: Callable[[int], SamplingParams], n: int = 1,
                  reasoning_end: tuple[int, ...] = ()) -> list[SamplingParams]:
    """SamplingParams for choices 0..n-1 from an API's translator (`build(choice)`), with a chat's think-end ids
    (PreparedChat.reasoning_end) for the engine to count thinking tokens by; a value SamplingParams refuses is a 400
    saying why (a ProtocolError keeps the field it names)."""
    try:
        return [replace(build(j), reasoning_end=reasoning_end) if reasoning_end else build(j) for j in range(n)]
    except ProtocolError:
        raise
    except ValueError as e:  # SamplingParams' own checks
        raise ApiError(400, str(e)) from None


async def submit(state: ServerState, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 received_s: float, *, images=None, boundaries=(), prompt_param: str = "prompt") -> Generation:
    """One API request handed to the engine's thread (engine/door.py), awaited without blocking the event loop: each
    prompt once per entry of `params` (the n choices), all queued or none; a refusal is the error response it names.
    `images` and `boundaries` belong to a chat's one prompt; `prompt_param` is the field a refused prompt is named
    by."""
    if state.drain.cut:  # admitted before the drain, but reached the engine after its deadline
        raise ApiError(503, REFUSED, code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
    try:
        reply = engine.submit_all(Submission(prompts, params, images, tuple(boundaries), prompt_param))
        streams = await _answer(engine, reply)
    except Refused as e:
        raise refused_error(e) from None
    choice_prompt = [i // len(params) for i in range(len(streams))]
    gen = Generation(engine, state.metrics, prompts, choice_prompt, streams, received_s, state.log)
    state.drain.track(gen)
    return gen


async def _answer(engine: Engine, reply: Future) -> list[RequestStream]:
    """The engine's answer to a submission; if this handler is cancelled first (its client left), the choices the
    engine admits meanwhile are aborted as soon as they exist."""
    try:
        return await asyncio.wrap_future(reply)
    except asyncio.CancelledError:
        def abort_admitted(done: Future) -> None:
            if not done.cancelled() and done.exception() is None:
                for stream in done.result():
                    engine.abort(stream.request_id)

        reply.add_done_callback(abort_admitted)
        raise


async def collect(request: Request, gen: Generation, state: ServerState) -> None:
    """Read every output of a non-streamed request, aborting it if the client leaves meanwhile."""

    async def drain() -> None:
        async for _ in gen.events():
            pass

    task = asyncio.create_task(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                state.metrics.disconnects.inc()
                raise ClientDisconnect()
        task.result()
    except GenerationFailed as e:
        raise ApiError(e.status, e.message, code=e.code) from None
    finally:
        task.cancel()
        gen.close()


class EventStream(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends (finished, error, or client gone)."""

    def __init__(self, events: AsyncIterator[bytes], gen: Generation):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.gen.done and not self.gen.failed:
                self.gen.metrics.disconnects.inc()
            self.gen.close()
