"""The ledger's lines: what each consumer costs for a model, settings and device, and the draft that holds them
before plan_budget judges it (budget/ledger.py) or option_costs prices a change (budget/advice.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from deltaserve.budget.errors import SpecError
from deltaserve.budget.spec import ModelMemorySpec
from deltaserve.config import DTYPE_BYTES, EngineConfig, MiB, int8_activation_panels, torch_int4_layout

SAMPLER_PASSES = 6  # [batch, vocab] buffers: fp32 logits, penalised copy, probs, sorted values, int64 indices (2)
# prompt log-probabilities (SamplingParams.prompt_logprobs): at most this many prompt rows' logits a step, and
# their log-softmax beside them (engine/scheduler.py caps each step's rows; a prompt is never held whole)
PROMPT_LOGPROB_ROWS = 64
PROMPT_LOGPROB_PASSES = 2
GDN_CHUNK = 64  # chunk length of the chunked gated delta rule (intra-chunk [64, 64] matrices)
PAGED_ATTENTION_WORKSPACE_BYTES = 256 * MiB  # split-KV partial outputs of a paged kernel (flashinfer-sized)
CPU_RUNTIME_BYTES = 512 * MiB  # Python + torch + tokenizer + HTTP server, resident before any pool
CUDA_CONTEXT_BYTES = 512 * MiB  # CUDA context and kernel images, outside torch's allocator
CONSUMER_LINES = ("weights", "vision_weights", "kv_pool", "state_pool", "checkpoint_pool", "speculative_states",
                  "prefill_activations", "gdn_workspace", "attention_workspace", "vision_workspace", "sampler")
POOL_LINES = ("weights", "vision_weights", "kv_pool", "state_pool", "checkpoint_pool", "speculative_states")


@dataclass
class Draft:
    """A ledger before it is judged: lines, pool and the shortfall (> 0 when it does not fit)."""

    c: EngineConfig
    total: int
    lines: dict[str, tuple[int, str]]
    usable: int
    kv_pages: int
    bpt: int
    context: int
    shortfall: int
    problem: str
    load_bytes: int = 0  # the load's peak, before any pool: the weights as loaded, the vision tower, the runtime
    load_short: bool = False  # the shortfall is the load's: its peak needs more than the usable memory, and more
    # than any other line does (CPU, int8 activations: the weights as loaded exceed their panels)

    @property
    def required(self) -> int:
        """What must be free at start: every consumer line, or the load's peak where it is higher (CPU, int8
        activations: the weights as loaded exceed their panels, and the load comes before the pools)."""
        return max(sum(self.lines[name][0] for name in CONSUMER_LINES), self.load_bytes)


def draft_ledger(spec: ModelMemorySpec, config: EngineConfig, device_total: int, kind: str,
           pricing: bool = False) -> Draft:
    """Every line; the KV pool last, from what remains (or exactly --max-total-tokens).

    `pricing` (option costs): the pool is not capped and not checked against --context-length.
    """
    c = config.for_device(kind)
    if c.speculative == "auto":  # plan_budget decides it by the fit first; a caller that did not: the head if any
        c = replace(c, speculative="mtp" if has_mtp_head(spec) else "off")
    spec = with_mtp_head(spec, c)
    total = c.device_memory or device_total
    context = c.context_length or spec.max_position_embeddings
    budgeted = int(c.mem_fraction * total)
    usable = budgeted - c.headroom
    lines = _fixed_lines(spec, c, context, kind)
    fixed = sum(b for b, _ in lines.values())
    remaining = usable - fixed
    bpt = spec.kv_bytes_per_token(c.kv_dtype)
    page_bytes = bpt * c.page_size
    # More than max_running_requests x context could never be reserved at once.
    most_pages = math.inf if pricing else math.ceil(c.max_running_requests * context / c.page_size)
    shortfall, problem = 0, ""
    if c.max_total_tokens is not None:
        kv_pages = c.max_total_tokens // c.page_size  # whole pages, never more than asked (a note says so)
        if kv_pages * page_bytes > remaining:
            shortfall = kv_pages * page_bytes - remaining
            problem = (f"--max-total-tokens {c.max_total_tokens} needs {mib(kv_pages * page_bytes)} MiB of KV "
                       f"but the other lines take {mib(fixed)} MiB of {mib(usable)} MiB usable, leaving "
                       f"{mib(max(remaining, 0))} MiB")
        free_reason = "the rest, beside --max-total-tokens: free for temporary buffers"
    else:
        kv_pages = min(max(remaining, 0) // page_bytes, most_pages) if page_bytes else most_pages
        if kv_pages < 1:
            shortfall = max(page_bytes, 1) - remaining
            problem = (f"the lines before the KV pool take {mib(fixed)} MiB of {mib(usable)} MiB usable, "
                       f"leaving no room for one KV page")
        free_reason = (f"beyond max-running-requests x context = {most_pages * c.page_size:,} KV tokens, which "
                       f"could never be reserved at once" if kv_pages == most_pages else "less than one KV page")
    if not (shortfall or pricing) and c.context_length is not None and c.context_length > kv_pages * c.page_size:
        shortfall = (c.context_length - kv_pages * c.page_size) * bpt
        problem = f"--context-length {c.context_length} is longer than the KV pool of {kv_pages * c.page_size} tokens"
    loaded = loaded_weight_bytes(spec, c)
    load = loaded + lines["vision_weights"][0] + lines["runtime"][0]  # the pools come after the load (engine.py)
    load_short = not pricing and load - usable > shortfall
    if load_short:
        shortfall = load - usable
        problem = (f"the load holds the weights as loaded ({mib(loaded)} MiB, before the int8-activation swap makes "
                   f"its panels), the vision tower and the runtime: {mib(load)} MiB of {mib(usable)} MiB usable")
    kv_bytes = kv_pages * page_bytes
    mtp = " (1 of them the MTP head's, --speculative mtp)" if c.speculative == "mtp" else ""
    lines["kv_pool"] = (kv_bytes, f"{kv_pages * c.page_size:,} tokens x {bpt:,} bytes/token ({spec.attention_layers} "
                                  f"attention layers{mtp} x K,V x {spec.num_kv_heads} heads x {spec.head_dim} x "
                                  f"{c.kv_dtype}) in {kv_pages:,} pages of {c.page_size}")
    lines["headroom"] = (c.headroom, "kept free for other processes (--headroom)")
    lines["free"] = (remaining - kv_bytes, free_reason)
    lines["outside_fraction"] = (total - budgeted, f"1 - mem-fraction {c.mem_fraction} of the device: not budgeted")
    return Draft(c, total, lines, usable, kv_pages, bpt, context, shortfall, problem, load, load_short)


def has_mtp_head(spec: ModelMemorySpec) -> bool:
    """Whether the checkpoint carries a multi-token-prediction head (--speculative auto drafts with it where the
    ledger fits)."""
    return any(g.name == "mtp" for g in spec.weight_groups)


def with_mtp_head(spec: ModelMemorySpec, c: EngineConfig) -> ModelMemorySpec:
    """The spec as --speculative mtp serves it: the checkpoint's MTP head loaded (its weight group counted), and its
    attention layer's K/V one more layer of every KV page (models/mtp.py). SpecError where there is no head."""
    if c.speculative != "mtp":
        return spec
    if not has_mtp_head(spec):
        raise SpecError(f"--speculative mtp: the {spec.model_type} checkpoint has no multi-token-prediction head "
                        "(mtp.*); --speculative ngram drafts from the prompt and needs no weights")
    groups = [replace(g, excluded=False) if g.name == "mtp" else g for g in spec.weight_groups]
    return replace(spec, weight_groups=groups, attention_layers=spec.attention_layers + 1)


def _fixed_lines(spec: ModelMemorySpec, c: EngineConfig, context: int, kind: str) -> dict[str, tuple[int, str]]:
    """Every consumer but the KV pool: (bytes, reason) by line name."""
    rows = c.prefill_chunk_tokens + c.max_running_requests  # one step: a prefill chunk beside every decode row
    # a request's drafts are rows of its step too: taken from the chunk's rows, but each one is a logits row
    logits_rows = c.max_running_requests * (1 + (c.speculative_tokens if c.speculative != "off" else 0))
    # The Responses API's store is host memory: on CPU it shares the device; on a GPU it is outside this ledger.
    runtime = ((CUDA_CONTEXT_BYTES, "CUDA context and kernel images (outside torch's allocator)") if kind == "cuda"
               else (CPU_RUNTIME_BYTES + c.responses_store_bytes,
                     f"Python, torch, tokenizer and HTTP server resident memory ({mib(CPU_RUNTIME_BYTES)} MiB), "
                     f"stored Responses API responses ({mib(c.responses_store_bytes)} MiB, --responses-store-bytes)"))
    return {
        "weights": _weights_line(spec, c),
        "vision_weights": _vision_weights_line(spec, c),
        "vision_workspace": _vision_workspace_line(spec, c),
        "state_pool": _state_line(spec, c),
        "checkpoint_pool": _checkpoint_line(spec, c),
        "speculative_states": _speculative_line(spec, c),
        "prefill_activations": (rows * _activation_elements_per_row(spec) * DTYPE_BYTES[c.dtype],
                                f"one step of {rows} rows ({c.prefill_chunk_tokens} prefill + "
                                f"{c.max_running_requests} decode) through the widest layer, {c.dtype}"),
        "gdn_workspace": _gdn_workspace_line(spec, rows),
        "attention_workspace": _attention_line(spec, c, context, kind),
        "sampler": (spec.vocab_size * 4 * (logits_rows * SAMPLER_PASSES + PROMPT_LOGPROB_ROWS * PROMPT_LOGPROB_PASSES),
                    f"vocab {spec.vocab_size:,} x {logits_rows} logits rows x 4 bytes x {SAMPLER_PASSES} passes"
                    + (f" ({c.max_running_requests} requests x (1 + {c.speculative_tokens} drafts))"
                       if c.speculative != "off" else "")
                    + f", and {PROMPT_LOGPROB_ROWS} prompt log-prob rows x {PROMPT_LOGPROB_PASSES} passes"),
        "runtime": runtime,
    }


def _weights_line(spec: ModelMemorySpec, c: EngineConfig) -> tuple[int, str]:
    held, how = _held_weights(spec, c, panels=c.compact_weights and int8_activation_panels(c.device,
                                                                                           c.activation_dtype))
    skipped = [f"{g.name} {mib(g.stored_bytes)} MiB" for g in spec.weight_groups
               if g.excluded and not (g.name == "vision" and serves_images(spec, c))]
    reason = f"{mib(spec.weight_bytes)} MiB in the checkpoint ({spec.weight_source}); {how}"
    loaded = loaded_weight_bytes(spec, c)
    if loaded != held:
        reason += f"; loaded as {mib(loaded)} MiB (packed) before the swap, checked to fit in the usable memory"
    return held, reason + (f"; not loaded: {', '.join(skipped)}" if skipped else "")


def loaded_weight_bytes(spec: ModelMemorySpec, c: EngineConfig) -> int:
    """The weights as the load holds them: the held form, except that on CPU with int8 activations the layers are
    loaded packed and only then swapped into the kernel's panels (models/int8_activations.py), one at a time."""
    return _held_weights(spec, c, panels=False)[0]


def _held_weights(spec: ModelMemorySpec, c: EngineConfig, panels: bool) -> tuple[int, str]:
    """(bytes, how) of the language model's weights as held; `panels`: after the int8-activation swap into the
    compact K-quant panels (--compact-weights; without it the panels are the packed bytes, moved)."""
    cb = DTYPE_BYTES[c.dtype]
    groups = [g for g in spec.weight_groups if not g.excluded]
    if c.dequantize_weights:
        held = sum(g.params * cb if g.held_dequantized_bytes is None else g.held_dequantized_bytes for g in groups)
        return held, f"held dequantized in {c.dtype}"
    if torch_int4_layout(c.device, c.dtype):
        held = sum(g.float_params * cb + (g.quantized_bytes if g.torch_int4_bytes is None else g.torch_int4_bytes)
                   for g in groups)
        return held, f"4-bit matrices in torch's int4 layout (4-bit codes + per group a bfloat16 scale, and a zero " \
                     f"unless symmetric) where its CUDA kernel takes them, else packed, the rest in {c.dtype}"
    packed = "4-bit matrices packed (4-bit codes + per group the checkpoint's 16-bit scale, or a float32 scale and " \
             "offset where 16 bits cannot hold them), 8-bit ones (INT8, GGUF Q8_0 / Q6_K / Q5_K) a byte a weight + " \
             "per group a float32 scale (and offset)"
    if panels:
        held = sum(g.float_params * cb + (g.quantized_bytes if g.panel_bytes is None else g.panel_bytes)
                   for g in groups)
        return held, f"the layers the int8-activation kernel takes in its panels, GGUF's K-quants as compact as the " \
                     f"file (codes at their width, per row and 256 columns a float32 scale and int8 sub-scales, " \
                     f"offsets alike), the rest as loaded: {packed}, floats in {c.dtype}"
    held = sum(g.float_params * cb + g.quantized_bytes for g in groups)
    return held, f"{packed}, the rest in {c.dtype}"


def serves_images(spec: ModelMemorySpec, c: EngineConfig) -> bool:
    """The engine loads the checkpoint's vision tower: it has one, and --language-model-only is not set."""
    return spec.vision is not None and not c.language_model_only and any(g.name == "vision"
                                                                          for g in spec.weight_groups)


def _vision_weights_line(spec: ModelMemorySpec, c: EngineConfig) -> tuple[int, str]:
    """The vision tower's weights, held in the compute dtype (the family's checkpoints keep it unquantized)."""
    if spec.vision is None:
        return 0, "no vision tower"
    group = next(g for g in spec.weight_groups if g.name == "vision")
    if c.language_model_only:
        return 0, f"--language-model-only: the vision tower ({mib(group.stored_bytes)} MiB on disk) is not loaded"
    held = group.params * DTYPE_BYTES[c.dtype] if c.dequantize_weights or not group.quantized_bytes else (
        group.float_params * DTYPE_BYTES[c.dtype] + group.quantized_bytes)
    return held, (f"vision tower: {group.params:,} parameters ({mib(group.stored_bytes)} MiB in the checkpoint) in "
                  f"{c.dtype}; --language-model-only gives it back to the KV pool")


def _vision_workspace_line(spec: ModelMemorySpec, c: EngineConfig) -> tuple[int, str]:
    """Encoding the largest allowed image, plus the embeddings each running request may hold (one image each)."""
    v = spec.vision
    if v is None or c.language_model_only:
        return 0, "no images served"
    cb = DTYPE_BYTES[c.dtype]
    tokens = v.max_image_tokens(c.max_image_pixels)
    encode = v.workspace_elements(c.max_image_pixels) * cb
    held = c.max_running_requests * tokens * v.out_hidden_size * cb
    return encode + held, (f"one image at a time of at most {c.max_image_pixels:,} pixels (--max-image-pixels) = "
                           f"{tokens:,} tokens x {v.merge_size ** 2} patches through the tower, {c.dtype}; and "
                           f"{c.max_running_requests} requests x one image's embeddings awaiting prefill")


def _state_line(spec: ModelMemorySpec, c: EngineConfig) -> tuple[int, str]:
    per_slot = spec.state_bytes_per_slot(c.state_dtype)
    if not spec.gdn_layers:
        return 0, "no GDN layers"
    return c.max_running_requests * per_slot, (
        f"{c.max_running_requests} slots x {per_slot / MiB:,.1f} MiB ({spec.gdn_layers} GDN layers x (conv "
        f"{spec.gdn_conv_dim} x {spec.gdn_conv_kernel - 1} + {spec.gdn_num_v_heads} x {spec.gdn_key_head_dim} x "
        f"{spec.gdn_value_head_dim}) x {c.state_dtype})")


def _checkpoint_line(spec: ModelMemorySpec, c: EngineConfig) -> tuple[int, str]:
    """The prefix cache's GDN state checkpoints: --checkpoint-slots x one state, and what one costs in KV tokens."""
    if not spec.gdn_layers:
        return 0, "no GDN layers: the prefix cache needs KV pages alone"
    if not c.prefix_cache:
        return 0, "--no-prefix-cache"
    per_slot = spec.state_bytes_per_slot(c.state_dtype)
    kv_tokens = per_slot / max(spec.kv_bytes_per_token(c.kv_dtype), 1)
    return c.checkpoint_slots * per_slot, (
        f"{c.checkpoint_slots} checkpoints (--checkpoint-slots) x {per_slot / MiB:,.1f} MiB (one GDN state, "
        f"{c.state_dtype}); one checkpoint costs as much as {kv_tokens:,.0f} tokens of KV ({c.kv_dtype}); the pool "
        f"buys hits for {c.checkpoint_slots} prefixes at once (about {max(c.checkpoint_slots // 2, 1)} "
        f"conversations: each keeps its last message's end and a branch point)")


def speculative_state_slots(spec: ModelMemorySpec, c: EngineConfig) -> int:
    """GDN states speculation keeps: one per draft token per running request (the state after each draft, to roll
    back to the last accepted one); none for a dense model (rejected KV is only not kept) or speculation off."""
    if c.speculative == "off" or not spec.gdn_layers:
        return 0
    return c.max_running_requests * c.speculative_tokens


def _speculative_line(spec: ModelMemorySpec, c: EngineConfig) -> tuple[int, str]:
    if c.speculative == "off":
        return 0, "speculative decoding off (--speculative)"
    if not spec.gdn_layers:
        return 0, "no GDN layers: rejected drafts' KV is only not kept"
    per_slot = spec.state_bytes_per_slot(c.state_dtype)
    return speculative_state_slots(spec, c) * per_slot, (
        f"{c.max_running_requests} requests x {c.speculative_tokens} drafts (--speculative-tokens) x "
        f"{per_slot / MiB:,.1f} MiB: the GDN state after each draft, so a rejection rolls back by one copy")


def _activation_elements_per_row(spec: ModelMemorySpec) -> int:
    """Elements live per token row inside the widest layer: residual, norm, mixer projections, MLP."""
    h = spec.hidden_size
    heads, kv_heads = spec.num_attention_heads, spec.num_kv_heads
    attn = (3 * heads + 2 * kv_heads) * spec.head_dim  # gated q (2x), k, v, attention output
    value_dim = spec.gdn_num_v_heads * spec.gdn_value_head_dim
    gdn = 2 * spec.gdn_conv_dim + 2 * value_dim + 2 * spec.gdn_num_v_heads if spec.gdn_layers else 0
    if spec.num_experts:
        mlp = (3 * spec.num_experts_per_tok * spec.moe_intermediate_size + 3 * spec.shared_expert_intermediate_size
               + spec.num_experts + 2 * spec.num_experts_per_tok * h)
    else:
        mlp = 3 * spec.intermediate_size
    return 3 * h + max(attn if spec.attention_layers else 0, gdn, mlp)


def _gdn_workspace_line(spec: ModelMemorySpec, rows: int) -> tuple[int, str]:
    if not spec.gdn_layers:
        return 0, "no GDN layers"
    hv, dk, dv = spec.gdn_num_v_heads, spec.gdn_key_head_dim, spec.gdn_value_head_dim
    per_row = hv * (3 * dk + 4 * dv) + 3 * hv * GDN_CHUNK + 2 * spec.gdn_conv_dim
    total = 4 * (rows * per_row + 2 * hv * dk * dv)
    return total, (f"chunked delta rule for {rows} rows of one layer in float32: q, k, v, w, u, out, "
                   f"[{GDN_CHUNK}, {GDN_CHUNK}] chunk matrices, conv input, state in/out")


def _attention_line(spec: ModelMemorySpec, c: EngineConfig, context: int, kind: str) -> tuple[int, str]:
    if not spec.attention_layers:
        return 0, "no attention layers"
    if cuda_paged(c):
        return PAGED_ATTENTION_WORKSPACE_BYTES, "paged kernel reads KV pages in place; split-KV scratch"
    # decode reads pages in place (kernels/paged_cpu.py) or gathers one sequence; prefill gathers one sequence
    cb, kvb = DTYPE_BYTES[c.dtype], DTYPE_BYTES[c.kv_dtype]
    row = spec.num_kv_heads * spec.head_dim * 2 * (cb + (kvb if kvb != cb else 0))  # gathered K,V (+ cast copy)
    # one sequence at a time (kernels/attention.py): its K,V gathered, plus its scores (decode: one row per head)
    decode = context * (row + spec.num_attention_heads * 4)
    if kind == "cpu":  # prefill's scores in tiles (kernels/prefill_cpu.py, or torch's flash kernel): none whole
        return decode, (f"one layer, one sequence at a time: K,V of a context of {context:,} gathered (prefill "
                        f"scores in tiles, kernels/prefill_cpu.py)")
    prefill = context * row + c.prefill_chunk_tokens * context * (spec.num_attention_heads * 4 + 1)
    return max(decode, prefill), (f"portable path, one layer, one sequence at a time: K,V of a context of "
                                  f"{context:,} gathered, and the masked scores of one chunk")


def cuda_paged(c: EngineConfig) -> bool:
    """The CUDA paged kernel: a fixed scratch. Otherwise attention gathers a context, which grows with it."""
    return c.attention_backend == "paged" and c.device.startswith("cuda")


def mib(nbytes: int | float) -> str:
    return f"{math.ceil(nbytes / MiB):,}"
