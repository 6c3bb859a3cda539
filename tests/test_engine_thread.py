"""The engine owns its thread (engine/engine.py, engine/door.py): once started, only its thread admits, schedules,
touches the prefix cache and aborts; the server's event loop hands it messages and awaits the answers. And an open
stream keeps its step rate while 50 requests with long cached prefixes arrive and leave: the steps between two of
its tokens are counted with and without that churn (wall-clock gaps are printed, never asserted)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deltaserve.engine.door import Submission
from deltaserve.engine.errors import Refused
from deltaserve.engine.request import SamplingParams
from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt

CHURN_REQUESTS = 50
PREFIX_TOKENS = 384  # the shared prefix every churning request hits: several pages and a GDN checkpoint
OPEN_TOKENS = 160  # the open stream's length: it outlives the churn
# Methods that read or write the engine's state: each call is recorded with the thread it ran on.
WATCHED = {"scheduler": ("admit", "add", "abort", "start_waiting", "schedule", "complete"),
           "prefix_cache": ("lookup", "attach", "store", "evict", "flush")}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid-thread")
    make_hybrid_checkpoint(folder)
    eng = engine(str(folder), prefix_cache=True, max_total_tokens=8192, max_running_requests=8,
                 checkpoint_slots=16, max_queue=64)
    yield eng
    eng.shutdown()


def watch_threads(eng) -> dict[str, set[str]]:
    """Wrap the watched methods of the engine's scheduler and prefix cache; the thread names each ran on."""
    seen: dict[str, set[str]] = {}
    for owner_name, methods in WATCHED.items():
        owner = getattr(eng, owner_name)
        for name in methods:
            original = getattr(owner, name)

            def wrapped(*args, _original=original, _key=f"{owner_name}.{name}", **kwargs):
                seen.setdefault(_key, set()).add(threading.current_thread().name)
                return _original(*args, **kwargs)

            setattr(owner, name, wrapped)
    return seen


def unwatch(eng) -> None:
    for owner_name, methods in WATCHED.items():
        owner = getattr(eng, owner_name)
        for name in methods:
            delattr(owner, name)


def count_steps(eng, request_id: str) -> list[int]:
    """A step hook on the engine's thread: before each step completes, the open request's generated length."""
    lengths: list[int] = []

    def hook(point: str) -> None:
        if point == "before_complete":
            request = eng._live.get(request_id)
            if request is not None:
                lengths.append(len(request.output_ids))

    eng.step_hook = hook
    return lengths


def longest_step_gap(lengths: list[int]) -> int:
    """The most steps in a row in which the open request got no new token (a step with a token: gap 0)."""
    gap = longest = 0
    for before, after in zip(lengths, lengths[1:]):
        gap = 0 if after > before else gap + 1
        longest = max(longest, gap)
    return longest


async def open_stream_with_churn(eng, churn: bool) -> tuple[int, float]:
    """One open stream, and (with churn) 50 requests sharing a long cached prefix that arrive from the event loop
    and leave after their first token; the open stream's longest gap in steps and in seconds."""
    greedy = SamplingParams(max_tokens=OPEN_TOKENS, temperature=0, ignore_eos=True)
    stream = (await asyncio.wrap_future(eng.submit_all(Submission(
        [random_prompt(24, 7, HYBRID_VOCAB, low=1)], [greedy]))))[0]
    lengths = count_steps(eng, stream.request_id)
    prefix = random_prompt(PREFIX_TOKENS, 11, HYBRID_VOCAB, low=1)

    async def churner(i: int) -> None:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        try:
            got = await asyncio.wrap_future(eng.submit_all(Submission(
                [prefix + random_prompt(8, 100 + i, HYBRID_VOCAB, low=1)], [params], boundaries=(PREFIX_TOKENS,))))
        except Refused:
            return  # a full queue is an answer too; the open stream must not feel it either way
        async for out in got[0]:
            eng.abort(got[0].request_id)  # it leaves after its first output
            break

    gaps_s, last = [], None
    async for out in stream:
        now = time.monotonic()
        if last is not None:
            gaps_s.append(now - last)
        last = now
        if churn and len(gaps_s) == 4:  # the open stream is decoding: the churn starts now, all at once
            asyncio.gather(*(churner(i) for i in range(CHURN_REQUESTS)))
        if out.finished:
            break
    await asyncio.sleep(0)
    eng.step_hook = None
    return longest_step_gap(lengths), max(gaps_s)


def test_only_the_engine_thread_touches_its_state_and_open_streams_keep_their_step_rate(hybrid):
    eng = hybrid
    # the shared prefix read once, so that every churning request hits it (pages and a GDN checkpoint)
    prefix = random_prompt(PREFIX_TOKENS, 11, HYBRID_VOCAB, low=1)
    warm = eng.submit(prefix + [1], SamplingParams(max_tokens=1), boundaries=(PREFIX_TOKENS,))
    while not warm.finished:
        eng.step()
    eng.start()
    seen = watch_threads(eng)
    try:
        quiet_steps, quiet_s = asyncio.run(open_stream_with_churn(eng, churn=False))
        hit_before = eng.stats().prefix_cache_hit_tokens_total
        churn_steps, churn_s = asyncio.run(open_stream_with_churn(eng, churn=True))
        hits = eng.stats().prefix_cache_hit_tokens_total - hit_before
    finally:
        unwatch(eng)
    print(f"longest gap between the open stream's tokens: {quiet_steps} steps / {quiet_s * 1e3:.1f} ms alone, "
          f"{churn_steps} steps / {churn_s * 1e3:.1f} ms with {CHURN_REQUESTS} requests arriving and leaving")
    assert hits >= PREFIX_TOKENS // 2, "the churning requests did not hit the cached prefix: the test proves nothing"
    assert set().union(*seen.values()) == {"deltaserve-engine"}, seen
    assert {"scheduler.admit", "scheduler.abort", "prefix_cache.attach"} <= set(seen)
    assert quiet_steps == 0
    assert churn_steps == quiet_steps
    stats = eng.stats()
    assert (stats.running, stats.waiting) == (0, 0)
