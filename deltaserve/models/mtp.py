"""The multi-token-prediction head of Qwen3.5 / Qwen3-Next checkpoints (`mtp.*`): a draft model of one layer.

At position t it reads the target's hidden state h_t (after the target's final norm) and the embedding of the
token at t + 1, and predicts the token at t + 2 (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py read the same way):

    x = fc(cat([pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)]))     fc: 2H -> H, no bias
    x = layers.0(x)         one full-attention decoder layer (gated attention; the model's MLP kind, MoE included)
    h'_t = norm(x)          logits = lm_head(h'_t), the target's own lm_head and embed_tokens
Chained drafting feeds h'_t back as the hidden state of the next position (with the token just drafted).

Its attention has its own KV: one more attention layer of the KV pool (index num_hidden_layers), at the same page
slots as the target's positions, so it is paged, shared and freed with the request's pages and priced by the
ledger's KV line (budget/lines.py: --speculative mtp adds the head's layer). The norms are zero-centred like the
model's. Parameter names are the checkpoint's (mtp.fc.weight, mtp.layers.0.self_attn.q_proj.weight, ...), so every
weight format the model loads loads the head too, quantized as stored.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from deltaserve.kernels import decode_cpu, fused_cpu
from deltaserve.models.batch import ATTENTION, ForwardBatch, ModelCaches
from deltaserve.models.decode_stack_path import layer_args
from deltaserve.models.hybrid import (FULL_ATTENTION, HybridDecoderLayer, SparseMoeBlock, SwiGLU,
                                      ZeroCentredRMSNorm)
from deltaserve.models.layers import apply_rotary, current_parts, linear

MTP_CONFIG_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def mtp_layers(config: dict) -> int:
    """The checkpoint's MTP layers (0: it has no head)."""
    text = config.get("text_config") or config
    return int(next((c.get(k) for c in (text, config) for k in MTP_CONFIG_KEYS if c.get(k)), 0) or 0)


class MtpHead(nn.Module):
    """`mtp.*`: the head's own weights; embed_tokens, lm_head and the rotary are the target's (`attach`)."""

    def __init__(self, config: dict, rotary, moe_norm_topk_prob: bool):
        super().__init__()
        h, eps = config["hidden_size"], config["rms_norm_eps"]
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.fc = linear(2 * h, h)
        mlp = (SparseMoeBlock(config, moe_norm_topk_prob) if config.get("num_experts", 0) > 0
               else SwiGLU(h, config["intermediate_size"]))
        self.kv_layer = config["num_hidden_layers"]  # its K/V: the pool's layer after the target's
        self.layers = nn.ModuleList([HybridDecoderLayer(config, self.kv_layer, FULL_ATTENTION, rotary, mlp,
                                                        fused_projections=False)])
        self.norm = ZeroCentredRMSNorm(h, eps)
        self.rotary = rotary
        self.stack = decode_cpu.Stack()  # decode_rows' arguments, kept between passes
        self.target_hidden: torch.Tensor | None = None  # the last forward's hidden states, every row (post-norm)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, start: int, k_cache: torch.Tensor,
                v_cache: torch.Tensor, context_slots: torch.Tensor, write_slots: torch.Tensor | None = None,
                chain: list | None = None) -> torch.Tensor:
        """The head over n consecutive positions start .. start + n - 1 of one sequence: h' [n, H].

        embeds [n, H]: embeddings of the tokens at positions + 1; hidden [n, H]: the hidden state at each position
        (the target's, or h' of the position before when chaining). The rows attend to the head's K/V of positions
        0 .. start - 1: the cache at `context_slots` [c], then the K/V in `chain` (provisional rows, never in the
        cache: c + len(chain) == start), then to each other causally. Their own K/V go to the cache at
        `write_slots` or, when None, onto `chain`."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = self.layers[0]
        attn = layer.self_attn
        n = x.shape[0]
        positions = torch.arange(start, start + n, dtype=torch.long, device=x.device)
        cos, sin = self.rotary.cos_sin(positions)
        normed = layer.input_layernorm(x)
        q, gate = attn.q_proj(normed).view(n, attn.num_heads, 2 * attn.head_dim).chunk(2, dim=-1)
        q = apply_rotary(attn.q_norm(q), cos, sin)
        k = apply_rotary(attn.k_norm(attn.k_proj(normed).view(n, attn.num_kv_heads, attn.head_dim)), cos, sin)
        v = attn.v_proj(normed).view(n, attn.num_kv_heads, attn.head_dim)
        past = [(k_cache.index_select(0, context_slots).to(k.dtype),
                 v_cache.index_select(0, context_slots).to(v.dtype))]
        past += chain or []
        keys = torch.cat([p[0] for p in past] + [k], dim=0)  # [start + n, kv_heads, D]
        values = torch.cat([p[1] for p in past] + [v], dim=0)
        if write_slots is not None:
            k_cache.index_copy_(0, write_slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, write_slots, v.to(v_cache.dtype))
        elif chain is not None:
            chain.append((k, v))
        o = self._attend(q, keys, values, start, attn)
        width = attn.num_heads * attn.head_dim
        o = o.reshape(n, width) * torch.sigmoid(gate.reshape(n, width))
        normed, x = layer.post_attention_layernorm.after_add(attn.o_proj(o.to(x.dtype)), x)
        return self.norm(x + layer.mlp(normed))

    def decode_rows(self, tokens: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, start: int,
                    write_slots: torch.Tensor, context_slots: torch.Tensor, caches: ModelCaches,
                    paged_kernel: bool = True) -> torch.Tensor | None:
        """The head over n rows at positions start .. start + n - 1 of one sequence (`rows`, one sequence)."""
        return self.rows(tokens, embeds, hidden, list(range(start, start + tokens.shape[0])), write_slots,
                         context_slots, caches, paged_kernel)

    def rows(self, tokens: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, positions: list[int],
             write_slots: torch.Tensor, context_slots: torch.Tensor, caches: ModelCaches,
             paged_kernel: bool = True) -> torch.Tensor | None:
        """The head over n rows, each at its own position of its own sequence, as decode rows of the native blocks
        (kernels/decode_cpu.py: its layer's attention and MLP in one decode_stack call, as the target's decode steps
        run theirs): h' [n, H], or None where those blocks do not serve (then `forward`, op by op, one sequence at a
        time). Row i (tokens[i], its embedding embeds[i], hidden[i]) writes its K/V at write_slots[i], then attends
        to context_slots[i, :positions[i] + 1], the slots of its sequence's positions 0 .. positions[i] (every row's
        K/V is written before any row attends: rows of one sequence at consecutive positions attend causally).
        `caches`: the pool's tensors, the head's K/V at index kv_layer; `paged_kernel` False: the portable attention
        backend, which these blocks do not serve. The rows of every request a step kept go in one pass
        (engine/mtp_drafter.py observe), one read of the head's weights for them all."""
        n = tokens.shape[0]
        batch = ForwardBatch(input_ids=tokens, positions=torch.tensor(positions, dtype=torch.long),
                             q_lens=[1] * n, cached_lens=positions, num_decode=n,
                             cu_q=torch.arange(n + 1), slot_mapping=write_slots, context_slots=context_slots,
                             state_slots=torch.zeros(n, dtype=torch.long), logits_indices=torch.arange(n),
                             paged_kernel=paged_kernel)
        k_cache = caches.k[self.kv_layer]
        if not (decode_cpu.serves(embeds, batch, k_cache) and fused_cpu.serves(hidden)):
            return None
        layer = self.layers[0]
        args = self.stack.args_for((caches, *current_parts(self.layers)), lambda: [layer_args(layer, caches)])
        if args is None:  # a block the layer's weights do not take (a mixture of experts)
            return None
        norm_e, norm_h = self.pre_fc_norm_embedding, self.pre_fc_norm_hidden
        x = self.fc(torch.cat([fused_cpu.rms_norm(embeds, norm_e.weight, norm_e.eps, 1.0),
                               fused_cpu.rms_norm(hidden, norm_h.weight, norm_h.eps, 1.0)], dim=-1))
        x = x.contiguous()  # the residual stream, updated in place
        self.stack.run_with(args, x, *self.rotary.decode_rows(batch.positions, max(positions) + 1), batch)
        return fused_cpu.rms_norm(x, self.norm.weight, self.norm.eps, 1.0)

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, attn) -> torch.Tensor:
        """Causal softmax attention of rows at start .. start + n - 1 over keys of positions 0 .. start + n - 1."""
        n, total = q.shape[0], keys.shape[0]
        group = attn.num_heads // attn.num_kv_heads
        keys = keys.float().repeat_interleave(group, dim=1)  # [total, heads, D]
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q.float(), keys) * attn.scale
        rows = torch.arange(n, device=q.device)
        allowed = torch.arange(total, device=q.device)[None, :] <= (start + rows)[:, None]  # [n, total]
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), values)


def attach(model, config: dict, moe_norm_topk_prob: bool = True) -> None:
    """Give a hybrid model (HybridForCausalLM) its checkpoint's MTP head as `model.mtp`, and one more attention
    layer in its cache geometry for the head's K/V (of the head's shape: a checkpoint whose target layers are all
    Gated DeltaNet has no other attention layer to take it from; the fuzzer's seed 7 crashed on that)."""
    model.mtp = MtpHead(config, model.model.rotary, moe_norm_topk_prob)
    attn = model.mtp.layers[0].self_attn  # the pool's K/V shape is the head's, also where no target layer attends
    model.geometry = replace(model.geometry, layer_kinds=model.geometry.layer_kinds + (ATTENTION,),
                             num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)
