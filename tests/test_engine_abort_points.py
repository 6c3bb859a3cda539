"""One client's leaving never touches the requests batched beside it: an abort at each point of a step (a hook in
the step loop, not a sleep), on the dense built-in model and the tiny hybrid. The others' greedy tokens equal their
tokens alone, the aborted one ends with "abort", and the pools and the scheduler's books come back to empty."""

from __future__ import annotations

import threading

import pytest

from deltaserve.engine.request import SamplingParams
from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt, tokens_of

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
POINTS = ["schedule", "forward", "sample", "complete"]


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def eng(request, tmp_path_factory):
    if request.param == "dense":
        return engine(None, max_running_requests=8, max_total_tokens=4096, prefill_chunk_tokens=64)
    folder = tmp_path_factory.mktemp("hybrid")
    make_hybrid_checkpoint(folder)
    return engine(str(folder), max_running_requests=8, max_total_tokens=4096, prefill_chunk_tokens=64)


def prompts(eng) -> dict[str, list[int]]:
    vocab = HYBRID_VOCAB  # token ids both models have
    # a decoding neighbour, one still reading its prompt (chunks of 64) and a short one; the victim between them
    return {"a": random_prompt(20, 1, vocab, low=1), "b": random_prompt(150, 2, vocab, low=1),
            "c": random_prompt(7, 3, vocab, low=1), "victim": random_prompt(90, 4, vocab, low=1)}


def run(eng, submitted: dict[str, list[int]], hook=None) -> dict[str, list]:
    streams = {rid: eng.submit(ids, GREEDY, request_id=rid) for rid, ids in submitted.items()}
    outputs = {rid: [] for rid in streams}
    eng.step_hook = hook
    try:
        while not all(s.finished for s in streams.values()):
            eng.step()
            for rid, stream in streams.items():
                outputs[rid].extend(stream.drain())
    finally:
        eng.step_hook = None
    for rid, stream in streams.items():
        outputs[rid].extend(stream.drain())
    return outputs


def assert_empty(eng) -> None:
    eng.scheduler.check()
    stats = eng.stats()
    assert (stats.kv_pages_used, stats.kv_pages_reserved, stats.state_slots_used, stats.running,
            stats.waiting) == (0, 0, 0, 0, 0)


@pytest.fixture(scope="module")
def alone(eng):
    return {rid: tokens_of(run(eng, {rid: ids})[rid]) for rid, ids in prompts(eng).items() if rid != "victim"}


@pytest.mark.parametrize("step", [1, 3, 5])
@pytest.mark.parametrize("point", POINTS)
def test_abort_at_each_point_of_a_step(eng, alone, point, step):
    steps = {"n": 0}

    def hook(where: str) -> None:
        if where == "schedule":
            steps["n"] += 1
        if where == point and steps["n"] == step:
            eng.abort("victim")  # as the server's thread would, from inside the step

    outputs = run(eng, prompts(eng), hook)
    assert outputs["victim"][-1].finish_reason == "abort"
    for rid, tokens in alone.items():
        assert tokens_of(outputs[rid]) == tokens, rid
        assert outputs[rid][-1].finish_reason == "length" and outputs[rid][-1].error is None
    assert_empty(eng)


def test_aborts_from_another_thread_while_the_loop_runs(eng, alone):
    """The background loop with a second thread aborting at every step point: the survivors are untouched."""
    eng.start()
    try:
        victims = [eng.submit(random_prompt(60, 100 + i, 100, low=1), GREEDY, request_id=f"v{i}") for i in range(6)]
        survivors = {rid: eng.submit(ids, GREEDY, request_id=rid) for rid, ids in prompts(eng).items()
                     if rid != "victim"}
        order = iter(f"v{i}" for i in range(6))

        def leave(where: str) -> None:
            rid = next(order, None)
            if rid is not None:
                threading.Thread(target=eng.abort, args=(rid,)).start()

        eng.step_hook = leave
        outs = {rid: [o for o in stream] for rid, stream in survivors.items()}
        for victim in victims:
            assert list(victim)[-1].finish_reason in ("abort", "length")
    finally:
        eng.step_hook = None
        eng.shutdown()
    for rid, tokens in alone.items():
        assert tokens_of(outs[rid]) == tokens and outs[rid][-1].finish_reason == "length"
    assert_empty(eng)


def test_a_failing_step_names_no_request_content(eng, monkeypatch):
    """An internal error fails the step's requests with an error id, never another request's prompt or repr."""
    secret = random_prompt(33, 77, 100, low=1)

    def broken(plan):
        raise RuntimeError(f"boom while holding {plan.requests!r}")

    monkeypatch.setattr(eng.runner, "forward", broken)
    outputs = run(eng, {"mine": secret})
    error = outputs["mine"][-1].error
    assert outputs["mine"][-1].finish_reason == "error" and "error id" in error
    assert "boom" not in error and "Request" not in error
    assert_empty(eng)
