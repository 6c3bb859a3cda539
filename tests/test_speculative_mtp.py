"""--speculative mtp (models/mtp.py, engine/mtp_drafter.py): the head against a reference built from transformers'
own Qwen3.5 layer and norm classes on the same weights, greedy output unchanged, the GDN rollback, the ledger.

The tiny hybrid of test_engine_support gets a random MTP head (`add_mtp_head`): its drafts are mostly wrong, so
these tests pass rejections everywhere and some acceptances; tests/data/mtp_fitted (test_mtp_fitted_acceptance) is
a head fitted to the tiny model's own next-next tokens, for acceptance.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.budget import SpecError
from deltaserve.engine.loader import load_model
from deltaserve.engine.request import SamplingParams
from deltaserve.kernels import decode_cpu, fused_cpu
from deltaserve.models.batch import ModelCaches
from test_engine_support import (HYBRID_VOCAB, engine, make_dense_checkpoint, make_hybrid_checkpoint, random_prompt,
                                 run_all, tokens_of)

K = 3
GREEDY = dict(temperature=0, ignore_eos=True)
MTP_LAYER_OF_TINY = 3  # a full-attention layer index of the tiny config: its layer_types give the reference's class


def mtp_reference_parts(config_dict: dict, tensors: dict[str, torch.Tensor]):
    """transformers' own classes holding the head's weights: the decoder layer (full attention), the three norms, fc."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                              Qwen3_5TextRotaryEmbedding)

    config = Qwen3_5TextConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    assert config.layer_types[MTP_LAYER_OF_TINY] == "full_attention"
    h = config.hidden_size
    layer = Qwen3_5DecoderLayer(config, MTP_LAYER_OF_TINY).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps).eval()
        norms[name].weight.data.copy_(tensors[f"mtp.{name}.weight"])
    fc = torch.nn.Linear(2 * h, h, bias=False)
    fc.weight.data.copy_(tensors["mtp.fc.weight"])
    return config, layer, norms, fc, Qwen3_5TextRotaryEmbedding(config)


def add_mtp_head(folder: Path, seed: str = "mtp-head", head: dict[str, torch.Tensor] | None = None) -> None:
    """Add an `mtp.*` head to a tiny Qwen3.5 checkpoint, and mtp_num_hidden_layers = 1 to its config: `head`'s
    tensors, or a random head (one full-attention Qwen3.5 layer, made by transformers, in the checkpoint's dtype;
    the fuzzer's Qwen3.5 cases drawn for MTP get one too)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    config_path = folder / "config.json"
    config_dict = json.loads(config_path.read_text())
    config_dict["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config_dict))
    torch.manual_seed(zlib.crc32(seed.encode()))
    config = Qwen3_5TextConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    if "full_attention" not in config.layer_types:  # the head's layer is full attention whatever the target's are
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))
    h = config.hidden_size
    tensors = load_file(folder / "model.safetensors")
    if head is not None:
        save_file({**tensors, **head}, folder / "model.safetensors", metadata={"format": "pt"})
        return
    head = {f"mtp.layers.0.{k}": (v.normal_(0, 0.1) if "norm" not in k else torch.randn_like(v) * 0.2).contiguous()
            for k, v in layer.state_dict().items()}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{name}.weight"] = torch.randn(h) * 0.2
    head["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.1
    dtype = tensors["model.embed_tokens.weight"].dtype  # as the checkpoint stores its own (bfloat16 or float32)
    save_file({**tensors, **{k: v.to(dtype) for k, v in head.items()}}, folder / "model.safetensors",
              metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec-mtp")
    make_hybrid_checkpoint(folder)
    add_mtp_head(folder)
    return folder


def test_head_matches_transformers_layers_on_the_same_weights(mtp_folder):
    """Our head over a prompt (written to its cache in two pieces) and then chained on its own output (K/V kept
    off the cache) against the reference: transformers' Qwen3.5 full-attention decoder layer, its zero-centred
    RMSNorms and an fc, composed as vLLM's Qwen3NextMultiTokenPredictor composes them (embedding norm first in the
    concatenation), fed the target's hidden states after its final norm (transformers' last_hidden_state)."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(mtp_folder / "model.safetensors")
    config_dict = json.loads((mtp_folder / "config.json").read_text())
    config, layer, norms, fc, rotary = mtp_reference_parts(config_dict, tensors)
    target = AutoModelForCausalLM.from_pretrained(mtp_folder, dtype=torch.float32).eval()
    ours = load_model(mtp_folder, mtp=True).model
    head = ours.mtp
    assert head is not None and ours.geometry.layer_kinds[-1] == "attention"
    ids = random_prompt(23, 5, HYBRID_VOCAB)
    n, chain_len = len(ids) - 1, 3
    with torch.no_grad():
        hidden = target.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
        embed = target.model.embed_tokens

        def reference(tokens_next: list[int], hiddens: torch.Tensor) -> torch.Tensor:
            x = fc(torch.cat([norms["pre_fc_norm_embedding"](embed(torch.tensor(tokens_next))),
                              norms["pre_fc_norm_hidden"](hiddens)], dim=-1))[None]
            positions = torch.arange(x.shape[1])[None]
            cos_sin = rotary(x, positions[None].expand(3, 1, -1))
            return norms["norm"](layer(x, cos_sin, attention_mask=None, position_ids=positions))[0]

        want = reference(ids[1:], hidden[:n])
        # ours: positions 0..n-1 into a cache of its own (two calls: the second reads the first's K/V)
        kv_heads, d = head.layers[0].self_attn.num_kv_heads, head.layers[0].self_attn.head_dim
        k_cache, v_cache = torch.zeros(64, kv_heads, d), torch.zeros(64, kv_heads, d)
        slots = torch.randperm(64)[:n + chain_len]  # any slots: a request's pages need not be contiguous
        m = 9
        got = torch.cat([
            head(ours.model.embed_tokens(torch.tensor(ids[1:m + 1])), hidden[:m], 0, k_cache, v_cache, slots[:0],
                 write_slots=slots[:m]),
            head(ours.model.embed_tokens(torch.tensor(ids[m + 1:])), hidden[m:n], m, k_cache, v_cache, slots[:m],
                 write_slots=slots[m:n])])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        # chaining: row n reads (h' of row n - 1, the token it drafts), K/V kept in `chain`, not the cache
        drafts, h_ref, h_ours, chain = list(ids[1:]), want, got, []
        before = k_cache.clone()
        for j in range(chain_len):
            draft = int(target.lm_head(h_ref[-1]).argmax())
            assert draft == int(ours.lm_head(h_ours[-1]).argmax())
            drafts.append(draft)
            h_ref = reference(drafts, torch.cat([hidden[:n], h_ref[n - 1:]]))
            row = head(ours.model.embed_tokens(torch.tensor([draft])), h_ours[-1:], n + j, k_cache, v_cache,
                       slots[:n], chain=chain)
            h_ours = torch.cat([h_ours, row])
            torch.testing.assert_close(h_ours, h_ref, atol=2e-5, rtol=1e-4)
        assert torch.equal(k_cache, before)

        # the native blocks (decode_rows, what the drafter runs on CPU) on the same rows, into caches of their own;
        # the chained rows' K/V go to their positions' slots (what the drafter's propose does)
        assert decode_cpu.load() is not None and fused_cpu.load() is not None  # this machine builds them
        none = [None] * head.kv_layer
        caches = ModelCaches(k=none + [torch.zeros(64, kv_heads, d)], v=none + [torch.zeros(64, kv_heads, d)],
                             conv=[], recurrent=[])

        def native(tokens: list[int], hiddens: torch.Tensor, start: int) -> torch.Tensor:
            ids_ = torch.tensor(tokens)
            rows = len(tokens)
            out = head.decode_rows(ids_, ours.model.embed_tokens(ids_), hiddens, start, slots[start:start + rows],
                                   slots[:start + rows].expand(rows, -1).contiguous(), caches)
            assert out is not None  # the blocks serve here: float32 on CPU, built (conftest)
            return out

        got = torch.cat([native(ids[1:m + 1], hidden[:m], 0), native(ids[m + 1:], hidden[m:n], m)])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        for j in range(chain_len):
            got = torch.cat([got, native([drafts[n + j]], got[-1:], n + j)])
        torch.testing.assert_close(got, h_ref, atol=2e-5, rtol=1e-4)


def test_greedy_equals_speculation_off_and_pools_return(mtp_folder):
    """Greedy output with MTP drafts (batch 1, then mixed batches beside prompt chunks) equals output without
    speculation, with logprobs; the verifier saw drafts, every page and state slot comes back."""
    prompts = [random_prompt(n, 60 + n, HYBRID_VOCAB) for n in (9, 130, 70)]
    params = SamplingParams(max_tokens=20, logprobs=2, **GREEDY)
    off = engine(str(mtp_folder), max_running_requests=4, speculative="off")
    off.scheduler.prefill_chunk_tokens = 64
    plain = run_all(off, [(p, params) for p in prompts])
    on = engine(str(mtp_folder), max_running_requests=4, speculative="mtp", speculative_tokens=K)
    on.speculation.adaptive = False  # always K drafts: rejections at every position of a random head
    on.scheduler.prefill_chunk_tokens = 64
    for batch in ([prompts[0]], prompts):
        spec = run_all(on, [(p, params) for p in batch])
        for want, got in zip(plain, spec):
            assert tokens_of(got) == tokens_of(want)
            # the same tokens; log-probs within float32 rounding (a verification row is a prefill row)
            want_lp = [lp.logprob for o in want for lp in o.logprobs]
            assert [lp.logprob for o in got for lp in o.logprobs] == pytest.approx(want_lp, abs=1e-4)
    assert on.speculation.drafted_total > 0
    on.scheduler.check()
    assert on.kv_pool.used_pages == 0 and on.state_pool.used_slots == 0
    assert not on.mtp_drafter.next


@pytest.mark.parametrize("blocks", ["native", "op-by-op"])
def test_drafter_state_equals_the_head_over_the_whole_sequence(mtp_folder, blocks):
    """Whatever the steps were (prompt chunks, verifications with rejections, plain decodes), after each step the
    drafter's first draft and its hidden state equal the head run once over the request's whole kept sequence,
    fed transformers' hidden states of it: the rows the head saw, and the tokens paired with them, are the right
    ones. Its chained drafts (propose) are those of the head run op by op. Both with the native decode blocks (the
    drafter's CPU path) and without (decode_cpu disabled: the head's rows op by op)."""
    import contextlib

    with decode_cpu.disabled() if blocks == "op-by-op" else contextlib.nullcontext():
        drafter_state_equals_the_head(mtp_folder)


def drafter_state_equals_the_head(mtp_folder):
    """Three requests at once (the head reads every request's kept rows in one pass), of different lengths."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(mtp_folder, dtype=torch.float32).eval()
    on = engine(str(mtp_folder), max_running_requests=3, speculative="mtp", speculative_tokens=K)
    on.speculation.adaptive = False
    on.scheduler.prefill_chunk_tokens = 32  # the longest prompt in three chunks
    names = {"r": (90, 8, 14), "s": (20, 9, 18), "t": (41, 10, 10)}  # prompt length, seed, new tokens
    for name, (length, seed, tokens) in names.items():
        on.submit(random_prompt(length, seed, HYBRID_VOCAB), SamplingParams(max_tokens=tokens, **GREEDY),
                  request_id=name)
    head, checked, together = on.loaded.model.mtp, 0, 0
    kv = head.layers[0].self_attn
    while on.scheduler.has_work:
        live = {name: on._live.get(name) for name in names}
        on.step()
        observed = [r for r in live.values() if r is not None and not r.finished and r in on.mtp_drafter.next]
        together += len(observed) > 1
        for request in observed:
            state = on.mtp_drafter.next[request]
            ids = (request.prompt_ids + request.output_ids)[:request.num_cached + 1]
            with torch.no_grad():
                hidden = target.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
                cache = torch.zeros(len(ids), kv.num_kv_heads, kv.head_dim)
                slots = torch.arange(len(ids) - 1)
                want = head(target.model.embed_tokens(torch.tensor(ids[1:])), hidden, 0, cache, cache.clone(),
                            slots[:0], write_slots=slots)[-1]
            torch.testing.assert_close(state.hidden, want, atol=1e-4, rtol=1e-4)
            first = on.mtp_drafter._logits_token(state.hidden)  # the first draft, read when the request drafts
            assert state.cached == request.num_cached and first == int(target.lm_head(want).argmax())
            # the chain: the head op by op from the same state, its K/V in a list (not the cache)
            on.kv_pool.ensure(request, request.num_cached + K - 1)  # what the scheduler grows before drafting
            drafts, hidden_j, chain = [first], state.hidden, []
            slots = on.kv_pool.slots(request)[:request.num_cached]
            with torch.no_grad():
                for j in range(1, K):
                    hidden_j = head(on.loaded.model.model.embed_tokens(torch.tensor([drafts[-1]])), hidden_j[None],
                                    request.num_cached + j - 1, on.kv_pool.k[head.kv_layer],
                                    on.kv_pool.v[head.kv_layer], slots, chain=chain)[0]
                    drafts.append(int(on.loaded.model.lm_head(hidden_j).argmax()))
            assert on.mtp_drafter.propose(request, K) == drafts
            checked += 1
    assert checked >= 15 and together >= 3 and on.speculation.drafted_total > on.speculation.accepted_total


def test_a_crowded_step_retires_its_requests_from_the_head(mtp_folder):
    """Where the head's pass over a step's rows costs more than drafts could gain there (observing_pays, from the
    measured step and pass times), the step's requests are not read by the head and never drafted for again; the
    output stays the output without speculation and later requests are read (and drafted for) again."""
    from deltaserve.engine.speculative import StepRows

    params = SamplingParams(max_tokens=16, **GREEDY)
    prompts = [random_prompt(12, 30 + seed, HYBRID_VOCAB) for seed in range(3)]
    want = [tokens_of(o) for o in run_all(engine(str(mtp_folder), max_running_requests=3, speculative="off"),
                                          [(p, params) for p in prompts])]
    on = engine(str(mtp_folder), max_running_requests=3, speculative="mtp", speculative_tokens=K)
    spec = on.speculation
    assert spec.observing_pays(StepRows(3, 3))  # nothing measured yet: read
    run_all(on, [(prompts[0], params)])  # measures the steps and the head's pass
    assert spec.observe_s is not None and spec.costs.decode_s
    measured = spec.observe_s
    spec.observe_s = 10.0  # a pass dearer than any gain: every decode-only step is crowded
    drafted = spec.drafted_total
    seen = set()
    outs = run_all(on, [(p, params) for p in prompts], on_step=lambda _: seen.update(on.scheduler.running))
    assert [tokens_of(o) for o in outs] == want
    assert len(seen) == len(prompts) and all(r.speculative.retired for r in seen) and not on.mtp_drafter.next
    assert spec.drafted_total - drafted <= len(prompts) * K  # at most the first decode step's drafts
    spec.observe_s = 0.0  # a free pass: every step is read again (whether drafts pay is the policy's, by timing)
    spec.observed = lambda seconds: None  # (kept free: not measured again)
    seen, read = set(), set()

    def watch(_):
        seen.update(on.scheduler.running)
        read.update(on.mtp_drafter.next)

    assert [tokens_of(o) for o in run_all(on, [(p, params) for p in prompts], on_step=watch)] == want
    assert len(seen) == len(prompts) and seen <= read and not any(r.speculative.retired for r in seen)
    assert measured > 0


def test_sampled_output_runs_and_a_seed_repeats(mtp_folder):
    """Sampling with MTP drafts (rejection sampling against point-mass drafts): with a fixed draft length (the
    adaptive one follows measured step times) the same seed gives the same tokens, so the drafts are a function of
    the tokens so far."""
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    prompt = random_prompt(30, 4, HYBRID_VOCAB)
    on = engine(str(mtp_folder), max_running_requests=2, speculative="mtp", speculative_tokens=K)
    on.speculation.adaptive = False
    first, second = (tokens_of(run_all(on, [(prompt, params)])[0]) for _ in range(2))
    assert first == second and len(first) == 24


def test_ledger_prices_the_head_and_its_kv(mtp_folder):
    """--speculative mtp: the KV line gains the head's attention layer and the weights line its tensors; both equal
    what the engine holds."""
    off = engine(str(mtp_folder), max_running_requests=2, speculative="ngram")
    on = engine(str(mtp_folder), max_running_requests=2, speculative="mtp")
    layers_off = off.budget.kv_bytes_per_token // (2 * 2 * 16 * 4)  # K,V x 2 heads x 16 x float32
    assert on.budget.kv_bytes_per_token == off.budget.kv_bytes_per_token * (layers_off + 1) // layers_off
    measured = on.measured_bytes()
    assert measured["kv_pool"] == on.budget.line("kv_pool").bytes
    assert abs(measured["weights"] - on.budget.line("weights").bytes) <= 0.01 * measured["weights"]
    assert measured["weights"] > off.measured_bytes()["weights"]
    assert "MTP head" in on.budget.line("kv_pool").reason


def test_auto_drafts_with_the_head_where_there_is_one(mtp_folder, tmp_path):
    """--speculative auto (the default): the checkpoint's MTP head drafts where the checkpoint has one; without a
    head nothing is drafted and nothing is priced for it."""
    auto = engine(str(mtp_folder), max_running_requests=2)
    assert auto.config.speculative == auto.budget.speculative == "mtp"
    assert auto.mtp_drafter is not None and auto.speculation.drafter is auto.mtp_drafter
    assert auto.budget.line("speculative_states").bytes > 0
    params = SamplingParams(max_tokens=16, **GREEDY)
    prompts = [random_prompt(12, seed, HYBRID_VOCAB) for seed in range(2)]
    off = engine(str(mtp_folder), max_running_requests=2, speculative="off")
    assert ([tokens_of(o) for o in run_all(auto, [(p, params) for p in prompts])]
            == [tokens_of(o) for o in run_all(off, [(p, params) for p in prompts])])
    assert auto.speculation.verify_steps_total > 0
    make_hybrid_checkpoint(tmp_path)  # transformers saves no head
    plain = engine(str(tmp_path), max_running_requests=2)
    assert plain.config.speculative == plain.budget.speculative == "off" and plain.speculation is None
    assert plain.budget.line("speculative_states").bytes == 0


def test_auto_takes_the_head_only_where_the_context_keeps_most_of_its_room(monkeypatch):
    """The field's 27B (a W4A16 header fixture with an 811 MiB MTP head) on a 24 GiB card: with 16 running requests
    the head's weights, its K/V layer and 48 draft states do not fit, so auto plans without it and names what would
    make room; with 4 they fit but leave under AUTO_MTP_MIN_KV_SHARE of the KV pool, so auto still plans without it
    and says the price; on 48 GiB auto takes it, the same ledger as --speculative mtp. Decided on the card's size
    alone, never on what is free at start. CUDA is not among AUTO_MTP_DEVICES until bench/cuda_check.py's mtp
    section has passed on a GPU: auto is off there and says so (the rest of this test lets it in, to price it)."""
    from deltaserve.budget import advice, load_spec, option_costs, plan_budget
    from deltaserve.budget.advice import AUTO_MTP_MIN_KV_SHARE
    from deltaserve.config import EngineConfig, GiB

    spec = load_spec(str(Path(__file__).parent / "data" / "qwen3_5_27b_w4a16" / "config.json"), None, "int8", "int4")
    field = dict(device="cuda", language_model_only=True)

    def plan(gib: int = 24, **settings):
        return plan_budget(spec, EngineConfig(**field, **settings), device_total_bytes=gib * GiB, device_kind="cuda")

    def note(budget):
        return next(n for n in budget.notes if n.startswith("--speculative auto is off"))

    unchecked = plan(48)
    assert "cuda" not in advice.AUTO_MTP_DEVICES and unchecked.speculative == "off"
    assert "not yet been checked" in note(unchecked)
    monkeypatch.setattr(advice, "AUTO_MTP_DEVICES", ("cpu", "cuda"))
    crowded = plan()
    assert crowded.speculative == "off" and crowded.line("speculative_states").bytes == 0
    assert "short by" in note(crowded) and "--max-running-requests" in note(crowded)
    tight, priced = plan(max_running_requests=4), plan(max_running_requests=4, speculative="mtp")
    assert tight.speculative == "off" and priced.speculative == "mtp"
    assert priced.kv_tokens < AUTO_MTP_MIN_KV_SHARE * tight.kv_tokens
    assert f"would leave {priced.kv_tokens:,} of {tight.kv_tokens:,} KV tokens" in note(tight)
    costs = {c.option.split(" (")[0]: c.delta_kv_tokens
             for c in option_costs(spec, EngineConfig(**field, max_running_requests=4), 24 * GiB, device_kind="cuda")}
    assert costs["--speculative mtp"] == priced.kv_tokens - tight.kv_tokens  # `plan` lists the price too
    roomy = plan(48)
    assert roomy.speculative == "mtp" and roomy.line("speculative_states").bytes > 0
    assert roomy.kv_tokens >= AUTO_MTP_MIN_KV_SHARE * plan(48, speculative="off").kv_tokens
    assert roomy.to_json() == plan(48, speculative="mtp").to_json()
    with pytest.raises(SpecError, match="no multi-token-prediction head"):  # explicit mtp still refuses no head
        plan_budget(spec_without_head(spec), EngineConfig(**field, speculative="mtp"), device_total_bytes=24 * GiB,
                    device_kind="cuda")


def spec_without_head(spec):
    from dataclasses import replace

    return replace(spec, weight_groups=[g for g in spec.weight_groups if g.name != "mtp"])


def test_mtp_refused_without_a_head(tmp_path):
    make_dense_checkpoint(tmp_path)
    with pytest.raises(SpecError, match="no multi-token-prediction head"):
        engine(str(tmp_path), speculative="mtp")


FITTED = Path(__file__).parent / "data" / "mtp_fitted"


def test_fitted_head_accepts_most_drafts_on_held_out_prompts():
    """tests/data/mtp_fitted (made by tests/data/make_mtp_fitted.py): a tiny hybrid taught to continue text by a
    fixed successor table and an MTP head fitted to its own greedy continuations of prompts drawn with seeds >= 1000.
    On prompts of seeds it never saw, greedy output equals speculation off and more than half the drafts are
    accepted (a random head: about 1 in 160)."""
    prompts = [random_prompt(16, seed, HYBRID_VOCAB) for seed in range(8)]
    params = SamplingParams(max_tokens=32, **GREEDY)
    plain = run_all(engine(str(FITTED), max_running_requests=8, speculative="off"), [(p, params) for p in prompts])
    on = engine(str(FITTED), max_running_requests=8, speculative="mtp", speculative_tokens=K)
    on.speculation.adaptive = False
    spec = run_all(on, [(p, params) for p in prompts])
    assert [tokens_of(o) for o in spec] == [tokens_of(o) for o in plain]
    s = on.speculation
    assert s.drafted_total > 0 and s.accepted_total / s.drafted_total > 0.5, (s.accepted_total, s.drafted_total)

def test_compressed_tensors_head_loads_as_stored(tmp_path):
    """A compressed-tensors checkpoint (the library's own pack-quantized 4-bit, group 32) whose MTP head is
    quantized too: the head's matrices load quantized (packed: fewer bytes than float32) and dequantize to the
    library's own decompression of them."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    from test_engine_support import _save_word_tokenizer
    from test_weights_compressed_tensors import minmax_qparams_

    torch.manual_seed(zlib.crc32(b"mtp-compressed"))
    config = Qwen3_5TextConfig(
        vocab_size=HYBRID_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, initializer_range=0.1, mtp_num_hidden_layers=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                             mrope_section=[4, 2, 2], mrope_interleaved=True))
    model = Qwen3_5ForCausalLM(config).eval()
    mtp = torch.nn.Module()
    mtp.fc = torch.nn.Linear(256, 128, bias=False)
    mtp.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(config, MTP_LAYER_OF_TINY)])
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        setattr(mtp, name, Qwen3_5RMSNorm(128, eps=config.rms_norm_eps))
    model.mtp = mtp
    w4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    qconfig = QuantizationConfig.model_validate(dict(
        config_groups={"body": {"targets": ["Linear"], "weights": w4}}, ignore=["lm_head"], format="pack-quantized",
        quantization_status="frozen"))
    apply_quantization_config(model, qconfig, show_progress=False)
    minmax_qparams_(model)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "mtp.fc.weight_packed" in state and "mtp.layers.0.self_attn.q_proj.weight_packed" in state
    config.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors")
    compressor.update_config(str(tmp_path))
    _save_word_tokenizer(tmp_path)
    compressor.decompress_model(model)
    expected = model.state_dict()

    ours = load_model(tmp_path, mtp=True).model  # dequantized at load
    names = [name for name in ours.mtp.state_dict() if "mtp." + name in expected]
    assert len(names) == len([k for k in expected if k.startswith("mtp.") and k.endswith(".weight")]) > 10
    for name in names:
        key, got = "mtp." + name, ours.mtp.state_dict()[name]
        scale = state.get(key.rpartition(".")[0] + ".weight_scale")
        bound = 0.0 if scale is None else 8 * torch.finfo(torch.float32).eps * float(scale.abs().max()) * 256
        assert (got - expected[key]).abs().max() <= bound, key
    packed = load_model(tmp_path, mtp=True, dequantize=False).model
    held = sum(t.numel() * t.element_size() for t in packed.mtp.state_dict().values())
    floats = sum(t.numel() * 4 for t in ours.mtp.state_dict().values())
    assert held < 0.4 * floats


GGUF_MTP = Path(__file__).parent / "data" / "gguf" / "tiny-mtp-fitted-q8_0.gguf"


def _held_weight(module: torch.nn.Module) -> torch.Tensor:
    """A loaded linear's or norm's weight in float32: dequantized where it is held int8."""
    from deltaserve.models.layers import Int8Linear

    return module.rows().dequantize() if isinstance(module, Int8Linear) else module.weight.detach().float()


def test_gguf_head_converted_by_llama_cpp_loads_as_stored():
    """The fitted hybrid converted by llama.cpp's own converter with its MTP head (tests/data/make_gguf_fixtures.py
    mtp_fixture: blk.4.* and blk.4.nextn.*, {arch}.nextn_predict_layers = 1, at its Q8_0): the decoder keeps its 4
    layers, and each head tensor is the checkpoint's own (the converter's Q8_0 matrices within a quantum of each
    block's largest weight, its norms less the one it added, which it added in float16: within half a float16 ulp in
    [1, 2)), the matrices held 8-bit as stored. Speculation on that file is lossless and its drafts are verified."""
    from deltaserve.models.layers import Int8Linear
    from deltaserve.weights.gguf import read_gguf_config

    config = read_gguf_config(GGUF_MTP)
    assert config["num_hidden_layers"] == 4 and config["mtp_num_hidden_layers"] == 1
    assert len(config["layer_types"]) == 4
    ours = load_model(GGUF_MTP, mtp=True, dequantize=False).model.mtp
    reference = {k: v.float() for k, v in load_file(FITTED / "model.safetensors").items() if k.startswith("mtp.")}
    modules = dict(ours.named_modules(prefix="mtp"))
    for name, want in reference.items():
        module = modules[name[: -len(".weight")]]
        got = _held_weight(module)
        assert got.shape == want.shape, name
        if want.dim() == 1:  # a norm
            assert (got - want).abs().max() <= 2.0 ** -11 + 1e-6, name
        else:
            assert isinstance(module, Int8Linear), name  # held 8-bit as stored
            quantum = want.view(want.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
            assert ((got - want).view(want.shape[0], -1, 32).abs() <= quantum + 1e-6).all(), name
    on = speculates_losslessly_as_stored(GGUF_MTP, prompts=4, tokens=24)
    assert on.speculation.accepted_total > 0


def speculates_losslessly_as_stored(path: Path, prompts: int, tokens: int):
    """Greedy output of `prompts` random prompts with --speculative mtp (K drafts always) on the file's weights as
    stored equals the output without; the ledger's weights line is what the engine holds. Returns that engine."""
    ids = [random_prompt(16, seed, HYBRID_VOCAB) for seed in range(prompts)]
    params = SamplingParams(max_tokens=tokens, **GREEDY)
    as_stored = dict(max_running_requests=4, dequantize_weights=False, activation_dtype="float32")
    plain = run_all(engine(str(path), **as_stored, speculative="off"), [(p, params) for p in ids])
    on = engine(str(path), **as_stored, speculative="mtp", speculative_tokens=K)
    on.speculation.adaptive = False
    assert [tokens_of(o) for o in run_all(on, [(p, params) for p in ids])] == [tokens_of(o) for o in plain]
    assert on.speculation.drafted_total > 0
    measured = on.measured_bytes()
    assert abs(measured["weights"] - on.budget.line("weights").bytes) <= 0.01 * measured["weights"]
    return on


def make_qwen3_next_mtp_checkpoint(folder: Path):
    """A tiny random Qwen3-Next (GDN 3 : 1 attention, every layer a mixture of experts with a shared expert) saved
    by transformers, with an `mtp.*` head whose decoder layer is another such model's full-attention layer 3 as
    transformers saved it (the experts as the format writes them) plus random norms and fc, as Qwen3-Next-80B's
    checkpoint lays its head out. Returns (the target, the donor's layer 3 holding the head's layer weights)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from test_engine_support import _save_word_tokenizer

    def model(seed: str):
        torch.manual_seed(zlib.crc32(seed.encode()))
        config = Qwen3NextConfig(
            vocab_size=HYBRID_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, initializer_range=0.1,
            max_position_embeddings=32768)
        config._attn_implementation = "sdpa"
        m = Qwen3NextForCausalLM(config).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "norm" in name or "dt_bias" in name:
                    p.add_(torch.randn_like(p) * 0.2)
        return m

    target, donor = model("qwen3-next-target"), model("qwen3-next-mtp-donor")
    target.save_pretrained(folder)
    _save_word_tokenizer(folder)
    donor_folder = folder / "donor"
    donor.save_pretrained(donor_folder)
    layer_prefix = f"model.layers.{MTP_LAYER_OF_TINY}."
    assert donor.config.layer_types[MTP_LAYER_OF_TINY] == "full_attention"
    donor_tensors = load_file(donor_folder / "model.safetensors")
    head = {"mtp.layers.0." + k[len(layer_prefix):]: v for k, v in donor_tensors.items() if k.startswith(layer_prefix)}
    assert any(".experts." in k for k in head) and any("shared_expert" in k for k in head)
    h = target.config.hidden_size
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{name}.weight"] = torch.randn(h) * 0.2
    head["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.1
    config_path = folder / "config.json"
    config_dict = json.loads(config_path.read_text())
    config_dict["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config_dict))
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, **head}, folder / "model.safetensors", metadata={"format": "pt"})
    return target, donor.model.layers[MTP_LAYER_OF_TINY], head


def test_qwen3_next_head_matches_transformers_and_decodes_losslessly(tmp_path):
    """Qwen3-Next's layout of the head (its decoder layer a mixture of experts with a gated shared expert, the
    checkpoint's experts as transformers writes them): our head over a prompt against transformers' own
    Qwen3NextDecoderLayer and RMSNorm on the same weights, composed as in vLLM's qwen3_next_mtp.py; then greedy
    output with --speculative mtp equals output without, beside prompt chunks, and the pools come back. Its layer
    is not one the native decode blocks take (experts): the drafter runs it op by op."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding

    folder = tmp_path / "qwen3-next-mtp"
    target, layer, head_tensors = make_qwen3_next_mtp_checkpoint(folder)
    ours = load_model(folder, mtp=True).model
    head = ours.mtp
    assert head is not None and ours.geometry.layer_kinds[-1] == "attention"
    h = target.config.hidden_size
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3NextRMSNorm(h, eps=target.config.rms_norm_eps).eval()
        norms[name].weight.data.copy_(head_tensors[f"mtp.{name}.weight"])
    fc = torch.nn.Linear(2 * h, h, bias=False)
    fc.weight.data.copy_(head_tensors["mtp.fc.weight"])
    rotary = Qwen3NextRotaryEmbedding(target.config)
    ids = random_prompt(20, 11, HYBRID_VOCAB)
    n = len(ids) - 1
    with torch.no_grad():
        hidden = target.model(torch.tensor([ids])).last_hidden_state[0]
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](target.model.embed_tokens(torch.tensor(ids[1:]))),
                          norms["pre_fc_norm_hidden"](hidden[:n])], dim=-1))[None]
        positions = torch.arange(n)[None]
        out = layer(x, rotary(x, positions), attention_mask=None, position_ids=positions)
        want = norms["norm"](out[0] if isinstance(out, tuple) else out)[0]
        attn = head.layers[0].self_attn
        k_cache, v_cache = (torch.zeros(32, attn.num_kv_heads, attn.head_dim) for _ in range(2))
        slots = torch.randperm(32)[:n]
        got = head(ours.model.embed_tokens(torch.tensor(ids[1:])), hidden[:n], 0, k_cache, v_cache, slots[:0],
                   write_slots=slots)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

    prompts = [random_prompt(n, 70 + n, HYBRID_VOCAB) for n in (9, 100)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    off = engine(str(folder), max_running_requests=2, speculative="off")
    plain = run_all(off, [(p, params) for p in prompts])
    on = engine(str(folder), max_running_requests=2, speculative="mtp", speculative_tokens=K)
    on.speculation.adaptive = False
    on.scheduler.prefill_chunk_tokens = 48
    spec = run_all(on, [(p, params) for p in prompts])
    assert [tokens_of(o) for o in spec] == [tokens_of(o) for o in plain]
    assert on.speculation.drafted_total > 0
    assert on.kv_pool.used_pages == 0 and on.state_pool.used_slots == 0


GGUF_NEXT_MTP = Path(__file__).parent / "data" / "gguf" / "tiny-qwen3next-mtp-q8_0.gguf"


def test_gguf_qwen3_next_head_converted_by_llama_cpp_loads_as_stored(tmp_path):
    """Qwen3-Next with its MTP head converted by llama.cpp's converter (make_gguf_fixtures.py next_mtp_fixture, at its
    Q8_0: the head's experts stacked in blk.4.ffn_*_exps, a shared expert's 48-wide rows left F16): each head tensor
    is the checkpoint's own (made again here by the same seeded function): Q8_0 matrices within a quantum of each
    block's largest weight, F16 / F32 ones within float16 rounding, norms less the converter's one; the dense
    matrices held 8-bit as stored.
    Speculation on that file is lossless and drafts; the ledger prices what is held."""
    from deltaserve.models.layers import Int8Linear
    from deltaserve.weights.gguf import read_gguf_config

    config = read_gguf_config(GGUF_NEXT_MTP)
    assert config["num_hidden_layers"] == 4 and config["mtp_num_hidden_layers"] == 1
    _, _, head = make_qwen3_next_mtp_checkpoint(tmp_path / "hf")
    ours = load_model(GGUF_NEXT_MTP, mtp=True, dequantize=False).model.mtp
    modules = dict(ours.named_modules(prefix="mtp"))
    held_8bit = 0
    for name, want in head.items():
        module = modules[name[: -len(".weight")]]
        got = _held_weight(module)
        assert got.shape == want.shape, name
        # F32 (exact), F16 (the converter's float16), a norm with its one added in float16 ...
        bound = (want.abs() + (1 if want.dim() == 1 else 0)) * 2.0 ** -11 + 1e-6
        if want.dim() == 2 and want.shape[1] % 32 == 0:  # ... or Q8_0: a quantum of the block's largest weight
            quantum = want.view(want.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
            bound = torch.maximum(bound, quantum.expand(-1, -1, 32).reshape(want.shape) + 1e-6)
        assert ((got - want).abs() <= bound).all(), name
        held_8bit += isinstance(module, Int8Linear)
    assert held_8bit >= 7  # fc, q / k / v / o, the shared expert's gate / up: as stored (the routed experts are
    # held as the model's other experts are)
    on = speculates_losslessly_as_stored(GGUF_NEXT_MTP, prompts=3, tokens=16)
    assert on.kv_pool.used_pages == 0 and on.state_pool.used_slots == 0
