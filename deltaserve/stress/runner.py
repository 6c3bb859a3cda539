"""Running the matrix: each cell by N parallel clients, watched by a health probe, bounded in count and time."""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from deltaserve.stress.client import RequestResult, Target, generation_body, stream_generation
from deltaserve.stress.health import HealthSample, ServerInfo, probe_health
from deltaserve.stress.matrix import Cell
from deltaserve.stress.prompts import PromptPlan, build_prompt, request_rng

RESTART_TOLERANCE_S = 2.0  # start times derived from an uptime jitter by the probe's own latency


@dataclass(frozen=True)
class RunLimits:
    """Bounds of one run: every loop below stops by one of these."""

    cell_duration_s: float  # a cell's requests are abandoned after this long
    probe_interval_s: float  # health probe period during a cell
    recover_wait_s: float  # how long to wait for a server that stopped answering before the next cell


@dataclass
class CellRun:
    """Raw outcome of one cell: every request's result and every health probe taken while it ran."""

    cell: Cell
    results: list[RequestResult] = field(default_factory=list)
    health: list[HealthSample] = field(default_factory=list)
    wall_s: float = 0.0
    started_at: float = 0.0  # monotonic clock
    start_time_before: float | None = None  # server start time seen before the cell began
    not_run_reason: str | None = None  # set when the cell was skipped (server gone)
    force_fields: tuple[str, ...] = ()  # what was sent to ask for full-length generations
    back_after_s: float | None = None  # the server stopped answering, then answered again this long after the cell

    @property
    def sent(self) -> int:
        return len(self.results)


@dataclass
class Progress:
    """Callbacks for a live display; all optional."""

    cell_started: Callable[[Cell, int], None] = lambda cell, index: None
    request_done: Callable[[Cell, RequestResult], None] = lambda cell, result: None
    cell_done: Callable[[CellRun], None] = lambda run: None


def server_down(run: CellRun) -> bool:
    """The server stopped answering during the cell: refused connections or cut responses."""
    return any(sample.down for sample in run.health) or any(r.kind == "transport" for r in run.results)


def stopped_at_s(run: CellRun) -> float | None:
    """Seconds into the cell when the server was first seen gone (a refused probe or a cut request)."""
    if run.not_run_reason:
        return None
    times = [sample.at - run.started_at for sample in run.health if sample.down]
    times += [r.sent_at + (r.e2e_s or 0.0) - run.started_at for r in run.results if r.kind == "transport"]
    return max(0.0, min(times)) if times else None


def server_restarted(run: CellRun) -> bool:
    """The server's start time moved during the cell (a watchdog restarted it)."""
    starts = [run.start_time_before] + [sample.start_time for sample in run.health]
    starts = [s for s in starts if s is not None]
    return bool(starts) and max(starts) - min(starts) > RESTART_TOLERANCE_S


async def run_cell(client: httpx.AsyncClient, target: Target, info: ServerInfo, cell: Cell, plan: PromptPlan,
                   *, seed: int, limits: RunLimits, force_fields: tuple[str, ...], start_time_before: float | None,
                   count_tokens: Callable[[str], int] | None = None, progress: Progress = Progress()) -> CellRun:
    """Send `cell.requests` requests from `cell.concurrency` parallel workers, probing health meanwhile."""
    run = CellRun(cell=cell, start_time_before=start_time_before, force_fields=force_fields)
    bodies = [generation_body(target, build_prompt(plan, cell.prompt_tokens, request_rng(seed, cell.label, i),
                                                   count_tokens),
                              cell.gen_tokens, stream=True, force_fields=force_fields)
              for i in range(cell.requests)]
    next_index = iter(range(cell.requests))
    stop = asyncio.Event()
    started = run.started_at = time.monotonic()
    deadline = started + limits.cell_duration_s

    async def worker():
        for index in next_index:
            if stop.is_set() or time.monotonic() >= deadline:
                return
            progress.cell_started(cell, index)
            result = await stream_generation(client, target, bodies[index], index, deadline)
            bodies[index] = None  # a 72K-token body is not kept once sent
            run.results.append(result)
            progress.request_done(cell, result)
            if result.kind == "transport" and result.error.startswith("connection refused"):
                stop.set()

    async def monitor():
        while True:
            sample = await probe_health(client, target, info)
            run.health.append(sample)
            if sample.down:
                stop.set()
            await asyncio.sleep(limits.probe_interval_s)

    watcher = asyncio.create_task(monitor())
    try:
        await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
    finally:
        watcher.cancel()
        try:
            await watcher
        except asyncio.CancelledError:
            pass
    run.wall_s = time.monotonic() - started
    run.health.append(await probe_health(client, target, info))
    run.results.sort(key=lambda r: r.index)
    progress.cell_done(run)
    return run


async def wait_until_answering(client: httpx.AsyncClient, target: Target, info: ServerInfo,
                               wait_s: float) -> HealthSample:
    """Probe until the server answers or `wait_s` has passed; the last sample."""
    give_up = time.monotonic() + wait_s
    while True:
        sample = await probe_health(client, target, info)
        if sample.answering or time.monotonic() >= give_up:
            return sample
        await asyncio.sleep(1.0)


async def run_matrix(client: httpx.AsyncClient, target: Target, info: ServerInfo, cells: list[Cell],
                     plan: PromptPlan, *, seed: int, limits: RunLimits, force_fields: tuple[str, ...],
                     count_tokens: Callable[[str], int] | None = None,
                     progress: Progress = Progress()) -> list[CellRun]:
    """Every cell in order; once the server stops answering for good, the rest are marked not run."""
    runs: list[CellRun] = []
    for cell in cells:
        if runs and runs[-1].not_run_reason:
            runs.append(CellRun(cell=cell, not_run_reason=runs[-1].not_run_reason))
            progress.cell_done(runs[-1])
            continue
        wait_s = limits.recover_wait_s if runs and server_down(runs[-1]) else 0.0
        waited_from = time.monotonic()
        before = await wait_until_answering(client, target, info, wait_s)
        if before.answering and wait_s:
            runs[-1].back_after_s = time.monotonic() - waited_from
        if not before.answering:
            reason = (f"server stopped answering ({before.error})" if wait_s == 0 else
                      f"server stopped answering and did not come back within {wait_s:g} s ({before.error})")
            runs.append(CellRun(cell=cell, not_run_reason=reason, health=[before]))
            progress.cell_done(runs[-1])
            continue
        runs.append(await run_cell(client, target, info, cell, plan, seed=seed, limits=limits,
                                   force_fields=force_fields, start_time_before=before.start_time,
                                   count_tokens=count_tokens, progress=progress))
    return runs
