"""Planted bugs the fixed slice must catch (issue 54): realistic one-line faults, each applied at run time to the real
engine (a patched function or a fault written into the loaded weights, undone after), run over the slice's seeds
until the first case fails. A mutant the slice lets through is a hole in the proof: widen the draw or tighten the
bound until it fails.

Each mutant names the seeds tried first (a case whose draw carries what the fault touches), then the rest of the
slice: the first failing case ends the run, so a caught mutant costs a case or two, not the slice.

A Q4_K scale nibble swapped (`q4k_scale_nibble_swapped`) cannot reach the slice (the draw's GGUF types are those
gguf-py quantizes, no K-quant): its catcher is gguf-py's own dequantization of the Q4_K fixture llama-quantize made
(tests/test_weights_gguf_quantized.py), run by test_mutants.py with the bug planted. Likewise the generated tokens' rotary
positions one late after an image (`image_positions_late`): no fuzz case decodes after an image through the engine
(run_image_case compares one prefill row through ImageOracle), so its catcher is tests/test_engine_vision.py's
log-probs of every generated token against transformers'."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mutant:
    name: str
    fault: str  # the one-line bug it stands for
    plant: Callable[[], contextlib.AbstractContextManager]
    first_seeds: tuple[int, ...] = ()  # slice seeds whose draw carries what the fault touches, tried first


@contextlib.contextmanager
def patched(owner, attribute: str, replacement) -> Iterator[None]:
    original = getattr(owner, attribute)
    setattr(owner, attribute, replacement(original))
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def after_load(change: Callable[[torch.nn.Module], None]):
    """The loaded model changed by `change` right after load_weights fills it (models/__init__.build_model)."""
    import deltaserve.models as models

    def wrap(original):
        def load_weights(model, tensors, **kwargs):
            original(model, tensors, **kwargs)
            with torch.no_grad():
                change(model)
        return load_weights
    return patched(models, "load_weights", wrap)


def rotary_one_pair_short():
    import deltaserve.models.layers as layers

    return patched(layers, "rope_inv_freq", lambda original: lambda params, dim: original(params, dim - 2))


def o_proj_bias_dropped():
    def drop(model):
        for name, module in model.named_modules():
            if name.endswith("o_proj") and getattr(module, "bias", None) is not None:
                module.bias.zero_()
    return after_load(drop)


def gdn_gate_sign():
    """softplus(a - dt_bias) for softplus(a + dt_bias): the decay gate's bias with the wrong sign (every path reads
    the layer's dt_bias, the native blocks included)."""
    def flip(model):
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.neg_()
    return after_load(flip)


@contextlib.contextmanager
def kv_one_position_late_16bit():
    """Each step's new rows written one KV slot late where the cache is 16-bit (float32 caches unchanged): the
    runner's batches shifted, so the Python and native paths alike write there and read where they should."""
    from deltaserve.engine.runner import ModelRunner

    def wrap(original):
        def build(self, plan):
            batch = original(self, plan)
            if self.kv_pool.dtype != torch.float32:
                batch.slot_mapping = (batch.slot_mapping + 1) % self.kv_pool.kv_tokens
            return batch
        return build
    with patched(ModelRunner, "build_batch", wrap), patched(ModelRunner, "decode_batch", wrap):
        yield


def int8_with_63_levels():
    """The int8 path's activations rounded to 63 levels a sign per block of 32 (its quantum twice the int8 one),
    before the kernel's own rounding to 127."""
    from deltaserve.models.layers import Int8DotLinear

    def wrap(original):
        def forward(self, x):
            rows = x if self.perm is None else x[..., self.perm]
            blocks = rows.reshape(*rows.shape[:-1], rows.shape[-1] // 32, 32)
            d = blocks.abs().amax(-1, keepdim=True) / 63
            rounded = torch.where(d > 0, torch.round(blocks / d) * d, blocks).reshape(rows.shape)
            if self.perm is not None:
                rounded = torch.empty_like(rounded).index_copy_(-1, self.perm, rounded)
            return original(self, rounded)
        return forward
    return patched(Int8DotLinear, "forward", wrap)


def head_from_embedding():
    """An untied checkpoint's lm_head read from the embedding (the tie applied whatever the config says)."""
    import deltaserve.models as models

    def wrap(original):
        def load_weights(model, tensors, *, tied=None, **kwargs):
            if "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
                tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
                tied = {**(tied or {}), "lm_head.weight": "model.embed_tokens.weight"}
            original(model, tensors, tied=tied, **kwargs)
        return load_weights
    return patched(models, "load_weights", wrap)


MUTANTS = (
    Mutant("rotary_one_pair_short", "the rotary dimension one pair short", rotary_one_pair_short, (2, 3)),
    Mutant("o_proj_bias_dropped", "o_proj's bias dropped at load", o_proj_bias_dropped, (42, 1, 19)),
    Mutant("gdn_gate_sign", "the GDN decay gate's dt_bias with the wrong sign", gdn_gate_sign, (0, 5)),
    Mutant("kv_late_16bit", "K/V written one position late, 16-bit caches only", kv_one_position_late_16bit,
           (18, 2)),
    Mutant("int8_63_levels", "int8 activations rounded to 63 levels", int8_with_63_levels, ()),
    Mutant("head_from_embedding", "an untied lm_head read from the embedding", head_from_embedding, (42, 22)),
)


def q4k_scale_nibble_swapped():
    """Q4_K's packed 6-bit scales and mins with the high nibbles of their last four read from each other's half of
    the byte (ggml's get_scale_min_k4 with `mh >> 4` and `mh & 0x0F` swapped); Q5_K reads the same bytes. Planted in
    the numpy readers, which the load then takes (the C++ block kernels, kernels/gguf_blocks_cpu.py, give the same
    bytes: tests/test_weights_gguf_blocks.py)."""
    import numpy as np

    import deltaserve.weights.gguf_int4 as gguf_int4
    import deltaserve.weights.gguf_int8 as gguf_int8
    from deltaserve.kernels import gguf_blocks_cpu

    def numpy_k_scales(original):
        def unpack(function, data):
            return None if function in ("q4_k_packed", "q5_k_codes") else original(function, data)
        return unpack

    def swapped(original):
        def scale_min(scales):
            d, m, mh = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
            sc = np.concatenate([d & 0x3F, (mh >> 4) | ((d >> 6) << 4)], axis=1)
            mn = np.concatenate([m & 0x3F, (mh & 0x0F) | ((m >> 6) << 4)], axis=1)
            return sc.astype(np.float32), mn.astype(np.float32)
        return scale_min

    stack = contextlib.ExitStack()
    stack.enter_context(patched(gguf_int4, "_k_scale_min", swapped))
    stack.enter_context(patched(gguf_int8, "_k_scale_min", swapped))
    stack.enter_context(patched(gguf_blocks_cpu, "unpack", numpy_k_scales))
    return stack


def image_positions_late():
    """The M-RoPE position of every token generated after an image one late (engine/multimodal.py
    PromptImages.positions: `+ self.delta + 1`); the prompt's own positions stay right."""
    from deltaserve.engine.multimodal import PromptImages

    def wrap(original):
        def positions(self, start, n):
            out = original(self, start, n).clone()
            prompt_len = self.rope.shape[1]
            late = torch.arange(start, start + n) >= prompt_len
            out[:, late] += 1
            return out
        return positions
    return patched(PromptImages, "positions", wrap)
