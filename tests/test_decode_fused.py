"""The fused decode blocks (kernels/decode_cpu.py) against the per-op path on the same model and caches.

Tiny random Llama / Qwen3 models (float32 weights, and packed 4-bit ones with and without a level table) and the
hybrid test configs (gated attention with partial RoPE, GDN layers, SwiGLU and mixture-of-experts MLPs), a batch
of decode rows over contexts of different lengths, float32 and 16-bit caches: every step's logits and the K/V rows
written agree with the per-op path to float32 rounding (tests/tolerance.py's bound), on the native and the AVX2
build; the one-call path's logits come from the final norm and LM head inside that call (decode_cpu head_args). The transformers-oracle tests (test_models_dense.py, test_models_hybrid.py) run their decode steps through
the fused blocks too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from deltaserve.kernels import decode_cpu
from deltaserve.kernels.int4 import Int4Codes
from deltaserve.models import build_model
from deltaserve.models.batch import ForwardBatch, allocate_caches, single_sequence_batch
from deltaserve.models.decode_stack_path import DecodeStackPath, step_logits
from tolerance import logits_rtol

transformers = pytest.importorskip("transformers")

VOCAB = 256
SLOTS_PER_SEQ = 64


def tiny_dense(kind: str, weights: str, hidden: int = 128, intermediate: int = 192):
    """A tiny random Llama ("llama", with q/k/v biases) or Qwen3 ("qwen3", q/k norms) in our model classes, its
    projections float32 ("fp32") or packed 4-bit ("int4", "iq4": a 16-level table)."""
    torch.manual_seed(3)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                  tie_word_embeddings=False)
    if kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=64, **common), transformers.Qwen3ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(attention_bias=True, **common), transformers.LlamaForCausalLM
    hf = cls(cfg).eval()
    tensors = {}
    for name, t in hf.state_dict().items():
        if "norm" in name:
            t = t + torch.randn_like(t) * 0.2  # norms are ones at init: hide no weight-vs-offset slip
        if "bias" in name:
            t = torch.randn_like(t) * 0.1  # biases are zeros at init
        if weights != "fp32" and t.dim() == 2 and "layers." in name:
            t = random_int4(t.shape, lut=weights == "iq4")
        tensors[name] = t
    config = cfg.to_dict()
    config["o_bias"] = kind == "llama"  # transformers' attention_bias puts one on o_proj too
    return build_model(config, tensors)


def random_int4(shape, lut: bool) -> Int4Codes:
    n, k = shape
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // 32) * 0.02 + 0.005
    offsets = -8 * scales + torch.randn(n, k // 32) * 0.002
    table = torch.sort(torch.randn(16)).values if lut else None
    return Int4Codes(codes, scales, offsets, 32, table)


def decode_batch(tokens: list[int], lens: list[int]) -> ForwardBatch:
    """One decode row per sequence b, whose context lives in slots b * SLOTS_PER_SEQ onwards."""
    b = len(tokens)
    slots = [torch.arange(i * SLOTS_PER_SEQ, i * SLOTS_PER_SEQ + n + 1) for i, n in enumerate(lens)]
    return ForwardBatch(
        input_ids=torch.tensor(tokens), positions=torch.tensor(lens), q_lens=[1] * b, cached_lens=list(lens),
        num_decode=b, cu_q=torch.arange(b + 1), slot_mapping=torch.stack([s[-1] for s in slots]),
        context_slots=torch.nn.utils.rnn.pad_sequence(slots, batch_first=True), state_slots=torch.arange(b),
        logits_indices=torch.arange(b))


def prefilled(model, prompts: list[list[int]], dtype: torch.dtype):
    caches = allocate_caches(model.geometry, len(prompts) * SLOTS_PER_SEQ, len(prompts), dtype,
                             state_dtype=torch.float32)
    last = []
    for i, ids in enumerate(prompts):
        slots = torch.arange(i * SLOTS_PER_SEQ, (i + 1) * SLOTS_PER_SEQ)
        logits = step_logits(model, single_sequence_batch(ids, 0, slots, state_slot=i), caches)
        last.append(int(logits[-1].argmax()))
    return caches, last


def steps_both_ways(model, prompts, dtype, steps: int):
    """(fused logits, per-op logits, fused caches, per-op caches) of `steps` batched decode steps from the same
    prefilled caches, both fed the per-op path's greedy tokens. Where the one-call head gave its argmax with the
    logits (ForwardBatch.logits_argmax: the sampler's greedy tokens), it is torch's argmax of those logits."""
    caches, tokens = prefilled(model, prompts, dtype)
    other = copy.deepcopy(caches)
    lens = [len(p) for p in prompts]
    fused, plain, row_argmax = [], [], []
    for _ in range(steps):
        batch = decode_batch(tokens, lens)
        fused.append(step_logits(model, batch, caches))
        row_argmax.append(batch.logits_argmax is not None)
        if batch.logits_argmax is not None:
            assert torch.equal(batch.logits_argmax, fused[-1].argmax(-1))
        with decode_cpu.disabled():
            plain.append(step_logits(model, decode_batch(tokens, lens), other))
        tokens = plain[-1].argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    return torch.stack(fused), torch.stack(plain), caches, other, set(row_argmax)


@pytest.mark.parametrize("kind,weights", [("llama", "fp32"), ("llama", "int4"), ("qwen3", "iq4"),
                                          ("qwen3", "fp32")])
@pytest.mark.parametrize("cache", ["float32", "float16", "bfloat16"])
@torch.inference_mode()
def test_fused_decode_equals_the_per_op_path(kind, weights, cache, isa):
    assert decode_cpu.load() is not None  # this machine builds it; where none could, the per-op path serves
    model = tiny_dense(kind, weights)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 1, 40, 9)]
    fused, plain, caches, other, row_argmax = steps_both_ways(model, prompts, getattr(torch, cache), steps=6)
    assert model.model.layers[0].fused.parts is not None  # the blocks served (they take these weights)
    assert DecodeStackPath.of(model).stack._args is not None  # all layers in one call (decode_stack)
    assert model.fused_head.args is not None  # ... the final norm and the LM head at its end (and their argmax)
    assert row_argmax == {True}  # ... and their argmax, every step (steps_both_ways compared it with torch's)
    hidden = model.config["hidden_size"]
    tol = logits_rtol(3, max(hidden, model.config["intermediate_size"], 48)) * plain.abs().max().item()
    assert (fused - plain).abs().max().item() <= tol
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    for i in model.geometry.attention_layers:  # the rows each path wrote: equal to their dtype's rounding
        for a, b in ((caches.k[i], other.k[i]), (caches.v[i], other.v[i])):
            step = 1e-6 if cache == "float32" else (2 ** -10 if cache == "float16" else 2 ** -7)
            assert ((a.float() - b.float()).abs() <= step * (1 + b.float().abs()) * 4).all()


@torch.inference_mode()
def test_one_to_sixty_four_rows_and_a_prefill_step_keep_their_paths():
    """64 decode rows take the blocks; a step with a prefill chunk in it (or more rows) takes the per-op path."""
    assert decode_cpu.load() is not None
    model = tiny_dense("llama", "int4")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 30, (64,), generator=gen)]
    fused, plain, _, _, _ = steps_both_ways(model, prompts, torch.float16, steps=2)
    tol = logits_rtol(3, 192) * plain.abs().max().item()
    assert (fused - plain).abs().max().item() <= tol
    x = torch.zeros(3, 128)
    prefill_step = single_sequence_batch([1, 2, 3], 0, torch.arange(8))
    assert not decode_cpu.serves(x, prefill_step, None)
    assert not decode_cpu.serves(torch.zeros(65, 128), decode_batch([1] * 65, [1] * 65), None)
    assert decode_cpu.serves(torch.zeros(64, 128), decode_batch([1] * 64, [1] * 64), None)


@torch.inference_mode()
def test_a_short_chunk_beside_decode_rows_gives_the_logits_of_its_last_row():
    """A step with a 3-token prompt chunk beside two decode rows runs as decode rows (as_decode_rows: every row its
    own query) in one call whose head projects the step's logits rows only: the chunk's last row and the two decode
    rows, equal to the per-op path's."""
    from deltaserve.models.batch import as_decode_rows

    assert decode_cpu.load() is not None
    model = tiny_dense("llama", "int4")
    caches, tokens = prefilled(model, [[5, 9, 2, 7], [3, 3, 8], [1]], torch.float32)  # the third's slots reused
    tokens, lens = tokens[:2], [4, 3]
    chunk = [11, 12, 13]  # a third sequence's first 3 prompt tokens, at slots 2 * SLOTS_PER_SEQ onwards
    slots = [torch.arange(i * SLOTS_PER_SEQ, i * SLOTS_PER_SEQ + n + 1) for i, n in enumerate(lens)]
    third = torch.arange(2 * SLOTS_PER_SEQ, 2 * SLOTS_PER_SEQ + 3)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens + chunk), positions=torch.tensor(lens + [0, 1, 2]), q_lens=[1, 1, 3],
        cached_lens=lens + [0], num_decode=2, cu_q=torch.tensor([0, 1, 2, 5]),
        slot_mapping=torch.cat([torch.stack([s[-1] for s in slots]), third]),
        context_slots=torch.nn.utils.rnn.pad_sequence([*slots, third], batch_first=True),
        state_slots=torch.arange(3), logits_indices=torch.tensor([0, 1, 4]))
    assert as_decode_rows(batch, decode_cpu.MAX_ROWS) is not None  # the fused path takes this step
    other = copy.deepcopy(caches)
    fused = step_logits(model, batch, caches)
    assert model.fused_head.args is not None
    with decode_cpu.disabled():
        plain = step_logits(model, batch, other)
    assert fused.shape == plain.shape == (3, VOCAB)
    assert (fused - plain).abs().max().item() <= logits_rtol(3, 192) * plain.abs().max().item()


def test_weights_it_does_not_take_leave_the_per_op_path():
    """An activation-ordered 4-bit weight (a column permutation) is not taken: that layer runs op by op."""
    from deltaserve.models.layers import projection_parts

    model = tiny_dense("llama", "int4")
    proj = model.model.layers[1].mlp.down_proj
    assert projection_parts(proj) is not None
    proj.perm = torch.arange(proj.in_features)
    assert projection_parts(proj) is None


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_5_text_tied", "qwen3_next"])
@pytest.mark.parametrize("cache", ["float32", "float16"])
@torch.inference_mode()
def test_hybrid_fused_decode_equals_the_per_op_path(name, cache, tmp_path):
    """Gated attention, Qwen3.5's GDN and SwiGLU blocks fused, Qwen3-Next's GDN and experts op by op, in one
    residual stream; the GDN states each path leaves behind agree too. The tied config's 3 value heads give its
    in_proj_b / in_proj_a 3 rows: fewer than a block of the kernels' row tiles, all of them rows past it."""
    import json

    from deltaserve.models import skip_prefixes
    from deltaserve.weights import load_checkpoint
    from test_models_hybrid import VOCAB as HYBRID_VOCAB, make_checkpoint

    assert decode_cpu.load() is not None
    ref = make_checkpoint(name, tmp_path)
    ckpt = load_checkpoint(tmp_path, skip_prefixes=skip_prefixes(json.loads((tmp_path / "config.json").read_text())))
    model = build_model(ckpt.config, ckpt.tensors)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, HYBRID_VOCAB, (n,), generator=gen).tolist() for n in (6, 23, 2, 31)]
    fused, plain, caches, other, row_argmax = steps_both_ways(model, prompts, getattr(torch, cache), steps=5)
    # the attention layers' blocks served, and Qwen3.5's GDN mixers (Qwen3-Next's packed in-projections: op by op)
    for layer in model.model.layers:
        fused_mixer = layer.kind != "linear_attention" or name.startswith("qwen3_5")
        assert (layer.fused.parts[0] is not None) == fused_mixer
    # every layer in one call (decode_stack) where all blocks are fused; Qwen3-Next's steps go layer by layer
    assert (DecodeStackPath.of(model).stack._args is not None) == name.startswith("qwen3_5")
    assert model.fused_head.args is not None  # the head joins that call where there is one
    assert row_argmax == {name.startswith("qwen3_5")}  # with its argmax (steps_both_ways compared it with torch's)
    tol = logits_rtol(ref.config.num_hidden_layers, 64 * 16) * plain.abs().max().item()
    assert (fused - plain).abs().max().item() <= tol
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    for i in model.geometry.gdn_layers:  # the GDN states each path left behind
        scale = other.recurrent[i].abs().max().item()
        assert (caches.recurrent[i] - other.recurrent[i]).abs().max().item() <= tol / plain.abs().max().item() * scale


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "offsets"])
@pytest.mark.parametrize("rows", [1, 2, 3, 64, 65])
@torch.inference_mode()
def test_int8_head_equals_a_float64_product(rows, symmetric, isa):
    """The tied int8 vocabulary projection against float64: 1-2 rows widen each code in registers, 3-64 widen a block
    of weight rows once for the float32 few-row kernel, more take widened tiles through torch.mm; a symmetric table
    (a GGUF's Q8_0) never reads its offsets. 301 weight rows: a tail past the last full block."""
    from deltaserve.kernels.int8 import Int8Rows
    from deltaserve.models.layers import Int8Embedding, Int8Linear

    gen = torch.Generator().manual_seed(rows)
    n, k = 301, 160
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // 32, generator=gen) * 0.01
    offsets = torch.zeros_like(scales) if symmetric else torch.randn(n, k // 32, generator=gen) * 0.01
    table = Int8Rows(codes, scales, offsets, 32)
    head = Int8Linear.of_embedding(Int8Embedding(table))
    assert head.symmetric == symmetric
    x = torch.randn(rows, k, generator=gen)
    got = head(x)
    exact = (codes.double().view(n, -1, 32) * scales.double()[..., None] + offsets.double()[..., None]).view(n, k)
    want = x.double() @ exact.t()
    # n*u per dot product, on the weight's parts: forming scale * q + offset rounds at that size, not at |w|'s
    parts = (codes.double().abs().view(n, -1, 32) * scales.double()[..., None] + offsets.double().abs()[..., None])
    bound = 2 * k * 2.0 ** -24 * (x.double().abs() @ parts.view(n, k).t())
    assert ((got.double() - want).abs() <= bound).all()
    assert decode_cpu.serves_int8(x.contiguous(), 32) == (rows <= 64)


@torch.inference_mode()
def test_a_projection_of_no_rows_widens_nothing(monkeypatch):
    """The head of a prefill chunk that ends no prompt gets no rows: the int8 head and a packed 4-bit projection
    answer [0, N] without widening their weight (the int8 head widened its whole table, ~0.05-0.45 s a chunk for
    SmolLM2's vocabulary; a packed head or a pruned last layer widened every tile)."""
    from deltaserve.kernels import int4_cpu
    from deltaserve.kernels.int4 import Int4Codes, PackedInt4, int4_linear, pack
    from deltaserve.kernels.int8 import Int8Rows
    from deltaserve.models.layers import Int8Embedding, Int8Linear

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was widened for no rows")

    monkeypatch.setattr(Int8Rows, "dequantize", refuse)
    monkeypatch.setattr(int4_cpu, "widen", refuse)
    monkeypatch.setattr(PackedInt4, "widened", refuse)
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 64
    table = Int8Rows(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                     torch.rand(n, k // 32, generator=gen), torch.rand(n, k // 32, generator=gen), 32)
    assert Int8Linear.of_embedding(Int8Embedding(table))(torch.empty(0, k)).shape == (0, n)
    codes = Int4Codes(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                      torch.rand(n, k // 32, generator=gen), None, 32)
    assert int4_linear(torch.empty(0, k), pack(codes), torch.randn(n)).shape == (0, n)


def test_the_runner_takes_the_native_path_for_decode_steps(monkeypatch):
    """The runner, not the model, picks the path: an engine's decode steps go through one decode_stack call each
    (models/decode_stack_path.py); its 5-token prompt too, as 5 decode rows (batch.as_decode_rows: a short chunk)."""
    from test_engine_support import engine, run_all, tokens_of

    from deltaserve.engine.request import SamplingParams

    assert decode_cpu.load() is not None
    calls = []
    real = decode_cpu.Stack.run_with

    def counted(*args, **kwargs):
        calls.append(args[4].num_decode)  # the batch the call served
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_cpu.Stack, "run_with", staticmethod(counted))
    eng = engine(None, max_running_requests=2, max_total_tokens=1024)
    ids = eng.tokenizer.encode("The capital of France is")
    out = run_all(eng, [(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])[0]
    assert len(tokens_of(out)) == 4
    assert calls == [5, 1, 1, 1]  # the prompt's rows, then each of the 3 decode steps
