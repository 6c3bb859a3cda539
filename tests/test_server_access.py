"""Who may talk to a real `deltaserve serve` on 127.0.0.1, and how: the key on every route but /health, the Host and
Content-Type checks that stop a browser page (DNS rebinding, text/plain CSRF), CORS only for named origins, strict
request types, and the slow-client limits (header deadline, connection cap), driven by httpx and raw sockets.
"""

import json
import socket
import time

import httpx
import pytest

from server_util import assert_openai_error, running_server

KEY = "access-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD_ORIGIN = "http://good.example:3000"
EXTRA_HOST = "deltaserve.lan"
HEADER_TIMEOUT_S = 2
MAX_CONNECTIONS = 6
USER = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_access")
    key_file = folder / "key"
    key_file.write_text(KEY + "\n")
    with running_server(folder, "--api-key-file", str(key_file), "--allowed-hosts", EXTRA_HOST,
                        "--allowed-origins", GOOD_ORIGIN, "--header-timeout-s", str(HEADER_TIMEOUT_S),
                        "--max-connections", str(MAX_CONNECTIONS), "--max-total-tokens", "2048",
                        "--max-running-requests", "2") as s:
        yield s


def _chat(server, body, **kwargs):
    return server.post("/v1/chat/completions", json=body, headers={**AUTH, **kwargs.pop("headers", {})}, **kwargs)


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/v1/budget"])
def test_every_route_but_health_needs_the_key(server, path):
    assert_openai_error(server.get(path), 401, "Authorization: Bearer")
    assert_openai_error(server.get(path, headers={"Authorization": "Bearer wrong"}), 401, "invalid API key")
    assert server.get(path, headers=AUTH).status_code == 200
    assert server.get(path, headers={"x-api-key": KEY}).status_code == 200  # Anthropic-style clients
    assert server.get("/health").status_code == 200


def test_post_bodies_must_be_json(server):
    body = json.dumps({"messages": USER, "max_tokens": 1})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = server.post("/v1/chat/completions", content=body, headers={**AUTH, "Content-Type": content_type})
        assert_openai_error(r, 415, "application/json", content_type)
    r = httpx.Request("POST", server.url + "/v1/completions", content=body, headers=AUTH)
    r.headers.pop("content-type", None)  # httpx adds none for raw bytes; make sure
    assert_openai_error(httpx.Client(trust_env=False).send(r), 415, "Content-Type is missing")
    ok = server.post("/v1/chat/completions", content=body,
                     headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("host, allowed", [
    ("localhost", True), ("127.0.0.1:8000", True), ("[::1]:1234", True), (f"{EXTRA_HOST}:80", True),
    ("attacker.example", False), ("attacker.example:8000", False), ("127.0.0.1.attacker.example", False),
])
def test_host_header_is_checked_on_loopback(server, host, allowed):
    r = server.get("/health", headers={"Host": host})
    if allowed:
        assert r.status_code == 200
    else:
        assert_openai_error(r, 403, repr(host), "--allowed-hosts")


def test_cors_only_for_the_named_origin(server):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    good = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": GOOD_ORIGIN, **preflight},
                         trust_env=False)
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == GOOD_ORIGIN
    bad = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight},
                        trust_env=False)
    assert "access-control-allow-origin" not in bad.headers
    read = server.get("/v1/models", headers={**AUTH, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in read.headers


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "n": 1.0}, "n"),
])
def test_strict_types_name_the_field(server, route, body, field):
    error = assert_openai_error(server.post(route, json=body, headers=AUTH), 400, field)
    assert error["param"] == field


def test_floats_still_take_integers(server):
    r = _chat(server, {"messages": USER, "max_tokens": 1, "temperature": 0, "top_p": 1, "presence_penalty": 0})
    assert r.status_code == 200, r.text


def test_lone_surrogate_is_named_with_its_position(server):
    raw = b'{"max_tokens": 1, "messages": [{"role": "user", "content": "ab\\ud800c"}]}'
    r = server.post("/v1/chat/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    error = assert_openai_error(r, 400, "messages[0].content", "character 2", "lone UTF-16 surrogate", "\\ud800")
    assert error["param"] == "messages[0].content"
    paired = raw.replace(b"\\ud800", b"\\ud83d\\ude00")  # a whole pair is an emoji: served
    r = server.post("/v1/chat/completions", content=paired, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket's timeout)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_slow_headers_get_408_and_extra_connections_503(server):
    extra, port = 3, int(server.url.rsplit(":", 1)[1])
    sockets = []
    try:
        for _ in range(MAX_CONNECTIONS + extra):
            s = socket.create_connection(("127.0.0.1", port), timeout=10 * HEADER_TIMEOUT_S)
            s.sendall(b"GET /health HTTP/1.1\r\nHo")  # and never the rest: a byte-by-byte client stalled
            sockets.append(s)
            time.sleep(0.05)  # in order: the first MAX_CONNECTIONS are the ones held
        answers = [_answer(s) for s in sockets]
    finally:
        for s in sockets:
            s.close()
    statuses = [a.split(b" ", 2)[1] for a in answers]
    assert all(a for a in answers), answers  # every stalled client got an answer and was closed: none is held
    assert set(statuses) <= {b"408", b"503"}, answers
    assert statuses.count(b"503") >= extra and b"408" in statuses, statuses
    for answer in answers:
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert ("--header-timeout-s" if b" 408 " in answer else "--max-connections") in error["message"]
    assert server.get("/health").status_code == 200


@pytest.mark.parametrize("bias, words", [
    ({"1": 150}, ["logit_bias", "less than or equal to 100"]),
    ({"1": -100.5}, ["logit_bias", "greater than or equal to -100"]),
    ({"hello": 1}, ["logit_bias", "'hello' is not a token id"]),
    ({"999999999": 1}, ["logit_bias", "token id 999999999 is outside the vocabulary"]),
])
def test_logit_bias_out_of_range_is_refused(server, bias, words):
    r = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logit_bias": bias}, headers=AUTH)
    assert_openai_error(r, 400, *words)


def test_logit_bias_forces_a_token(server):
    # A prompt of the one token itself, echoed, is what that token reads as (no tokenizer load in the test).
    forced = 1000
    body = {"prompt": [forced], "max_tokens": 1, "temperature": 0, "logit_bias": {str(forced): 100}}
    piece = server.post("/v1/completions", json=body, headers=AUTH).json()["choices"][0]["text"]
    echoed = server.post("/v1/completions", json={**body, "echo": True}, headers=AUTH).json()["choices"][0]["text"]
    assert piece and echoed == piece + piece
    plain = {"prompt": [forced], "max_tokens": 1, "temperature": 0}
    unbiased = server.post("/v1/completions", json=plain, headers=AUTH).json()["choices"][0]["text"]
    assert unbiased != piece  # so the bias, not the model, chose it
