"""A decode step's layers in one native call on CPU: per layer the token mixer (attention or GDN) and the MLP blocks.

A batch-1 decode step of a small model is a few thousand PyTorch ops (SmolLM2: ~100 per layer: norms, three
projections, views, RoPE's cat / neg / addcmul, cache writes, the attention call, the residual adds, SiLU), each
~5-20 us of dispatch and allocation on top of its arithmetic, while the arithmetic itself (reading ~3 MB of packed
weights per layer) takes ~0.2 ms. Here each block runs from the residual stream to the residual stream in one
call, with every intermediate in one scratch buffer:

- attention_block: x += o_proj(attend(rope(q_norm(q)), rope(k_norm(k)), v)) over norm(x), the new K/V rows written
  to the paged cache (float32, float16 or bfloat16) and each sequence's context read in place; optionally a
  per-head output gate in q_proj (sigmoid(gate) * o, Qwen3.5 / Qwen3-Next's gated attention);
- mlp_block: x += down(silu(gate(norm(x))) * up(norm(x)));
- gdn_block: x += out_proj(gated_norm(delta_rule(conv(in_proj(norm(x)))))), Qwen3.5's Gated DeltaNet mixer for one
  token per sequence, its conv and recurrent states updated where they lie in the pool (fused_cpu.py's step).

decode_stack runs every layer's blocks in one call (`Stack` keeps its flat arguments between steps): two calls per
layer from Python cost SmolLM2 ~0.6 ms of a ~9 ms step. A model with a layer the blocks do not take (Qwen3-Next's
packed in-projections, experts) calls the blocks layer by layer. The same call ends with the final norm and the LM
head over the sampled rows (`head_args`, head_block) where the head is a projection the blocks take: between the
last layer and the logits the step no longer returns to Python, whose few ops there ran on caches the weights had
just streamed through (~100 us of a 1.4 ms step of bench/hybrid_decode.py's 4-bit tiny hybrid on Sapphire Rapids:
decode 664-673 -> 734-752 tok/s; SmolLM2 Q4_1 +3%, alternated in one run).

Projections are either float32 weights (linear_cpu.py's few-row kernel), packed 4-bit ones (int4_cpu.py's kernel) or,
under --activation-dtype int8, packed 4-bit ones in int4_int8.py's panels: a block quantizes its normed input to int8
once for all the projections that read it (q / k / v, gate / up, a GDN mixer's four in-projections) and each takes
the integer dot-product tile. The attention is paged_cpu.py's kernel. Their C++ is in csrc/decode.cpp, which includes
those modules' headers (csrc/int4_tile.h, linear_tile.h, int4_int8_tile.h, paged_attention.h, gdn.h; each its own
namespace), so one arithmetic serves both paths: the result equals the per-op path's to float32 rounding (the order
of a few additions differs). Norms
are RMSNorm with scale offset + weight (offset 1: zero-centred). float32 activations, 1 to MAX_ROWS decode rows;
anything else (prefill chunks, other dtypes) takes the per-op path.
"""

from __future__ import annotations

import torch

from deltaserve.kernels import fused_cpu, int4_cpu, int4_int8, linear_cpu, paged_cpu
from deltaserve.kernels.cpp_build import CSRC, CompiledKernels

MAX_ROWS = 64  # decode rows: what the few-row kernels it builds on take

KERNELS = CompiledKernels("deltaserve_decode_cpu", CSRC / "decode.cpp",
                           ["attention_block", "mlp_block", "gdn_block", "int8_linear", "decode_stack"],
                           "fused CPU decode blocks", "the per-op decode path")

EMPTY = torch.empty(0)  # where a block has no such tensor (no bias, no level table, no q/k norm)


def load(log=None):
    """The compiled module (built once per machine into our kernel cache), or None when it cannot be built here."""
    return KERNELS.load(log)


def disabled():
    """Inside the block the per-op path serves (the built module is kept); for comparisons and tests."""
    return KERNELS.disabled()


# ---- what the blocks serve, in words: their TORCH_CHECKs on the model's shapes (the model builder asks at load, a
# layer a block declines runs op by op; tests/test_kernel_capability.py holds each answer to the compiled kernel) ----

FLOAT_WEIGHT_K_MULTIPLE = 16  # lin_of: a float32 weight's input width, the few-row kernel's vector


def projection_declines(in_features: int, group_size: int = 0, out_features: int = 0, bits: int = 4) -> str | None:
    """Why the blocks cannot take a projection of this input width (group_size 0: a float32 weight; positive: packed
    4-bit in these groups, int4_cpu's checks; negative: `bits`-bit codes in int4_int8's panels on int8 activations,
    in groups of -group_size, int4_int8's checks), or None when they can."""
    if group_size < 0:
        return int4_int8.declines(out_features, in_features, -group_size, bits=bits)
    if group_size:
        return int4_cpu.declines(in_features, group_size)
    if in_features % FLOAT_WEIGHT_K_MULTIPLE:
        return f"projection input width {in_features} not a multiple of {FLOAT_WEIGHT_K_MULTIPLE}"
    return None


def gdn_block_declines(hidden: int, num_k_heads: int, num_v_heads: int, value_head_dim: int,
                       conv_width: int) -> str | None:
    """Why gdn_block cannot serve a Gated DeltaNet mixer of these shapes (float32 projections), or None."""
    return (fused_cpu.gdn_declines(num_k_heads, num_v_heads, value_head_dim)
            or (f"conv width {conv_width} below 2" if conv_width < 2 else None)
            or projection_declines(hidden) or projection_declines(num_v_heads * value_head_dim))


def attention_block_declines(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                             rotary_dim: int) -> str | None:
    """Why attention_block cannot serve an attention mixer of these shapes (float32 projections), or None."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}"
    if rotary_dim % 2 or rotary_dim > head_dim:
        return f"rotary dim {rotary_dim} not even and at most the head dim {head_dim}"
    return projection_declines(hidden) or projection_declines(num_heads * head_dim)


def mlp_block_declines(hidden: int, intermediate: int) -> str | None:
    """Why mlp_block cannot serve a SwiGLU MLP of these widths (float32 projections), or None."""
    return projection_declines(hidden) or projection_declines(intermediate)


def int8_linear_declines(in_features: int, group_size: int) -> str | None:
    """Why int8_linear cannot multiply an int8 weight of this input width and group size, or None."""
    if group_size % 16 or group_size < 16 or in_features % group_size:
        return f"int8 group {group_size} not a multiple of 16 dividing the input width {in_features}"
    return None


def serves(x: torch.Tensor, batch, k_cache: torch.Tensor | None) -> bool:
    """Whether a step's rows x [B, hidden] take the fused blocks: built, float32 on CPU, every sequence one decode
    row (no prefill chunk in the step), at most MAX_ROWS of them, the paged kernel allowed, a cache it reads."""
    return (KERNELS.module is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and batch.paged_kernel and batch.num_decode == batch.num_seqs == x.shape[0]
            and 0 < x.shape[0] <= MAX_ROWS
            and (k_cache is None or (k_cache.dtype in paged_cpu.CACHE_DTYPES and k_cache.is_contiguous())))


def attention_block(x, tensors: list, meta: list[int], cos, sin, k_cache, v_cache, batch, eps: float,
                    offset: float, scale: float) -> torch.Tensor:
    """x [B, hidden] += the attention block's output over norm(x), in place (the module docstring)."""
    return KERNELS.module.attention_block(x, tensors, meta, cos, sin, k_cache, v_cache, batch.slot_mapping,
                                          batch.context_slots, batch.decode_context_lens, eps, offset, scale)


def mlp_block(x, tensors: list, groups: list[int], eps: float, offset: float) -> torch.Tensor:
    """x [B, hidden] += the SwiGLU MLP of norm(x), in place."""
    return KERNELS.module.mlp_block(x, tensors, groups, eps, offset)


def attention_args(parts, k_cache, v_cache, eps: float, offset: float, scale: float) -> tuple[list, list, list]:
    """An attention mixer's share of decode_stack's flat arguments: its block parts (tensors, meta) and caches."""
    tensors, meta = parts
    return [*tensors, k_cache, v_cache], [1, *meta], [eps, offset, scale]


def gdn_args(parts, conv_states, states, eps: float, offset: float, norm_eps: float, snap_conv=None,
             snap_states=None) -> tuple[list, list, list]:
    """A Gated DeltaNet mixer's share of decode_stack's flat arguments: its block parts, state pools and snapshot
    tensors (where a step's rows keep states: ForwardBatch.row_snapshots; None: none)."""
    tensors, meta = parts
    snaps = [EMPTY, EMPTY] if snap_conv is None else [snap_conv, snap_states]
    return [*tensors, conv_states, states, *snaps], [2, *meta], [eps, offset, norm_eps]


def mlp_args(parts, eps: float, offset: float) -> tuple[list, list, list]:
    """A SwiGLU MLP's share of decode_stack's flat arguments: its block parts (tensors, group sizes)."""
    tensors, groups = parts
    return list(tensors), [1, *groups], [eps, offset]


def head_args(norm_weight: torch.Tensor, parts, eps: float, offset: float,
              vocab: int) -> tuple[tuple[list, list, list], int]:
    """The final norm and the LM head as decode_stack's last entry (head_block): (its flat arguments, the vocabulary),
    `parts` the head's projection_parts (models/layers.py)."""
    tensors, group = parts
    return ([norm_weight, *tensors], [3, group], [eps, offset]), vocab


class Stack:
    """Every layer of a decode-only step in one native call (decode_stack) instead of two per layer: the flat
    argument lists are built once and rebuilt only when a layer's block parts or the caches are other objects."""

    def __init__(self):
        self._key: tuple | None = None
        self._args: tuple[list, list, list] | None = None

    def args_for(self, key: tuple, build) -> tuple[list, list, list] | None:
        """decode_stack's flat arguments. `key`: the objects they are made of (the layers' parts, the caches);
        `build()` -> per layer (mixer args, MLP args) from the *_args helpers above, or None for a layer the blocks
        do not take (then the whole result is None, and cached as such)."""
        if self._key is None or len(key) != len(self._key) or any(a is not b for a, b in zip(key, self._key)):
            layers = build()
            args = None
            if all(layer is not None for layer in layers):
                args = ([], [], [])
                for layer in layers:
                    for part in layer:
                        for whole, share in zip(args, part):
                            whole += share
            self._args, self._key = args, key
        return self._args

    def forget(self) -> None:
        """Drop the arguments (and the tensors they hold): rebuilt at the next args_for."""
        self._key = self._args = None

    @staticmethod
    def run_with(args: tuple[list, list, list], x, cos, sin, batch, head=None, rows=None,
                 normed=None, argmax=None) -> torch.Tensor:
        """x [B, hidden] updated in place by every layer (cos / sin [B, rd] float32), returned; with `head` (head_args)
        the same call ends with the final norm and the LM head over the rows `rows` of x (int64 [R]: the step's
        logits rows, which a batch made by as_decode_rows does not carry), and returns their logits [R, vocab]
        float32 (no return to Python between the last layer and the logits); `normed` [B, hidden] float32 (with
        `head`): every row's final-norm output written there too (what an MTP head reads); `argmax` int64 [R] (with
        `head`): each logits row's argmax written there (torch.argmax's answer, ties and NaN alike)."""
        tensors, ints, floats = args
        snaps = EMPTY if batch.row_snapshots is None else batch.row_snapshots
        if head is None:
            return KERNELS.module.decode_stack(x, tensors, ints, floats, cos, sin, batch.slot_mapping,
                                               batch.context_slots, batch.decode_context_lens, batch.state_slots, snaps,
                                               EMPTY, EMPTY, EMPTY, EMPTY)
        (head_tensors, head_ints, head_floats), vocab = head
        rows = batch.logits_indices if rows is None else rows
        logits = torch.empty(rows.shape[0], vocab)
        KERNELS.module.decode_stack(x, tensors + head_tensors, ints + head_ints, floats + head_floats, cos, sin,
                                    batch.slot_mapping, batch.context_slots, batch.decode_context_lens,
                                    batch.state_slots, snaps, rows, logits, EMPTY if normed is None else normed,
                                    EMPTY if argmax is None else argmax)
        return logits

    def run(self, x, key: tuple, build, cos, sin, batch, head=None, rows=None, argmax=None) -> torch.Tensor:
        """args_for then run_with, for a model whose layers the blocks always take."""
        return self.run_with(self.args_for(key, build), x, cos, sin, batch, head, rows, None, argmax)


def serves_gdn(conv_states: torch.Tensor, states: torch.Tensor, *snapshots: torch.Tensor) -> bool:
    """Whether gdn_block takes these state pools (and snapshot tensors): float32 and contiguous (it updates them in
    place)."""
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
               for t in (conv_states, states, *snapshots))


def gdn_block(x, tensors: list, meta: list[int], conv_states, states, state_slots, eps: float, offset: float,
              norm_eps: float, snap_conv=EMPTY, snap_states=EMPTY, row_snapshots=EMPTY) -> torch.Tensor:
    """x [B, hidden] += a Gated DeltaNet mixer's output over norm(x) for one token per row, its conv and recurrent
    states updated in place; rows on one state slot (adjacent) run in order, each from the state the one before left,
    and a row's state goes to row_snapshots' slot of snap_conv / snap_states after it where that is not -1 (the
    comment above gdn_block in csrc/decode.cpp says which tensors)."""
    return KERNELS.module.gdn_block(x, tensors, meta, conv_states, states, state_slots, eps, offset, norm_eps,
                                    snap_conv, snap_states, row_snapshots)


def serves_int8(rows: torch.Tensor, group_size: int) -> bool:
    """Whether int8_linear takes these float32 input rows [M, K]: built, on CPU, 1 to MAX_ROWS rows."""
    return (rows.device.type == "cpu" and 0 < rows.shape[0] <= MAX_ROWS
            and int8_linear_declines(rows.shape[1], group_size) is None and KERNELS.module is not None)


def int8_linear(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """rows [M, K] float32 @ W.T, W = scale * codes + offset per group of the int8 codes [N, K] (`offsets` empty:
    all zero, never read)."""
    return KERNELS.module.int8_linear(rows, codes, scales, offsets, group_size)
