"""OpenAI's event streams: a Generation's outputs (server/generation.py) as chat.completion.chunk and completion
server-sent events, each choice's deltas and finish, the usage chunk, an engine failure as one error event, and
[DONE]. The bodies are openai_translate.py's; the routes are openai.py's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from deltaserve.engine.errors import internal_error
from deltaserve.engine.request import RequestOutput
from deltaserve.server import openai_translate, protocol
from deltaserve.server.generation import Generation, GenerationFailed
from deltaserve.text.chat_output import ChatOutputParser, OutputDelta


async def chat_events(gen: Generation, meta: openai_translate.ResponseMeta, include_usage: bool,
                      token_bytes: Callable[[int], bytes],
                      parsers: list[ChatOutputParser] | None = None) -> AsyncIterator[bytes]:
    """The chat stream: each choice's role, its deltas (text, reasoning, tool calls, with logprobs), its finish;
    usage; [DONE]. `parsers[i]` splits choice i's text (none: the text is all content)."""
    for i in range(len(gen.streams)):
        yield openai_translate.chat_chunk(meta, i, role=True)
    async for i, out in _failures_as_events(gen):
        if isinstance(out, bytes):
            yield out
            return
        parser = parsers[i] if parsers else None
        delta = parser.push(out.text) if parser else OutputDelta(content=out.text)
        if out.finished and parser:
            rest = parser.flush()
            delta = OutputDelta(delta.reasoning + rest.reasoning, delta.content + rest.content,
                                delta.calls + rest.calls)
        if delta or out.logprobs:
            yield openai_translate.chat_chunk(
                meta, i, text=delta.content or (None if delta.reasoning or delta.calls else ""),
                reasoning=delta.reasoning, calls=delta.calls, logprobs=out.logprobs, token_bytes=token_bytes)
        if out.finished:
            yield openai_translate.chat_chunk(meta, i, text=None, finish=out.finish_reason,
                                              called=bool(parser and parser.called))
    if include_usage:
        yield openai_translate.chat_usage_chunk(meta, openai_translate.usage(gen.counts()))
    yield protocol.SSE_DONE


async def completion_events(gen: Generation, meta: openai_translate.ResponseMeta, include_usage: bool,
                            echoes: list[str]) -> AsyncIterator[bytes]:
    """The completions stream: echoed prompts, text deltas (with logprobs), finishes; usage; [DONE]."""
    offsets = [len(e) for e in echoes]
    for i, echo in enumerate(echoes):
        if echo:
            yield openai_translate.completion_chunk(meta, i, echo)
    async for i, out in _failures_as_events(gen):
        if isinstance(out, bytes):
            yield out
            return
        if out.text or out.logprobs:
            yield openai_translate.completion_chunk(meta, i, out.text, logprobs=out.logprobs,
                                                    text_start=offsets[i])
            offsets[i] += len(out.text)
        if out.finished:
            yield openai_translate.completion_chunk(meta, i, "", finish=out.finish_reason)
    if include_usage:
        yield openai_translate.completion_usage_chunk(meta, openai_translate.usage(gen.counts()))
    yield protocol.SSE_DONE


async def _failures_as_events(gen: Generation) -> AsyncIterator[tuple[int, RequestOutput | bytes]]:
    """The merged outputs; a failure becomes one error event and [DONE] (the status line has already gone out)."""
    try:
        async for item in gen.events():
            yield item
    except GenerationFailed as e:
        yield -1, protocol.sse_event(protocol.error_body(e.message, protocol.error_type(e.status),
                                                         code=e.code)) + protocol.SSE_DONE
    except Exception as e:  # an internal failure ends this stream only
        message = internal_error(gen.log, "a stream failed", e)
        yield -1, protocol.sse_event(protocol.error_body(message, "server_error", code="internal_error")) \
            + protocol.SSE_DONE


