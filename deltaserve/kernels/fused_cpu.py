"""CPU kernels in C++ for the work between the matmuls, each output computed once from inputs held in L1: the
causal conv (+ SiLU) of GDN layers, RMSNorm (plain, zero-centred, gated by SiLU(z), or after the residual add),
and the gated delta rule itself (the chunked prefill per sequence and value head, and the one-token step on each
state where it lies in the pool).

Each PyTorch op reads and writes its whole tensor, and on CPU a fresh output of a long prompt is also
page-faulted in: a 16K-token prefill of the tiny hybrid spent ~0.7 s in the conv (an index_put, four
multiply-adds, a gather, a SiLU: ~8 passes over 64 MB per layer) and ~0.6 s in norms; the chunked GDN ran three
small torch matmuls per chunk in its scan; a 64-row decode step gathered and scattered 8 MB of state per layer.
float32 only, as the CPU computes. The engine builds the module at start (kernels/cpp_build.py); the portable
PyTorch code serves wherever it is not built, and for other devices and dtypes. Same functions as conv.py,
gated_delta.py and the norms in models/, to float32 rounding; the tests run both paths.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from deltaserve.kernels.cpp_build import CSRC, CompiledKernels

KERNELS = CompiledKernels("deltaserve_fused_cpu", CSRC / "fused.cpp",
                           ["causal_conv1d", "rms_norm", "gdn_prefill", "gdn_decode", "argmax_rows", "int8_rows",
                            "int8_panel_rows", "silu_mul", "rope", "flush_denormals"],
                           "fused CPU kernels (conv, RMSNorm, gated delta rule, argmax, int8 rows, SwiGLU, RoPE)",
                           "the portable PyTorch ops")


def load(log=None):
    """The compiled module (built once per machine into our kernel cache), or None when it cannot be built here."""
    return KERNELS.load(log)


@contextlib.contextmanager
def denormals_flushed(active: bool = True):
    """Inside the block denormal floats are read and written as zero on this thread and its OpenMP team (our
    kernels' and torch's ops alike; csrc/fused.cpp says why: the GDN's decays pass through that range, at ~100 cycles
    an operand); after it each thread's setting is back. Nothing where not active or the module is not built."""
    if not active or KERNELS.module is None:
        yield
        return
    KERNELS.module.flush_denormals(True)
    try:
        yield
    finally:
        KERNELS.module.flush_denormals(False)


def disabled():
    """Inside the block every caller takes its portable PyTorch path (the built module is kept); for comparisons."""
    return KERNELS.disabled()


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the built kernels take these inputs (all float32 on CPU); never waits for a compiler."""
    return KERNELS.module is not None and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def causal_conv1d(x, weight, bias, cu_seqlens, initial_state, activation):
    """conv.causal_conv1d's contract (x [T, C], weight [C, W], cu_seqlens [N+1]) in one pass over the rows."""
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, x.shape[0]])
    return tuple(KERNELS.module.causal_conv1d(x.contiguous(), weight, bias, cu_seqlens.cpu(), initial_state,
                                               activation == "silu"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """x / rms(x) * (offset + weight) [* silu(gate)] over the last dim, for x of any leading shape."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    gate_rows = None if gate is None else gate.reshape(-1, d)
    return KERNELS.module.rms_norm(rows, weight, eps, offset, gate_rows, None)[0].view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; x and residual [R, D]."""
    normed, total = KERNELS.module.rms_norm(x, weight, eps, offset, None, residual)
    return normed, total


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up into gate: by the kernel where it takes them (float32 rows on CPU), else by torch ops."""
    if serves(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.stride(1) == up.stride(1) == 1:
        return KERNELS.module.silu_mul(gate, up)
    return F.silu(gate, inplace=True).mul_(up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """layers.apply_rotary's result for x [T, H, D] and cos, sin [T, 1, rd] in one pass, or None where the kernel
    does not take them (not float32 on CPU, heads not contiguous): the caller then uses torch ops."""
    if not serves(x, cos, sin) or x.dim() != 3 or cos.dim() != 3:
        return None
    (t, _, d), rd = x.shape, cos.shape[2]
    if (x.stride(2) != 1 or x.stride(1) != d or cos.shape[:2] != (t, 1) or sin.shape != cos.shape
            or rope_declines(d, rd) is not None):
        return None
    return KERNELS.module.rope(x, cos.reshape(t, rd), sin.reshape(t, rd))


def rope_declines(head_dim: int, rotary_dim: int) -> str | None:
    """Why the rope kernel cannot rotate `rotary_dim` of a head's `head_dim` channels (its TORCH_CHECK: even, at
    most the head), or None when it can."""
    if rotary_dim % 2 or rotary_dim > head_dim:
        return f"rotary dim {rotary_dim} not even and at most the head dim {head_dim}"
    return None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of logits [R, V] (int64 [R]), through the kernel where it is built and takes x (float32 on
    CPU, contiguous rows)."""
    if serves(x) and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
        return KERNELS.module.argmax_rows(x)
    return x.argmax(-1)


def int8_rows(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """Rows `ids` [R] of a symmetric int8 table (codes [N, K], float32 scales [N, K / group]) as float32 [R, K], or
    None where the kernel is not built or does not take these tensors (the caller then widens with torch ops)."""
    if (KERNELS.module is None or codes.device.type != "cpu" or codes.dtype != torch.int8 or ids.dim() != 1
            or scales.dtype != torch.float32):
        return None
    return KERNELS.module.int8_rows(codes, scales, ids.long().contiguous())


def int8_panel_rows(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, bits: int = 8) -> torch.Tensor | None:
    """Rows `ids` [R] of a symmetric 8- or 6-bit panel table (kernels/int4_int8.py's layouts: codes [N / 16, K * 2 *
    bits] uint8, float32 scales [N / 16, K / group, 16] or int8 super scales) as float32 [R, K], or None where the
    kernel is not built or does not take these tensors (the caller then gathers with torch ops, the same values)."""
    if (KERNELS.module is None or codes.device.type != "cpu" or codes.dtype != torch.uint8 or ids.dim() != 1
            or scales.dtype not in (torch.float32, torch.int8)):
        return None
    return KERNELS.module.int8_panel_rows(codes, scales, ids.long().contiguous(), bits)


# The value head sizes the GDN kernels are compiled for: any multiple of 16 up to 128 (csrc/gdn.h's gdn_value_dim_ok).
GDN_VALUE_DIMS = tuple(range(16, 129, 16))


def gdn_declines(num_k_heads: int, num_v_heads: int, value_head_dim: int) -> str | None:
    """Why gdn_prefill / gdn_decode cannot serve GDN heads of these shapes, or None when they can: their
    TORCH_CHECKs on the model's shapes, in words (the model builder asks at load; the tests hold the two equal)."""
    if num_k_heads < 1 or num_v_heads % num_k_heads:
        return f"value heads {num_v_heads} not a multiple of key heads {num_k_heads}"
    if value_head_dim not in GDN_VALUE_DIMS:
        return f"value head dim {value_head_dim} not a multiple of 16 up to 128"
    return None


def serves_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether gdn_prefill / gdn_decode take these q, k [*, Hk, Dk] and v [*, Hv, Dv]: float32 on CPU, head shapes
    they serve (gdn_declines), q and k laid out alike (splits of one projection), contiguous last dims."""
    return (serves(q, k, v) and gdn_declines(q.shape[-2], v.shape[-2], v.shape[-1]) is None
            and q.stride() == k.stride() and q.stride(-1) == v.stride(-1) == 1)


def gdn_prefill(q, k, v, g, beta, cu_seqlens: list[int], state, chunk_size: int, scale: float,
                use_qk_l2norm: bool) -> torch.Tensor:
    """chunk_gated_delta_rule's arithmetic, one (sequence, value head) per task: o [T, Hv, Dv] float32; `state`
    [N, Hv, Dk, Dv] (float32, contiguous) enters as the initial states and leaves as the final ones."""
    return KERNELS.module.gdn_prefill(q, k, v, g.float().contiguous(), beta.float().contiguous(), cu_seqlens, state,
                                       chunk_size, scale, use_qk_l2norm)


def gdn_decode(q, k, v, g, beta, states: torch.Tensor, slots: torch.Tensor, scale: float,
               use_qk_l2norm: bool) -> torch.Tensor:
    """One token per sequence (recurrent_gated_delta_rule_step's arithmetic) on states[slots[b]] in place, with no
    gather or scatter of the states: o [B, Hv, Dv] float32. `states` [S, Hv, Dk, Dv] float32, contiguous."""
    return KERNELS.module.gdn_decode(q, k, v, g.float().contiguous(), beta.float().contiguous(), states,
                                      slots.long().contiguous(), scale, use_qk_l2norm)
