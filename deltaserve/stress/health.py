"""Is the server under test alive, since when, and how many requests wait: /health, /metrics, /v1/models."""

import asyncio
import math
import re
import time
from dataclasses import dataclass, field

import httpx

from deltaserve.stress.client import Target, TargetError, error_text, transport_error_text

HEALTH_TIMEOUT_S = 5.0
# /health JSON fields that say when the server started (epoch seconds) or for how long it has run.
START_TIME_FIELDS = ("start_time", "started_at", "process_start_time_seconds", "start_time_s")
UPTIME_FIELDS = ("uptime_s", "uptime_seconds", "uptime")
# /metrics gauges of waiting requests in deltaserve, vLLM, SGLang, llama.cpp.
QUEUE_METRIC = re.compile(r"^[A-Za-z_:]*(requests_waiting|num_requests_waiting|num_queue_reqs|requests_deferred)\b")
START_METRIC = "process_start_time_seconds"


@dataclass
class HealthSample:
    """One health probe: did the server answer, how fast, since when does it run, how many wait."""

    at: float  # monotonic clock
    answering: bool
    latency_s: float
    down: bool = False  # the connection was refused or reset: nobody is listening
    error: str | None = None
    start_time: float | None = None  # epoch seconds the server process started
    queued: float | None = None


@dataclass
class ServerInfo:
    """What the first probes learned: model id, which probes exist."""

    model: str
    health_path: str | None  # "/health", or None when only /v1/models answers
    has_metrics: bool
    notes: list[str] = field(default_factory=list)


async def discover(client: httpx.AsyncClient, target: Target, ready_wait_s: float) -> ServerInfo:
    """Find the health route, the metrics route and the model id; TargetError when nothing answers.

    A /health that answers 503 (model still loading) is polled for up to `ready_wait_s` seconds.
    """
    give_up = time.monotonic() + ready_wait_s
    while True:
        try:
            response = await client.get(f"{target.root_url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.TransportError as e:
            raise TargetError(f"cannot reach {target.root_url}: {transport_error_text(e)}") from None
        if response.status_code != 503 or time.monotonic() >= give_up:
            break
        await asyncio.sleep(1.0)
    if response.status_code == 503:
        raise TargetError(f"{target.root_url}/health still answers 503 after {ready_wait_s:g} s: "
                          f"{error_text(response.content)}")
    health_path = "/health" if response.status_code == 200 else None
    model = target.model
    notes = []
    try:
        response = await client.get(f"{target.api_url}/models", headers=target.headers, timeout=HEALTH_TIMEOUT_S)
        ids = [m.get("id") for m in response.json().get("data", [])] if response.status_code == 200 else []
    except (httpx.TransportError, ValueError, AttributeError):
        ids = []
    if model is None:
        if not ids:
            raise TargetError(f"{target.api_url}/models lists no model; give --model NAME")
        model = ids[0]
    has_metrics = (await _get_metrics(client, target)) is not None
    if health_path is None:
        notes.append("no /health route: /v1/models is the health probe")
    if not has_metrics:
        notes.append("no /metrics: restarts are detected from /health uptime only, if it reports one")
    return ServerInfo(model=model, health_path=health_path, has_metrics=has_metrics, notes=notes)


async def probe_health(client: httpx.AsyncClient, target: Target, info: ServerInfo) -> HealthSample:
    """One health probe (and a /metrics read when the server has one)."""
    started = time.monotonic()
    path = f"{target.root_url}{info.health_path}" if info.health_path else f"{target.api_url}/models"
    try:
        response = await client.get(path, headers=target.headers, timeout=HEALTH_TIMEOUT_S)
    except httpx.TimeoutException:
        return HealthSample(at=started, answering=False, latency_s=time.monotonic() - started,
                            error=f"no answer in {HEALTH_TIMEOUT_S:g} s")
    except httpx.TransportError as e:
        return HealthSample(at=started, answering=False, latency_s=time.monotonic() - started, down=True,
                            error=transport_error_text(e))
    sample = HealthSample(at=started, answering=response.status_code == 200,
                          latency_s=time.monotonic() - started,
                          error=None if response.status_code == 200 else f"HTTP {response.status_code}")
    sample.start_time = start_time_from_health(response)
    if info.has_metrics:
        text = await _get_metrics(client, target)
        if text is not None:
            start, queued = parse_metrics(text)
            sample.start_time = start if start is not None else sample.start_time
            sample.queued = queued
    return sample


def start_time_from_health(response: httpx.Response) -> float | None:
    """Epoch start time from a /health JSON body (a start time, or now minus an uptime), else None."""
    try:
        data = response.json()
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for name in START_TIME_FIELDS:
        if _is_number(data.get(name)):
            return float(data[name])
    for name in UPTIME_FIELDS:
        if _is_number(data.get(name)):
            return time.time() - float(data[name])
    return None


def parse_metrics(text: str) -> tuple[float | None, float | None]:
    """(process_start_time_seconds, total waiting requests) from a Prometheus text page."""
    start, queued = None, None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        value = _float(rest.split(" ")[0]) if rest else None
        if value is None:
            continue
        base = name.split("{")[0]
        if base == START_METRIC:
            start = value
        elif QUEUE_METRIC.match(base):
            queued = (queued or 0.0) + value
    return start, queued


async def _get_metrics(client: httpx.AsyncClient, target: Target) -> str | None:
    try:
        response = await client.get(f"{target.root_url}/metrics", headers=target.headers, timeout=HEALTH_TIMEOUT_S)
    except httpx.TransportError:
        return None
    return response.text if response.status_code == 200 else None


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
