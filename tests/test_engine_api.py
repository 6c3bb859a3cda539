"""The engine's public surface on a tiny hybrid: the background loop, blocking and asyncio streams from other
threads, aborts while running, a failing step that fails only its requests, shutdown, and the offline LLM."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from deltaserve.engine.engine import LLM, Completion
from deltaserve.engine.request import SamplingParams
from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt, run_all, tokens_of

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    make_hybrid_checkpoint(folder)
    return str(folder)


def prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed, HYBRID_VOCAB)


def test_background_loop_serves_threads_and_asyncio_alike(checkpoint):
    eng = engine(checkpoint, max_running_requests=4)
    prompts = [prompt(10 + 7 * i, i) for i in range(6)]  # more than 4 slots: two wait for a free one
    expected = [tokens_of(run_all(eng, [(p, GREEDY)])[0]) for p in prompts]
    eng.start()
    try:
        results: dict[int, list[int]] = {}

        def blocking(i: int) -> None:
            results[i] = [t for out in eng.submit(prompts[i], GREEDY, request_id=f"t{i}") for t in out.token_ids]

        async def streaming(i: int) -> list[int]:
            return [t async for out in eng.submit(prompts[i], GREEDY) for t in out.token_ids]

        async def main():
            return await asyncio.gather(*(streaming(i) for i in range(3, 6)))

        threads = [threading.Thread(target=blocking, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        async_results = asyncio.run(main())
        for t in threads:
            t.join()
        assert [results[i] for i in range(3)] + async_results == expected
        slow = eng.submit(prompt(30, 9), SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True),
                          request_id="slow")
        first = next(iter(slow))
        eng.abort("slow")  # from this thread, while the loop runs it
        rest = list(slow)
        assert rest[-1].finish_reason == "abort" and rest[-1].completion_tokens < 200
        assert first.prompt_tokens == 30
    finally:
        eng.shutdown()
    eng.scheduler.check()
    assert eng.stats().running == 0 and eng.kv_pool.used_pages == 0


class FailingOnce(torch.nn.Module):
    """Fault injection around the real model: the first call with more than `rows` tokens runs out of memory."""

    def __init__(self, model, rows: int):
        super().__init__()
        self.model, self.rows, self.failed = model, rows, False

    def forward(self, batch, caches):
        if not self.failed and batch.input_ids.numel() > self.rows:
            self.failed = True
            raise torch.OutOfMemoryError("simulated: 48 MiB asked, 39 MiB free")
        return self.model(batch, caches)


def test_a_failing_step_fails_its_requests_not_the_engine(checkpoint):
    eng = engine(checkpoint)
    ok = prompt(12, 1)
    before = tokens_of(run_all(eng, [(ok, GREEDY)])[0])
    eng.runner.model = FailingOnce(eng.runner.model, rows=100)
    eng.start()
    try:
        victim = eng.submit(prompt(300, 2), GREEDY)
        outs = list(victim)
        # the kind of failure and an id the log carries, never the exception's text (it may hold others' requests)
        assert outs[-1].finish_reason == "error" and outs[-1].error.startswith("out of memory, id ")
        assert "simulated" not in outs[-1].error
        assert [t for out in eng.submit(ok, GREEDY) for t in out.token_ids] == before  # still serving
    finally:
        eng.shutdown()
    eng.scheduler.check()
    assert eng.stats().finished["error"] == 1 and eng.kv_pool.used_pages == 0


def test_shutdown_aborts_what_is_left(checkpoint):
    eng = engine(checkpoint, max_running_requests=2)
    streams = [eng.submit(prompt(20, i), SamplingParams(max_tokens=4000, ignore_eos=True)) for i in range(4)]
    eng.start()
    next(iter(streams[0]))
    eng.shutdown()
    assert all(s.finished for s in streams) and eng.stats().finished.get("abort") == 4
    assert eng.kv_pool.used_pages == 0 and eng.state_pool.used_slots == 0


def test_offline_llm_generates_for_text_and_token_prompts(checkpoint):
    llm = LLM(checkpoint, max_total_tokens=4096, max_queue=2)  # 5 prompts through a queue of 2
    prompts = ["t5 t6 t7", [8, 9, 10, 11], "t100", [3] * 40, "t1 t2"]
    params = [SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True, logprobs=1) for i in range(5)]
    results = llm.generate(prompts, params)
    alone = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert all(isinstance(r, Completion) for r in results)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    tok = llm.tokenizer
    for i, r in enumerate(results):
        assert r.finish_reason == "length" and r.completion_tokens == len(r.token_ids) == 6 + i
        ids = tok.encode(prompts[i]) if isinstance(prompts[i], str) else prompts[i]
        # the continuation as the whole sequence's text shows it (a word-level vocabulary joins with spaces)
        assert r.text == tok.decode(ids + r.token_ids)[len(tok.decode(ids)):] and len(r.logprobs) == 6 + i
    assert results[0].prompt_tokens == 3 and results[3].prompt_tokens == 40
