"""The hybrid decoder shared by Qwen3-Next and Qwen3.5: Gated DeltaNet layers interleaved with gated attention.

Each decoder layer is pre-norm: a token mixer (a Gated DeltaNet "linear_attention" layer or a gated softmax
"full_attention" layer) and then an MLP (dense SwiGLU or a sparse mixture of experts with a gated shared expert).
Every RMSNorm of the residual stream and of q/k is zero-centred (y = norm(x) * (1 + weight)); the norm on the GDN
output is a plain-weight RMSNorm gated by silu(z). Parameter names are the Hugging Face checkpoints' own; the
files qwen3_next.py and qwen3_5.py only choose the GDN in-projection layout and the MLP of each layer.

One file over 500 lines on purpose: a model file reads like the paper, the whole architecture top to bottom
(docs/architecture.md); the layers it shares with llama.py (SwiGLU among them) are in layers.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from deltaserve.kernels import conv_decode, conv_prefill, fused_cpu, gated_delta_decode_in_place, gated_delta_prefill
from deltaserve.kernels.attention import paged_attention, write_kv
from deltaserve.models.batch import ATTENTION, GDN, CacheGeometry, ForwardBatch, ModelCaches, rows_as_decode
from deltaserve.models.layers import (FusedHead, FusedParts, Rotary, SwiGLU, add_then_norm, announce_refusals,
                                     apply_rotary, attention_parts, attention_refusals, embedding,
                                     gdn_block_declines, gdn_block_refusal, linear, mlp_parts, mlp_refusals,
                                     projection_parts, refusal, rope_parameters)

log = logging.getLogger(__name__)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # what transformers' configs assume when a checkpoint names none
DEFAULT_MROPE_SECTION = [11, 11, 10]  # likewise


def layer_types(config: dict) -> list[str]:
    """The token mixer of each layer: `layer_types` when given, else every `full_attention_interval`-th is attention."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    if len(types) != n or any(t not in (LINEAR_ATTENTION, FULL_ATTENTION) for t in types):
        raise ValueError(f"layer_types must list {n} entries of {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}, "
                         f"got {types!r}")
    return list(types)


def check_activation(config: dict) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported by the hybrid models; supported: 'silu'")


def frozen(*shape: int) -> nn.Parameter:
    """An empty parameter filled later by load_weights."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class ZeroCentredRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + weight), in float32: the weight is stored as an offset from one."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = frozen(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_cpu.serves(x, self.weight):
            return fused_cpu.rms_norm(x, self.weight, self.eps, 1.0)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.mul_(1.0 + self.weight.float()).to(x.dtype)

    def after_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and this norm, in one pass where fused."""
        return add_then_norm(self, x, residual, 1.0)


class GatedRMSNorm(nn.Module):
    """y = (x / rms(x) * weight) * silu(gate): the norm on each GDN value head, gated by z."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = frozen(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if fused_cpu.serves(x, gate, self.weight):
            return fused_cpu.rms_norm(x, self.weight, self.eps, gate=gate)
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed.mul_(self.weight) * F.silu(gate.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Softmax attention whose q_proj also yields a per-channel output gate; q/k are normed per head."""

    def __init__(self, config: dict, layer_idx: int, rotary: Rotary):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        self.q_proj = linear(hidden, self.num_heads * self.head_dim * 2, bias)
        self.k_proj = linear(hidden, self.num_kv_heads * self.head_dim, bias)
        self.v_proj = linear(hidden, self.num_kv_heads * self.head_dim, bias)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden, bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config["rms_norm_eps"])
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config["rms_norm_eps"])
        self.layer_idx = layer_idx
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos_sin, batch: ForwardBatch, caches: ModelCaches,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output of every row, or only of `rows` (all rows' K/V are still cached)."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        k = apply_rotary(k, *cos_sin)
        i = self.layer_idx
        if rows is not None:
            write_kv(caches.k[i], caches.v[i], batch.slot_mapping, k, v)
            x, cos_sin, k, v = x[rows], (cos_sin[0][rows], cos_sin[1][rows]), k[rows], v[rows]
            batch = rows_as_decode(batch, rows)
        # Each head's 2 * head_dim outputs are [query | gate].
        q, gate = self.q_proj(x).view(x.shape[0], self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), *cos_sin)
        o = paged_attention(q, k, v, caches.k[i], caches.v[i], batch, self.scale)
        width = self.num_heads * self.head_dim
        o = o.reshape(x.shape[0], width).mul_(torch.sigmoid(gate.reshape(x.shape[0], width)))
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer: in-projections, a causal depthwise conv over [q|k|v], the gated delta rule
    with a per-request recurrent state, a gated RMSNorm per value head, and out_proj.

    `fused_projections` selects the checkpoint layout: Qwen3-Next packs [q k v z] and [b a] per key-head group
    (in_proj_qkvz, in_proj_ba); Qwen3.5 keeps in_proj_qkv, in_proj_z, in_proj_b and in_proj_a apart.
    """

    def __init__(self, config: dict, layer_idx: int, fused_projections: bool):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_k_heads = config["linear_num_key_heads"]
        self.num_v_heads = config["linear_num_value_heads"]
        self.head_k_dim = config["linear_key_head_dim"]
        self.head_v_dim = config["linear_value_head_dim"]
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config["linear_conv_kernel_dim"]
        self.fused_projections = fused_projections
        if fused_projections:
            self.in_proj_qkvz = linear(hidden, 2 * self.key_dim + 2 * self.value_dim)
            self.in_proj_ba = linear(hidden, 2 * self.num_v_heads)
        else:
            self.in_proj_qkv = linear(hidden, self.conv_dim)
            self.in_proj_z = linear(hidden, self.value_dim)
            self.in_proj_b = linear(hidden, self.num_v_heads)
            self.in_proj_a = linear(hidden, self.num_v_heads)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False,
                                device="meta")
        self.conv1d.requires_grad_(False)
        self.dt_bias = frozen(self.num_v_heads)
        self.A_log = frozen(self.num_v_heads)
        self.norm = GatedRMSNorm(self.head_v_dim, config["rms_norm_eps"])
        self.out_proj = linear(self.value_dim, hidden)
        self.layer_idx = layer_idx
        # asked once, here: a shape gdn_block does not serve runs op by op from the first step on
        self.block_declines = gdn_block_declines(hidden, self)

    def refusals(self) -> list[str]:
        """The native GDN kernels' refusals of this mixer's shapes, as load-time log lines (layers.refusal)."""
        lines = [refusal(fused_cpu.KERNELS, "gdn_prefill / gdn_decode",
                         fused_cpu.gdn_declines(self.num_k_heads, self.num_v_heads, self.head_v_dim))]
        if not self.fused_projections:  # Qwen3-Next's packed layout never takes the block: no shape to explain
            lines.append(gdn_block_refusal(self.block_declines))
        return [line for line in lines if line]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> mixed_qkv [T, conv_dim] (all q, then k, then v), z [T, Hv, Dv], b and a [T, Hv]."""
        t = x.shape[0]
        if not self.fused_projections:
            z = self.in_proj_z(x).view(t, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next: per key head, [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] and [b (r) | a (r)], r = Hv / Hk.
        r = self.num_v_heads // self.num_k_heads
        dk, rdv = self.head_k_dim, r * self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * dk + 2 * rdv)
        q, k, v, z = torch.split(qkvz, [dk, dk, rdv, rdv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.num_k_heads, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.num_v_heads, self.head_v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def block_parts(self, norm: nn.Module) -> tuple[list, list[int]] | None:
        """The native decode path's gdn_block tensors and sizes for this mixer after `norm`, or None (Qwen3-Next's
        packed in-projections, or projections not in a form it takes): then it runs op by op."""
        if self.fused_projections or self.block_declines is not None:
            return None
        projections = [projection_parts(p) for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                                     self.in_proj_a, self.out_proj)]
        if any(p is None for p in projections) or self.conv1d.bias is not None:
            return None
        small = [self.conv1d.weight.squeeze(1).contiguous(), self.A_log.float().contiguous(),
                 self.dt_bias.float().contiguous(), self.norm.weight]
        if any(t.dtype != torch.float32 for t in small):
            return None
        tensors = [norm.weight, *small]
        for parts, _ in projections:
            tensors += parts
        meta = [self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim] + [g for _, g in projections]
        return tensors, meta

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self.project(x)
        i = self.layer_idx
        snap = batch.snapshots and caches.snapshot_conv is not None  # GDN states kept from inside the chunks
        snap_conv, snap_recurrent = (caches.snapshot_conv[i], caches.snapshot_recurrent[i]) if snap else (None, None)
        mixed = self.conv(mixed, batch, caches.conv[i], snap_conv)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(t, self.num_k_heads, self.head_k_dim)
        k = k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = self.delta_rule(q, k, v, g, beta, batch, caches.recurrent[i], snap_recurrent)
        o = self.norm(o, z).reshape(t, self.value_dim)
        return self.out_proj(o)

    def conv(self, mixed: torch.Tensor, batch: ForwardBatch, conv_cache: torch.Tensor,
             snapshot_cache: torch.Tensor | None = None) -> torch.Tensor:
        """Causal conv + silu over each sequence, continuing from and updating its conv state; with
        `snapshot_cache`, the conv state in the middle of a chunk goes there for each of `batch.snapshots`."""
        weight = self.conv1d.weight.squeeze(1)  # [C, W]
        # Decode sequences come first, one row each; the prefill chunks follow from row nd.
        nd, slots = batch.num_decode, batch.state_slots
        parts = []
        if nd:
            y, state = conv_decode(mixed[:nd], weight, None, conv_cache[slots[:nd]].to(mixed.dtype),
                                   activation="silu")
            conv_cache.index_copy_(0, slots[:nd], state.to(conv_cache.dtype))
            parts.append(y)
        if nd < batch.num_seqs:
            cu = batch.cu_q[nd:] - batch.cu_q[nd]
            initial = conv_cache[slots[nd:]].to(mixed.dtype)
            y, state = conv_prefill(mixed[nd:], weight, None, cu_seqlens=cu, initial_state=initial,
                                    activation="silu")
            if snapshot_cache is not None:
                starts = batch.cu_q.tolist()
                for b, read, slot in batch.snapshots:  # the state is the last W - 1 inputs
                    window = torch.cat([initial[b - nd], mixed[starts[b]:starts[b] + read].T], dim=-1)
                    snapshot_cache[slot].copy_(window[:, window.shape[1] - initial.shape[-1]:])
            conv_cache.index_copy_(0, slots[nd:], state.to(conv_cache.dtype))
            parts.append(y)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def delta_rule(self, q, k, v, g, beta, batch: ForwardBatch, state_cache: torch.Tensor,
                   snapshot_cache: torch.Tensor | None = None) -> torch.Tensor:
        """The gated delta rule per sequence from its recurrent state; the final state is written back (and with
        `snapshot_cache`, the states in the middle of chunks that `batch.snapshots` ask for go there)."""
        nd, slots = batch.num_decode, batch.state_slots
        parts = []
        if nd:
            parts.append(gated_delta_decode_in_place(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], state_cache,
                                                     slots[:nd], use_qk_l2norm=True))
        if nd < batch.num_seqs:
            if snapshot_cache is not None:
                o, state = self.delta_rule_in_pieces(q, k, v, g, beta, batch, state_cache, snapshot_cache)
            else:
                cu = batch.cu_q[nd:] - batch.cu_q[nd]
                o, state = gated_delta_prefill(q[nd:], k[nd:], v[nd:], g[nd:], beta[nd:], cu_seqlens=cu,
                                               initial_state=state_cache[slots[nd:]], use_qk_l2norm=True,
                                               output_final_state=True)
            state_cache.index_copy_(0, slots[nd:], state.to(state_cache.dtype))
            parts.append(o.to(v.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def delta_rule_in_pieces(q, k, v, g, beta, batch: ForwardBatch, state_cache: torch.Tensor,
                             snapshot_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill sequences' (outputs, final states), each sequence cut where a snapshot is asked for: its
        pieces run one after another, each from the state the previous one left, which is kept at each cut."""
        nd, starts = batch.num_decode, batch.cu_q.tolist()
        cuts: dict[int, list[tuple[int, int]]] = {}
        for b, read, slot in batch.snapshots:
            cuts.setdefault(b, []).append((read, slot))
        outs, finals = [], []
        for b in range(nd, batch.num_seqs):
            lo, state, done = starts[b], state_cache[batch.state_slots[b:b + 1]], 0
            for end, slot in cuts.get(b, []) + [(starts[b + 1] - lo, None)]:
                piece = slice(lo + done, lo + end)
                o, state = gated_delta_prefill(q[piece], k[piece], v[piece], g[piece], beta[piece],
                                               initial_state=state, use_qk_l2norm=True, output_final_state=True)
                outs.append(o)
                if slot is not None:
                    snapshot_cache[slot].copy_(state[0])
                done = end
            finals.append(state)
        return torch.cat(outs), torch.cat(finals)


class SparseMoeBlock(nn.Module):
    """Top-k routed SwiGLU experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: dict, norm_topk_prob: bool):
        super().__init__()
        hidden = config["hidden_size"]
        self.top_k = config["num_experts_per_tok"]
        self.norm_topk_prob = norm_topk_prob
        self.gate = linear(hidden, config["num_experts"])
        self.experts = nn.ModuleList(
            SwiGLU(hidden, config["moe_intermediate_size"]) for _ in range(config["num_experts"])
        )
        self.shared_expert = SwiGLU(hidden, config["shared_expert_intermediate_size"])
        self.shared_expert_gate = linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            tokens, pick = torch.where(chosen == e)
            y = self.experts[e](x[tokens]) * weights[tokens, pick, None]
            out.index_add_(0, tokens, y)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int, kind: str, rotary: Rotary, mlp: nn.Module,
                 fused_projections: bool):
        super().__init__()
        eps = config["rms_norm_eps"]
        self.kind = kind
        self.input_layernorm = ZeroCentredRMSNorm(config["hidden_size"], eps)
        if kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, layer_idx, fused_projections)
        else:
            self.self_attn = GatedAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config["hidden_size"], eps)
        self.mlp = mlp
        self.fused = FusedParts(self._fused_parts)

    def refusals(self) -> list[str]:
        """The native kernels' refusals of this layer's shapes, as load-time log lines (layers.refusal)."""
        hidden = self.input_layernorm.weight.shape[0]
        mixer = (self.linear_attn.refusals() if self.kind == LINEAR_ATTENTION
                 else attention_refusals(hidden, self.self_attn))
        mlp = mlp_refusals(hidden, self.mlp.gate_proj.out_features) if isinstance(self.mlp, SwiGLU) else []
        return mixer + mlp

    def forward(self, x, cos_sin, batch: ForwardBatch, caches: ModelCaches,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for every row, or only for `rows` (the caches still see every row)."""
        h = self.input_layernorm(x)
        if self.kind == LINEAR_ATTENTION:
            h = self.linear_attn(h, batch, caches)
            if rows is not None:
                h = h[rows]
        else:
            h = self.self_attn(h, cos_sin, batch, caches, rows)
        normed, x = self.post_attention_layernorm.after_add(h, x if rows is None else x[rows])
        return x + self.mlp(normed)

    def _fused_parts(self):
        """(mixer block parts, MLP block parts), each None where that part runs op by op: a Qwen3-Next GDN
        (packed in-projections), a mixture of experts, or projections not in a form the blocks take."""
        if self.kind == LINEAR_ATTENTION:
            mixer = self.linear_attn.block_parts(self.input_layernorm)
        else:
            mixer = attention_parts(self.input_layernorm, self.self_attn, gated=True)
        return mixer, mlp_parts(self.post_attention_layernorm, self.mlp) if isinstance(self.mlp, SwiGLU) else None


class HybridModel(nn.Module):
    def __init__(self, config: dict, mlp_of_layer, fused_projections: bool):
        super().__init__()
        check_activation(config)
        hidden = config["hidden_size"]
        self.embed_tokens = embedding(config["vocab_size"], hidden)
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        rope = rope_parameters(config)
        rope.setdefault("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
        # Qwen3.5's interleaved mrope gives every section the same angle when t/h/w positions are equal (text);
        # image tokens (rope_positions) need its sections: transformers' default where a config names none.
        rope.setdefault("mrope_section", DEFAULT_MROPE_SECTION)
        self.rotary = Rotary(rope, head_dim)
        self.layer_types = layer_types(config)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, kind, self.rotary, mlp_of_layer(i), fused_projections)
            for i, kind in enumerate(self.layer_types)
        )
        self.norm = ZeroCentredRMSNorm(hidden, config["rms_norm_eps"])
        announce_refusals([layer.refusals() for layer in self.layers])

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's rows [T, hidden]: the token embeddings, an image token's the vision tower's instead."""
        x = self.embed_tokens(batch.input_ids)
        if batch.image_rows is not None:
            x = x.index_copy(0, batch.image_rows, batch.image_embeds.to(x.dtype))
        return x

    def forward(self, batch: ForwardBatch, caches: ModelCaches, all_rows: bool = False) -> torch.Tensor:
        """Hidden states [R, hidden] of the batch's logits rows (before the final norm), op by op; of every row if
        `all_rows` (what an MTP head reads)."""
        x = self.embed(batch)
        cos_sin = self.rotary.cos_sin(batch.positions if batch.rope_positions is None else batch.rope_positions)
        for layer in self.layers[:-1]:
            x = layer(x, cos_sin, batch, caches)
        keep = None if all_rows else batch.last_layer_rows
        x = self.layers[-1](x, cos_sin, batch, caches, keep)
        return x if keep is not None or all_rows else x.index_select(0, batch.logits_indices)


class HybridForCausalLM(nn.Module):
    """A hybrid model with its LM head: forward(batch, caches) -> float32 logits of batch.logits_indices rows.

    `config` is the language model's own config (for a multimodal checkpoint, its text_config).
    """

    def __init__(self, config: dict, mlp_of_layer, fused_projections: bool, tie_word_embeddings: bool):
        super().__init__()
        self.config = config
        self.model = HybridModel(config, mlp_of_layer, fused_projections)
        self.lm_head = linear(config["hidden_size"], config["vocab_size"])
        self.tie_word_embeddings = tie_word_embeddings
        self.geometry = hybrid_geometry(self.model)
        self.mtp = None  # the checkpoint's MTP head where built (models/mtp.py attach)
        self.fused_head = FusedHead(1.0)  # the zero-centred final norm and lm_head in the decode step's native call

    @property
    def tied_weights(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The logits rows float32, op by op (the runner takes models/decode_stack_path.py where it serves)."""
        return self.logits(self.model(batch, caches, all_rows=self.mtp is not None), batch)

    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final norm and the LM head: float32 [R, vocab] of the logits rows. With an MTP head `hidden` is every
        row's [T, hidden], and every row's final-norm output is kept for the drafter (engine/mtp_drafter.py)."""
        if self.mtp is None:
            return self.lm_head(self.model.norm(hidden)).float()
        hidden = self.model.norm(hidden)
        self.mtp.target_hidden = hidden
        return self.lm_head(hidden.index_select(0, batch.logits_indices)).float()


def hybrid_geometry(model: HybridModel) -> CacheGeometry:
    kinds = tuple(GDN if t == LINEAR_ATTENTION else ATTENTION for t in model.layer_types)
    attn = next((layer.self_attn for layer in model.layers if layer.kind == FULL_ATTENTION), None)
    gdn = next((layer.linear_attn for layer in model.layers if layer.kind == LINEAR_ATTENTION), None)
    return CacheGeometry(
        layer_kinds=kinds,
        num_kv_heads=attn.num_kv_heads if attn else 0,
        head_dim=attn.head_dim if attn else 0,
        conv_dim=gdn.conv_dim if gdn else 0,
        conv_width=gdn.conv_width if gdn else 0,
        num_v_heads=gdn.num_v_heads if gdn else 0,
        key_head_dim=gdn.head_k_dim if gdn else 0,
        value_head_dim=gdn.head_v_dim if gdn else 0,
    )


LANGUAGE_MODEL_PREFIX = "model.language_model."
VISION_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")
SKIP_PREFIXES = (*VISION_PREFIXES, *MTP_PREFIXES)
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def announce_unloaded_parts(config: dict, name: str, vision_loaded: bool = False,
                            mtp_loaded: bool = False) -> tuple[bool, bool]:
    """Log once, when the model is built, the checkpoint parts it never loads (a reader may skip them unread).

    Returns whether the (vision tower, MTP head) were announced, so the tensor mapping does not repeat it.
    """
    text = config.get("text_config") or config
    vision = "vision_config" in config and not vision_loaded
    mtp = bool(config.get("mtp_num_hidden_layers") or text.get("mtp_num_hidden_layers")) and not mtp_loaded
    if vision:
        log.info("%s: loading the language model only; the vision tower (model.visual.*) is not loaded", name)
    if mtp:
        log.info("%s: ignoring the multi-token-prediction head (mtp.*)", name)
    return vision, mtp


def language_model_tensors(tensors: Mapping[str, torch.Tensor], name: str,
                           announced: tuple[bool, bool] = (False, False), mtp: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint tensors a hybrid model loads, under its own parameter names.

    A multimodal checkpoint keeps the language model under `model.language_model.`: it moves to `model.`. The
    vision tower and the multi-token-prediction head are skipped by name, never read (`tensors` may be lazy);
    either is logged here unless `announced` (see announce_unloaded_parts) already said so.
    Experts stored fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) become per-expert views, no copy.
    `mtp`: the model built the MTP head (models/mtp.py): its tensors are kept, as `mtp.*`.
    """
    out: dict[str, torch.Tensor] = {}
    skipped_vision = skipped_mtp = 0
    for key in tensors.keys():
        if key.startswith(VISION_PREFIXES):
            skipped_vision += 1
            continue
        if key.startswith(MTP_PREFIXES):
            if not mtp:
                skipped_mtp += 1
                continue
            own = "mtp." + key.split("mtp.", 1)[1]
        elif key.startswith(LANGUAGE_MODEL_PREFIX):
            own = "model." + key[len(LANGUAGE_MODEL_PREFIX):]
        else:
            own = key
        if own.endswith(FUSED_EXPERTS):
            out.update(split_fused_experts(own, tensors[key]))
        else:
            out[own] = tensors[key]
    if skipped_vision and not announced[0]:
        log.info("%s: loading the language model only; skipped %d vision-tower tensors (model.visual.*)",
                 name, skipped_vision)
    if skipped_mtp and not announced[1]:
        log.info("%s: ignoring %d multi-token-prediction tensors (mtp.*)", name, skipped_mtp)
    return out


def split_fused_experts(own: str, fused: torch.Tensor) -> dict[str, torch.Tensor]:
    """`...mlp.experts.gate_up_proj` [E, 2I, H] or `...mlp.experts.down_proj` [E, H, I] as per-expert weights."""
    prefix, _, kind = own.rpartition(".")
    if fused.dim() != 3:
        raise ValueError(f"{own}: fused experts must be 3-D [experts, out, in], got shape {tuple(fused.shape)}")
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": fused[e] for e in range(fused.shape[0])}
    gate, up = fused.chunk(2, dim=1)
    out = {}
    for e in range(fused.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
        out[f"{prefix}.{e}.up_proj.weight"] = up[e]
    return out
