"""The native decode path: a step of decode rows through kernels/decode_cpu.py's blocks instead of the model's
per-op forward.

The runner builds one DecodeStackPath per model at load and asks it each step (`run`): it serves a step of decode
rows (or short verifying chunks as decode rows, batch.as_decode_rows) in float32 on a cache the blocks read, and
returns None for every other step, which then takes the model's per-op forward. The models keep their math and
the parts this path reads (each layer's FusedParts, the causal LM's FusedHead, `embed`, `logits`); a shape the
blocks cannot serve declined at load, in the model builder's log lines (layers.announce_refusals).

Every layer goes in one decode_stack call (Stack keeps its flat arguments between steps), with the final norm and
the LM head where the head is a projection the blocks take; a hybrid layer the blocks do not take (Qwen3-Next's
packed in-projections, experts) makes a decode-only step go layer by layer, each block one native call where it
takes the layer, else op by op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from deltaserve.kernels import decode_cpu
from deltaserve.models.batch import ForwardBatch, ModelCaches, as_decode_rows
from deltaserve.models.layers import current_parts


@dataclass
class StepOutput:
    """One step's result on the native path: the logits rows' logits float32 [R, vocab]; `hidden` the residual
    stream the per-op head read (None where the head ran in the native call); `normed` every row's final-norm
    output where the model keeps it for an MTP head, else None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    normed: torch.Tensor | None = None


def zero_centred(layer: nn.Module) -> bool:
    """Whether a decoder layer's norms are zero-centred (the hybrid family's, weight + 1) rather than plain."""
    return hasattr(layer, "kind")


def layer_args(layer: nn.Module, caches: ModelCaches) -> tuple | None:
    """A decoder layer's share of decode_cpu.decode_stack's arguments (its mixer's and its MLP's), or None where a
    block does not take it (then the step goes layer by layer through `layer_decode`, or op by op)."""
    mixer, mlp = layer.fused.get(layer.input_layernorm.weight)
    if mixer is None or mlp is None:
        return None
    offset = 1.0 if zero_centred(layer) else 0.0
    norm, mlp_eps = layer.input_layernorm, layer.post_attention_layernorm.eps
    gdn = getattr(layer, "linear_attn", None) if zero_centred(layer) and layer.kind == "linear_attention" else None
    if gdn is not None:
        i = gdn.layer_idx
        snaps = (caches.snapshot_conv[i], caches.snapshot_recurrent[i]) if caches.snapshot_conv else (None, None)
        if not decode_cpu.serves_gdn(caches.conv[i], caches.recurrent[i], *(t for t in snaps if t is not None)):
            return None
        return (decode_cpu.gdn_args(mixer, caches.conv[i], caches.recurrent[i], norm.eps, offset, gdn.norm.eps,
                                    *snaps), decode_cpu.mlp_args(mlp, mlp_eps, offset))
    attn = layer.self_attn
    i = attn.layer_idx
    return (decode_cpu.attention_args(mixer, caches.k[i], caches.v[i], norm.eps, offset, attn.scale),
            decode_cpu.mlp_args(mlp, mlp_eps, offset))


def layer_decode(layer: nn.Module, x: torch.Tensor, cos_sin, batch: ForwardBatch, caches: ModelCaches) -> None:
    """A hybrid decoder layer for decode rows, x updated in place: the token mixer and the SwiGLU MLP one native
    call each where a block takes it, else op by op (the layer's own modules)."""
    mixer, mlp = layer.fused.get(layer.input_layernorm.weight)
    norm = layer.input_layernorm
    if layer.kind == "linear_attention":
        gdn = layer.linear_attn
        i = gdn.layer_idx
        if mixer is not None and decode_cpu.serves_gdn(caches.conv[i], caches.recurrent[i]):
            decode_cpu.gdn_block(x, *mixer, caches.conv[i], caches.recurrent[i], batch.state_slots, norm.eps, 1.0,
                                 gdn.norm.eps)
        else:
            x.add_(gdn(norm(x), batch, caches))
    elif mixer is not None:
        cos, sin = cos_sin
        attn = layer.self_attn
        decode_cpu.attention_block(x, *mixer, cos, sin, caches.k[attn.layer_idx], caches.v[attn.layer_idx], batch,
                                   norm.eps, 1.0, attn.scale)
    else:
        x.add_(layer.self_attn(norm(x), (cos_sin[0][:, None], cos_sin[1][:, None]), batch, caches))
    if mlp is None:
        x.add_(layer.mlp(layer.post_attention_layernorm(x)))
    else:
        decode_cpu.mlp_block(x, *mlp, layer.post_attention_layernorm.eps, 1.0)


class DecodeStackPath:
    """The native decode path of one causal LM (llama.py's or hybrid.py's), built at load; `run` per step."""

    def __init__(self, lm: nn.Module):
        self.lm = lm
        self.stack = decode_cpu.Stack()
        # a hybrid model goes layer by layer where a layer's blocks decline; a dense one then runs op by op
        self.by_layer = all(zero_centred(layer) for layer in lm.model.layers)

    @classmethod
    def of(cls, lm: nn.Module) -> DecodeStackPath:
        """The path of this causal LM, made at its first ask (the runner's, at load) and kept beside it: the runner,
        tests and benchmarks that step the same model share its argument cache, and arena.py's move forgets it."""
        path = vars(lm).get("decode_path")
        if path is None:
            path = vars(lm)["decode_path"] = cls(lm)
        return path

    def forget(self) -> None:
        """Drop the stack's arguments (and the tensors they hold): rebuilt at the next step."""
        self.stack.forget()

    def run(self, batch: ForwardBatch, caches: ModelCaches) -> StepOutput | None:
        """The step on the native blocks, or None where they do not serve it (the caller runs the model's per-op
        forward): not built here, not float32, a prefill chunk, more than MAX_ROWS rows, a cache they do not read."""
        lm, model = self.lm, self.lm.model
        flat = as_decode_rows(batch, decode_cpu.MAX_ROWS)
        if flat is None:  # a prefill chunk or too many rows: declined before embedding (the per-op forward embeds)
            return None
        x = model.embed(batch)
        k_cache = next((k for k in caches.k if k is not None), None)
        if not decode_cpu.serves(x, flat, k_cache):
            return None
        parts = current_parts(model.layers)
        args = None
        if self.by_layer or all(p is not None for p in parts):
            args = self.stack.args_for((caches, *parts), lambda: [layer_args(layer, caches) for layer in model.layers])
        # layer by layer only for decode rows proper (gdn_block chains a sequence's rows; the per-op path does not)
        if args is None and not (self.by_layer and flat is batch):
            return None
        rows = batch.logits_indices
        all_rows = getattr(lm, "mtp", None) is not None  # an MTP head reads every row's final-norm output
        x = x.contiguous()  # the residual stream, updated in place
        positions = batch.positions if batch.rope_positions is None else batch.rope_positions
        cos_sin = model.rotary.decode_rows(positions, max(batch.context_lens))
        head = lm.fused_head.get(model.norm, lm.lm_head)  # built on the first decode step, whichever way it goes
        if args is not None and head is not None:  # every layer, the final norm and the LM head in one native call
            normed = torch.empty_like(x) if all_rows else None
            batch.logits_argmax = torch.empty(rows.shape[0], dtype=torch.long)  # the sampler's greedy tokens
            logits = self.stack.run_with(args, x, *cos_sin, flat, head, rows, normed, batch.logits_argmax)
            if all_rows:
                lm.mtp.target_hidden = normed
            return StepOutput(logits, None, normed)
        if args is not None:
            self.stack.run_with(args, x, *cos_sin, flat)
        else:
            for layer in model.layers:
                layer_decode(layer, x, cos_sin, batch, caches)
        hidden = x if all_rows else x.index_select(0, rows)
        return StepOutput(lm.logits(hidden, batch), hidden)


def step_logits(lm: nn.Module, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
    """A step's logits rows float32: the native decode path's where it serves the step, else the model's per-op
    forward (what the runner does each step; tests and benchmarks that drive a model without one call this)."""
    out = DecodeStackPath.of(lm).run(batch, caches)
    return out.logits if out is not None else lm(batch, caches)
