"""Speculative decoding (engine/speculative.py): lossless against speculation off, the GDN rollback, the ledger.

Random tiny models accept few n-gram drafts, so most tests draft with `ForcedDrafter`: it proposes the true
greedy continuation (from a run with speculation off) with one wrong token at a position that moves every
verification (0, 1, .., k - 1, then none wrong), so each test passes rejections at every position and full
acceptances. It replaces only where drafts come from; the verifier, rollback and scheduling are the engine's.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from deltaserve.config import ConfigError, EngineConfig
from deltaserve.engine.request import SamplingParams
from deltaserve.engine.speculative import SpecState, draft_len, ngram_drafts, verify
from test_engine_support import (HYBRID_VOCAB, engine, make_dense_checkpoint, make_hybrid_checkpoint, random_prompt,
                                 run_all, tokens_of)

K = 3
GREEDY = dict(temperature=0, ignore_eos=True)


class ForcedDrafter:
    """The true continuation of each prompt, wrong at position (verification number mod k + 1) of the drafts."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int):
        self.truth, self.vocab, self.verifications = truth, vocab, Counter()

    def propose(self, request, k: int) -> list[int]:
        done = len(request.output_ids)
        drafts = list(self.truth[tuple(request.prompt_ids)][done:done + k])
        wrong = self.verifications[request] % (K + 1)
        self.verifications[request] += 1
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % self.vocab
        return drafts


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec-hybrid")
    make_hybrid_checkpoint(folder)
    return str(folder)


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec-dense")
    make_dense_checkpoint(folder)
    return str(folder)


def forced(eng, truth, vocab=HYBRID_VOCAB):
    eng.speculation.drafter = ForcedDrafter(truth, vocab)
    eng.speculation.adaptive = False
    return eng


def assert_pools_full(eng) -> None:
    eng.scheduler.check()
    assert eng.kv_pool.used_pages == 0 and eng.state_pool.used_slots == 0


@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_greedy_equals_speculation_off_with_rejections_at_every_position(model, hybrid_folder, dense_folder):
    folder = hybrid_folder if model == "hybrid" else dense_folder
    prompts = [random_prompt(n, 40 + n, HYBRID_VOCAB) for n in (9, 130, 70)]
    params = SamplingParams(max_tokens=20, logprobs=2, **GREEDY)
    off = engine(folder, max_running_requests=4)
    off.scheduler.prefill_chunk_tokens = 64  # mixed steps: decodes (and verifications) beside prompt chunks
    plain = run_all(off, [(p, params) for p in prompts])
    truth = {tuple(p): tokens_of(o) for p, o in zip(prompts, plain)}
    on = forced(engine(folder, max_running_requests=4, speculative="ngram", speculative_tokens=K), truth)
    on.scheduler.prefill_chunk_tokens = 64
    for batch in ([prompts[0]], prompts):  # batch 1, then mixed batches
        spec = run_all(on, [(p, params) for p in batch])
        for p, out in zip(batch, spec):
            assert tokens_of(out) == truth[tuple(p)]
            want = [lp.logprob for o in plain[prompts.index(p)] for lp in o.logprobs]
            assert [lp.logprob for o in out for lp in o.logprobs] == pytest.approx(want, abs=1e-4)
            assert out[-1].speculative["accepted"] < out[-1].speculative["drafted"]
    s = on.speculation
    assert s.verify_steps_total > 10 and 0 < s.accepted_total < s.drafted_total
    assert_pools_full(on)


def gdn_state(eng, slot: int) -> list[torch.Tensor]:
    pool = eng.state_pool
    return [t[slot].clone() for t in pool.conv + pool.recurrent if t is not None]


def test_rollback_leaves_the_state_of_a_plain_read_of_the_kept_tokens(hybrid_folder):
    """After every verification (accepts and rejects), the request's GDN state equals the state a plain engine
    reaches by reading its prompt and kept tokens, within float32 rounding (chunked vs row-by-row recurrence)."""
    prompt = random_prompt(50, 3, HYBRID_VOCAB)
    params = SamplingParams(max_tokens=16, **GREEDY)
    off = engine(hybrid_folder, max_running_requests=2)
    truth = {tuple(prompt): tokens_of(run_all(off, [(prompt, params)])[0])}
    on = forced(engine(hybrid_folder, max_running_requests=2, speculative="ngram", speculative_tokens=K), truth)
    on.submit(prompt, params, request_id="r")
    seen = []
    while on.scheduler.has_work:
        request = on._live.get("r")
        on.step()
        if request is not None and not request.finished and request.prefilled:
            seen.append((request.num_cached, gdn_state(on, on.state_pool.slot(request))))
    assert len(seen) >= 4 and len({n for n, _ in seen}) == len(seen)
    captured = {}

    def capture(point):
        if point == "before_complete":
            request = off._live["ref"]
            captured["state"] = gdn_state(off, off.state_pool.slot(request))

    off.step_hook = capture
    for num_cached, state in seen:
        tokens = (prompt + truth[tuple(prompt)])[:num_cached]
        stream = off.submit(tokens, SamplingParams(max_tokens=1, **GREEDY), request_id="ref")
        while not stream.finished:
            off.step()
        for got, want in zip(state, captured["state"]):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert_pools_full(on)


def smollm_truth(eng, prompts, params):
    return {tuple(eng.tokenizer.encode(p)): tokens_of(o) for p, o in zip(prompts, run_all(
        eng, [(eng.tokenizer.encode(p), params) for p in prompts]))}


def test_grammar_and_stop_strings_keep_working(tmp_path):
    """SmolLM2 (a real tokenizer): a JSON-schema grammar row and a stop-string row beside a plain one."""
    from deltaserve.text.structured import schema_grammar

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    texts = ["Tell me about Paris in one sentence.", "Describe a person as JSON:", "Count: one, two, three,"]
    off = engine(None, max_running_requests=4, max_total_tokens=4096)
    vocab = off.vocab_size
    plain_params = SamplingParams(max_tokens=24, **GREEDY)
    base = run_all(off, [(off.tokenizer.encode(t), plain_params) for t in texts])
    stop = off.tokenizer.decode(tokens_of(base[2])[4:6]).strip()
    assert stop
    params = [plain_params, SamplingParams(max_tokens=24, grammar=schema_grammar(schema), temperature=0),
              SamplingParams(max_tokens=24, stop=(stop,), **GREEDY)]
    ids = [off.tokenizer.encode(t) for t in texts]
    want = run_all(off, list(zip(ids, params)))
    truth = {tuple(i): tokens_of(o) for i, o in zip(ids, want)}
    on = forced(engine(None, max_running_requests=4, max_total_tokens=4096, speculative="ngram",
                       speculative_tokens=K), truth, vocab)
    got = run_all(on, list(zip(ids, params)))
    for a, b in zip(want, got):
        assert tokens_of(a) == tokens_of(b)
        assert "".join(o.text for o in a) == "".join(o.text for o in b)
        assert a[-1].finish_reason == b[-1].finish_reason
    assert got[2][-1].finish_reason == "stop" and len(tokens_of(got[2])) < 24
    assert on.speculation.accepted_total > 0
    assert_pools_full(on)


def chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories either saw, and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    stat, cells = 0.0, 0
    for key in set(a) | set(b):
        x, y = a[key], b[key]
        if x + y < 10:  # pooled with nothing: rare cells carry no power and break the approximation
            continue
        cells += 1
        stat += (math.sqrt(nb / na) * x - math.sqrt(na / nb) * y) ** 2 / (x + y)
    return stat, cells - 1


# chi-square 99.9% quantiles by degrees of freedom (for a test that fails by chance once in a thousand runs)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31, 19: 43.82,
            20: 45.31}


def test_verify_samples_the_target_distribution():
    """Rejection sampling against point-mass drafts: the tokens kept at each position follow the distribution
    `sample` draws from (temperature, top-k, penalties, logit_bias applied), the drafts' quality aside."""
    from deltaserve.engine.sampler import distribution

    vocab, n = 8, 6000
    torch.manual_seed(0)
    logits = torch.randn(K + 1, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, presence_penalty=0.5, logit_bias=((2, 1.0),))
    prompt = [1, 2]

    class Row:
        def __init__(self, seed):
            self.params, self.prompt_ids, self.output_ids, self.grammar = params, prompt, [], None
            self.generator = torch.Generator().manual_seed(seed)
            self.stop_ids, self.max_new_tokens = frozenset(), 100

    drafts = [int(logits[0].argmax()), 5, 1]
    first, second = Counter(), Counter()
    for seed in range(n):
        out = verify(logits, Row(seed), drafts)
        first[out[0].token_id] += 1
        if out[0].token_id == drafts[0] and len(out) > 1:
            second[out[1].token_id] += 1
    p0 = distribution(logits[0], Row(0))
    row1 = Row(0)
    row1.output_ids = [drafts[0]]
    p1 = distribution(logits[1], row1)
    for counts, p in ((first, p0), (second, p1)):
        total = sum(counts.values())
        p = p / p.sum()
        stat = sum((counts[t] - total * float(p[t])) ** 2 / (total * float(p[t])) for t in range(vocab) if p[t] > 0)
        dof = int((p > 0).sum()) - 1
        assert stat < CHI2_999[dof], (stat, dof, counts, p)
        assert all(counts[t] == 0 for t in range(vocab) if p[t] == 0)


def test_engine_sampling_matches_plain_sampling(hybrid_folder):
    """The tiny hybrid, temperature 1: the second and third tokens with speculation (drafts often rejected) are
    distributed as without it (a two-sample chi-square at the 99.9% level)."""
    prompt = random_prompt(12, 5, HYBRID_VOCAB)
    n = 600
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=8, seed=s, ignore_eos=True) for s in range(n)]
    off = engine(hybrid_folder, max_running_requests=16, max_queue=n)
    on = engine(hybrid_folder, max_running_requests=16, max_queue=n, speculative="ngram", speculative_tokens=2)
    common = Counter(tokens_of(o)[1] for o in run_all(off, [(prompt, params[0])] * 50)).most_common(2)

    class Fixed:  # always the two tokens most often seen second, whatever came first
        def propose(self, request, k):
            return [t for t, _ in common][:k]

    on.speculation.drafter, on.speculation.adaptive = Fixed(), False
    plain = [tokens_of(o) for o in run_all(off, [(prompt, p) for p in params])]
    spec = [tokens_of(o) for o in run_all(on, [(prompt, p) for p in params])]
    assert on.speculation.accepted_total > 0 and on.speculation.accepted_total < on.speculation.drafted_total
    for position in (1, 2):
        stat, dof = chi_square(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert dof >= 2 and stat < CHI2_999[min(dof, 20)] * (1 if dof <= 20 else dof / 20), (position, stat, dof)
    assert_pools_full(on)


def test_ngram_drafts_and_acceptance_policy():
    import numpy as np

    tokens = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7], dtype=np.int64)
    assert ngram_drafts(tokens, 3) == [8, 9, 1]  # the 3-gram 5 6 7 seen before
    assert ngram_drafts(np.array([1, 2, 3, 4]), 2) == []
    assert ngram_drafts(np.array([4, 2, 9, 9, 3, 2]), 2) == [9, 9]  # only the last token recurs
    # the 4-gram 1 5 6 7 seen first wins over the later 3-gram 5 6 7
    assert ngram_drafts(np.array([1, 5, 6, 7, 8, 2, 5, 6, 7, 9, 3, 1, 5, 6, 7]), 2) == [8, 2]
    batch_one = [0.18 * k for k in (1, 2, 3)]  # a draft row at batch 1: ~0.18 of the request's plain step
    assert draft_len(0.9, batch_one) == 3 and draft_len(0.05, batch_one) == 0
    state = SpecState()
    for _ in range(10):
        state.record(3, 0)
    assert draft_len(state.rate, batch_one) == 0


def test_ngram_drafting_on_a_repetitive_prompt_is_greedy_equal(hybrid_folder):
    """The real n-gram drafter on a prompt that repeats itself, adaptive draft lengths on."""
    unit = random_prompt(20, 9, HYBRID_VOCAB)
    prompt = unit * 4
    params = SamplingParams(max_tokens=24, **GREEDY)
    off = engine(hybrid_folder, max_running_requests=2)
    on = engine(hybrid_folder, max_running_requests=2, speculative="ngram")
    assert tokens_of(run_all(on, [(prompt, params)])[0]) == tokens_of(run_all(off, [(prompt, params)])[0])
    assert on.speculation.drafted_total > 0
    assert_pools_full(on)


def test_config_and_ledger():
    from deltaserve.budget import plan_budget, spec_from_checkpoint, default_model_path

    EngineConfig(speculative="mtp")  # accepted; refused at planning where a checkpoint has no head
    with pytest.raises(ConfigError, match="speculative-tokens"):
        EngineConfig(speculative="ngram", speculative_tokens=0)
    spec = spec_from_checkpoint(str(default_model_path()))
    budget = plan_budget(spec, EngineConfig(speculative="ngram", device="cpu").for_device("cpu"),
                         device_total_bytes=8 << 30, device_kind="cpu")
    assert budget.line("speculative_states").bytes == 0  # dense: nothing to roll back but KV, which is not kept


def test_hybrid_ledger_line_equals_measured(hybrid_folder):
    eng = engine(hybrid_folder, max_running_requests=4, speculative="ngram", speculative_tokens=K,
                 prefix_cache=True)
    line = eng.budget.line("speculative_states").bytes
    assert line == 4 * K * eng.budget.state_bytes_per_slot > 0
    assert eng.measured_bytes()["speculative_states"] == line
    assert eng.measured_bytes()["checkpoint_pool"] == eng.budget.line("checkpoint_pool").bytes


def test_prefix_cache_resumes_from_the_rolled_back_state(hybrid_folder):
    """A finished request stores its end (pages and GDN state) in the prefix cache: after verifications with
    rejections that state must be the one after its kept tokens, so a follow-up turn that hits it (the answer
    sent back, then new tokens) continues exactly as without speculation or cache."""
    prompts = [random_prompt(n, 70 + n, HYBRID_VOCAB) for n in (30, 45)]
    params = SamplingParams(max_tokens=14, **GREEDY)
    off = engine(hybrid_folder, max_running_requests=4)
    first = {tuple(p): tokens_of(o) for p, o in zip(prompts, run_all(off, [(p, params) for p in prompts]))}
    follow = [p + first[tuple(p)] + random_prompt(5, 90 + i, HYBRID_VOCAB) for i, p in enumerate(prompts)]
    truth = dict(first)
    truth.update({tuple(f): tokens_of(o) for f, o in zip(follow, run_all(off, [(f, params) for f in follow]))})
    on = forced(engine(hybrid_folder, max_running_requests=4, speculative="ngram", speculative_tokens=K,
                       prefix_cache=True, checkpoint_slots=8), truth)
    assert [tokens_of(o) for o in run_all(on, [(p, params) for p in prompts])] == [first[tuple(p)] for p in prompts]
    hits = on.prefix_cache.hit_tokens_total
    assert [tokens_of(o) for o in run_all(on, [(f, params) for f in follow])] == [truth[tuple(f)] for f in follow]
    assert on.prefix_cache.hit_tokens_total - hits >= sum(len(p) + 13 for p in prompts)
    on.flush_cache()
    assert_pools_full(on)
    assert on.checkpoint_pool.used_slots == 0


def test_usage_reports_drafts_only_when_speculating(hybrid_folder, tmp_path):
    """A real server with --speculative ngram: /v1/completions' usage carries the drafted and accepted counts
    (the engine's per-request counters); a server without speculation sends no such key."""
    from deltaserve.server import openai_translate
    from deltaserve.server.generation import TokenCounts
    from server_util import running_server

    assert "speculative" not in openai_translate.usage(TokenCounts(3, 4, 0)).model_dump()
    prompt = random_prompt(20, 9, HYBRID_VOCAB) * 4  # repeats itself: prompt lookup finds drafts
    with running_server(tmp_path, "--model", hybrid_folder, "--speculative", "ngram", "--max-total-tokens", "4096",
                        "--max-running-requests", "2") as server:
        model = server.get("/v1/models").json()["data"][0]["id"]
        body = server.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True}).json()
        metrics = server.get("/metrics").text
    spec = body["usage"]["speculative"]
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert f"deltaserve_speculative_draft_tokens_total {float(spec['drafted'])}" in metrics


def test_measured_step_cost_decides_the_draft_length():
    """Steps measured as a CPU decodes them (a row costs about as much as a request's share of a 16-row step, little
    beside a one-row step): a request accepting 0.7 of its drafts drafts 3 alone, none among 15 others, none in a step
    that carries a prompt chunk (where its rows run per op). The old rule (one cost per draft row for every batch and
    step, 0.18 of a plain step) drafted 3 in all three."""
    from types import SimpleNamespace

    from deltaserve.engine.speculative import NgramDrafter, Speculation, StepRows

    spec = Speculation(NgramDrafter(), 3)
    step_ms = {1: 19, 2: 25, 4: 32, 8: 59, 16: 104, 19: 122}  # one thread, SmolLM2, 550-token context
    for rows, ms in step_ms.items():
        plan = SimpleNamespace(decode=[object()] * rows, verify=[], drafts={}, prefill=[])
        for _ in range(3):
            spec.observe(plan, ms / 1000)
    chunk = SimpleNamespace(decode=[object()] * 8, verify=[], drafts={}, prefill=[(object(), 504)])
    spec.observe(chunk, 0.001)  # a step with a prompt chunk is not a decode step's cost
    alone, crowded, beside_chunk = StepRows(1, 1), StepRows(16, 16), StepRows(8, 8, prefill=True)
    assert draft_len(0.7, spec.draft_costs(alone, 3)) == 3
    assert draft_len(0.7, spec.draft_costs(crowded, 3)) == 0
    assert draft_len(0.7, spec.draft_costs(beside_chunk, 3)) == 0 == draft_len(1.0, spec.draft_costs(beside_chunk, 3))
    assert draft_len(0.95, spec.draft_costs(crowded, 3)) > 0  # nearly sure drafts still pay
    cost = spec.draft_costs(crowded, 1)[0]
    assert 0.7 < cost < 1.0  # a draft row is most of a request's share of a 16-row step
    # A noisy row count (a 17-row step measured fast) does not make a draft row look free.
    spec.observe(SimpleNamespace(decode=[object()] * 17, verify=[], drafts={}, prefill=[]), 0.090)
    assert draft_len(0.7, spec.draft_costs(crowded, 3)) == 0
    # A request that stopped drafting probes now and then alone, never in a crowded step.
    spec.drafter = SimpleNamespace(propose=lambda request, k: [1] * k)
    lone, crowd = (SimpleNamespace(images=None, speculative=SpecState(rate=0.1)) for _ in range(2))
    assert sum(map(len, (spec.propose(lone, 3, StepRows(1, 1)) for _ in range(40)))) == 2
    assert sum(map(len, (spec.propose(crowd, 3, StepRows(16, 16)) for _ in range(40)))) == 0
    # Before any step is measured, the prior: a draft row 1 / (STEP_FIXED_ROWS + 1) of a one-row step.
    fresh = Speculation(NgramDrafter(), 3)
    assert draft_len(0.6, fresh.draft_costs(alone, 3)) == 2 and draft_len(0.6, fresh.draft_costs(crowded, 3)) == 0


def test_an_observing_drafter_pays_alone_not_in_a_crowd():
    """observing_pays on the step times above (one thread, SmolLM2) and a head pass of 6 ms (a sixth of a one-row
    step beside it): alone, drafts accepted at PROBE_RATE would gain more than the pass costs; among 16, where a draft
    row costs most of a request's share, they would not. The rates of the requests do not enter (load, not luck);
    nothing is decided before the pass is measured."""
    from types import SimpleNamespace

    from deltaserve.engine.speculative import Speculation, StepRows

    spec = Speculation(SimpleNamespace(propose=lambda request, k: [1] * k, observes=True), 3)
    for rows, ms in {1: 19, 2: 25, 4: 32, 8: 59, 16: 104}.items():
        for _ in range(3):
            spec.observe(SimpleNamespace(decode=[object()] * rows, verify=[], drafts={}, prefill=[]), ms / 1000)

    def pays(requests: int) -> bool:
        step = StepRows(requests, requests)
        spec.step_gain = 0.0
        for _ in range(requests):
            spec.propose(SimpleNamespace(images=None, speculative=SpecState(rate=0.05)), 3, step)
        return spec.observing_pays(step)

    assert pays(1) and pays(16)  # observe_s not measured yet
    spec.observed(0.006)
    assert pays(1) and not pays(16)  # requests whose drafts nearly all miss (rate 0.05): the load decides
    assert spec.observing_pays(StepRows(16, 16, prefill=True))  # a step with a prompt chunk is always read


def test_step_costs_skip_first_steps_and_forget_stale_ones():
    """A row count's first step (one-time costs) is not kept, and a count not seen for STALE_STEPS steps no longer
    prices drafts: a slow early 3-row step (the MTP head's first verification) cannot keep drafting off for good."""
    from deltaserve.engine.speculative import STALE_STEPS, StepCosts

    costs = StepCosts()
    costs.observe(3, 0.0018)
    assert 3 not in costs.decode_s  # the first 3-row step: not kept
    for _ in range(2):
        costs.observe(1, 0.0007)
        costs.observe(2, 0.0009)
    costs.observe(3, 0.0030)  # a slow 3-row step, kept
    assert costs.decode_line(0.5, 4)[1] > 0.001  # it makes a row look dear
    for _ in range(STALE_STEPS // 2 + 1):
        costs.observe(1, 0.0007)
        costs.observe(2, 0.0009)
    fixed, per_row = costs.decode_line(0.5, 4)  # 1 and 2 rows only, the 3-row step gone stale
    assert per_row == pytest.approx(0.0002) and fixed == pytest.approx(0.0005)


def test_deploy_file_sets_speculation_per_role(tmp_path):
    from deltaserve.deploy.schema import DeployError, load_deployment

    path = tmp_path / "deploy.toml"
    path.write_text('[instances.chat]\ndevice = "cpu"\nport = 9101\nspeculative = "ngram"\nspeculative_tokens = 5\n'
                    '[instances.agents]\ndevice = "cpu"\nport = 9102\n')
    configs = {i.name: i.config for i in load_deployment(path).instances}
    assert (configs["chat"].speculative, configs["chat"].speculative_tokens) == ("ngram", 5)
    assert configs["agents"].speculative == "auto"  # mtp where the checkpoint has a head (test_speculative_mtp)
    path.write_text('[instances.chat]\ndevice = "cpu"\nport = 9101\nspeculative = "mtp"\n')
    assert load_deployment(path).instances[0].config.speculative == "mtp"
    path.write_text('[instances.chat]\ndevice = "cpu"\nport = 9101\nspeculative = "eagle"\n')
    with pytest.raises(DeployError, match="speculative"):
        load_deployment(path)
