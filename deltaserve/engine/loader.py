"""From a checkpoint path to a ready model and tokenizer (None: the built-in default, budget.default_model_path)."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve.budget import default_model_path
from deltaserve.text.tokenizer import Tokenizer
from deltaserve.models import build_model, skip_prefixes
from deltaserve.weights import CheckpointError, load_checkpoint, read_config
from deltaserve.weights.gguf import forget_parsed

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    """A model on its device, its tokenizer, and what the checkpoint says about generation."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    config: dict
    path: Path
    name: str
    eos_token_ids: frozenset[int]
    generation_config: dict = field(default_factory=dict)


def model_name(path: Path, default: bool) -> str:
    """What the API calls the model: the folder or file name without extension."""
    if default:
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def load_model(model: str | Path | None, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", dequantize: bool = True, vision: bool = False,
               mtp: bool = False) -> LoadedModel:
    """Read the checkpoint (None: the default model) and build its architecture on `device`.

    `dequantize=False` keeps 4-bit matrices packed (kernels/int4.py) on every device.
    `vision` loads a multimodal checkpoint's vision tower too (else it is not even read); `mtp` its
    multi-token-prediction head (--speculative mtp)."""
    path = Path(model) if model else default_model_path()
    prefixes = skip_prefixes(read_config(path), vision=vision, mtp=mtp)
    checkpoint = load_checkpoint(path, dtype=dtype, skip_prefixes=prefixes, keep_int4=not dequantize)
    try:
        net = build_model(checkpoint.config, checkpoint.tensors, dtype=dtype, device=device, vision=vision, mtp=mtp)
    except ValueError as e:  # a tensor missing, unknown or of the wrong shape: the checkpoint's fault, one line
        raise CheckpointError(checkpoint.path, str(e)) from e
    checkpoint.tensors = {}  # the model holds what it keeps; the rest (raw parts, temporaries) is garbage now
    forget_parsed()  # a GGUF's parsed headers, kept while the spec, the config and the weights read them
    return_freed_memory()
    eos = set(checkpoint.tokenizer.eos_token_ids)
    eos |= set(_ids(checkpoint.generation_config.get("eos_token_id")))
    return LoadedModel(net, checkpoint.tokenizer, checkpoint.config, checkpoint.path,
                       model_name(checkpoint.path, model is None), frozenset(eos), checkpoint.generation_config)


def return_freed_memory() -> None:
    """Give the heap pages the load freed back to the OS: glibc keeps them otherwise, and the process would stay
    resident at up to twice the weights' bytes after loading a quantized checkpoint (no effect elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
