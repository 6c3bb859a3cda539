"""Layers shared by the model files: RMSNorm, rotary position embedding, SwiGLU, and loading weights by name."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from deltaserve.kernels import decode_cpu, fused_cpu, int4_int8, int4_torch, linear_cpu, prefill_cpu
from deltaserve.kernels.int4 import Int4Codes, PackedInt4, PackedTable, int4_linear, pack
from deltaserve.kernels.int8 import Int8Rows

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 (Llama / Qwen3 convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_cpu.serves(x, self.weight):
            return fused_cpu.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op: a decode step has 61 of them
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def after_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and this norm, in one pass where fused."""
        return add_then_norm(self, x, residual, 0.0)


def add_then_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                  offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for an RMSNorm whose scale is offset + weight."""
    if x.dim() == 2 and fused_cpu.serves(x, residual, norm.weight):
        return fused_cpu.add_rms_norm(x, residual, norm.weight, norm.eps, offset)
    total = x + residual
    return norm(total), total


def rope_parameters(config: dict) -> dict:
    """The rotary settings of a config, old style (rope_theta + rope_scaling) or new (rope_parameters)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", None) or "default")
    if "partial_rotary_factor" in config and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    return params


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(params: dict, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] for the config's rope type."""
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = params["rope_type"]
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    else:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return inv_freq.float()


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotary embedding of the first `rotary_dim` channels of each head (rotate-half layout)."""

    def __init__(self, params: dict, head_dim: int):
        super().__init__()
        self.rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        self.register_buffer("inv_freq", rope_inv_freq(params, self.rotary_dim), persistent=False)
        self.attention_factor = float(params.get("attention_factor", 1.0))
        # Multimodal rotary (Qwen3.5, interleaved): frequency j follows the row position where j % 3 == 1 and the
        # column where j % 3 == 2, within 3 x mrope_section[1 or 2] frequencies; time (the text position) elsewhere.
        section = params.get("mrope_section") or [len(self.inv_freq), 0, 0]
        axis = torch.zeros(len(self.inv_freq), dtype=torch.long)
        for dim in (1, 2):
            axis[dim: 3 * section[dim]: 3] = dim
        self.register_buffer("mrope_axis", axis, persistent=False)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # `table`'s rows, grown by doubling

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rd] (one row per token, broadcast over heads), computed once per forward.

        `positions` is [T], or [3, T] (time, row, column) for the multimodal rotary; equal rows give the same."""
        cos, sin = self.rows(positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin's values as two contiguous [T, rd] tensors, what the fused decode blocks take (no [T, 1, rd] view
        and copies of its rows)."""
        if positions.dim() == 2:
            freqs3 = positions.float().unsqueeze(2) * self.inv_freq  # [3, T, rd/2]
            index = self.mrope_axis.expand(1, positions.shape[1], -1)
            freqs = freqs3.gather(0, index).squeeze(0)
        else:
            freqs = positions.float().unsqueeze(1) * self.inv_freq  # [T, rd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # times 1.0 is the identity: skipped
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """rows() of every text position below `positions` ([P, rd] each, P >= positions), kept and grown by
        doubling: a decode step's cos / sin are then two row gathers of it, the same values bit for bit; None past
        ROTARY_TABLE_POSITIONS (then rows() computes them; the table stays within 2 x ROTARY_TABLE_POSITIONS x rd
        floats)."""
        if positions > ROTARY_TABLE_POSITIONS:
            return None
        if self._table is None or self._table[0].shape[0] < positions:
            size = min(ROTARY_TABLE_POSITIONS, max(256, 2 * positions))
            self._table = self.rows(torch.arange(size, device=self.inv_freq.device))
        return self._table

    def decode_rows(self, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows(positions) for text positions [T] all below `top`: gathered from `table` where it reaches."""
        table = self.table(top) if positions.dim() == 1 else None
        if table is None:
            return self.rows(positions)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)


ROTARY_TABLE_POSITIONS = 4096  # Rotary.table's reach: 2 MB at most for a rotary width of 64


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, rd] with rd <= D; channels past rd pass through."""
    fused = fused_cpu.rope(x, cos, sin)  # one native pass where built (float32 on CPU)
    if fused is not None:
        return fused
    rd = cos.shape[-1]
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = x[..., :rd] if rd < x.shape[-1] else x
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = torch.addcmul(rot * cos, rotated, sin)
    return torch.cat([out, x[..., rd:]], dim=-1) if rd < x.shape[-1] else out


class Linear(nn.Linear):
    """nn.Linear whose few-row products (a decode step's) take kernels/linear_cpu.py where it serves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_cpu.linear(x, self.weight, self.bias)


def linear(dim_in: int, dim_out: int, bias: bool = False) -> Linear:
    """A frozen linear layer whose weights come from a checkpoint (allocated empty, filled by load_weights)."""
    layer = Linear(dim_in, dim_out, bias=bias, device="meta")
    layer.requires_grad_(False)
    return layer


def embedding(num: int, dim: int) -> nn.Embedding:
    """A frozen embedding table whose weights come from a checkpoint (on the meta device until load_weights).

    Handed its meta weight, nn.Embedding skips its normal_ init: on a meta tensor that runs through torch's reference
    ops, whose first call imports torch._dynamo (paid at every start, for numbers nobody reads)."""
    table = nn.Embedding(num, dim, _weight=torch.empty(num, dim, device="meta"))
    table.requires_grad_(False)
    return table


class Int4Linear(nn.Module):
    """A linear layer whose weight stays 4-bit (kernels/int4.py's packed layout): what a checkpoint's 4-bit matrix
    becomes unless --dequantize-weights. Its result equals the dequantized float32 weight's to float32 rounding."""

    def __init__(self, codes: Int4Codes | PackedInt4, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = codes.group_size
        w = codes if isinstance(codes, PackedInt4) else pack(codes)
        self.register_buffer("packed", w.packed)
        self.register_buffer("scales", w.scales)
        self.register_buffer("offsets", w.offsets)
        self.register_buffer("lut", w.lut)
        self.register_buffer("perm", w.perm, persistent=False)  # an index into the input, not weight bytes
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.prefill_bf16 = False  # --prefill-dtype bfloat16 (set by the engine): GEMM rows in bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = PackedInt4(self.packed, self.scales, self.offsets, self.group_size, self.lut, self.perm)
        return int4_linear(x, w, self.bias, bf16_gemm=self.prefill_bf16)


class TorchInt4Linear(nn.Module):
    """A 4-bit linear layer on CUDA in a bfloat16 model: the packed weight converted once, at load, into torch's int4
    layout and multiplied by torch's int4 kernel (kernels/int4_torch.py: bfloat16 inputs, scales and zeros, float32
    sums)."""

    def __init__(self, w: int4_torch.TorchInt4, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group_size = w.group_size
        self.register_buffer("weight_int4pack", w.weight)
        self.register_buffer("scales_and_zeros", w.scales_and_zeros)
        self.register_buffer("perm", w.perm, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = int4_torch.TorchInt4(self.weight_int4pack, self.scales_and_zeros, self.group_size,
                                 (self.out_features, self.in_features), self.perm)
        return int4_torch.int4_linear(x, w, self.bias)


class Int8DotLinear(nn.Module):
    """A 4-bit (affine or IQ4's levels) or 8-bit linear in the int8 dot-product kernel's panel layout
    (--activation-dtype int8, swapped in by models/int8_activations.py): its result is the dequantized weight times
    the input rounded to int8 per block of 32 (within sum |w| d / 2 of the float32 path, d the block's quantum)."""

    def __init__(self, w: int4_int8.PanelWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group_size, self.bits = w.group_size, w.bits
        self.register_buffer("codes", w.codes)
        self.register_buffer("scales", w.scales)
        self.register_buffer("offsets", w.offsets)
        self.register_buffer("levels", w.levels)  # IQ4's level table (level + 128), or None
        self.register_buffer("perm", w.perm, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = int4_int8.PanelWeight(self.codes, self.scales, self.offsets, self.group_size, self.perm, self.bits,
                                  self.levels)
        return int4_int8.linear(x, w, self.bias)


def refusal(kernels, entry: str, reason: str | None) -> str | None:
    """A native kernel's answer for a layer's shapes (`reason`, from its *_declines function) as a load-time log line
    naming the kernel and what serves instead, its layers left as {layers}; None where the kernel serves them."""
    if reason is None:
        return None
    module = kernels.name.removeprefix("deltaserve_")
    return f"{entry} (kernels/{module}): {reason}: {kernels.fallback} serves {{layers}}"


def attention_refusals(hidden: int, attn: nn.Module) -> list[str]:
    """The native attention kernels' refusals of an attention layer's shapes (refusal's lines)."""
    lines = [refusal(decode_cpu.KERNELS, "attention_block", attention_block_declines(hidden, attn)),
             refusal(prefill_cpu.KERNELS, "prefill_attention",
                     prefill_cpu.declines(attn.num_heads, attn.num_kv_heads, attn.head_dim))]
    return [line for line in lines if line]


def attention_block_declines(hidden: int, attn: nn.Module) -> str | None:
    """decode_cpu.attention_block's answer for this attention layer (its rotary width: the cos / sin it is given)."""
    return decode_cpu.attention_block_declines(hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                               2 * attn.rotary.inv_freq.numel())


def gdn_block_declines(hidden: int, gdn: nn.Module) -> str | None:
    """decode_cpu.gdn_block's answer for this Gated DeltaNet mixer's shapes (float32 projections), asked at load."""
    return decode_cpu.gdn_block_declines(hidden, gdn.num_k_heads, gdn.num_v_heads, gdn.head_v_dim, gdn.conv_width)


def gdn_block_refusal(reason: str | None) -> str | None:
    """gdn_block's refusal line for a reason gdn_block_declines gave (refusal's line), or None."""
    return refusal(decode_cpu.KERNELS, "gdn_block", reason)


def mlp_refusals(hidden: int, intermediate: int) -> list[str]:
    """The fused MLP block's refusal of a SwiGLU MLP's widths (refusal's lines)."""
    line = refusal(decode_cpu.KERNELS, "mlp_block", decode_cpu.mlp_block_declines(hidden, intermediate))
    return [line] if line else []


def announce_refusals(refusals: list[list[str]]) -> None:
    """Log once, when a model is built, each native kernel's refusal of its shapes (refusals[i]: layer i's lines),
    with the layers it holds for: those layers take the portable path from the first step on."""
    layers_of: dict[str, list[int]] = {}
    for i, lines in enumerate(refusals):
        for line in lines:
            layers_of.setdefault(line, []).append(i)
    for line, layers in layers_of.items():
        log.info(line.format(layers=("layer " if len(layers) == 1 else "layers ") + ", ".join(map(str, layers))))


def projection_parts(layer: nn.Module) -> tuple[list[torch.Tensor], int] | None:
    """A projection as kernels/decode_cpu.py's blocks take it: [weight or packed codes, scales, offsets, level
    table, bias] (EMPTY where absent) and its group size (0: a float32 weight; negative: an Int8DotLinear's panel
    codes, on int8 activations); None where they do not take it."""
    EMPTY, projection_declines = decode_cpu.EMPTY, decode_cpu.projection_declines

    bias = EMPTY if layer.bias is None else layer.bias
    if bias.dtype != torch.float32:
        return None
    if type(layer) is Int8DotLinear:
        if layer.perm is not None or projection_declines(layer.in_features, -layer.group_size,
                                                         layer.out_features, layer.bits) is not None:
            return None
        offsets = EMPTY if layer.offsets is None else layer.offsets
        levels = EMPTY if layer.levels is None else layer.levels
        return [layer.codes, layer.scales, offsets, levels, bias], -layer.group_size
    if type(layer) is Int4Linear:
        if layer.perm is not None or projection_declines(layer.in_features, layer.group_size) is not None:
            return None
        offsets = EMPTY if layer.offsets is None else layer.offsets
        return [layer.packed, layer.scales, offsets, EMPTY if layer.lut is None else layer.lut, bias], \
            layer.group_size
    if type(layer) is Linear and layer.weight.dtype == torch.float32 and layer.weight.is_contiguous() \
            and projection_declines(layer.in_features) is None:
        return [layer.weight, EMPTY, EMPTY, EMPTY, bias], 0
    return None


def attention_parts(norm: nn.Module, attn: nn.Module, gated: bool) -> tuple[list, list[int]] | None:
    """The fused attention block's tensors and sizes for a layer (input norm, q/k norms where the model has them,
    q/k/v/o projections), or None where it declines the layer's shapes or a projection is not in a form it takes."""
    if attention_block_declines(norm.weight.numel(), attn) is not None:
        return None
    EMPTY = decode_cpu.EMPTY
    projections = [projection_parts(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
    if any(p is None for p in projections):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    tensors = [norm.weight, EMPTY if q_norm is None else q_norm.weight, EMPTY if k_norm is None else k_norm.weight]
    for parts, _ in projections:
        tensors += parts
    meta = [attn.num_heads, attn.num_kv_heads, attn.head_dim, int(gated)] + [group for _, group in projections]
    return tensors, meta


def mlp_parts(norm: nn.Module, mlp: nn.Module) -> tuple[list, list[int]] | None:
    """The fused MLP block's tensors and group sizes for a SwiGLU MLP after `norm`, or None where it declines the
    MLP's widths or a projection's form."""
    if decode_cpu.mlp_block_declines(norm.weight.numel(), mlp.gate_proj.out_features) is not None:
        return None
    projections = [projection_parts(p) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    if any(p is None for p in projections):
        return None
    tensors = [norm.weight]
    for parts, _ in projections:
        tensors += parts
    return tensors, [group for _, group in projections]


class FusedHead:
    """A causal LM's final norm and LM head as the last entry of its decode_stack call (decode_cpu.head_args), built
    once per loaded weights: rebuilt when the norm's weight or the head module is no longer the one it was built
    from; None where the head is not a projection the blocks take (then the step returns to Python for it)."""

    def __init__(self, offset: float):
        self.offset = offset  # the norm's scale offset: 1 for a zero-centred norm
        self.key: tuple | None = None
        self.args = None

    def get(self, norm: nn.Module, head: nn.Module):
        weight = norm._parameters["weight"]
        if self.key is None or self.key[0] is not weight or self.key[1] is not head:
            parts = projection_parts(head) if weight.dtype == torch.float32 else None
            self.args = (None if parts is None
                         else decode_cpu.head_args(weight, parts, norm.eps, self.offset, head.out_features))
            self.key = (weight, head)
        return self.args

    def forget(self) -> None:
        """Drop the arguments (and the tensors they hold): rebuilt at the next get."""
        self.key = self.args = None


class FusedParts:
    """What a layer hands the fused decode blocks, built once per loaded weights: rebuilt only when the layer's
    input norm weight is no longer the one it was built from (load_weights replaced the parameters)."""

    def __init__(self, build):
        self.build = build
        self.key = None
        self.parts = None

    def get(self, key: torch.Tensor):
        if self.key is not key:
            self.parts, self.key = self.build(), key
        return self.parts

    def forget(self) -> None:
        """Drop the parts (and the tensors they hold): rebuilt at the next get."""
        self.key = self.parts = None


def current_parts(layers: nn.ModuleList) -> list:
    """Every decoder layer's FusedParts for its input norm weight as it is now (a decode step's check that the parts
    were built from the loaded weights), read through the module dictionaries, not nn.Module's slower attribute
    fallback (a decode step asks it every step)."""
    return [layer.fused.get(layer._modules["input_layernorm"]._parameters["weight"])
            for layer in layers._modules.values()]


MLP_ROW_BLOCK = 2048  # rows per MLP pass: the [rows, intermediate] temporaries of a long prompt stay in cache


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), in place on the fresh projections (no extra temporaries)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return by_row_blocks(self._rows, x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_cpu.silu_mul(self.gate_proj(x), self.up_proj(x)))


def by_row_blocks(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn, computed MLP_ROW_BLOCK rows at a time: the same result, and on a 16K-token
    prompt the elementwise work between the matmuls reads cache instead of memory."""
    if x.shape[0] <= MLP_ROW_BLOCK:
        return fn(x)
    return torch.cat([fn(part) for part in x.split(MLP_ROW_BLOCK)])


def load_weights(module: nn.Module, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device | str, tied: dict[str, str] | None = None, name: str = "model") -> None:
    """Fill every parameter and buffer of `module` from `tensors` by its own name, exactly once.

    `tied` maps a parameter to the checkpoint tensor it shares (e.g. lm_head.weight -> model.embed_tokens.weight).
    Missing or surplus tensors are an error that names them: a silently random weight is the worst bug.
    """
    tied = tied or {}
    params = dict(module.named_parameters())
    missing = [n for n in params if n not in tensors and n not in tied]
    unused = [n for n in tensors if n not in params]
    if missing:
        raise ValueError(f"{name}: checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}")
    if unused:
        raise ValueError(f"{name}: checkpoint has {len(unused)} unknown tensors, e.g. {', '.join(unused[:4])}")
    shared: dict[str, nn.Parameter] = {}
    for pname, param in params.items():
        source = tied.get(pname, pname) if pname not in tensors else pname
        tensor = tensors[source]
        if isinstance(tensor, (Int4Codes, PackedInt4)):
            if _held_int4(module, pname, tensor, tensors, device, dtype):
                continue
            tensor = tensor.dequantize()
        if isinstance(tensor, Int8Rows):
            if pname not in tied and _held_int8(module, pname, tensor, tensors, device, dtype):
                continue
            if pname in tied and _tied_int8_head(module, pname, tied[pname]):
                continue
            tensor = tensor.dequantize()
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: tensor {source} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        if source in shared:
            new = shared[source]
        else:
            new = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
            shared[source] = new
        owner, _, leaf = pname.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, new)
    module.to(device)


def _held_int4(module: nn.Module, pname: str, codes: Int4Codes | PackedInt4, tensors: dict, device,
               dtype: torch.dtype) -> bool:
    """Swap the Linear owning `pname` for an Int4Linear when the weight is its own; False to dequantize.

    On every device: the C++ kernel serves the CPU; on CUDA a bfloat16 model's affine weights take torch's int4
    kernel (TorchInt4Linear, kernels/int4_torch.py), and the rest (level tables, float32 models) kernels/int4.py's
    path, which widens the packed weight a tile at a time with torch ops; so a 4-bit checkpoint takes on the GPU the
    bytes the ledger prices, not its dequantized size. A tied lm_head (the same tensor as the embedding) is packed
    too: the embedding is then dequantized for its row lookups, the head multiplies the packed codes. An embedding
    the loader marks a PackedTable (an untied GGUF token_embd) becomes an Int4Embedding."""
    owner_name, _, leaf = pname.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf == "weight" and type(owner) is nn.Embedding and isinstance(codes, PackedTable):
        if tuple(owner.weight.shape) != codes.shape:
            raise ValueError(f"tensor {pname} has shape {codes.shape}, expected {tuple(owner.weight.shape)}")
        parent_name, _, child = owner_name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, child, Int4Embedding(codes, dtype))
        return True
    if leaf != "weight" or type(owner) is not Linear:
        return False
    if tuple(owner.weight.shape) != codes.shape:
        raise ValueError(f"tensor {pname} has shape {codes.shape}, expected {tuple(owner.weight.shape)}")
    bias = tensors.get(owner_name + ".bias") if owner.bias is not None else None
    parent_name, _, child = owner_name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
    packed = codes if isinstance(codes, PackedInt4) else pack(codes)
    if int4_torch.serves(device, dtype) and int4_torch.takes(packed.shape, packed.group_size, packed.lut is not None):
        setattr(parent, child, TorchInt4Linear(int4_torch.convert(packed, device), bias))
    else:
        setattr(parent, child, Int4Linear(packed, bias))
    return True


NATIVE_GATHER_ROWS = 64  # ids an int8 embedding widens in fused_cpu's one-thread loop (a decode step's); more: torch


def held_int8_rows(module: nn.Module) -> Int8Rows:
    """An Int8Embedding's or Int8Linear's codes as an Int8Rows; a symmetric one holds no offsets, so its zeros are one
    value expanded (no table-sized tensor made on a lookup or a product)."""
    offsets = module.offsets if module.offsets is not None else module.scales.new_zeros(()).expand_as(module.scales)
    return Int8Rows(module.codes, module.scales, offsets, module.group_size)


class Int4Embedding(nn.Module):
    """An embedding whose table stays packed 4-bit (kernels/int4.PackedTable: an untied GGUF token_embd in Q4_K or
    IQ4_XS, 5,120 x 248,320 weights on the field's 27B, ~5 GB as floats): a lookup widens only the rows it reads."""

    def __init__(self, table: PackedInt4, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype  # of the rows it returns: the compute dtype
        self.num_embeddings, self.embedding_dim = table.shape
        self.group_size = table.group_size
        self.register_buffer("packed", table.packed)
        self.register_buffer("scales", table.scales)
        self.register_buffer("offsets", table.offsets)
        self.register_buffer("lut", table.lut)
        self.register_buffer("perm", table.perm, persistent=False)  # an index into the columns, not weight bytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = PackedInt4(self.packed, self.scales, self.offsets, self.group_size, self.lut, self.perm)
        return table.gather(ids, self.dtype).view(*ids.shape, self.embedding_dim)


class Int8Embedding(nn.Module):
    """An embedding whose table stays int8 (kernels/int8.py): a lookup widens only the rows it reads."""

    def __init__(self, rows: Int8Rows, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype  # of the rows it returns: the compute dtype
        self.num_embeddings, self.embedding_dim = rows.shape
        self.group_size = rows.group_size
        self.register_buffer("codes", rows.codes)
        self.register_buffer("scales", rows.scales.float())
        self.symmetric = not bool(rows.offsets.any())  # w = scale * q: no offsets held; a few ids: fused_cpu's gather
        self.register_buffer("offsets", None if self.symmetric else rows.offsets.float())

    def rows(self) -> Int8Rows:
        """The table as an Int8Rows (zero offsets where symmetric)."""
        return held_int8_rows(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.symmetric and ids.numel() <= NATIVE_GATHER_ROWS:
            rows = fused_cpu.int8_rows(self.codes, self.scales, ids)
            if rows is not None:
                return rows.to(self.dtype)
        return self.rows().gather(ids, self.dtype)


class PanelEmbedding(nn.Module):
    """An 8-bit embedding whose codes are held once, in the (8- or 6-bit) panels of its tied vocabulary projection (an
    Int8DotLinear under --activation-dtype int8, models/int8_activations.py): a lookup widens only the rows it reads,
    from there."""

    def __init__(self, head: "Int8DotLinear", dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.group_size, self.bits = head.group_size, head.bits
        self.register_buffer("codes", head.codes)  # the head's own tensors: the ledger counts them once
        self.register_buffer("scales", head.scales)  # symmetric: no offsets (models/int8_activations.py)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = int4_int8.PanelWeight(self.codes, self.scales, None, self.group_size, bits=self.bits)
        return int4_int8.gather_rows(w, ids, self.dtype)


class Int8Linear(nn.Module):
    """A linear layer whose weight stays int8 (kernels/int8.py: Q8_0, compressed-tensors INT8), or a vocabulary
    projection tied to an Int8Embedding, multiplying the embedding's own codes (no second copy: `tied`). Its result
    equals the dequantized float32 weight's to float32 rounding: decode rows (kernels/decode_cpu.py) widen each code
    in registers; more rows widen a tile at a time for linear_cpu.gemm. Under --activation-dtype int8 an untied one
    becomes an Int8DotLinear (models/int8_activations.py)."""

    def __init__(self, rows: Int8Rows, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                 tied: bool = False):
        super().__init__()
        self.out_features, self.in_features = rows.shape
        self.group_size = rows.group_size
        # tied: the embedding's tensors (already contiguous float32: the same storage), counted once by the ledger
        self.register_buffer("codes", rows.codes.contiguous())
        self.register_buffer("scales", rows.scales.to(torch.float32).contiguous())
        self.symmetric = not bool(rows.offsets.any())  # w = scale * q: no offsets read nor held
        self.register_buffer("offsets", None if self.symmetric else rows.offsets.to(torch.float32).contiguous())
        self.register_buffer("perm", perm, persistent=False)  # an index into the input, not weight bytes
        self.tied = tied
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of_embedding(cls, embedding: "Int8Embedding") -> "Int8Linear":
        return cls(embedding.rows(), tied=True)

    def rows(self) -> Int8Rows:
        """The weight as an Int8Rows (zero offsets where symmetric)."""
        return held_int8_rows(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deltaserve.kernels import decode_cpu
        from deltaserve.kernels.int4 import input_rows

        rows = input_rows(x, self.in_features, self.perm, torch.float32)
        if rows.shape[0] == 0:  # the head of a prefill chunk that ends no prompt: widening the table took ~0.45 s
            y = rows.new_empty((0, self.out_features))
        elif decode_cpu.serves_int8(rows, self.group_size):
            offsets = decode_cpu.EMPTY if self.symmetric else self.offsets
            y = decode_cpu.int8_linear(rows, self.codes, self.scales, offsets, self.group_size)
        else:
            w, step = self.rows(), max(16, (1 << 20) // self.in_features)  # ~4 MiB of widened rows at a time
            y = torch.cat([linear_cpu.gemm(rows, Int8Rows(w.codes[a:a + step], w.scales[a:a + step],
                                                          w.offsets[a:a + step], self.group_size).dequantize())
                           for a in range(0, self.out_features, step)], dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _tied_int8_head(module: nn.Module, pname: str, source: str) -> bool:
    """A tied lm_head whose embedding is held int8 becomes an Int8Linear over the same codes (on every device, so the
    ledger prices it once: weights/held.py); False to dequantize it."""
    owner_name, _, leaf = pname.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    embedding_name = source.rpartition(".")[0]
    embedding = module.get_submodule(embedding_name) if embedding_name else None
    if (leaf != "weight" or type(owner) is not Linear or not isinstance(embedding, Int8Embedding)
            or tuple(owner.weight.shape) != (embedding.num_embeddings, embedding.embedding_dim)):
        return False
    parent_name, _, child = owner_name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, child, Int8Linear.of_embedding(embedding))
    return True


def _held_int8(module: nn.Module, pname: str, rows: Int8Rows, tensors: dict, device, dtype: torch.dtype) -> bool:
    """Swap the nn.Embedding owning `pname` for an Int8Embedding, or the Linear for an Int8Linear (but where torch's
    int4 kernel serves the 4-bit ones, CUDA in bfloat16, an 8-bit linear is dequantized: weights/held.py and the
    ledger price both so); False (dequantize) for anything else."""
    owner_name, _, leaf = pname.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf != "weight" or type(owner) not in (nn.Embedding, Linear):
        return False
    if type(owner) is Linear and int4_torch.serves(device, dtype):
        return False
    if tuple(owner.weight.shape) != rows.shape:
        raise ValueError(f"tensor {pname} has shape {rows.shape}, expected {tuple(owner.weight.shape)}")
    parent_name, _, child = owner_name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    if type(owner) is nn.Embedding:
        setattr(parent, child, Int8Embedding(rows, dtype).to(device))
        return True
    bias = tensors.get(owner_name + ".bias") if owner.bias is not None else None
    bias = None if bias is None else bias.to(torch.float32)
    setattr(parent, child, Int8Linear(rows, bias, rows.perm))
    return True
