"""The engine on SmolLM2 (the built-in GGUF): transformers as the oracle, batched == alone, chunked == unchunked,
seeded sampling across batch compositions, aborts that return every page, stop strings across tokens."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.request import SamplingParams
from test_engine_support import engine, run_all, text_of, tokens_of

TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew "
        "into a trading port, then a capital, and its markets drew merchants from across the sea. Today the old "
        "town keeps its narrow streets, its stone bridges and a cathedral whose bells ring every hour. ")
GREEDY = dict(temperature=0, ignore_eos=True)
CHUNK_PARAMS = SamplingParams(max_tokens=3, logprobs=0, **GREEDY)


@pytest.fixture(scope="module")
def eng():
    return engine(None, max_running_requests=8, max_total_tokens=8192)


@pytest.fixture(scope="module")
def long_ids(eng):
    return eng.tokenizer.encode(TEXT * 12)


def reset_chunk(eng, tokens: int) -> None:
    eng.scheduler.prefill_chunk_tokens = tokens


def assert_pools_empty(eng) -> None:
    eng.scheduler.check()
    stats = eng.stats()
    assert (stats.kv_pages_used, stats.state_slots_used, stats.running, stats.waiting) == (0, 0, 0, 0)


def transformers_twin(eng):
    """transformers' own Llama holding the engine's weights (the GGUF reader is checked in test_models_dense)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {k: v for k, v in eng.loaded.config.items() if k not in ("architectures", "model_type")}
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    hf.load_state_dict(eng.runner.model.state_dict(), strict=True)
    return hf


def transformers_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of a prompt and its log-probabilities per step, [steps, vocab]."""
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, eos_token_id=None)
    return ref.sequences[0, len(prompt):].tolist(), torch.stack(ref.logits).log_softmax(-1)[:, 0]


def test_greedy_and_logprobs_match_transformers(eng, long_ids):
    hf = transformers_twin(eng)
    prompts = [long_ids[:21], long_ids[:150]]
    reset_chunk(eng, 64)  # the 150-token prompt is read over three steps, beside the other's decode
    outs = run_all(eng, [(p, SamplingParams(max_tokens=6, logprobs=2, **GREEDY)) for p in prompts])
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = transformers_greedy(hf, prompt, 6)
        assert tokens_of(out) == ref_tokens
        ours = [lp for o in out for lp in o.logprobs]
        for step, lp in enumerate(ours):
            assert lp.logprob == pytest.approx(ref_logprobs[step, lp.token_id].item(), abs=2e-3)
            top_ids = [t for t, _, _ in lp.top]
            assert top_ids == ref_logprobs[step].topk(2).indices.tolist()
    assert_pools_empty(eng)


def test_eight_prompts_together_equal_each_alone(eng, long_ids):
    reset_chunk(eng, 512)
    lengths = [2, 9, 17, 33, 48, 64, 65, 100]
    prompts = [long_ids[i * 7: i * 7 + n] for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    alone = [tokens_of(run_all(eng, [(p, params)])[0]) for p in prompts]
    together = [tokens_of(out) for out in run_all(eng, [(p, params) for p in prompts])]
    assert together == alone
    assert all(len(t) == 6 for t in together)
    assert_pools_empty(eng)


def test_decode_steps_build_the_same_batch_as_the_general_path(eng, long_ids):
    """The runner's decode-only batch (fewer small ops) equals the general packing, field by field, at 1 and at
    several sequences of different context lengths."""
    reset_chunk(eng, 512)
    runner, seen = eng.runner, []
    forward = runner.forward

    def compare(plan):
        if not plan.prefill:
            fast, general = runner.decode_batch(plan), runner.packed_batch(plan)
            for name, value in vars(general).items():
                other = getattr(fast, name)
                if isinstance(value, torch.Tensor):
                    assert other.dtype == value.dtype and torch.equal(other, value), name
                else:
                    assert other == value, name
            seen.append(len(plan.decode))
        return forward(plan)

    runner.forward = compare
    try:
        params = SamplingParams(max_tokens=5, **GREEDY)
        run_all(eng, [(long_ids[:7], params)])
        run_all(eng, [(long_ids[i * 5: i * 5 + n], params) for i, n in enumerate([3, 11, 30])])
    finally:
        runner.forward = forward
    assert 1 in seen and 3 in seen
    assert_pools_empty(eng)


@pytest.fixture(scope="module")
def unchunked(eng, long_ids):
    # 1,020 prompt tokens in all, so even chunks of 1000 split the second prompt.
    prompts = [long_ids[:560], long_ids[5:465]]
    reset_chunk(eng, 4096)
    return prompts, run_all(eng, [(p, CHUNK_PARAMS) for p in prompts])


@pytest.mark.parametrize("chunk", [64, 100, 1000])
def test_chunked_prefill_equals_unchunked(eng, unchunked, chunk):
    prompts, whole = unchunked
    params = CHUNK_PARAMS
    reset_chunk(eng, chunk)
    chunked = run_all(eng, [(p, params) for p in prompts])
    reset_chunk(eng, 512)
    for a, b in zip(whole, chunked):
        assert tokens_of(a) == tokens_of(b)
        la = [lp.logprob for o in a for lp in o.logprobs]
        lb = [lp.logprob for o in b for lp in o.logprobs]
        assert la == pytest.approx(lb, abs=1e-3)
    assert_pools_empty(eng)


def test_seeded_sampling_is_the_same_in_any_batch(eng, long_ids):
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    prompt = long_ids[:30]
    alone = tokens_of(run_all(eng, [(prompt, seeded)])[0])
    others = [(long_ids[50:50 + n], SamplingParams(max_tokens=n // 8 + 2, temperature=1.0, seed=n, ignore_eos=True))
              for n in (12, 30, 60)]
    mixed = run_all(eng, others[:2] + [(prompt, seeded)] + others[2:])
    assert tokens_of(mixed[2]) == alone
    other_seed = tokens_of(run_all(eng, [(prompt, SamplingParams(**{**seeded.__dict__, "seed": 99}))])[0])
    assert other_seed != alone  # the draw really depends on the seed
    assert_pools_empty(eng)


def test_abort_mid_prefill_and_mid_decode_returns_everything(eng, long_ids):
    reset_chunk(eng, 64)
    params = SamplingParams(max_tokens=50, **GREEDY)
    a = eng.submit(long_ids[:400], params, request_id="prefilling")
    b = eng.submit(long_ids[:20], params, request_id="decoding")
    c = eng.submit(long_ids[:30], params, request_id="waiting-or-running")
    for _ in range(3):
        eng.step()
    assert eng.stats().kv_pages_used > 0
    eng.abort("prefilling")  # still reading its prompt: 400 tokens take 7 chunks of 64
    eng.step()
    while not any(o.token_ids for o in b.drain()):
        eng.step()
    eng.abort("decoding")
    eng.abort("waiting-or-running")
    eng.abort("no-such-request")  # unknown ids are ignored
    reset_chunk(eng, 512)
    for stream in (a, b, c):
        assert stream.finished and stream.drain()[-1].finish_reason == "abort"
    assert_pools_empty(eng)
    assert eng.stats().finished.get("abort", 0) >= 3


def test_stop_string_across_token_boundaries(eng, long_ids):
    prompt = long_ids[:60]
    free = run_all(eng, [(prompt, SamplingParams(max_tokens=24, **GREEDY))])[0]
    ids = tokens_of(free)
    text = text_of(free)
    assert text == eng.tokenizer.decode(ids)  # streamed deltas add up to the whole text
    pieces = [eng.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    # A stop string made of the end of one token and the start of the next, well inside the text.
    boundary = next(len(pieces[i]) for i in range(4, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 2
                    and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = text[boundary - 2: boundary + 2]
    expected = text[: text.find(stop)]
    stopped = run_all(eng, [(prompt, SamplingParams(max_tokens=24, stop=("never-there", stop), **GREEDY))])[0]
    assert text_of(stopped) == expected
    assert stopped[-1].finish_reason == "stop"
    assert len(tokens_of(stopped)) < len(ids)
    assert_pools_empty(eng)


def test_eos_stops_unless_ignored_and_stop_token_ids(eng, long_ids):
    eos = next(iter(eng.eos_token_ids))
    chat = eng.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    out = run_all(eng, [(chat, SamplingParams(max_tokens=64, temperature=0))])[0]
    assert out[-1].finish_reason == "stop" and tokens_of(out)[-1] == eos
    assert eng.tokenizer.token_str(eos) not in text_of(out)
    free = tokens_of(run_all(eng, [(long_ids[:40], SamplingParams(max_tokens=8, **GREEDY))])[0])
    cut = run_all(eng, [(long_ids[:40], SamplingParams(max_tokens=8, stop_token_ids=(free[3],), **GREEDY))])[0]
    assert tokens_of(cut) == free[: free.index(free[3]) + 1] and cut[-1].finish_reason == "stop"


def test_utf8_split_across_tokens_streams_whole_characters(eng):
    # Forced through a request's own detokenizer: CJK and emoji are several byte tokens each in SmolLM2.
    from deltaserve.engine.engine import RequestStream
    from deltaserve.engine.request import Request

    text = "日本語のテキスト 😀 and 🎉🎉 done"
    ids = eng.tokenizer.encode(text)
    assert len(ids) > len(text.split())  # several tokens per character somewhere
    request = Request("utf8", [1, 2, 3], SamplingParams(max_tokens=len(ids), stop=("🎉 d",)), len(ids), 100,
                      RequestStream("utf8"), eng.tokenizer, frozenset(), torch.Generator(), 0.0)
    deltas = []
    for token_id in ids:
        deltas.append(request.append_token(token_id, None))
        if deltas[-1].finished:
            break
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text[: text.find("🎉 d")]
    assert request.finish_reason == "stop"


def test_reasoning_tokens_are_those_before_the_think_end_ids(eng):
    """The count a thinking request reports: tokens before its reasoning_end ids, matched as a sequence (a
    partial match is thinking), all of them while the marker has not come, and none for a request that does not
    think."""
    from deltaserve.engine.engine import RequestStream
    from deltaserve.engine.request import Request

    end = (7, 8, 9)
    ids = [1, 7, 8, 2, 3, 7, 8, 9, 4, 5]

    def counts(params: SamplingParams) -> list[int]:
        request = Request("think", [1], params, len(ids), 100, RequestStream("think"), eng.tokenizer, frozenset(),
                          torch.Generator(), 0.0)
        return [request.append_token(token_id, None).reasoning_tokens for token_id in ids]

    assert counts(SamplingParams(reasoning_end=end)) == [1, 2, 3, 4, 5, 6, 7, 5, 5, 5]
    assert counts(SamplingParams()) == [0] * len(ids)


def test_a_prefill_step_reuses_the_memory_the_last_one_freed(eng, long_ids):
    """glibc gave a step's freed activations and widened weight tiles back to the OS, and the next step took them
    again as fresh zeroed pages: ~70,000 page faults per 528-token prompt on the engine's thread (~0.1 s of ~0.75),
    ~20,000 stepped from this one; ~300 now that the engine keeps them (engine._keep_step_memory)."""
    resource = pytest.importorskip("resource")
    reset_chunk(eng, 512)
    params = SamplingParams(max_tokens=1, **GREEDY)
    prompts = [long_ids[i:i + 528] for i in (0, 1, 2)]
    assert len(prompts[-1]) == 528
    run_all(eng, [(prompts[0], params)])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run_all(eng, [(prompts[1], params)])
    run_all(eng, [(prompts[2], params)])
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 2
    assert faults < 10_000
    assert_pools_empty(eng)


def test_bfloat16_compute_on_cpu_runs_and_says_what_it_costs(eng, long_ids):
    """--dtype bfloat16 on CPU: the float32-only native kernels step aside (a note says so) and the engine still
    answers. Its greedy token is the float32 one wherever float32's top two log-probabilities are > 2 apart (bf16
    keeps 8 bits: logits move by a few tenths at most on this model, far less than that margin)."""
    notes = []
    bf16 = Engine(EngineConfig(model=None, device="cpu", dtype="bfloat16", kv_dtype="float32", max_total_tokens=2048,
                               dequantize_weights=True, prefix_cache=False), log=notes.append)
    assert any("--dtype bfloat16 on CPU" in str(n) for n in notes)
    params = SamplingParams(max_tokens=1, logprobs=2, **GREEDY)
    checked = 0
    for n in (9, 17, 33, 60, 90, 120):
        ref = run_all(eng, [(long_ids[:n], params)])[0]
        top = ref[0].logprobs[0]
        if len(top.top) > 1 and top.top[0][2] - top.top[1][2] > 2:
            assert tokens_of(run_all(bf16, [(long_ids[:n], params)])[0]) == tokens_of(ref)
            checked += 1
    assert checked, "no prompt with a clear float32 margin"


def test_prefill_dtype_bfloat16_takes_the_bf16_gemm(long_ids, monkeypatch):
    """--prefill-dtype bfloat16 on the packed default: every packed layer is flagged, a prefill chunk's projections
    go through the bfloat16 GEMM where this CPU has AVX512-BF16 (tests/test_kernels_int4.py holds that kernel to its
    derived bound; without the instructions the engine says so and stays float32), decode rows stay on the float32
    kernel, and on English text SmolLM2's greedy tokens are those of the float32 engine."""
    from deltaserve.kernels import int4_cpu
    from deltaserve.models.layers import Int4Linear

    logs: list[str] = []
    settings = dict(max_total_tokens=4096, dequantize_weights=False, device="cpu", kv_dtype="float32",
                    prefix_cache=False, activation_dtype="float32")  # bf16 rounds float32 activations only
    bf16 = Engine(EngineConfig(prefill_dtype="bfloat16", **settings), log=logs.append)
    layers = [m for m in bf16.runner.model.modules() if isinstance(m, Int4Linear)]
    if not int4_cpu.has_bf16():
        assert any("needs AVX512-BF16" in line for line in logs) and not any(m.prefill_bf16 for m in layers)
        pytest.skip("this CPU (or build) has no AVX512-BF16: prefill stays float32, as the log said")
    assert layers and all(m.prefill_bf16 for m in layers)
    assert any(f"{len(layers)} packed 4-bit layers multiply GEMM rows" in line for line in logs)
    calls = []
    real = int4_cpu.gemm_bf16
    monkeypatch.setattr(int4_cpu, "gemm_bf16", lambda rows, *a: calls.append(rows.shape[0]) or real(rows, *a))
    params = SamplingParams(max_tokens=8, **GREEDY)
    prompt = long_ids[:300]
    got = tokens_of(run_all(bf16, [(prompt, params)])[0])
    assert calls and set(calls) == {len(prompt)}  # the prompt's rows; the 7 decode steps' single rows: float32
    float32 = Engine(EngineConfig(**settings), log=None)
    assert got == tokens_of(run_all(float32, [(prompt, params)])[0])
    # a prompt read in a step beside a decode: its rows alone are rounded, the decode row stays float32
    first = bf16.submit(long_ids[:20], SamplingParams(max_tokens=4, **GREEDY))
    while not any(o.token_ids for o in first.drain()):
        bf16.step()
    calls.clear()
    second = bf16.submit(prompt, params)
    bf16.step()
    assert calls and set(calls) == {len(prompt)}, calls
    while not (first.finished and second.finished):
        bf16.step()


def test_prefill_dtype_bfloat16_under_int8_activations_says_int8_serves():
    """The default --activation-dtype int8 takes every packed 4-bit layer's rows as int8, prefill included: a
    --prefill-dtype bfloat16 beside it has nothing to round, and the engine says so (and which flag brings it back)."""
    from deltaserve.models.layers import Int8DotLinear, Int4Linear

    logs: list[str] = []
    eng = Engine(EngineConfig(prefill_dtype="bfloat16", max_total_tokens=2048, device="cpu"), log=logs.append)
    assert any("--prefill-dtype bfloat16 rounds float32 activations" in line and "--activation-dtype float32" in line
               for line in logs)
    modules = list(eng.runner.model.modules())
    assert any(isinstance(m, Int8DotLinear) for m in modules)
    assert not any(isinstance(m, Int4Linear) and m.prefill_bf16 for m in modules)
