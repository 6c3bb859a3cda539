"""Fast paths decline at load, never mid-answer (issue 37).

A Qwen3.5 hybrid whose GDN value heads are wider than its key heads (key 32 / value 48; key 64 / value 80 in a
W4A16 pack-quantized checkpoint with an INT8 embedding) answered its first token and then failed every decode step
inside the fused decode block. Here such checkpoints, saved by transformers and by compressed-tensors' own
compressor, run through the engine for several decode steps, batched, against transformers; a shape no native
kernel serves takes the portable path with one log line at load; and for every native kernel the load-time answer
(its `*_declines` function) is held to what the compiled kernel really accepts, so the two cannot drift.

Tolerances: greedy tokens identical, and each chosen token's log-probability within 2 * rtol * max|logit| of
transformers' (log-softmax moves by at most twice the largest logit change; rtol from tests/tolerance.py). The packed
4-bit checkpoint runs on int8 activations (the CPU default) too: there transformers is run on our tokens and each
log-probability, and each greedy choice's gap to the argmax, is held within that bound plus the activations' rounding
propagated (tests/int8_bound.py).
"""

from __future__ import annotations

import logging
import zlib

import pytest
import torch
import transformers

from deltaserve.engine.request import SamplingParams
from int8_bound import greedy_problems, swapped_layers
from test_engine_support import engine, run_all, tokens_of
from test_models_hybrid import VOCAB, prompt, randomize_, save_tiny_tokenizer
from tolerance import config_rtol

STEPS = 6  # decode steps per request: the defect failed the second token
PROMPT_LENGTHS = (9, 40, 17)
GREEDY = dict(temperature=0, ignore_eos=True, logprobs=0)


def hybrid_config(**shape) -> transformers.Qwen3_5TextConfig:
    """A tiny Qwen3.5 text config (GDN 3 : 1 attention) with `shape` over its defaults."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, initializer_range=0.1,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    config = transformers.Qwen3_5TextConfig(**dict(base, **shape))
    config._attn_implementation = "sdpa"
    return config


def make_float_checkpoint(folder, name: str, **shape):
    """A float32 checkpoint saved by transformers' save_pretrained; returns the transformers model."""
    torch.manual_seed(zlib.crc32(name.encode()))
    ref = transformers.Qwen3_5ForCausalLM(hybrid_config(**shape)).eval()
    randomize_(ref)
    ref.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return ref


def make_w4_checkpoint(folder, name: str, **shape):
    """A W4A16 pack-quantized checkpoint (groups of 64) with an INT8 embedding, made by compressed-tensors' own
    compressor; returns transformers running the library's own decompression of it."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import save_file

    from test_weights_compressed_tensors import INT8_EMBED, minmax_qparams_, w

    torch.manual_seed(zlib.crc32(name.encode()))
    config = hybrid_config(**shape)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    randomize_(model)
    groups = {"body": {"targets": ["Linear"], "weights": w(4, 64)}, "embed": INT8_EMBED}
    # in_proj_a / b ignored as in test_weights_compressed_tensors: the library cannot unpack their few rows
    qconfig = QuantizationConfig.model_validate(dict(
        config_groups=groups, ignore=["lm_head", r"re:.*linear_attn\.in_proj_[ab]$"], format="pack-quantized",
        quantization_status="frozen"))
    apply_quantization_config(model, qconfig, show_progress=False)
    minmax_qparams_(model)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    compressor.update_config(str(folder))
    save_tiny_tokenizer(folder)
    compressor.decompress_model(model)
    ref = transformers.Qwen3_5ForCausalLM(config).eval()
    plain = ref.state_dict()
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain})
    return ref


def reference(ref, ids: list[int], steps: int) -> tuple[list[int], list[float], float]:
    """transformers' greedy tokens (a full forward each step: the model's definition), each one's log-probability,
    and the largest |logit| seen."""
    ids, tokens, logprobs, top = list(ids), [], [], 0.0
    with torch.no_grad():
        for _ in range(steps):
            logits = ref(torch.tensor([ids])).logits[0, -1].double()
            tokens.append(int(logits.argmax()))
            logprobs.append(float(torch.log_softmax(logits, -1)[tokens[-1]]))
            top = max(top, float(logits.abs().max()))
            ids.append(tokens[-1])
    return tokens, logprobs, top


def assert_engine_matches(ref, folder, **settings) -> None:
    """Three prompts decoded together through the engine: transformers' tokens, log-probabilities within bound."""
    eng = engine(str(folder), max_running_requests=len(PROMPT_LENGTHS), **settings)
    prompts = [prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]
    outs = run_all(eng, [(p, SamplingParams(max_tokens=STEPS, **GREEDY)) for p in prompts])
    rtol = config_rtol(ref.config, context=max(PROMPT_LENGTHS) + STEPS)
    for p, out in zip(prompts, outs):
        assert all(o.error is None for o in out), out[-1].error
        tokens, logprobs, top = reference(ref, p, STEPS)
        assert tokens_of(out) == tokens
        ours = [lp.logprob for o in out for lp in o.logprobs]
        assert ours == pytest.approx(logprobs, abs=2 * rtol * top)


def assert_engine_within_int8(ref, folder, **settings) -> None:
    """assert_engine_matches on int8 activations: transformers teacher-forced on the engine's tokens, each chosen
    log-probability within the float32 bound plus int8_bound's, each greedy token within both bounds of the argmax."""
    eng = engine(str(folder), max_running_requests=len(PROMPT_LENGTHS), activation_dtype="int8", **settings)
    layers = swapped_layers(eng.runner.model)
    assert layers, "no layer took int8 activations"
    prompts = [prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]
    outs = run_all(eng, [(p, SamplingParams(max_tokens=STEPS, **GREEDY)) for p in prompts])
    rtol = config_rtol(ref.config, context=max(PROMPT_LENGTHS) + STEPS)
    for p, out in zip(prompts, outs):
        assert all(o.error is None for o in out), out[-1].error
        logprobs = [lp for o in out for lp in o.logprobs]
        problems, _ = greedy_problems(ref, layers, p, tokens_of(out), logprobs, rtol)
        assert problems == []


def test_value_heads_wider_than_key_heads_decode_batched(tmp_path):
    """The reported checkpoint: key head dim 32, value head dim 48 (float32)."""
    ref = make_float_checkpoint(tmp_path, "k32v48", linear_key_head_dim=32, linear_value_head_dim=48)
    assert_engine_matches(ref, tmp_path)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_w4a16_int8_embedding_key64_value80_decode_batched(tmp_path, activations):
    """The reported W4A16 checkpoint: key 64 / value 80, 4-bit projections held packed, INT8 embedding; on float32
    activations (transformers' tokens exactly) and on int8 ones (within their rounding)."""
    ref = make_w4_checkpoint(tmp_path, "w4k64v80", hidden_size=128, intermediate_size=256, head_dim=32,
                             linear_key_head_dim=64, linear_value_head_dim=80)
    if activations == "float32":
        assert_engine_matches(ref, tmp_path, dequantize_weights=False, activation_dtype="float32")
    else:
        assert_engine_within_int8(ref, tmp_path, dequantize_weights=False)


def test_a_shape_no_native_kernel_serves_takes_the_portable_path_logged_once(tmp_path, caplog):
    """Value head dim 24 (no multiple of 16) and attention head dim 24: the GDN kernels, the decode blocks and the
    prefill attention decline at load, one log line each naming the layers; the answers still equal transformers'."""
    ref = make_float_checkpoint(tmp_path, "k16v24", head_dim=24, linear_value_head_dim=24)
    with caplog.at_level(logging.INFO, logger="deltaserve.models.layers"):
        assert_engine_matches(ref, tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "deltaserve.models.layers"]
    expected = [
        "gdn_prefill / gdn_decode (kernels/fused_cpu): value head dim 24 not a multiple of 16 up to 128: the portable "
        "PyTorch ops serves layers 0, 1, 2",
        "gdn_block (kernels/decode_cpu): value head dim 24 not a multiple of 16 up to 128: the per-op decode path "
        "serves layers 0, 1, 2",
        "prefill_attention (kernels/prefill_cpu): head dim 24 not a multiple of 16: torch's flash attention serves "
        "layer 3",
    ]
    assert sorted(lines) == sorted(expected)


# ---- each native kernel's load-time answer against the compiled kernel itself ----

F32 = torch.float32
EMPTY = torch.empty(0)


def rand(*shape, dtype=F32, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3).to(dtype)


def accepts(call) -> bool:
    """Whether the compiled kernel runs on these inputs (a RuntimeError: its TORCH_CHECK refused them)."""
    try:
        call()
    except RuntimeError:
        return False
    return True


def float_projection(n: int, k: int, seed: int) -> list[torch.Tensor]:
    """A float32 projection as decode_cpu's blocks take it: weight, no packed parts, no bias."""
    return [rand(n, k, seed=seed), EMPTY, EMPTY, EMPTY, EMPTY]


@pytest.fixture(scope="module")
def kernels():
    from deltaserve.kernels import decode_cpu, fused_cpu, int4_cpu, linear_cpu, paged_cpu, prefill_cpu

    mods = (decode_cpu, fused_cpu, int4_cpu, linear_cpu, paged_cpu, prefill_cpu)
    if any(m.load() is None for m in mods):
        pytest.skip("the native kernels cannot be built here")
    return dict(decode_cpu=decode_cpu, fused_cpu=fused_cpu, int4_cpu=int4_cpu, linear_cpu=linear_cpu,
                paged_cpu=paged_cpu, prefill_cpu=prefill_cpu)


# (hidden, key heads, value heads, key head dim, value head dim, conv width)
GDN_SHAPES = [(64, 2, 4, 32, 48, 4), (64, 1, 2, 64, 80, 4), (64, 2, 2, 16, 128, 2), (64, 1, 1, 16, 16, 3),
              (64, 2, 4, 16, 24, 4), (64, 2, 4, 16, 144, 4), (64, 2, 3, 16, 32, 4), (64, 2, 4, 16, 32, 1),
              (40, 2, 4, 16, 32, 4)]


def gdn_block_call(decode_cpu, hidden, hk, hv, dk, dv, width, batch=3, slots=4):
    c = 2 * hk * dk + hv * dv
    tensors = [rand(hidden, seed=1), rand(c, width, seed=2), rand(hv, seed=3), rand(hv, seed=4), rand(dv, seed=5)]
    for j, (n, k) in enumerate([(c, hidden), (hv * dv, hidden), (hv, hidden), (hv, hidden), (hidden, hv * dv)]):
        tensors += float_projection(n, k, seed=10 + j)
    x = rand(batch, hidden, seed=6)
    conv, states = rand(slots, c, width - 1, seed=7), rand(slots, hv, dk, dv, seed=8)
    meta = [hk, hv, dk, dv, 0, 0, 0, 0, 0]
    return lambda: decode_cpu.gdn_block(x, tensors, meta, conv, states, torch.tensor([2, 0, 3]), 1e-6, 1.0, 1e-6)


@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_gdn_block_answer_is_what_the_kernel_accepts(kernels, shape):
    decode_cpu = kernels["decode_cpu"]
    hidden, hk, hv, dk, dv, width = shape
    served = decode_cpu.gdn_block_declines(hidden, hk, hv, dv, width) is None
    assert accepts(gdn_block_call(decode_cpu, *shape)) == served


@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_gdn_step_and_prefill_answer_is_what_the_kernels_accept(kernels, shape):
    """gdn_decode and gdn_prefill take exactly the head shapes gdn_declines admits, and where they do, equal the
    float64 portable recurrence within float32 rounding over the reduction (tests/tolerance.py)."""
    from deltaserve.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule_step
    from tolerance import logits_rtol

    fused_cpu = kernels["fused_cpu"]
    _, hk, hv, dk, dv, _ = shape
    served = fused_cpu.gdn_declines(hk, hv, dv) is None
    b, t = 3, 70
    q, k, v = rand(b, hk, dk, seed=1), rand(b, hk, dk, seed=2), rand(b, hv, dv, seed=3)
    g, beta = -rand(b, hv, seed=4).abs(), torch.sigmoid(rand(b, hv, seed=5))
    states, slots = rand(4, hv, dk, dv, seed=6), torch.tensor([3, 0, 1])
    assert accepts(lambda: fused_cpu.gdn_decode(q, k, v, g, beta, states.clone(), slots, dk ** -0.5, True)) == served
    pq, pk, pv = rand(t, hk, dk, seed=7), rand(t, hk, dk, seed=8), rand(t, hv, dv, seed=9)
    pg, pbeta = -rand(t, hv, seed=10).abs(), torch.sigmoid(rand(t, hv, seed=11))
    initial = rand(2, hv, dk, dv, seed=12)
    cu = [0, 30, t]
    assert accepts(lambda: fused_cpu.gdn_prefill(pq, pk, pv, pg, pbeta, cu, initial.clone(), 64, dk ** -0.5,
                                                 True)) == served
    if not served:
        return
    rtol = logits_rtol(1, 64 * dk)
    o = fused_cpu.gdn_decode(q, k, v, g, beta, states.clone(), slots, dk ** -0.5, True)
    ref_o, _ = recurrent_gated_delta_rule_step(*(x.double() for x in (q, k, v, g, beta)), states[slots].double())
    assert (o.double() - ref_o).abs().max() <= rtol * ref_o.abs().max()
    state = initial.clone()
    o = fused_cpu.gdn_prefill(pq, pk, pv, pg, pbeta, cu, state, 64, dk ** -0.5, True)
    ref_o, ref_state = chunk_gated_delta_rule(*(x.double() for x in (pq, pk, pv, pg, pbeta)),
                                              cu_seqlens=torch.tensor(cu), initial_state=initial.double())
    assert (o.double() - ref_o).abs().max() <= rtol * ref_o.abs().max()
    assert (state.double() - ref_state).abs().max() <= rtol * ref_state.abs().max()


# (hidden, query heads, KV heads, head dim, rotary width)
ATTENTION_SHAPES = [(64, 4, 2, 16, 8), (64, 4, 4, 32, 32), (64, 3, 2, 16, 8), (64, 4, 2, 16, 7), (64, 4, 2, 16, 18),
                    (40, 4, 2, 16, 8), (64, 4, 0, 16, 8)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_block_answer_is_what_the_kernel_accepts(kernels, shape):
    decode_cpu = kernels["decode_cpu"]
    hidden, hq, hkv, d, rd = shape
    served = decode_cpu.attention_block_declines(hidden, hq, hkv, d, rd) is None
    kv = max(hkv, 1)
    tensors = [rand(hidden, seed=1), rand(d, seed=2), rand(d, seed=3)]
    for j, (n, k) in enumerate([(hq * d, hidden), (kv * d, hidden), (kv * d, hidden), (hidden, hq * d)]):
        tensors += float_projection(n, k, seed=10 + j)
    b, slots, lmax = 2, 16, 5
    k_cache, v_cache = rand(slots, kv, d, seed=4), rand(slots, kv, d, seed=5)
    x, cos, sin = rand(b, hidden, seed=6), rand(b, rd, seed=7), rand(b, rd, seed=8)
    context = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]])
    call = lambda: decode_cpu.KERNELS.module.attention_block(  # noqa: E731
        x, tensors, [hq, hkv, d, 0, 0, 0, 0, 0], cos, sin, k_cache, v_cache, torch.tensor([4, 7]), context,
        torch.tensor([5, 3]), 1e-6, 0.0, d ** -0.5)
    assert accepts(call) == served


@pytest.mark.parametrize("widths", [(64, 96), (40, 96), (64, 40)])
def test_mlp_block_answer_is_what_the_kernel_accepts(kernels, widths):
    decode_cpu = kernels["decode_cpu"]
    hidden, inter = widths
    tensors = [rand(hidden, seed=1)]
    for j, (n, k) in enumerate([(inter, hidden), (inter, hidden), (hidden, inter)]):
        tensors += float_projection(n, k, seed=10 + j)
    call = lambda: decode_cpu.mlp_block(rand(2, hidden), tensors, [0, 0, 0], 1e-6, 0.0)  # noqa: E731
    assert accepts(call) == (decode_cpu.mlp_block_declines(hidden, inter) is None)


@pytest.mark.parametrize("k, group", [(64, 32), (64, 16), (64, 64), (64, 24), (48, 32), (64, 0)])
def test_int8_linear_answer_is_what_the_kernel_accepts(kernels, k, group):
    decode_cpu = kernels["decode_cpu"]
    codes = torch.randint(-127, 128, (8, k), dtype=torch.int8)
    scales = rand(8, k // group if group and k % group == 0 else 1).abs()
    call = lambda: decode_cpu.int8_linear(rand(2, k), codes, scales, EMPTY, group)  # noqa: E731
    assert accepts(call) == (decode_cpu.int8_linear_declines(k, group) is None)


@pytest.mark.parametrize("d, rd", [(16, 8), (16, 16), (16, 7), (16, 18)])
def test_rope_answer_is_what_the_kernel_accepts(kernels, d, rd):
    fused_cpu = kernels["fused_cpu"]
    call = lambda: fused_cpu.KERNELS.module.rope(rand(3, 2, d), rand(3, rd), rand(3, rd))  # noqa: E731
    assert accepts(call) == (fused_cpu.rope_declines(d, rd) is None)


@pytest.mark.parametrize("k", [64, 48, 40, 8])
def test_linear_rows_answer_is_what_the_kernel_accepts(kernels, k):
    linear_cpu = kernels["linear_cpu"]
    call = lambda: linear_cpu.KERNELS.module.linear_rows(rand(2, k), rand(8, k))  # noqa: E731
    assert accepts(call) == (linear_cpu.declines(k) is None)


@pytest.mark.parametrize("hq, hkv, dtype", [(4, 2, torch.float32), (4, 2, torch.bfloat16), (4, 4, torch.float16),
                                            (3, 2, torch.float32), (4, 2, torch.float64), (4, 0, torch.float32)])
def test_paged_decode_answer_is_what_the_kernel_accepts(kernels, hq, hkv, dtype):
    paged_cpu = kernels["paged_cpu"]
    d = 16
    caches = [rand(12, hkv, d, dtype=dtype, seed=s) for s in (1, 2)]
    call = lambda: paged_cpu.KERNELS.module.paged_decode(  # noqa: E731
        rand(2, hq, d), *caches, torch.tensor([[0, 1, 2], [3, 4, 0]]), torch.tensor([3, 2]), d ** -0.5)
    assert accepts(call) == (paged_cpu.declines(hq, hkv, dtype) is None)


@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 16), (4, 1, 32), (6, 2, 64), (3, 2, 16), (4, 2, 20), (4, 2, 12)])
def test_prefill_attention_answer_is_what_the_kernel_accepts(kernels, hq, hkv, d):
    """A multiple of 16 is asked on every build; the AVX2 build also takes multiples of 8 (so 24 is left out)."""
    prefill_cpu = kernels["prefill_cpu"]
    call = lambda: prefill_cpu.KERNELS.module.prefill_attention(  # noqa: E731
        rand(5, hq, d), rand(7, hkv, d, seed=1), rand(7, hkv, d, seed=2), 2, d ** -0.5)
    assert accepts(call) == (prefill_cpu.declines(hq, hkv, d) is None)


@pytest.mark.parametrize("k, group", [(64, 32), (128, 64), (256, 256), (64, 16), (64, 48), (96, 64), (48, 48)])
def test_int4_answer_is_what_the_kernel_accepts_and_what_load_packs(kernels, k, group):
    """The kernel's answer, and kernels/int4.py's `packable` (what a load packs) never admitting more than it."""
    from deltaserve.kernels.int4 import packable

    int4_cpu = kernels["int4_cpu"]
    packed = torch.randint(0, 256, (8, k // 2), dtype=torch.uint8)
    scales = rand(8, k // group if k % group == 0 else 1).abs()
    served = int4_cpu.declines(k, group) is None
    assert accepts(lambda: int4_cpu.decode(rand(2, k), packed, scales, EMPTY, None, group)) == served
    assert accepts(lambda: int4_cpu.gemm(rand(20, k), packed, scales, EMPTY, None, group)) == served
    assert served or not packable((8, k), group)


# ---- an internal error names the component that failed, and nothing of any request ----

def test_a_kernel_check_in_a_step_names_the_kernel_not_the_request(tmp_path):
    """A native kernel's check firing inside a step (here int8_rows refusing an id; its text quotes the id): the
    client's error names the kernel and where it was called, never the text after the entry point's name; the log
    keeps the whole trace under the same id; the engine then serves the next requests as if nothing happened."""
    from deltaserve.kernels import fused_cpu

    ref = make_float_checkpoint(tmp_path, "k32v48", linear_key_head_dim=32, linear_value_head_dim=48)
    eng = engine(str(tmp_path), max_running_requests=3)
    logged = []
    eng._log = logged.append
    bad_id = 987654

    def hook(at: str) -> None:
        if at == "during_forward":
            fused_cpu.int8_rows(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 1), torch.tensor([bad_id]))

    prompts = [prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]
    eng.step_hook = hook
    try:
        failed = run_all(eng, [(p, SamplingParams(max_tokens=STEPS, **GREEDY)) for p in prompts[:2]])
    finally:
        eng.step_hook = None
    for out in failed:
        error = out[-1].error
        assert out[-1].finish_reason == "error"
        assert error.startswith("internal error, id ")
        assert "int8_rows (kernels/fused_cpu.py, int8_rows) failed" in error
        assert str(bad_id) not in error and str(prompts[0][:3])[1:-1] not in error
        error_id = error.split("id ")[1].split(":")[0]
        assert any(error_id in line and str(bad_id) in line for line in logged)
    outs = run_all(eng, [(p, SamplingParams(max_tokens=STEPS, **GREEDY)) for p in prompts])
    for p, out in zip(prompts, outs):
        assert out[-1].error is None and tokens_of(out) == reference(ref, p, STEPS)[0]


def test_the_fused_decode_block_names_itself(kernels):
    """gdn_block refusing a shape, as a client would see it: the entry point and its file, not the check's text."""
    from deltaserve.engine.errors import internal_error

    logged = []
    with pytest.raises(RuntimeError) as raised:
        gdn_block_call(kernels["decode_cpu"], 64, 2, 4, 16, 24, 4)()
    message = internal_error(logged.append, "a step failed for 1 requests", raised.value)
    assert "gdn_block (kernels/decode_cpu.py, gdn_block) failed; see the server log" in message
    assert "head shapes" not in message and "head shapes" in logged[0]
