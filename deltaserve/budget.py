"""The memory ledger: every byte the engine will use, named, before anything is allocated.

`plan_budget(spec, config, device_total_bytes=..., device_kind=...)` turns the model's memory shape, the settings
and the device's TOTAL memory into a `Budget`: one line per consumer (bytes and a one-line reason), the KV pool in
tokens and pages, the GDN state pool in slots. It depends only on its inputs, never on what happens to be free
(field notes, incident 2); what is free at start is only checked against it. This is the only module that does
memory arithmetic; it imports nothing of deltaserve but config.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from deltaserve.config import (DEFAULT_MAX_NEW_TOKENS_CAP, DTYPE_BYTES, ConfigError, EngineConfig, GiB, MiB,
                               torch_int4_layout)

SAMPLER_PASSES = 6  # [batch, vocab] buffers: fp32 logits, penalised copy, probs, sorted values, int64 indices (2)
GDN_CHUNK = 64  # chunk length of the chunked gated delta rule (intra-chunk [64, 64] matrices)
PAGED_ATTENTION_WORKSPACE_BYTES = 256 * MiB  # split-KV partial outputs of a paged kernel (flashinfer-sized)
CPU_RUNTIME_BYTES = 512 * MiB  # Python + torch + tokenizer + HTTP server, resident before any pool
CUDA_CONTEXT_BYTES = 512 * MiB  # CUDA context and kernel images, outside torch's allocator
CUDA_GRAPH_BASE_BYTES = 256 * MiB  # graph memory pool segments and per-stream cuBLAS workspaces
CUDA_GRAPH_PER_SIZE_BYTES = 16 * MiB  # per captured decode batch size (1, 2, 4, ... max_running_requests)

CONSUMER_LINES = ("weights", "vision_weights", "kv_pool", "state_pool", "checkpoint_pool", "prefill_activations",
                  "gdn_workspace", "attention_workspace", "vision_workspace", "sampler", "cuda_graphs")
POOL_LINES = ("weights", "vision_weights", "kv_pool", "state_pool", "checkpoint_pool")


class BudgetError(RuntimeError):
    """The ledger does not fit; the message names the shortfall in MiB and two concrete fixes."""


@dataclass
class WeightGroup:
    """One group of checkpoint tensors (embedding, lm_head, layers, vision, mtp) and what it costs."""

    name: str
    params: int  # logical parameter count (dequantized element count)
    stored_bytes: int  # bytes in the checkpoint; quantized tensors at their packed size
    float_params: int  # elements stored as floats: held in the compute dtype after loading
    quantized_bytes: int  # bytes held when not dequantized: packed codes with their scales / offsets
    excluded: bool = False  # not in the language model's weights line (vision tower: its own line; mtp: unloaded)
    held_dequantized_bytes: int | None = None  # held with dequantize_weights when not params x dtype (INT8 embedding)
    # quantized_bytes with the 4-bit matrices torch's int4 kernel takes held in its layout (CUDA, bfloat16:
    # kernels/int4_torch.py); None: the same as quantized_bytes
    torch_int4_bytes: int | None = None


@dataclass
class VisionShape:
    """A vision tower's sizes (Qwen3.5 family): what its workspace and its image tokens cost."""

    hidden_size: int
    intermediate_size: int
    depth: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    in_channels: int
    out_hidden_size: int

    def max_image_tokens(self, max_pixels: int) -> int:
        """Language-model tokens of the largest image the resize (to at most max_pixels) can produce."""
        side = self.patch_size * self.merge_size
        return max(max_pixels // (side * side), 1)

    def workspace_elements(self, max_pixels: int) -> int:
        """Elements live while the tower encodes its largest image: per patch its pixels, the residual, the norm,
        q k v (and their rotated copies), the attention output and the MLP's hidden (attention itself runs
        block-wise, never [patches, patches]); then the merged rows and the output."""
        tokens = self.max_image_tokens(max_pixels)
        patches = tokens * self.merge_size ** 2
        h, i = self.hidden_size, self.intermediate_size
        patch_pixels = self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        merged = h * self.merge_size ** 2
        return patches * (patch_pixels + 9 * h + 2 * i) + tokens * (2 * merged + self.out_hidden_size)


@dataclass
class ModelMemorySpec:
    """The memory shape of a model: everything the ledger needs, nothing about the math."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    attention_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    gdn_layers: int = 0
    gdn_conv_dim: int = 0  # key_dim * 2 + value_dim: channels of the causal conv
    gdn_conv_kernel: int = 0  # conv width W; the state keeps W - 1 inputs
    gdn_num_v_heads: int = 0  # Hv
    gdn_key_head_dim: int = 0  # Dk
    gdn_value_head_dim: int = 0  # Dv
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0
    tie_word_embeddings: bool = False
    weight_groups: list[WeightGroup] = field(default_factory=list)
    weight_source: str = "estimated from config + quantization scheme"
    quantization: str = "none"
    vision: VisionShape | None = None  # a multimodal checkpoint's tower (its weights: the "vision" group)

    @property
    def weight_bytes(self) -> int:
        """Checkpoint bytes of what is loaded (excluded groups left out)."""
        return sum(g.stored_bytes for g in self.weight_groups if not g.excluded)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V of every attention layer for one token."""
        return self.attention_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def state_bytes_per_slot(self, state_dtype: str) -> int:
        """Conv state (W - 1 inputs) and recurrent state [Hv, Dk, Dv] of every GDN layer for one request."""
        return self.gdn_layers * self.state_elements_per_layer() * DTYPE_BYTES[state_dtype]

    def state_elements_per_layer(self) -> int:
        conv = self.gdn_conv_dim * max(self.gdn_conv_kernel - 1, 0)
        return conv + self.gdn_num_v_heads * self.gdn_key_head_dim * self.gdn_value_head_dim


@dataclass
class BudgetLine:
    name: str
    bytes: int
    reason: str


@dataclass
class Budget:
    """The ledger. `lines` cover the whole device: their bytes sum to `device_total_bytes`."""

    lines: list[BudgetLine]
    device_kind: str
    device_total_bytes: int
    mem_fraction: float
    usable_bytes: int  # mem_fraction * total - headroom
    kv_tokens: int
    kv_pages: int
    page_size: int
    kv_bytes_per_token: int
    kv_dtype: str
    state_slots: int
    state_bytes_per_slot: int
    state_dtype: str
    compute_dtype: str
    context_length: int  # configured (or the model's)
    max_context_tokens: int  # the longest one request can be: min(context, pool)
    max_new_tokens_cap: int
    default_max_tokens: int | None  # None: what remains of the context, capped
    max_running_requests: int
    required_bytes: int  # what must be free at start: every consumer line
    weight_source: str
    model_type: str
    settings: dict
    notes: list[str] = field(default_factory=list)
    checkpoint_slots: int = 0  # GDN state checkpoints of the prefix cache (0: dense model or no prefix cache)

    def line(self, name: str) -> BudgetLine:
        """The line called `name` (KeyError if there is none)."""
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(name)

    def to_json(self) -> dict:
        """The ledger as plain JSON values: what `deltaserve plan --json` prints and GET /v1/budget serves."""
        data = dataclasses.asdict(self)
        data["lines"] = [dataclasses.asdict(line) for line in self.lines]
        return data

    def to_table(self) -> str:
        """A plain-text table: one row per line with GiB and MiB columns and the reason."""
        rows = [f"{'line':<20} {'GiB':>8} {'MiB':>10}  reason", "-" * 100]
        for line in self.lines:
            rows.append(f"{line.name:<20} {line.bytes / GiB:>8.2f} {line.bytes / MiB:>10,.0f}  {line.reason}")
        rows.append("-" * 100)
        rows.append(f"{'device total':<20} {self.device_total_bytes / GiB:>8.2f} "
                    f"{self.device_total_bytes / MiB:>10,.0f}  {self.device_kind}, "
                    f"mem-fraction {self.mem_fraction}, usable {self.usable_bytes / MiB:,.0f} MiB")
        return "\n".join(rows)


@dataclass
class LineCheck:
    name: str
    predicted_bytes: int
    measured_bytes: int

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.predicted_bytes if self.predicted_bytes else math.inf

    def __str__(self) -> str:
        return (f"{self.name}: predicted {self.predicted_bytes / MiB:,.1f} MiB, measured "
                f"{self.measured_bytes / MiB:,.1f} MiB ({(self.ratio - 1) * 100:+.2f}%)")


def measure_vs_predicted(budget: Budget, measured: dict[str, int]) -> list[LineCheck]:
    """Pair what the engine really allocated (bytes per line name) with the ledger's prediction."""
    return [LineCheck(name, budget.line(name).bytes, int(nbytes)) for name, nbytes in measured.items()]


@dataclass
class _Draft:
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

    @property
    def required(self) -> int:
        return sum(self.lines[name][0] for name in CONSUMER_LINES)


def plan_budget(spec: ModelMemorySpec, config: EngineConfig, *, device_total_bytes: int, device_kind: str,
                device_free_bytes: int | None = None) -> Budget:
    """The ledger for `spec` on a device of `device_total_bytes` (config.device_memory overrides it).

    Raises BudgetError (shortfall in MiB and two fixes) when the ledger does not fit, or when
    `device_free_bytes`, what is free at start, is less than the consumers need.
    """
    draft = _draft(spec, config, device_total_bytes, device_kind)
    if draft.shortfall > 0:
        fixes = _fixes(spec, draft, device_kind, lambda d: d.shortfall <= 0)
        raise BudgetError(f"{draft.problem}: short by {_mib(draft.shortfall)} MiB. {fixes}")
    if device_free_bytes is not None and device_free_bytes < draft.required:
        short = draft.required - device_free_bytes
        fixes = _fixes(spec, draft, device_kind,
                       lambda d: d.shortfall <= 0 and d.required <= device_free_bytes)
        raise BudgetError(f"the ledger needs {_mib(draft.required)} MiB at start but the device has "
                          f"{_mib(device_free_bytes)} MiB free: short by {_mib(short)} MiB. {fixes}")
    return _finish(spec, draft, device_kind)


def _draft(spec: ModelMemorySpec, config: EngineConfig, device_total: int, kind: str,
           pricing: bool = False) -> _Draft:
    """Every line; the KV pool last, from what remains (or exactly --max-total-tokens).

    `pricing` (option costs): the pool is not capped and not checked against --context-length.
    """
    c = config.for_device(kind)
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
            problem = (f"--max-total-tokens {c.max_total_tokens} needs {_mib(kv_pages * page_bytes)} MiB of KV "
                       f"but the other lines take {_mib(fixed)} MiB of {_mib(usable)} MiB usable, leaving "
                       f"{_mib(max(remaining, 0))} MiB")
        free_reason = "the rest, beside --max-total-tokens: free for temporary buffers"
    else:
        kv_pages = min(max(remaining, 0) // page_bytes, most_pages) if page_bytes else most_pages
        if kv_pages < 1:
            shortfall = max(page_bytes, 1) - remaining
            problem = (f"the lines before the KV pool take {_mib(fixed)} MiB of {_mib(usable)} MiB usable, "
                       f"leaving no room for one KV page")
        free_reason = (f"beyond max-running-requests x context = {most_pages * c.page_size:,} KV tokens, which "
                       f"could never be reserved at once" if kv_pages == most_pages else "less than one KV page")
    if not (shortfall or pricing) and c.context_length is not None and c.context_length > kv_pages * c.page_size:
        shortfall = (c.context_length - kv_pages * c.page_size) * bpt
        problem = f"--context-length {c.context_length} is longer than the KV pool of {kv_pages * c.page_size} tokens"
    kv_bytes = kv_pages * page_bytes
    lines["kv_pool"] = (kv_bytes, f"{kv_pages * c.page_size:,} tokens x {bpt:,} bytes/token ({spec.attention_layers} "
                                  f"attention layers x K,V x {spec.num_kv_heads} heads x {spec.head_dim} x "
                                  f"{c.kv_dtype}) in {kv_pages:,} pages of {c.page_size}")
    lines["headroom"] = (c.headroom, "kept free for other processes (--headroom)")
    lines["free"] = (remaining - kv_bytes, free_reason)
    lines["outside_fraction"] = (total - budgeted, f"1 - mem-fraction {c.mem_fraction} of the device: not budgeted")
    return _Draft(c, total, lines, usable, kv_pages, bpt, context, shortfall, problem)


def _fixed_lines(spec: ModelMemorySpec, c: EngineConfig, context: int, kind: str) -> dict[str, tuple[int, str]]:
    """Every consumer but the KV pool: (bytes, reason) by line name."""
    rows = c.prefill_chunk_tokens + c.max_running_requests  # one step: a prefill chunk beside every decode row
    runtime = ((CUDA_CONTEXT_BYTES, "CUDA context and kernel images (outside torch's allocator)") if kind == "cuda"
               else (CPU_RUNTIME_BYTES, "Python, torch, tokenizer and HTTP server resident memory"))
    return {
        "weights": _weights_line(spec, c),
        "vision_weights": _vision_weights_line(spec, c),
        "vision_workspace": _vision_workspace_line(spec, c),
        "state_pool": _state_line(spec, c),
        "checkpoint_pool": _checkpoint_line(spec, c),
        "prefill_activations": (rows * _activation_elements_per_row(spec) * DTYPE_BYTES[c.dtype],
                                f"one step of {rows} rows ({c.prefill_chunk_tokens} prefill + "
                                f"{c.max_running_requests} decode) through the widest layer, {c.dtype}"),
        "gdn_workspace": _gdn_workspace_line(spec, rows),
        "attention_workspace": _attention_line(spec, c, context),
        "sampler": (spec.vocab_size * c.max_running_requests * 4 * SAMPLER_PASSES,
                    f"vocab {spec.vocab_size:,} x batch {c.max_running_requests} x 4 bytes x {SAMPLER_PASSES} passes"),
        "cuda_graphs": _cuda_graph_line(spec, c, kind),
        "runtime": runtime,
    }


def _finish(spec: ModelMemorySpec, d: _Draft, kind: str) -> Budget:
    c = d.c
    order = ("weights", "vision_weights", "kv_pool", "state_pool", "checkpoint_pool", "prefill_activations",
             "gdn_workspace", "attention_workspace", "vision_workspace", "sampler", "cuda_graphs", "runtime",
             "headroom", "free", "outside_fraction")
    kv_tokens = d.kv_pages * c.page_size
    max_context = min(d.context, kv_tokens)
    notes = []
    if max_context < d.context:
        notes.append(f"the model's context {d.context:,} is longer than the KV pool: requests are limited "
                     f"to {max_context:,} tokens")
    if c.max_total_tokens is not None and kv_tokens != c.max_total_tokens:
        notes.append(f"--max-total-tokens {c.max_total_tokens:,} rounded down to {kv_tokens:,}: the KV pool holds "
                     f"whole pages of {c.page_size} tokens")
    cap = min(c.max_new_tokens_cap or DEFAULT_MAX_NEW_TOKENS_CAP, max_context)
    if c.max_new_tokens_cap and cap < c.max_new_tokens_cap:
        notes.append(f"--max-new-tokens-cap {c.max_new_tokens_cap:,} lowered to the longest context {cap:,}")
    return Budget(
        lines=[BudgetLine(name, *d.lines[name]) for name in order],
        device_kind=kind, device_total_bytes=d.total, mem_fraction=c.mem_fraction, usable_bytes=d.usable,
        kv_tokens=kv_tokens, kv_pages=d.kv_pages, page_size=c.page_size, kv_bytes_per_token=d.bpt,
        kv_dtype=c.kv_dtype, state_slots=c.max_running_requests,
        checkpoint_slots=c.checkpoint_slots if c.prefix_cache and spec.gdn_layers else 0,
        state_bytes_per_slot=spec.state_bytes_per_slot(c.state_dtype), state_dtype=c.state_dtype,
        compute_dtype=c.dtype, context_length=d.context, max_context_tokens=max_context,
        max_new_tokens_cap=cap, default_max_tokens=c.default_max_tokens,
        max_running_requests=c.max_running_requests, required_bytes=d.required,
        weight_source=spec.weight_source, model_type=spec.model_type, settings=c.to_dict(), notes=notes,
    )


def _weights_line(spec: ModelMemorySpec, c: EngineConfig) -> tuple[int, str]:
    cb = DTYPE_BYTES[c.dtype]
    loaded = [g for g in spec.weight_groups if not g.excluded]
    if c.dequantize_weights:
        held = sum(g.params * cb if g.held_dequantized_bytes is None else g.held_dequantized_bytes for g in loaded)
        how = f"held dequantized in {c.dtype}"
    elif torch_int4_layout(c.device, c.dtype):
        held = sum(g.float_params * cb + (g.quantized_bytes if g.torch_int4_bytes is None else g.torch_int4_bytes)
                   for g in loaded)
        how = f"4-bit matrices in torch's int4 layout (4-bit codes + per group a bfloat16 scale, and a zero unless " \
              f"symmetric) where its CUDA kernel takes them, else packed, the rest in {c.dtype}"
    else:
        held = sum(g.float_params * cb + g.quantized_bytes for g in loaded)
        how = f"4-bit matrices packed (4-bit codes + per group the checkpoint's 16-bit scale, or a float32 scale and " \
              f"offset where 16 bits cannot hold them), the rest in {c.dtype}"
    skipped = [f"{g.name} {_mib(g.stored_bytes)} MiB" for g in spec.weight_groups
               if g.excluded and not (g.name == "vision" and serves_images(spec, c))]
    reason = f"{_mib(spec.weight_bytes)} MiB in the checkpoint ({spec.weight_source}); {how}"
    return held, reason + (f"; not loaded: {', '.join(skipped)}" if skipped else "")


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
        return 0, f"--language-model-only: the vision tower ({_mib(group.stored_bytes)} MiB on disk) is not loaded"
    held = group.params * DTYPE_BYTES[c.dtype] if c.dequantize_weights or not group.quantized_bytes else (
        group.float_params * DTYPE_BYTES[c.dtype] + group.quantized_bytes)
    return held, (f"vision tower: {group.params:,} parameters ({_mib(group.stored_bytes)} MiB in the checkpoint) in "
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


def _attention_line(spec: ModelMemorySpec, c: EngineConfig, context: int) -> tuple[int, str]:
    if not spec.attention_layers:
        return 0, "no attention layers"
    if _cuda_paged(c):
        return PAGED_ATTENTION_WORKSPACE_BYTES, "paged kernel reads KV pages in place; split-KV scratch"
    # CPU: decode reads pages in place (kernels/paged_cpu.py) or gathers one sequence; prefill gathers and masks
    cb, kvb = DTYPE_BYTES[c.dtype], DTYPE_BYTES[c.kv_dtype]
    row = spec.num_kv_heads * spec.head_dim * 2 * (cb + (kvb if kvb != cb else 0))  # gathered K,V (+ cast copy)
    # one sequence at a time (kernels/attention.py): its K,V gathered, plus its scores (decode: one row per head)
    decode = context * (row + spec.num_attention_heads * 4)
    prefill = context * row + c.prefill_chunk_tokens * context * (spec.num_attention_heads * 4 + 1)
    return max(decode, prefill), (f"portable path, one layer, one sequence at a time: K,V of a context of "
                                  f"{context:,} gathered, and the masked scores of one chunk")


def _cuda_paged(c: EngineConfig) -> bool:
    """The CUDA paged kernel: a fixed scratch. Otherwise attention gathers a context, which grows with it."""
    return c.attention_backend == "paged" and c.device.startswith("cuda")


def _cuda_graph_line(spec: ModelMemorySpec, c: EngineConfig, kind: str) -> tuple[int, str]:
    if kind != "cuda":
        return 0, "no CUDA graphs on CPU"
    if c.cuda_graph_reserve is not None:
        return c.cuda_graph_reserve, "--cuda-graph-reserve"
    sizes = 1 + int(math.log2(c.max_running_requests))
    rows = c.max_running_requests
    activations = rows * _activation_elements_per_row(spec) * DTYPE_BYTES[c.dtype]
    return (CUDA_GRAPH_BASE_BYTES + sizes * CUDA_GRAPH_PER_SIZE_BYTES + activations,
            f"estimate: pool base + {sizes} captured decode sizes up to {rows}; measure and set --cuda-graph-reserve")


def _mib(nbytes: int | float) -> str:
    return f"{math.ceil(nbytes / MiB):,}"


def _fixes(spec: ModelMemorySpec, d: _Draft, kind: str, ok) -> str:
    """Up to two concrete settings, each checked by re-running the ledger, that make `ok(draft)` true."""
    c = d.c
    tokens_now = d.kv_pages * c.page_size
    short = d.shortfall > 0
    context_problem = d.problem.startswith("--context-length")
    hundredths = round(c.mem_fraction * 100)
    cap = c.max_new_tokens_cap
    candidates = []  # (flag text, setting, values to try in order, extra changes)

    def with_cap(n: int) -> dict:
        return {"max_new_tokens_cap": min(cap, n)} if cap else {}

    def with_context(n: int) -> dict:
        return {"context_length": n} if c.context_length and c.context_length > n else {}

    if context_problem:
        candidates.append(("--context-length {}", "context_length", _descending(tokens_now, 1024), with_cap))
        if c.max_total_tokens is not None:
            candidates.append(("--max-total-tokens {}", "max_total_tokens", [d.context], _none))
    elif c.max_total_tokens is not None:
        candidates.append(("--max-total-tokens {}", "max_total_tokens", _descending(c.max_total_tokens, 1000),
                           with_context))
    if short:
        candidates.append(("raise --mem-fraction to {:.2f}", "mem_fraction",
                           [f / 100 for f in range(hundredths + 1, 101)], _none))
    else:
        candidates.append(("lower --mem-fraction to {:.2f}", "mem_fraction",
                           [f / 100 for f in range(hundredths - 1, 0, -1)], _none))
        if c.max_total_tokens is None:
            candidates.append(("--max-total-tokens {}", "max_total_tokens", _descending(tokens_now, 1000),
                               with_context))
    candidates.append(("--max-running-requests {}", "max_running_requests",
                       range(c.max_running_requests - 1, 0, -1), _none))
    if not _cuda_paged(c) and spec.attention_layers and not context_problem:
        candidates.append(("--context-length {}", "context_length", _descending(d.context, 1024), with_cap))
    if c.headroom:
        candidates.append(("--headroom {}", "headroom", [0], _none))
    found = []
    for text, name, values, extra in candidates:
        value = _first_fitting(spec, d, kind, ok, name, values, extra)
        if value is not None:
            also = "".join(f" --{k.replace('_', '-')} {v}" for k, v in extra(value).items()
                           if getattr(c, k) is not None and v != getattr(c, k))
            found.append(text.format(value) + also)
        if len(found) == 2:
            break
    if not found:
        return "No single setting fixes it: use a smaller or more quantized model, or a larger device."
    return "Fix: " + " or ".join(found) + "."


def _none(_value) -> dict:
    return {}


def _descending(start: int, step: int) -> list[int]:
    """start rounded down to a multiple of step, then down by step; small values go down by 16."""
    if start < step:
        return list(range(start // 16 * 16, 0, -16))
    return list(range(start // step * step, 0, -step))


def _first_fitting(spec, d: _Draft, kind: str, ok, name: str, values, extra):
    for value in values:
        try:
            config = dataclasses.replace(d.c, **{name: value}, **extra(value))
        except ConfigError:
            continue
        if ok(_draft(spec, config, d.total, kind)):
            return value
    return None


class OptionCost(NamedTuple):
    """What one option changes in the KV pool, in tokens of context (negative: it costs them)."""

    option: str
    delta_kv_tokens: int
    note: str


def option_costs(spec: ModelMemorySpec, config: EngineConfig, device_total: int, *, device_kind: str | None = None,
                 host_tier_bytes: int = 12 * 1000**3) -> list[OptionCost]:
    """What each option costs (negative) or gains in KV tokens, with the pool sized from memory, uncapped."""
    kind = device_kind or config.device_kind()
    base_config = dataclasses.replace(config, max_total_tokens=None)
    base = _draft(spec, base_config, device_total, kind, pricing=True)
    c, tokens = base.c, base.kv_pages * base.c.page_size
    costs = []

    def delta(**changes) -> int | None:
        d = _draft(spec, dataclasses.replace(base_config, **changes), device_total, kind, pricing=True)
        return None if d.shortfall > 0 else d.kv_pages * c.page_size - tokens

    for step in (0.01, -0.01):
        f = round(c.mem_fraction + step, 2)
        if 0 < f <= 1 and (n := delta(mem_fraction=f)) is not None:
            note = f"{step:+.2f} x device = {step * base.total / MiB:+,.0f} MiB"
            costs.append(OptionCost(f"--mem-fraction {f:.2f}", n, note))
    if spec.gdn_layers:
        other = "bfloat16" if c.state_dtype == "float32" else "float32"
        if (n := delta(state_dtype=other)) is not None:
            costs.append(OptionCost(f"--state-dtype {other}", n,
                                    f"GDN state {spec.state_bytes_per_slot(other) / MiB:,.1f} "
                                    f"MiB/request instead of {spec.state_bytes_per_slot(c.state_dtype) / MiB:,.1f}"))
    if serves_images(spec, c) and (n := delta(language_model_only=True)) is not None:
        costs.append(OptionCost("--language-model-only", n, f"no images: the vision tower's weights "
                                f"({_mib(base.lines['vision_weights'][0])} MiB) and workspace "
                                f"({_mib(base.lines['vision_workspace'][0])} MiB) become KV"))
    elif spec.vision is not None and c.language_model_only and (n := delta(language_model_only=False)) is not None:
        costs.append(OptionCost("images (without --language-model-only)", n, "loads the vision tower and its "
                                "workspace"))
    if (n := delta(max_running_requests=c.max_running_requests + 1)) is not None:
        costs.append(OptionCost(f"--max-running-requests {c.max_running_requests + 1}", n,
                                "one more state slot, sampler row and decode row"))
    if DTYPE_BYTES[c.kv_dtype] > 1 and (n := delta(kv_dtype="float8_e4m3fn")) is not None:
        costs.append(OptionCost("--kv-dtype fp8", n, f"{spec.kv_bytes_per_token('float8_e4m3fn'):,} bytes/token "
                                f"instead of {base.bpt:,} (needs a KV pool that stores fp8)"))
    costs.append(_host_tier_cost(spec, c, base, host_tier_bytes))
    if spec.gdn_layers and c.prefix_cache:
        per = spec.state_bytes_per_slot(c.state_dtype) / base.bpt
        more = 2 * c.checkpoint_slots
        if (n := delta(checkpoint_slots=more)) is not None:
            costs.append(OptionCost(f"--checkpoint-slots {more}", n,
                                    f"{more - c.checkpoint_slots} more reusable prefix states at {per:,.0f} KV tokens "
                                    f"each: {more // 2} conversations keep their last message and a branch point"))
        if (n := delta(prefix_cache=False)) is not None:
            costs.append(OptionCost("--no-prefix-cache", n, "no checkpoints: every turn of a conversation is read "
                                                            "again from its first token"))
    if spec.gdn_layers:
        scales = 4 * spec.gdn_num_v_heads * spec.gdn_key_head_dim  # one fp32 scale per state row
        int8_slot = spec.gdn_layers * (spec.state_elements_per_layer() + scales)
        pool = c.max_running_requests * int8_slot
        costs.append(OptionCost(f"INT8 GDN state checkpoints x{c.max_running_requests}", -math.ceil(pool / base.bpt),
                                f"{pool / MiB:,.0f} MiB added on top of the working pool ({int8_slot / MiB:,.1f} MiB "
                                f"each: {spec.state_bytes_per_slot(c.state_dtype) / int8_slot:.1f}x more prefixes "
                                f"per byte than {c.state_dtype}), not replacing it"))
    return costs


def _host_tier_cost(spec: ModelMemorySpec, c: EngineConfig, base: _Draft, host_bytes: int) -> OptionCost:
    """A host-RAM prefix tier split by the device pools' byte ratio (field notes, incident 5)."""
    kv_bytes, state_bytes = base.lines["kv_pool"][0], base.lines["state_pool"][0]
    per_state = spec.state_bytes_per_slot(c.state_dtype)
    kv_share = kv_bytes / (kv_bytes + state_bytes) if kv_bytes + state_bytes else 1.0
    prefix_tokens = int(host_bytes * kv_share // base.bpt) if base.bpt else 0
    states = int(host_bytes * (1 - kv_share) // per_state) if per_state else 0
    note = f"{host_bytes / 1000**3:.0f} GB of RAM: {prefix_tokens:,} tokens of cached prefix KV"
    if spec.gdn_layers:
        note += (f", but GDN state for only {states:,} prefixes: a hybrid prefix hit needs the state at that exact "
                 f"point, so most hits recompute")
    return OptionCost(f"host prefix tier {host_bytes / 1000**3:.0f} GB", 0, note)
