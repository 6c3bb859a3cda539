"""Many clients leaving at random moments beside long streams, through a real server, on a tiny dense model (the
built-in's Llama architecture) and the tiny hybrid: every long stream's text equals its text alone (greedy), the
pools come back full, no 5xx. Issue 16 saw all 6 streams fail on the hybrid when aborts freed state under a
running step; the leavers here leave mid-queue, mid-prefill (32-token chunks) and mid-decode.
"""

from __future__ import annotations

import asyncio
import random

import pytest

import traffic
from server_util import running_server
from test_engine_support import HYBRID_VOCAB, make_dense_checkpoint, make_hybrid_checkpoint, random_prompt

LONG_STREAMS = 6
LONG_TOKENS = 120
LEAVERS = 60
LEAVERS_AT_ONCE = 10
SEED = 16


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def server(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"load-{request.param}")
    (make_dense_checkpoint if request.param == "dense" else make_hybrid_checkpoint)(folder)
    with running_server(folder, "--model", str(folder), "--max-total-tokens", "16384", "--max-running-requests",
                        "16", "--prefill-chunk-tokens", "32") as s:
        yield s


async def _alone(url: str, prompts: list[list[int]]) -> list[traffic.Outcome]:
    async with traffic.client(url) as http:
        return [await traffic.complete(http, traffic.greedy(p, LONG_TOKENS, stream=True), "long") for p in prompts]


async def _together(url: str, prompts: list[list[int]], rng: random.Random):
    async with traffic.client(url) as http:
        longs = [asyncio.create_task(traffic.complete(http, traffic.greedy(p, LONG_TOKENS, stream=True), "long"))
                 for p in prompts]
        slots = asyncio.Semaphore(LEAVERS_AT_ONCE)

        async def one_leaver(i: int) -> traffic.Outcome:
            own = random.Random(rng.random())
            body = traffic.greedy(random_prompt(own.randint(1, 300), SEED * 1000 + i, HYBRID_VOCAB),
                                  own.randint(1, 64), stream=own.random() < 0.7)
            async with slots:
                return await traffic.leave(http, body, own)

        leavers = await asyncio.gather(*(one_leaver(i) for i in range(LEAVERS)))
        finished = await asyncio.gather(*longs)
        return finished, leavers, await traffic.until_pools_full(http)


def test_leaving_clients_never_hurt_long_streams(server):
    prompts = [random_prompt(8 + 20 * i, SEED + i, HYBRID_VOCAB) for i in range(LONG_STREAMS)]
    alone = asyncio.run(_alone(server.url, prompts))
    assert all(o.failure is None and o.finish == "length" for o in alone), [o.failure for o in alone]

    finished, leavers, metrics = asyncio.run(_together(server.url, prompts, random.Random(SEED)))

    for i, (solo, out) in enumerate(zip(alone, finished)):
        assert out.failure is None, (i, out.failure)
        assert out.text == solo.text and out.finish == "length", i
    assert not [o.status for o in leavers if o.status is not None and o.status >= 500]
    assert traffic.pools_full(metrics), {k: v for k, v in metrics.items() if "used" in k or "requests_" in k}
    assert traffic.server_errors(metrics) == 0
    assert metrics["deltaserve_client_disconnects_total"] > 0
    assert "internal error" not in server.log.read_text(errors="replace")
