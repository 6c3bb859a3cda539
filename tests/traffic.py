"""Clients of the load and soak tests (and of bench/soak.py), each one asyncio task over httpx against a real server:
ones that stay to the end (their text is checked), ones that leave at a seeded random moment, and ones that send
what a server must refuse (wrong types, not JSON, an oversize prompt, a wrong key). Plus what the server's /metrics
says of its pools, its 5xx answers and its memory.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field

import httpx

COMPLETIONS = "/v1/completions"
LEAVE_AFTER_EVENTS = 12  # a streamed leaver reads 0..this many events before it closes the connection
LEAVE_WITHIN_S = 0.5  # a leaver that never reads closes within this (queued, prefilling or decoding by then)


@dataclass
class Outcome:
    """What one client saw: the status (None: it left before one came), the text and finish of a completion, and
    a failure in words (a client that stays: anything short of a whole answer; a refused one: a 5xx)."""

    kind: str
    status: int | None = None
    text: str = ""
    finish: str | None = None
    failure: str | None = None
    detail: dict = field(default_factory=dict)


def client(base_url: str, api_key: str | None = None, connections: int = 100) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600, limits=limits, trust_env=False)


def greedy(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


async def complete(http: httpx.AsyncClient, body: dict, kind: str = "normal") -> Outcome:
    """A client that stays: a whole completion (streamed or not), or a failure saying what was missing."""
    if not body.get("stream"):
        response = await http.post(COMPLETIONS, json=body)
        out = Outcome(kind, response.status_code)
        if response.status_code != 200:
            out.failure = f"{response.status_code}: {response.text[:300]}"
            return out
        choice = response.json()["choices"][0]
        out.text, out.finish = choice["text"], choice["finish_reason"]
        return out
    async with http.stream("POST", COMPLETIONS, json=body) as response:
        out = Outcome(kind, response.status_code)
        if response.status_code != 200:
            out.failure = f"{response.status_code}: {(await response.aread())[:300]!r}"
            return out
        done = False
        async for line in response.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                out.failure = f"error event: {chunk['error']}"
                continue
            choice = chunk["choices"][0]
            out.text += choice["text"]
            out.finish = choice["finish_reason"] or out.finish
        if out.failure is None and not done:
            out.failure = "the stream ended without [DONE]"
    if out.failure is None and out.finish is None:
        out.failure = "no finish_reason"
    return out


async def leave(http: httpx.AsyncClient, body: dict, rng: random.Random) -> Outcome:
    """A client that leaves at a random moment: after reading a few events of its stream, or (streamed or not)
    after a random fraction of a second, whatever the server is doing with it by then."""
    out = Outcome("leaver")
    if body.get("stream") and rng.random() < 0.6:
        events = rng.randint(0, LEAVE_AFTER_EVENTS)
        async with http.stream("POST", COMPLETIONS, json=body) as response:
            out.status = response.status_code
            read = 0
            async for line in response.aiter_lines():
                if read >= events:
                    break
                read += bool(line)
        out.detail["events_read"] = read
        return out
    try:
        response = await asyncio.wait_for(http.post(COMPLETIONS, json=body), rng.uniform(0, LEAVE_WITHIN_S))
        out.status = response.status_code  # it finished before the client's patience ran out
    except asyncio.TimeoutError:
        pass  # cancelled: httpx closes the connection, the server sees the client gone
    return out


def malformed_request(rng: random.Random, context_tokens: int, max_body_bytes: int) -> tuple[str, dict]:
    """One request a server must refuse with a 4xx: (what it is, httpx request arguments)."""
    kind = rng.choice(["wrong_type", "not_json", "oversize_prompt", "oversize_body", "bad_auth", "no_auth",
                       "text_plain", "unknown_field_type", "empty_body", "bad_token_id"])
    json_headers = {"Content-Type": "application/json"}
    args: dict = {"method": "POST", "url": COMPLETIONS, "headers": json_headers}
    if kind == "wrong_type":
        args["json"] = rng.choice([{"prompt": [1, 2], "max_tokens": "5"}, {"prompt": [1, 2], "stream": "yes"},
                                   {"prompt": [True, False]}, {"prompt": 5}, {"prompt": [1], "n": 1.5}])
    elif kind == "not_json":
        args["content"] = rng.choice([b"{", b"prompt=hi", b"\xff\xfe\x00", b"[1, 2"])
    elif kind == "oversize_prompt":
        args["json"] = {"prompt": [1] * (context_tokens + rng.randint(1, 64)), "max_tokens": 1}
    elif kind == "oversize_body":
        args["content"] = b'{"prompt": "' + b"a" * (max_body_bytes + 1) + b'"}'
    elif kind == "bad_auth":
        args["headers"] = {**json_headers, "Authorization": "Bearer wrong-key"}
        args["json"] = {"prompt": [1, 2], "max_tokens": 1}
    elif kind == "no_auth":
        args["headers"] = {**json_headers, "Authorization": ""}
        args["json"] = {"prompt": [1, 2], "max_tokens": 1}
    elif kind == "text_plain":
        args["headers"] = {"Content-Type": "text/plain"}
        args["content"] = b'{"prompt": [1, 2]}'
    elif kind == "unknown_field_type":
        args["json"] = {"prompt": [1, 2], "temperature": "hot", "stop": {"a": 1}}
    elif kind == "empty_body":
        args["content"] = b""
    else:
        args["json"] = {"prompt": [1, 10 ** 9], "max_tokens": 1}
    return kind, args


async def malformed(http: httpx.AsyncClient, rng: random.Random, context_tokens: int,
                    max_body_bytes: int) -> Outcome:
    """A request the server must refuse: any 4xx is right, a 5xx (or a 2xx) is a failure."""
    kind, args = malformed_request(rng, context_tokens, max_body_bytes)
    response = await http.request(**args)
    out = Outcome("malformed", response.status_code, detail={"what": kind})
    if not 400 <= response.status_code < 500:
        out.failure = f"{kind}: {response.status_code} {response.text[:200]}"
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text as {name{labels}: value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    response = await http.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


def pools_full(m: dict[str, float]) -> bool:
    """Nothing running or waiting, and every KV page and state slot free (cached pages no request holds are free)."""
    return all(m.get(f"deltaserve_{name}", 0) == 0
               for name in ("requests_running", "requests_waiting", "kv_pages_used", "state_slots_used"))


def server_errors(m: dict[str, float]) -> float:
    """5xx answers the server counted (by status label)."""
    return sum(v for k, v in m.items() if k.startswith("deltaserve_http_errors_total{") and 'status="5' in k)


async def until_pools_full(http: httpx.AsyncClient, give_up_s: float = 120) -> dict[str, float]:
    """The metrics once the pools are full again (aborts of clients that left are applied between steps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + give_up_s
    while True:
        m = await metrics(http)
        if pools_full(m) or loop.time() > deadline:
            return m
        await asyncio.sleep(0.1)


@dataclass
class SoakResult:
    """What a soak saw: counts by kind and status, the failures among clients that stayed, 5xx answers, the server's
    memory after warm-up and at the end, and its pools once every client is gone."""

    requests: int
    by_kind: dict[str, int]
    by_status: dict[str, int]
    normal_failures: list[str]
    malformed_failures: list[str]  # refused with anything but a 4xx
    client_5xx: int
    server_5xx: float
    disconnects: float
    rss_warm_bytes: float
    rss_end_bytes: float
    pools_full: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return (not self.normal_failures and not self.malformed_failures and self.client_5xx == 0
                and self.server_5xx == 0 and self.pools_full)


SOAK_MIX = (("normal", 0.5), ("leaver", 0.3), ("malformed", 0.2))
SOAK_PROMPTS = 8  # the normal clients' prompts: each answered alone first, every later answer must equal it
WARM_UP_FRACTION = 0.1  # RSS is read once this share of the requests is done, and again at the end


async def soak(url: str, api_key: str | None, requests: int, *, seed: int = 0, at_once: int = 16,
               max_body_bytes: int = 65536, vocab: int = 160, progress=None) -> SoakResult:
    """`requests` clients, `at_once` at a time, drawn from SOAK_MIX with a seeded generator, against one server
    that requires `api_key`; see SoakResult. Normal clients ask a greedy completion of one of SOAK_PROMPTS prompts
    (streamed or not) and must get exactly the text that prompt gets alone."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with client(url, api_key, connections=at_once + 4) as http:
        context_tokens = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
        prompts = [(random_ids(rng, rng.randint(4, 200), vocab), rng.randint(4, 24)) for _ in range(SOAK_PROMPTS)]
        alone = [await complete(http, greedy(p, n, stream=False)) for p, n in prompts]
        bad = [o.failure for o in alone if o.failure]
        if bad:
            raise RuntimeError(f"the reference answers failed: {bad[0]}")
        plans = [(rng.choices([k for k, _ in SOAK_MIX], [w for _, w in SOAK_MIX])[0], rng.random())
                 for _ in range(requests)]
        slots = asyncio.Semaphore(at_once)
        done = 0
        rss: dict[str, float] = {}
        outcomes: list[Outcome] = []

        async def one(kind: str, own_seed: float) -> None:
            nonlocal done
            own = random.Random(own_seed)
            async with slots:
                if kind == "normal":
                    p = own.randrange(SOAK_PROMPTS)
                    out = await complete(http, greedy(prompts[p][0], prompts[p][1], stream=own.random() < 0.5))
                    if out.failure is None and (out.text, out.finish) != (alone[p].text, alone[p].finish):
                        out.failure = f"prompt {p}: {out.text!r} ({out.finish}) differs from alone: {alone[p].text!r}"
                elif kind == "leaver":
                    body = greedy(random_ids(own, own.randint(1, 400), vocab), own.randint(1, 64),
                                  stream=own.random() < 0.7)
                    out = await leave(http, body, own)
                else:
                    out = await malformed(http, own, context_tokens, max_body_bytes)
            outcomes.append(out)
            done += 1
            if done == max(1, int(requests * WARM_UP_FRACTION)):
                rss["warm"] = (await metrics(http))["process_resident_memory_bytes"]
            if progress is not None and done % 100 == 0:
                progress(done, requests)

        await asyncio.gather(*(one(kind, s) for kind, s in plans))
        final = await until_pools_full(http)
    by_kind: dict[str, int] = {}
    by_status: dict[str, int] = {}
    for out in outcomes:
        by_kind[out.kind] = by_kind.get(out.kind, 0) + 1
        status = "left" if out.status is None else str(out.status)
        by_status[status] = by_status.get(status, 0) + 1
    return SoakResult(
        requests=requests, by_kind=by_kind, by_status=dict(sorted(by_status.items())),
        normal_failures=[o.failure for o in outcomes if o.kind == "normal" and o.failure],
        malformed_failures=[o.failure for o in outcomes if o.kind == "malformed" and o.failure],
        client_5xx=sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        server_5xx=server_errors(final), disconnects=final.get("deltaserve_client_disconnects_total", 0),
        rss_warm_bytes=rss.get("warm", 0.0), rss_end_bytes=final["process_resident_memory_bytes"],
        pools_full=pools_full(final), seconds=loop.time() - started)


def random_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(length)]
