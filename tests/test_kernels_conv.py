"""Causal depthwise conv1d against torch's conv1d (groups=C, padding W-1) and transformers' GDN conv.

The prefill tests run on both CPU paths: the portable PyTorch one and the fused C++ one (kernels/fused_cpu.py).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels import conv_decode, conv_prefill, fused_cpu
from deltaserve.kernels.conv import causal_conv1d as portable_conv1d
from deltaserve.kernels.conv import causal_conv1d_step

# every test here runs on each build of the C++ kernels: native and AVX2-only (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("isa")


def fused_conv1d(x, weight, bias=None, *, cu_seqlens=None, initial_state=None, activation="silu"):
    return fused_cpu.causal_conv1d(x, weight, bias, cu_seqlens, initial_state, activation)


@pytest.fixture(params=["portable", "fused"])
def causal_conv1d(request):
    """The prefill conv under test, with conv.causal_conv1d's signature."""
    if request.param == "portable":
        return portable_conv1d
    assert fused_cpu.load() is not None  # this machine builds it; where none could, the engine keeps portable
    return fused_conv1d


def reference(x, weight, bias, initial_state=None, activation="silu"):
    """One sequence x [L, C] in float64: conv1d over [state | x] with W-1 left padding when there is no state."""
    channels, width = weight.shape
    seq = x.double().T[None]
    if initial_state is None:
        y = F.conv1d(seq, weight.double()[:, None], None if bias is None else bias.double(),
                     padding=width - 1, groups=channels)[..., :x.shape[0]]
    else:
        seq = torch.cat([initial_state.double()[None], seq], dim=-1)
        y = F.conv1d(seq, weight.double()[:, None], None if bias is None else bias.double(), groups=channels)
    y = y[0].T
    return F.silu(y) if activation == "silu" else y


def make(tokens, channels=24, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, channels, generator=gen), torch.randn(channels, width, generator=gen),
            torch.randn(channels, generator=gen))


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_single_sequence_matches_conv1d(causal_conv1d, width, use_bias, activation):
    x, weight, bias = make(50, width=width)
    bias = bias if use_bias else None
    y, final = causal_conv1d(x, weight, bias, activation=activation)
    torch.testing.assert_close(y.double(), reference(x, weight, bias, activation=activation), rtol=1e-5, atol=1e-5)
    assert torch.equal(final[0], x[-(width - 1):].T)


def test_packed_sequences_with_states(causal_conv1d):
    lengths = [7, 1, 2, 30, 0]
    x, weight, bias = make(sum(lengths), seed=1)
    state = torch.randn(len(lengths), 24, 3)
    cu = torch.tensor([0] + lengths).cumsum(0)
    y, final = causal_conv1d(x, weight, bias, cu_seqlens=cu, initial_state=state)
    for n in range(len(lengths)):
        lo, hi = int(cu[n]), int(cu[n + 1])
        if hi > lo:
            torch.testing.assert_close(y[lo:hi].double(), reference(x[lo:hi], weight, bias, state[n]),
                                       rtol=1e-5, atol=1e-5)
        # the last W-1 inputs, reaching into the initial state for sequences shorter than W-1
        assert torch.equal(final[n], torch.cat([state[n], x[lo:hi].T], dim=-1)[:, -3:])


@pytest.mark.parametrize("split", [1, 2, 3, 17, 39])
def test_split_invariance(causal_conv1d, split):
    x, weight, bias = make(40, seed=2)
    whole, s_whole = causal_conv1d(x, weight, bias)
    first, s_mid = causal_conv1d(x[:split], weight, bias)
    rest, s_end = causal_conv1d(x[split:], weight, bias, initial_state=s_mid)
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(s_end, s_whole)


def test_prefill_then_steps_equals_whole(causal_conv1d):
    x, weight, bias = make(30, seed=3)
    whole, s_whole = causal_conv1d(x, weight, bias)
    y, state = causal_conv1d(x[:20], weight, bias)
    outs = [y]
    for t in range(20, 30):
        before = state.clone()
        y_t, new_state = causal_conv1d_step(x[t:t + 1], weight, bias, state)
        assert torch.equal(state, before)
        outs.append(y_t)
        state = new_state
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, s_whole)


def test_matches_transformers_gdn_conv(causal_conv1d):
    """Same weight layout ([C, W], squeezed from nn.Conv1d) and state convention as the Qwen3.5 layer."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update
    x, weight, _ = make(25, seed=4)
    y, state = causal_conv1d(x, weight)
    y_hf = causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    x_next = torch.randn(1, 24)
    hf_state = state.clone()
    y_next_hf = causal_conv1d_update(x_next[:, :, None], hf_state, weight, None, "silu")[:, :, 0]
    y_next, new_state = causal_conv1d_step(x_next, weight, None, state)
    torch.testing.assert_close(y_next, y_next_hf, rtol=1e-5, atol=1e-5)
    assert torch.equal(new_state, hf_state)


@pytest.mark.parametrize("built", [False, True])
def test_dispatch_on_cpu(built):
    """CPU float32 takes the fused kernel once built (prefill and the one-token step), else the portable path."""
    assert fused_cpu.load() is not None
    with contextlib.nullcontext() if built else fused_cpu.disabled():
        dispatch_cases(built)


def dispatch_cases(built):
    x, weight, bias = make(9, seed=5)
    state = torch.randn(2, 24, 3)
    cu = torch.tensor([0, 4, 9])
    prefill = fused_conv1d if built else portable_conv1d
    assert all(torch.equal(a, b) for a, b in zip(conv_prefill(x, weight, bias, cu_seqlens=cu, initial_state=state),
                                                 prefill(x, weight, bias, cu_seqlens=cu, initial_state=state)))
    y, new_state = conv_decode(x[:2], weight, bias, state)
    y_ref, state_ref = causal_conv1d_step(x[:2], weight, bias, state)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_state, state_ref)
    if built:  # the step really ran the fused kernel: it equals a packed prefill of one-token sequences
        assert torch.equal(y, fused_conv1d(x[:2], weight, bias, cu_seqlens=torch.arange(3), initial_state=state)[0])


def test_bad_input_names_the_limit():
    x, weight, bias = make(9)
    with pytest.raises(ValueError, match="weight"):
        portable_conv1d(x, weight[:5], bias)
    with pytest.raises(ValueError, match="initial_state"):
        portable_conv1d(x, weight, bias, initial_state=torch.zeros(1, 24, 2))
    with pytest.raises(ValueError, match="activation"):
        portable_conv1d(x, weight, bias, activation="gelu")
    assert fused_cpu.load() is not None
    with pytest.raises(RuntimeError, match="initial_state must be"):
        fused_conv1d(x, weight, bias, initial_state=torch.zeros(1, 24, 2))
    with pytest.raises(RuntimeError, match="weight must be"):
        fused_conv1d(x, weight[:5], bias)
    with pytest.raises(ValueError, match="state"):
        causal_conv1d_step(x[:1], weight, bias, torch.zeros(2, 24, 3))
