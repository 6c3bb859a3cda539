"""Kernels: pure tensor functions. Each entry point takes a fast path (flash-linear-attention, causal-conv1d)
only for CUDA tensors when that package imports, the fused C++ kernels (fused_cpu.py: conv, GDN chunk and step)
for float32 CPU tensors once the engine has built them, and the portable PyTorch path otherwise.

The fast-path glue keeps our conventions: q/k are l2-normalised here (eps 1e-6, as transformers does) rather
than by fla's in-kernel norm, and key heads are repeated to value heads (value head j reads key head
j // (Hv // Hk)) before the call, so both paths compute the same function.
"""

import functools
import importlib

import torch

from deltaserve.kernels import fused_cpu
from deltaserve.kernels.conv import ACTIVATIONS, causal_conv1d, causal_conv1d_step
from deltaserve.kernels.gated_delta import (CPU_CHUNK_SIZE, check_heads, chunk_gated_delta_rule, l2norm,
                                            recurrent_gated_delta_rule_step)

__all__ = [
    "causal_conv1d", "causal_conv1d_step", "chunk_gated_delta_rule", "recurrent_gated_delta_rule_step", "l2norm",
    "gated_delta_prefill", "gated_delta_decode", "gated_delta_decode_in_place", "conv_prefill", "conv_decode",
]

FAST_CONV_MAX_WIDTH = 4     # causal-conv1d's CUDA kernels handle widths 2..4


@functools.cache
def _optional(module: str):
    """The module if it imports (asked only for CUDA inputs, so CPU-only installs never try), else None."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def _fla_inputs(q, k, v, use_qk_l2norm):
    """Our normalisation and head repeat, then fla's [1, T, H, D] layout with q/k in v's dtype."""
    if use_qk_l2norm:
        q, k = l2norm(q.float()), l2norm(k.float())
    ratio = v.shape[1] // q.shape[1]
    q, k = (x.repeat_interleave(ratio, dim=1).to(v.dtype) for x in (q, k))
    return q, k


def gated_delta_prefill(q, k, v, g, beta, *, cu_seqlens=None, initial_state=None, use_qk_l2norm=True,
                        scale=None, output_final_state=True):
    """Chunked gated delta rule; same contract as `chunk_gated_delta_rule` (packed [T, H, D] inputs), with
    the chunk size each path runs best at."""
    # fla's chunk kernel refuses float32 inputs; those take the portable path (which runs on CUDA too).
    fla = _optional("fla.ops.gated_delta_rule") if q.is_cuda and v.dtype != torch.float32 else None
    if fla is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                      chunk_size=64 if q.is_cuda else CPU_CHUNK_SIZE,
                                      use_qk_l2norm=use_qk_l2norm, scale=scale,
                                      output_final_state=output_final_state)
    qr, kr = _fla_inputs(q, k, v, use_qk_l2norm)
    # every argument by keyword: fla's signatures move between releases (0.6.0 put gk, gv before beta in the
    # recurrent kernel, which read a positional beta as a per-key decay and returned NaN on an H200)
    o, final = fla.chunk_gated_delta_rule(
        q=qr[None], k=kr[None], v=v[None], g=g[None].float(), beta=beta[None].to(v.dtype),
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=False)
    return o[0], None if final is None else final.float()


def gated_delta_decode(q, k, v, g, beta, state, *, use_qk_l2norm=True, scale=None):
    """One token per sequence; same contract as `recurrent_gated_delta_rule_step` ([B, H, D] inputs)."""
    fla = _optional("fla.ops.gated_delta_rule") if q.is_cuda else None
    if fla is None:
        return recurrent_gated_delta_rule_step(q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm, scale=scale)
    qr, kr = _fla_inputs(q, k, v, use_qk_l2norm)
    o, new_state = fla.fused_recurrent_gated_delta_rule(
        q=qr[:, None], k=kr[:, None], v=v[:, None], g=g[:, None].float(), beta=beta[:, None].to(v.dtype),
        scale=q.shape[-1] ** -0.5 if scale is None else scale, initial_state=state.float(),
        output_final_state=True, use_qk_l2norm_in_kernel=False)
    return o[:, 0], new_state.float()


def gated_delta_decode_in_place(q, k, v, g, beta, states, slots, *, use_qk_l2norm=True, scale=None):
    """One token per sequence whose state is states[slots[b]], updated in place; returns o [B, Hv, Dv] in v's dtype.

    On CPU in float32 the fused kernel updates each state where it lies; elsewhere the states are gathered, stepped
    (gated_delta_decode) and written back."""
    if fused_cpu.serves_gdn(q, k, v) and fused_cpu.serves(states) and states.is_contiguous():
        check_heads(q, k, v, g, beta)
        return fused_cpu.gdn_decode(q, k, v, g, beta, states, slots,
                                    q.shape[-1] ** -0.5 if scale is None else scale, use_qk_l2norm)
    o, new_states = gated_delta_decode(q, k, v, g, beta, states[slots], use_qk_l2norm=use_qk_l2norm, scale=scale)
    states.index_copy_(0, slots, new_states.to(states.dtype))
    return o


def conv_prefill(x, weight, bias=None, *, cu_seqlens=None, initial_state=None, activation="silu"):
    """Causal depthwise conv + activation; same contract as `conv.causal_conv1d` (packed [T, C] input)."""
    if activation in ACTIVATIONS and fused_cpu.serves(x, weight):
        return fused_cpu.causal_conv1d(x, weight, bias, cu_seqlens, initial_state, activation)
    fast = None
    if x.is_cuda and weight.shape[1] <= FAST_CONV_MAX_WIDTH and activation in ("silu", None):
        fast = _optional("causal_conv1d")
    if fast is None:
        return causal_conv1d(x, weight, bias, cu_seqlens=cu_seqlens, initial_state=initial_state,
                             activation=activation)
    bounds = [0, x.shape[0]] if cu_seqlens is None else cu_seqlens.tolist()
    history = weight.shape[1] - 1
    if initial_state is None:
        initial_state = x.new_zeros(len(bounds) - 1, x.shape[1], history)
    y = torch.empty_like(x)
    finals = []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = initial_state[n:n + 1].to(x.dtype)
        if hi > lo:
            # [1, C, L] channel-last views, the layout in which the kernel accepts initial states
            init_cl = init.transpose(1, 2).contiguous().transpose(1, 2)
            out = fast.causal_conv1d_fn(x[lo:hi].T[None], weight, bias, initial_states=init_cl,
                                        activation=activation)
            y[lo:hi] = out[0].T
        finals.append(torch.cat([init, x[lo:hi].T[None]], dim=-1)[..., -history:] if history else init)
    return y, torch.cat(finals)


def conv_decode(x, weight, bias, state, activation="silu"):
    """One token per sequence; same contract as `conv.causal_conv1d_step` ([B, C] input, state not modified)."""
    if activation in ACTIVATIONS and fused_cpu.serves(x, weight) and state.shape == (*x.shape, weight.shape[1] - 1):
        # one token per sequence is a packed prefill of length-1 sequences from their states
        y, new_state = fused_cpu.causal_conv1d(x, weight, bias, torch.arange(x.shape[0] + 1), state, activation)
        return y, new_state.to(state.dtype)
    fast = None
    if x.is_cuda and weight.shape[1] <= FAST_CONV_MAX_WIDTH and activation in ("silu", None):
        fast = _optional("causal_conv1d")
    if fast is None:
        return causal_conv1d_step(x, weight, bias, state, activation)
    new_state = state.to(x.dtype).clone()                       # the kernel updates the state in place
    y = fast.causal_conv1d_update(x, new_state, weight, bias, activation)
    return y, new_state.to(state.dtype)
