"""A request that leaves at any point of a step never hurts the others: aborts queued while a step holds the
request, applied as it ends. On the dense built-in model and the tiny hybrid, the leaver is aborted (and a newcomer
submitted, which would take the leaver's freed slot mid-step if the abort freed it at once) at each point of a step
through Engine.step_hook: the others' outputs equal their outputs alone, the pools come back full, check() passes."""

from __future__ import annotations

import pytest

from deltaserve.engine.engine import STEP_POINTS
from deltaserve.engine.request import SamplingParams
from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt, run_all, tokens_of

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CHUNK_TOKENS = 32  # the leaver's 80-token prompt takes three steps: it is aborted mid-prefill or mid-decode
TRIGGER_STEP = 2  # the leaver still reads its prompt; the keepers already decode


@pytest.fixture(scope="module")
def dense():
    return engine(None, max_running_requests=4, max_total_tokens=2048)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid-abort")
    make_hybrid_checkpoint(folder)
    return engine(str(folder), max_running_requests=4, max_total_tokens=2048)


@pytest.fixture(params=["dense", "hybrid"])
def eng(request):
    eng = request.getfixturevalue(request.param)
    eng.scheduler.prefill_chunk_tokens = CHUNK_TOKENS
    yield eng
    eng.step_hook = None


def prompts_for(eng) -> dict[str, list[int]]:
    vocab = min(eng.vocab_size, HYBRID_VOCAB)
    return {name: random_prompt(length, seed, vocab, low=1)
            for name, length, seed in (("keep-a", 12, 1), ("keep-b", 40, 2), ("leaver", 80, 3), ("newcomer", 20, 4))}


def assert_pools_full(eng) -> None:
    eng.scheduler.check()
    stats = eng.stats()
    assert (stats.kv_pages_used, stats.state_slots_used, stats.running, stats.waiting) == (0, 0, 0, 0)


ALONE: dict[int, dict[str, list[int]]] = {}  # per engine: each prompt's greedy tokens, run alone


def alone_tokens(eng) -> dict[str, list[int]]:
    if id(eng) not in ALONE:
        ALONE[id(eng)] = {name: tokens_of(run_all(eng, [(ids, GREEDY)])[0]) for name, ids in prompts_for(eng).items()}
    return ALONE[id(eng)]


@pytest.mark.parametrize("point", STEP_POINTS)
def test_abort_at_each_point_of_a_step_leaves_the_others_intact(eng, point):
    prompts, alone, trigger_step = prompts_for(eng), alone_tokens(eng), TRIGGER_STEP
    assert_pools_full(eng)

    streams = {name: eng.submit(prompts[name], GREEDY, request_id=name) for name in ("keep-a", "keep-b", "leaver")}
    steps = {"before_schedule": 0}

    def hook(at: str) -> None:
        if at == "before_schedule":
            steps["before_schedule"] += 1
        if at == point and steps["before_schedule"] == trigger_step and "newcomer" not in streams:
            eng.abort("leaver")
            streams["newcomer"] = eng.submit(prompts["newcomer"], GREEDY, request_id="newcomer")

    eng.step_hook = hook
    outputs = {name: [] for name in ("keep-a", "keep-b", "leaver", "newcomer")}
    while "newcomer" not in streams or not all(s.finished for s in streams.values()):
        assert eng.step() or "newcomer" not in streams
        for name, stream in streams.items():
            outputs[name].extend(stream.drain())
    eng.step_hook = None

    for name in ("keep-a", "keep-b", "newcomer"):
        assert outputs[name][-1].finish_reason == "length", (name, outputs[name][-1].error)
        assert tokens_of(outputs[name]) == alone[name], name
    assert outputs["leaver"][-1].finish_reason == "abort"
    assert_pools_full(eng)


def test_abort_between_steps_frees_at_once(eng):
    stream = eng.submit(prompts_for(eng)["keep-a"], GREEDY, request_id="between")
    eng.step()
    eng.abort("between")
    assert stream.finished and stream.drain()[-1].finish_reason == "abort"
    assert_pools_full(eng)


def test_a_failed_step_sends_an_error_id_and_no_request_content(eng):
    prompt = prompts_for(eng)["keep-b"]
    logged = []
    eng._log = logged.append

    def hook(at: str) -> None:
        if at == "during_forward":
            raise RuntimeError(f"boom while holding {prompt}")

    eng.step_hook = hook
    try:
        out = run_all(eng, [(prompt, GREEDY)])[0]
    finally:
        eng.step_hook, eng._log = None, lambda message: None
    error = out[-1].error
    assert out[-1].finish_reason == "error" and error.startswith("internal error, id ")
    assert str(prompt[:3])[1:-1] not in error and "boom" not in error
    error_id = error.split("id ")[1].split(":")[0]
    assert any(error_id in line and "boom" in line for line in logged)
    assert_pools_full(eng)
