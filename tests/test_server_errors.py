"""Every bad input to a real `deltaserve serve` gets its status and one clear message in OpenAI's error shape, and the
server keeps answering /health 200 afterwards. The server here has an API key, a queue of one and one running
request, so 401 and 429 can be provoked for real.
"""

import json
import threading
import time

import httpx
import pytest

from server_util import assert_openai_error, running_server

KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}  # raw bodies must say they are JSON (else 415)
MAX_BODY_BYTES = 65536
USER = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server_errors"), "--api-key", KEY, "--max-queue", "1",
                        "--max-running-requests", "1", "--max-total-tokens", "4096",
                        "--max-body-bytes", str(MAX_BODY_BYTES), headers=AUTH, probe_while_loading=True) as s:
        yield s


def _healthy(server) -> None:
    assert server.get("/health").status_code == 200


def test_503_while_loading_then_200(server):
    loading = [r for r in server.loading_answers if r.status_code == 503]
    assert loading, "no request reached the server while the model was loading"
    error = assert_openai_error(loading[0], 503, "loading")
    assert error["code"] == "model_loading"
    assert int(loading[0].headers["Retry-After"]) > 0
    _healthy(server)
    assert server.get("/v1/models", headers=AUTH).status_code == 200


def test_401_without_the_right_key(server):
    body = {"messages": USER, "max_tokens": 2}
    assert_openai_error(server.post("/v1/chat/completions", json=body), 401, "Authorization: Bearer")
    wrong = {"Authorization": "Bearer not-the-key"}
    assert_openai_error(server.post("/v1/chat/completions", json=body, headers=wrong), 401, "invalid API key")
    assert_openai_error(server.get("/v1/models", headers={"Authorization": "Basic abc"}), 401, "Bearer")
    assert server.post("/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    _healthy(server)


BAD_BODIES = [
    (b'{"messages": [', 400, ("not valid JSON",)),
    (b"", 400, ("empty",)),
    (b"[1, 2]", 400, ("request body", "dictionary")),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, ("temperature",)),
    ({"messages": "hello"}, 400, ("messages",)),
    ({"messages": []}, 400, ("messages", "at least 1")),
    ({}, 400, ("messages", "required")),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, ("messages[0].role", "robot")),
    ({"messages": USER, "temperature": "hot"}, 400, ("temperature", "hot")),
    ({"messages": USER, "temperature": 5}, 400, ("temperature", "less than or equal to 2")),
    ({"messages": USER, "top_p": 0}, 400, ("top_p",)),
    ({"messages": USER, "max_tokens": 0}, 400, ("max_tokens", "greater than or equal to 1")),
    ({"messages": USER, "max_tokens": 10**40}, 400, ("max_tokens",)),
    ({"messages": USER, "n": 0}, 400, ("n",)),
    ({"messages": USER, "n": 1000}, 400, ("n", "16")),
    ({"messages": USER, "seed": 2**70}, 400, ("seed",)),
    ({"messages": USER, "stop": [""]}, 400, ("stop", "empty")),
    ({"messages": USER, "stop": 7}, 400, ("stop: must be a string or a list of strings",)),
    ({"messages": USER, "top_logprobs": 3}, 400, ("top_logprobs", "logprobs")),
    ({"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, ("top_logprobs",)),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     ("messages[0].content[0]", "image_url")),
    ({"messages": USER, "stream": "maybe"}, 400, ("stream",)),
    ({"messages": USER, "max_tokens": 100_000}, 400, ("maximum context length is 4096 tokens", "in the prompt")),
    ({"messages": [{"role": "user", "content": "hi " * 5000}], "max_tokens": 4}, 400,
     ("maximum context length is 4096 tokens", "in the prompt")),
    ({"messages": USER, "model": "gpt-4o"}, 404, ("'gpt-4o' does not exist",)),
]


@pytest.mark.parametrize("body,status,fragments", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_chat_request(server, body, status, fragments):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    error = assert_openai_error(server.post("/v1/chat/completions", headers=JSON_AUTH, **kwargs), status, *fragments)
    assert error["type"] == "invalid_request_error"
    _healthy(server)


BAD_COMPLETIONS = [
    ({"prompt": []}, 400, ("prompt: must be", "non-empty")),
    ({"prompt": ""}, 400, ("prompt: must be", "non-empty")),
    ({"prompt": [[1, 2], []]}, 400, ("prompt: must be",)),
    ({"prompt": [10**9]}, 400, ("token id 1000000000", "vocabulary")),
    ({"prompt": 5}, 400, ("prompt",)),
    ({"prompt": "hi", "logprobs": 99}, 400, ("logprobs",)),
    ({"prompt": "hi", "suffix": "end"}, 400, ("suffix", "not supported")),
    ({"prompt": "hi", "best_of": 3}, 400, ("best_of",)),
    ({"prompt": ["a"] * 20}, 400, ("16",)),
    ({"prompt": "hi", "model": "other"}, 404, ("'other' does not exist",)),
]


@pytest.mark.parametrize("body,status,fragments", BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_bad_completions_request(server, body, status, fragments):
    assert_openai_error(server.post("/v1/completions", headers=AUTH, json=body), status, *fragments)
    _healthy(server)


def test_unknown_route_and_wrong_method(server):
    assert_openai_error(server.get("/v1/nothing", headers=AUTH), 404, "/v1/nothing")
    assert_openai_error(server.get("/v1/chat/completions", headers=AUTH), 405, "GET /v1/chat/completions")
    _healthy(server)


def test_413_over_the_body_limit(server):
    body = json.dumps({"messages": USER, "user": "x" * MAX_BODY_BYTES}).encode()
    assert_openai_error(server.post("/v1/chat/completions", headers=JSON_AUTH, content=body), 413,
                        str(MAX_BODY_BYTES))

    def chunks():  # no Content-Length: the limit is enforced on the streamed body itself
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    assert_openai_error(server.post("/v1/chat/completions", headers=JSON_AUTH, content=chunks()), 413,
                        str(MAX_BODY_BYTES))
    _healthy(server)


def test_a_body_that_is_not_declared_json_is_refused(server):
    # A browser form posts text/plain without a CORS preflight (CSRF): it must not reach the model.
    body = json.dumps({"messages": USER, "max_tokens": 2, "temperature": 0})
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = server.post("/v1/chat/completions", content=body, headers={**AUTH, "Content-Type": content_type})
        assert_openai_error(r, 415, "application/json", content_type)
    _healthy(server)


def _open_stream(server, max_tokens: int):
    """A streaming chat request, open; (client, response) to close later."""
    client = httpx.Client(timeout=300, trust_env=False)
    body = {"messages": USER, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    request = client.build_request("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH)
    response = client.send(request, stream=True)
    assert response.status_code == 200
    return client, response


def test_429_with_retry_after_when_the_queue_is_full(server):
    client_a, running = _open_stream(server, 2000)
    lines = running.iter_lines()
    assert sum(next(lines).startswith("data: ") for _ in range(4)) >= 2  # role chunk + a token: it runs
    assert server.metric("deltaserve_requests_running") == 1
    waiting_result: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: waiting_result.append(
        server.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "max_tokens": 2}, timeout=600)))
    waiter.start()
    give_up = time.monotonic() + 60
    while server.metric("deltaserve_requests_waiting") < 1:
        assert time.monotonic() < give_up, "the second request never queued"
        time.sleep(0.1)
    full = server.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "max_tokens": 2})
    assert_openai_error(full, 429, "--max-queue 1")
    assert int(full.headers["Retry-After"]) >= 1
    _healthy(server)
    running.close()  # the running client leaves: the queued one runs and is answered
    client_a.close()
    waiter.join(timeout=300)
    assert waiting_result and waiting_result[0].status_code == 200
    assert server.metric("deltaserve_requests_refused_total", '{reason="queue_full"}') >= 1


def test_errors_are_counted_in_metrics(server):
    text = server.get("/metrics", headers=AUTH).text
    assert 'deltaserve_http_errors_total{status="400",type="invalid_request_error"}' in text
    assert 'deltaserve_http_errors_total{status="401",type="invalid_request_error"}' in text


def test_n_beyond_running_plus_queue_is_400_not_429_forever(server):
    """n copies beyond --max-running-requests 1 + --max-queue 1 could never be admitted together: 400 with the
    arithmetic on an idle server; n at the limit is served."""
    too_many = server.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "max_tokens": 2, "n": 3})
    assert_openai_error(too_many, 400, "3 choices", "at most 2", "--max-queue 1")
    assert too_many.json()["error"]["param"] == "n"
    at_limit = server.post("/v1/chat/completions", headers=AUTH, json={"messages": USER, "max_tokens": 2, "n": 2})
    assert at_limit.status_code == 200 and len(at_limit.json()["choices"]) == 2
    _healthy(server)
