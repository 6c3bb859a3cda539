"""Gated delta rule kernels against a float64 token-by-token recurrence, and against transformers."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels import gated_delta, gated_delta_decode, gated_delta_decode_in_place, gated_delta_prefill
from deltaserve.kernels.gated_delta import CPU_CHUNK_SIZE, chunk_gated_delta_rule, recurrent_gated_delta_rule_step

# every test here runs on each build of the C++ kernels: native and AVX2-only (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")

TOL = 1e-4   # max abs error relative to the output's scale (max |o_ref|)


def reference(q, k, v, g, beta, initial_state=None):
    """The recurrence itself, one token at a time in float64: one sequence, q/k [T, Hk, Dk], v [T, Hv, Dv]."""
    ratio = v.shape[1] // q.shape[1]
    q, k = (x.double().repeat_interleave(ratio, dim=1) for x in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v, g, beta = v.double(), g.double(), beta.double()
    heads, key_dim, value_dim = v.shape[1], q.shape[2], v.shape[2]
    state = torch.zeros(heads, key_dim, value_dim, dtype=torch.float64)
    if initial_state is not None:
        state = initial_state.double().clone()
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], state)
        state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
        out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return out, state


def make_inputs(tokens, key_heads=2, value_heads=4, key_dim=32, value_dim=32, seed=0, decay_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, key_heads, key_dim, generator=gen)
    k = torch.randn(tokens, key_heads, key_dim, generator=gen)
    v = torch.randn(tokens, value_heads, value_dim, generator=gen)
    # the model's gate: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    a_log = torch.rand(value_heads, generator=gen).mul(3).log()
    g = -a_log.exp() * F.softplus(torch.randn(tokens, value_heads, generator=gen)) * decay_scale
    beta = torch.randn(tokens, value_heads, generator=gen).sigmoid()
    return q, k, v, g, beta


def random_state(n, value_heads=4, key_dim=32, value_dim=32, seed=1):
    return torch.randn(n, value_heads, key_dim, value_dim, generator=torch.Generator().manual_seed(seed))


def rel_err(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [64, CPU_CHUNK_SIZE])
def test_chunked_matches_token_loop(tokens, with_state, chunk_size, cpu_kernels):
    q, k, v, g, beta = make_inputs(tokens, seed=tokens)
    h0 = random_state(1) if with_state else None
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)
    o_ref, s_ref = reference(q, k, v, g, beta, None if h0 is None else h0[0])
    assert o.shape == v.shape and o.dtype == torch.float32 and final.dtype == torch.float32
    assert rel_err(o, o_ref) <= TOL
    assert rel_err(final[0], s_ref) <= TOL


@pytest.mark.parametrize("key_heads,value_heads", [(4, 4), (2, 4), (1, 3)])
@pytest.mark.parametrize("value_dim", [24, 32])  # 24: a head size the fused kernel leaves to the portable path
def test_grouped_value_heads(key_heads, value_heads, value_dim, cpu_kernels):
    q, k, v, g, beta = make_inputs(150, key_heads, value_heads, key_dim=16, value_dim=value_dim, seed=7)
    h0 = torch.randn(1, value_heads, 16, value_dim)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = reference(q, k, v, g, beta, h0[0])
    assert rel_err(o, o_ref) <= TOL and rel_err(final[0], s_ref) <= TOL


@pytest.mark.parametrize("chunk_size", [16, 32, 48, 128])
def test_chunk_sizes(chunk_size, cpu_kernels):
    q, k, v, g, beta = make_inputs(300, seed=3)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)
    o_ref, s_ref = reference(q, k, v, g, beta)
    assert rel_err(o, o_ref) <= TOL and rel_err(final[0], s_ref) <= TOL


def test_l2norm_epsilon_convention():
    """Near-zero q/k, where the 1e-6 inside the l2norm's sqrt decides the result."""
    q, k, v, g, beta = make_inputs(100, seed=2)
    q, k = q * 3e-4, k * 3e-4
    o, final = chunk_gated_delta_rule(q, k, v, g, beta)
    o_ref, s_ref = reference(q, k, v, g, beta)
    assert rel_err(o, o_ref) <= TOL and rel_err(final[0], s_ref) <= TOL
    o_step, s_step = recurrent_gated_delta_rule_step(q[:1], k[:1], v[:1], g[:1], beta[:1], torch.zeros(1, 4, 32, 32))
    assert rel_err(o_step, o_ref[:1]) <= TOL


def test_strong_decay_stays_finite(cpu_kernels):
    """Cumulative log decays of thousands within a chunk: exp only of masked differences, no inf/nan."""
    q, k, v, g, beta = make_inputs(200, seed=4, decay_scale=40.0)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta)
    o_ref, s_ref = reference(q, k, v, g, beta)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_err(o, o_ref) <= TOL and rel_err(final[0], s_ref) <= TOL


@pytest.mark.parametrize("lengths", [[70, 1, 200], [64, 128, 5], [0, 33, 0]])
def test_packed_sequences(lengths, cpu_kernels):
    total = sum(lengths)
    q, k, v, g, beta = make_inputs(total, seed=5)
    h0 = random_state(len(lengths), seed=6)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
    for n in range(len(lengths)):
        lo, hi = int(cu[n]), int(cu[n + 1])
        o_ref, s_ref = reference(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], h0[n])
        if hi > lo:
            assert rel_err(o[lo:hi], o_ref) <= TOL
        assert rel_err(final[n], s_ref) <= TOL


@pytest.mark.parametrize("block_chunks", [1, 3])
def test_many_blocks(block_chunks, monkeypatch, cpu_kernels):
    """A workspace that holds only a few chunks: the state crosses many blocks."""
    chunk_bytes = gated_delta._Workspace.chunk_bytes(2, 2, 64, 32, 32)
    monkeypatch.setattr(gated_delta, "WORKSPACE_BYTES", block_chunks * chunk_bytes)
    q, k, v, g, beta = make_inputs(1000, seed=17)
    h0 = random_state(1)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = reference(q, k, v, g, beta, h0[0])
    assert rel_err(o, o_ref) <= TOL and rel_err(final[0], s_ref) <= TOL


def test_many_sequences_wider_than_a_block(monkeypatch, cpu_kernels):
    """More sequences alive at one step than a block holds, lengths spread over several chunk counts."""
    monkeypatch.setattr(gated_delta, "WORKSPACE_BYTES", 8 * gated_delta._Workspace.chunk_bytes(2, 2, 16, 32, 32))
    lengths = [(7 * i) % 45 + 1 for i in range(20)]
    q, k, v, g, beta = make_inputs(sum(lengths), seed=9)
    h0 = random_state(len(lengths), seed=10)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, chunk_size=16)
    for n in range(len(lengths)):
        lo, hi = int(cu[n]), int(cu[n + 1])
        o_ref, s_ref = reference(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], h0[n])
        assert rel_err(o[lo:hi], o_ref) <= TOL and rel_err(final[n], s_ref) <= TOL


@pytest.mark.parametrize("split", [1, 37, 64, 100, 128, 299])
def test_split_invariance(split, cpu_kernels):
    q, k, v, g, beta = make_inputs(300, seed=8)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta)
    first, s_mid = chunk_gated_delta_rule(q[:split], k[:split], v[:split], g[:split], beta[:split])
    rest, s_end = chunk_gated_delta_rule(q[split:], k[split:], v[split:], g[split:], beta[split:],
                                         initial_state=s_mid)
    assert rel_err(torch.cat([first, rest]), whole.double()) <= TOL
    assert rel_err(s_end, s_whole.double()) <= TOL


def test_recurrent_step_matches_reference():
    batch, steps = 3, 20
    inputs = [make_inputs(steps, seed=10 + b) for b in range(batch)]
    state = random_state(batch, seed=11)
    outs = []
    s = state
    for t in range(steps):
        q, k, v, g, beta = (torch.stack([x[i][t] for x in inputs]) for i in range(5))
        o, s = recurrent_gated_delta_rule_step(q, k, v, g, beta, s)
        outs.append(o)
    for b in range(batch):
        o_ref, s_ref = reference(*inputs[b], state[b])
        assert rel_err(torch.stack([o[b] for o in outs]), o_ref) <= TOL
        assert rel_err(s[b], s_ref) <= TOL


@pytest.mark.parametrize("value_dim", [32, 24])  # 24: a head size the fused kernel leaves to the portable path
def test_decode_in_place_steps_only_the_named_slots(value_dim, cpu_kernels):
    """The engine's decode: each sequence's state read and written where it lies in the pool (no gather/scatter)."""
    slots = torch.tensor([6, 1, 3, 0])
    states = random_state(8, value_dim=value_dim, seed=20)
    q, k, v, g, beta = make_inputs(len(slots), value_dim=value_dim, seed=21)
    pool = states.clone()
    for step in range(3):  # the same tokens again: the states must carry from step to step
        o = gated_delta_decode_in_place(q, k, v, g, beta, pool, slots)
        for b, slot in enumerate(slots.tolist()):
            o_ref, s_ref = reference(*(x[b:b + 1].repeat(step + 1, *[1] * (x.dim() - 1)) for x in (q, k, v, g, beta)),
                                     states[slot])
            assert rel_err(o[b], o_ref[-1]) <= TOL and rel_err(pool[slot], s_ref) <= TOL
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], states[untouched])


def test_prefill_then_steps_equals_prefill_of_whole():
    q, k, v, g, beta = make_inputs(90, seed=12)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta)
    prefix = 70
    o, s = chunk_gated_delta_rule(q[:prefix], k[:prefix], v[:prefix], g[:prefix], beta[:prefix])
    outs = [o]
    for t in range(prefix, 90):
        o_t, s = recurrent_gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        outs.append(o_t)
    assert rel_err(torch.cat(outs), whole.double()) <= TOL
    assert rel_err(s, s_whole.double()) <= TOL


def test_step_leaves_state_untouched():
    q, k, v, g, beta = make_inputs(1, seed=13)
    state = random_state(1)
    before = state.clone()
    recurrent_gated_delta_rule_step(q, k, v, g, beta, state)
    assert torch.equal(state, before)


def test_matches_transformers_torch_chunk():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    q, k, v, g, beta = make_inputs(333, key_heads=2, value_heads=6, seed=14)
    h0 = random_state(1, value_heads=6)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    # transformers: [B, T, H, D]; it repeats key heads to value heads itself (repeat_interleave), so passing
    # the grouped heads or already-repeated ones must agree
    for ratio in (1, 3):
        o_hf, s_hf = torch_chunk_gated_delta_rule(
            q.repeat_interleave(ratio, 1)[None], k.repeat_interleave(ratio, 1)[None], v[None], g[None], beta[None],
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert rel_err(o, o_hf[0].double()) <= 1e-5
        assert rel_err(final, s_hf.double()) <= 1e-5


def test_dispatch_on_cpu_is_portable_path():
    q, k, v, g, beta = make_inputs(70, seed=15)
    h0 = random_state(1)
    assert all(torch.equal(a, b) for a, b in zip(gated_delta_prefill(q, k, v, g, beta, initial_state=h0),
                                                 chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                                        chunk_size=CPU_CHUNK_SIZE)))
    one = [x[:1] for x in (q, k, v, g, beta)]
    assert all(torch.equal(a, b) for a, b in zip(gated_delta_decode(*one, h0),
                                                 recurrent_gated_delta_rule_step(*one, h0)))


def test_half_precision_output_dtype_and_no_final_state():
    q, k, v, g, beta = make_inputs(40, seed=16)
    o, final = chunk_gated_delta_rule(q.half(), k.half(), v.half(), g, beta.half(), output_final_state=False)
    o_ref, _ = reference(q.half(), k.half(), v.half(), g, beta.half())
    assert o.dtype == torch.float16 and final is None
    assert rel_err(o.float(), o_ref) <= 2e-3


def test_bad_input_names_the_limit():
    q, k, v, g, beta = make_inputs(10, key_heads=3, value_heads=4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta = make_inputs(10)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=random_state(2))
    with pytest.raises(ValueError, match="state"):
        recurrent_gated_delta_rule_step(q[:1], k[:1], v[:1], g[:1], beta[:1], random_state(1, key_dim=16))
