"""Layers shared by the model files: RMSNorm, rotary position embedding, SwiGLU, and loading weights by name."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 (Llama / Qwen3 convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


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

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, rd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, rd] with rd <= D; channels past rd pass through."""
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def linear(dim_in: int, dim_out: int, bias: bool = False) -> nn.Linear:
    """A frozen linear layer whose weights come from a checkpoint (allocated empty, filled by load_weights)."""
    layer = nn.Linear(dim_in, dim_out, bias=bias, device="meta")
    layer.requires_grad_(False)
    return layer


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


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
