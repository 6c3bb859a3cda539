"""Llama and Qwen3 (dense): pre-norm decoder, grouped-query attention with RoPE, SwiGLU MLP.

Qwen3 is Llama plus an RMSNorm on each head of q and k before the rotary embedding, and an explicit head_dim.
Parameter names are the Hugging Face checkpoints' own.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from deltaserve.kernels.attention import paged_attention, write_kv
from deltaserve.models.batch import ATTENTION, CacheGeometry, ForwardBatch, ModelCaches, rows_as_decode
from deltaserve.models.layers import (FusedHead, FusedParts, Int8DotLinear, Int4Linear, Int8Linear, RMSNorm, Rotary,
                                     SwiGLU, TorchInt4Linear, announce_refusals, apply_rotary, attention_parts,
                                     attention_refusals, embedding, linear, mlp_parts,
                                     mlp_refusals, rope_parameters)


class LlamaAttention(nn.Module):
    def __init__(self, config: dict, layer_idx: int, rotary: Rotary):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        self.q_proj = linear(hidden, self.num_heads * self.head_dim, bias)
        self.k_proj = linear(hidden, self.num_kv_heads * self.head_dim, bias)
        self.v_proj = linear(hidden, self.num_kv_heads * self.head_dim, bias)
        # transformers' attention_bias biases o_proj too; a GGUF says apart whether it has one (o_bias)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden, bool(config.get("o_bias", bias)))
        self.qk_norm = config["model_type"] == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.layer_idx = layer_idx
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos_sin, batch: ForwardBatch, caches: ModelCaches,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output of every row, or only of `rows` (all rows' K/V are still cached)."""
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        k = apply_rotary(k, *cos_sin)
        i = self.layer_idx
        if rows is not None:
            write_kv(caches.k[i], caches.v[i], batch.slot_mapping, k, v)
            x, cos_sin, k, v = x[rows], (cos_sin[0][rows], cos_sin[1][rows]), k[rows], v[rows]
            batch = rows_as_decode(batch, rows)
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rotary(q, *cos_sin)
        o = paged_attention(q, k, v, caches.k[i], caches.v[i], batch, self.scale)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int, rotary: Rotary):
        super().__init__()
        eps = config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = SwiGLU(config["hidden_size"], config["intermediate_size"])
        self.eps = eps
        self.fused = FusedParts(self._fused_parts)

    def forward(self, x, cos_sin, batch, caches, rows: torch.Tensor | None = None):
        """The layer's output for every row, or only for `rows` (the KV cache still sees every row)."""
        h = self.self_attn(self.input_layernorm(x), cos_sin, batch, caches, rows)
        normed, x = self.post_attention_layernorm.after_add(h, x if rows is None else x[rows])
        return x + self.mlp(normed)

    def refusals(self) -> list[str]:
        """The native kernels' refusals of this layer's shapes, as load-time log lines (layers.refusal)."""
        hidden = self.input_layernorm.weight.shape[0]
        return attention_refusals(hidden, self.self_attn) + mlp_refusals(hidden, self.mlp.gate_proj.out_features)

    def _fused_parts(self):
        attn = attention_parts(self.input_layernorm, self.self_attn, gated=False)
        mlp = mlp_parts(self.post_attention_layernorm, self.mlp)
        return None if attn is None or mlp is None else (attn, mlp)


class LlamaModel(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.embed_tokens = embedding(config["vocab_size"], hidden)
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        self.rotary = Rotary(rope_parameters(config), head_dim)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary) for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden, config["rms_norm_eps"])
        announce_refusals([layer.refusals() for layer in self.layers])

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's rows [T, hidden] in the compute dtype (a bf16-held vocabulary: back to compute)."""
        return self.embed_tokens(batch.input_ids).to(self.norm.weight.dtype)

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Hidden states [R, hidden] of the batch's logits rows (before the final norm), op by op."""
        x = self.embed(batch)
        cos_sin = self.rotary.cos_sin(batch.positions)
        for layer in self.layers[:-1]:
            x = layer(x, cos_sin, batch, caches)
        keep = batch.last_layer_rows  # a prefill's last layer for its sampled row only (1/30 of SmolLM2's work)
        x = self.layers[-1](x, cos_sin, batch, caches, keep)
        return x if keep is not None else x.index_select(0, batch.logits_indices)


class LlamaForCausalLM(nn.Module):
    """The whole model: forward(batch, caches) -> float32 logits of batch.logits_indices rows."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = linear(config["hidden_size"], config["vocab_size"])
        self.fused_head = FusedHead(0.0)
        attn = self.model.layers[0].self_attn
        self.geometry = CacheGeometry(
            layer_kinds=(ATTENTION,) * config["num_hidden_layers"],
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
        )

    @property
    def tied_weights(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.get("tie_word_embeddings") else {}

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """The logits rows float32, op by op (the runner takes models/decode_stack_path.py where it serves)."""
        return self.logits(self.model(batch, caches), batch)

    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final norm and the LM head over the logits rows' hidden states [R, hidden]: float32 [R, vocab]. Only
        the rows the sampler needs pass them (in a decode step's native call where it goes in one: FusedHead)."""
        hidden = self.model.norm(hidden)
        head = self.lm_head
        held = isinstance(head, (Int4Linear, Int8DotLinear, Int8Linear, TorchInt4Linear))  # any input dtype
        return head(hidden if held else hidden.to(head.weight.dtype)).float()
