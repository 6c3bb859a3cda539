"""deltaserve stress: the streaming client against a raw HTTP peer that answers, refuses, cuts and hangs.

The peer speaks plain HTTP/1.1 over a socket, so every failure the client classifies is a real one:
a 429 body, a stream error event, a connection closed mid-body, a server that never answers.
"""

import asyncio
import json
import time

import httpx
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector

from deltaserve.stress.client import Target, chunk_text, error_text, generation_body, sse_data, stream_generation
from deltaserve.stress.health import parse_metrics, start_time_from_health


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(content=None, finish=None, usage=None) -> bytes:
    choices = [] if usage else [{"index": 0, "delta": {"content": content} if content else {},
                                 "finish_reason": finish}]
    return sse({"object": "chat.completion.chunk", "choices": choices, **({"usage": usage} if usage else {})})


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


async def answer(scenario: str, writer: asyncio.StreamWriter) -> None:
    if scenario == "ok":
        writer.write(STREAM_HEAD + sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        for word in ("one", " two", " three"):
            writer.write(chunk(word))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(chunk(finish="length") + chunk(usage={"prompt_tokens": 40, "completion_tokens": 3})
                     + sse(b"[DONE]"))
    elif scenario == "refuse":
        body = json.dumps({"error": {"message": "the request queue is full (1 waiting)", "type": "x"}}).encode()
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                     + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
    elif scenario == "event_error":
        writer.write(STREAM_HEAD + chunk("a") + sse({"error": {"message": "out of memory in step 7"}}))
    elif scenario == "cut":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100000\r\n\r\n"
                     + chunk("a"))
    elif scenario == "no_finish":
        writer.write(STREAM_HEAD + chunk("a"))
    elif scenario == "hang":
        await asyncio.sleep(30)
    await writer.drain()
    writer.close()


@pytest.fixture
def peer():
    """Start the raw peer on a free port in the test's event loop; yields its base URL."""
    async def start():
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            await answer(path.split("/")[1], writer)

        return await asyncio.start_server(handle, "127.0.0.1", 0)

    return start


def run_scenario(peer, scenario: str, deadline_s: float = 10.0):
    async def go():
        server = await peer()
        port = server.sockets[0].getsockname()[1]
        root = f"http://127.0.0.1:{port}/{scenario}"
        target = Target(root_url=root, api_url=f"{root}/v1", model="m", endpoint="chat")
        body = generation_body(target, "Words: a b", 3, stream=True, force_fields=("ignore_eos",))
        async with httpx.AsyncClient(trust_env=False) as client:
            result = await stream_generation(client, target, body, 0, time.monotonic() + deadline_s)
        server.close()
        return result

    return asyncio.run(go())


def test_a_full_stream_is_timed_and_its_usage_read(peer):
    r = run_scenario(peer, "ok")
    assert r.kind == "ok" and r.failure and r.ok
    assert (r.prompt_tokens, r.completion_tokens, r.text_chunks, r.finish_reason) == (40, 3, 3, "length")
    assert 0 < r.ttft_s < r.last_token_s <= r.e2e_s


def test_429_is_counted_as_refused_with_the_servers_message(peer):
    r = run_scenario(peer, "refuse")
    assert (r.kind, r.status) == ("refused", 429)
    assert r.failure == "HTTP 429 (queue full): the request queue is full (1 waiting)"


@pytest.mark.parametrize("scenario, kind, needle", [
    ("event_error", "stream", "out of memory in step 7"),
    ("cut", "transport", "closed the connection mid-response"),
    ("no_finish", "stream", "without a finish reason"),
])
def test_broken_streams_are_failures_that_say_what_broke(peer, scenario, kind, needle):
    r = run_scenario(peer, scenario)
    assert r.kind == kind and needle in r.error, r


def test_a_server_that_never_answers_is_cut_at_the_deadline(peer):
    r = run_scenario(peer, "hang", deadline_s=0.5)
    assert r.kind == "timeout" and "duration limit" in r.error  # cut by the deadline, not by the server


def test_sse_and_chunk_parsing_cover_chat_and_completions():
    assert sse_data("data: {\"a\": 1}") == "{\"a\": 1}" and sse_data(": keepalive") is None
    assert sse_data("event: x") is None and sse_data("data:[DONE]") == "[DONE]"
    assert chunk_text({"choices": [{"text": "hi", "finish_reason": None}]}) == ("hi", None)
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "r", "content": "c"},
                                    "finish_reason": "stop"}]}) == ("cr", "stop")
    assert chunk_text({"choices": [], "usage": {"prompt_tokens": 1}}) == ("", None)


def test_error_text_reads_openai_and_fastapi_bodies_on_one_line():
    assert error_text(b'{"error": {"message": "prompt 900 + 32000 > pool 67375"}}') == "prompt 900 + 32000 > pool 67375"
    assert error_text(b'{"detail": "Not Found"}') == "Not Found"
    assert error_text(b"Internal\nServer   Error") == "Internal Server Error"
    assert len(error_text(b"x" * 10_000)) <= 160


def test_metrics_give_the_start_time_and_the_waiting_requests():
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    Gauge("deltaserve_requests_waiting", "w", registry=registry).set(3)
    Gauge("vllm:num_requests_waiting", "w", ["model_name"], registry=registry).labels("m").set(2)
    prometheus_client.Histogram("deltaserve_queue_time_seconds", "not a count", registry=registry).observe(7)
    page = generate_latest(registry).decode()
    start, queued = parse_metrics(page)
    assert queued == 5.0
    oracle = {s.name: s.value for family in text_string_to_metric_families(page) for s in family.samples}
    assert start == oracle["process_start_time_seconds"]
    assert parse_metrics("# nothing here\n") == (None, None)


def test_health_bodies_give_a_start_time_from_a_timestamp_or_an_uptime():
    assert start_time_from_health(httpx.Response(200, json={"status": "ok", "start_time": 1234.5})) == 1234.5
    before = time.time()
    from_uptime = start_time_from_health(httpx.Response(200, json={"uptime_s": 100}))
    assert before - 100 <= from_uptime <= time.time() - 100  # now less the uptime, read between the two clocks
    assert start_time_from_health(httpx.Response(200, json={"status": "ok", "uptime": True})) is None
    assert start_time_from_health(httpx.Response(200, text="OK")) is None
