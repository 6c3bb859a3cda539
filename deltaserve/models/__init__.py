"""Model architectures by Hugging Face `model_type`, and building one from a loaded checkpoint."""

from __future__ import annotations

import importlib

import torch

from deltaserve.models.hybrid import MTP_PREFIXES, VISION_PREFIXES
from deltaserve.models.layers import load_weights

# model_type -> (module, class); each module is one architecture family, top to bottom.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("deltaserve.models.llama", "LlamaForCausalLM"),
    "qwen3": ("deltaserve.models.llama", "LlamaForCausalLM"),
    "qwen3_next": ("deltaserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("deltaserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5": ("deltaserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("deltaserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("deltaserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one deltaserve implements."""


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def model_class(config: dict):
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    module, name = ARCHITECTURES[model_type]
    return getattr(importlib.import_module(module), name)


def supports_images(config: dict) -> bool:
    """The checkpoint carries a vision tower that deltaserve can build (Qwen3.5 family)."""
    return "vision_config" in config and getattr(model_class(config), "vision_capable", False)


def skip_prefixes(config: dict, vision: bool = False, mtp: bool = False) -> tuple[str, ...]:
    """Checkpoint name prefixes the architecture never loads (the MTP head unless `mtp`; the vision tower unless
    `vision`): pass them to the checkpoint reader so those tensors are not even read."""
    prefixes = tuple(getattr(model_class(config), "skip_prefixes", ()))
    if vision and supports_images(config):
        prefixes = tuple(p for p in prefixes if p not in VISION_PREFIXES)
    if mtp and supports_mtp(config):
        prefixes = tuple(p for p in prefixes if p not in MTP_PREFIXES)
    return prefixes


def supports_mtp(config: dict) -> bool:
    """The checkpoint carries a multi-token-prediction head deltaserve can build (models/mtp.py)."""
    from deltaserve.models.mtp import mtp_layers

    return getattr(model_class(config), "mtp_capable", False) and mtp_layers(config) > 0


def build_model(config: dict, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", vision: bool = False, mtp: bool = False):
    """Instantiate the architecture named by config['model_type'] and fill it from `tensors` (HF names).

    A model with a `checkpoint_tensors(tensors)` method first maps the checkpoint's names onto its own (and skips
    what it does not load, e.g. a vision tower); `tensors` may be a lazy mapping, read only for what is kept.
    `vision` builds and loads the checkpoint's vision tower too, where it has one (supports_images); `mtp` its
    multi-token-prediction head (supports_mtp).
    """
    cls = model_class(config)
    kwargs = {"vision": True} if vision and supports_images(config) else {}
    if mtp and supports_mtp(config):
        kwargs["mtp"] = True
    model = cls(config, **kwargs)
    if hasattr(model, "checkpoint_tensors"):
        tensors = model.checkpoint_tensors(tensors)
    load_weights(model, tensors, dtype=dtype, device=device, tied=model.tied_weights, name=config["model_type"])
    return model.eval()
