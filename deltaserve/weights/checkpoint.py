"""One entry point for every checkpoint: an HF model folder or a .gguf file."""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve.text.tokenizer import Tokenizer
from deltaserve.weights import gguf, hf
from deltaserve.weights.errors import CheckpointError


@dataclass
class TensorInfo:
    """One tensor as stored: dtype name ("BF16", "Q4_K", ...), shape in HF order, bytes on disk."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Checkpoint:
    """A loaded checkpoint: HF-style config, HF-named tensors, tokenizer."""

    path: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    generation_config: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # "prefix* (N tensors)" groups not loaded


def checkpoint_kind(path: str | Path) -> tuple[str, Path]:
    """("gguf" | "hf", path), or a CheckpointError saying why `path` is neither."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, "no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (to load a GGUF, pass the file itself: {ggufs[0]})" if ggufs else ""
            raise CheckpointError(path, f"folder has no config.json, so it is not an HF model folder{hint}")
        return "hf", path
    if path.suffix.lower() == ".gguf":
        return "gguf", path
    raise CheckpointError(path, "not a checkpoint: expected an HF model folder or a .gguf file")


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32,
                    skip_prefixes: tuple[str, ...] = (), keep_int4: bool = False) -> Checkpoint:
    """Load config, tensors (converted / dequantized to `dtype`) and tokenizer.

    Tensors whose HF name starts with one of `skip_prefixes` are not read; they are counted in
    `Checkpoint.skipped`. With `keep_int4`, the 4-bit matrices the CPU kernel takes (GGUF, compressed-tensors, GPTQ,
    AWQ) come packed, as kernels.int4.PackedInt4.
    """
    kind, path = checkpoint_kind(path)
    if kind == "gguf":
        loaded = gguf.load_gguf(path, dtype, tuple(skip_prefixes), keep_int4=keep_int4)
    else:
        loaded = hf.load_hf(path, dtype, tuple(skip_prefixes), keep_int4=keep_int4)
    config, tensors, tokenizer, generation_config, skipped = loaded
    return Checkpoint(path=path, config=config, tensors=tensors, tokenizer=tokenizer,
                      generation_config=generation_config, skipped=skipped)


def read_tensor_index(path: str | Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo from headers alone (no tensor data read), quantized blocks at packed size."""
    kind, path = checkpoint_kind(path)
    index = gguf.read_gguf_index(path) if kind == "gguf" else hf.read_hf_index(path)
    return {name: TensorInfo(dtype, shape, nbytes) for name, (dtype, shape, nbytes) in index.items()}


def read_config(path: str | Path) -> dict:
    """The HF-style config (config.json, or synthesized from GGUF metadata) without loading tensors."""
    kind, path = checkpoint_kind(path)
    return gguf.read_gguf_config(path) if kind == "gguf" else hf.read_hf_config(path)


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint without loading tensors."""
    kind, path = checkpoint_kind(path)
    return gguf.read_gguf_tokenizer(path) if kind == "gguf" else hf.read_hf_tokenizer(path)
