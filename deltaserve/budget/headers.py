"""A model's memory spec from its checkpoint's headers: exact bytes from safetensors headers or GGUF tensor infos,
without touching tensor data; each tensor priced as the loader holds it (weights/held.py, weights/gguf.py).

The headers are read by weights/' own readers (a GGUF is parsed once for the spec and the load); this module
imports them inside its functions, so importing budget/ costs no torch.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

from deltaserve.budget.errors import SpecError
from deltaserve.budget.quant import config_bits, describe_config_quant
from deltaserve.budget.spec import ModelMemorySpec, WeightGroup, spec_from_config, spec_shape

FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
VISION_RE = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")
MTP_RE = re.compile(r"^(model\.)?mtp\.")


def spec_from_checkpoint(path: str | Path, *, tied_heads: bool | None = None) -> ModelMemorySpec:
    """Exact weight bytes from a checkpoint folder (safetensors), a .gguf file, or an estimate from a config.json.
    `tied_heads`: whether the int8-activation swap takes a vocabulary projection tied to an 8-bit GGUF embedding
    (None: this CPU's answer, kernels/int4_int8.swaps_tied_heads; a test names both)."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: no such file or folder")
    if path.is_file() and path.suffix == ".gguf":
        return _spec_from_gguf(path, tied_heads)
    if path.is_file():
        return spec_from_config(_read_json(path))
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists() and len(ggufs) == 1:
        return _spec_from_gguf(ggufs[0], tied_heads)
    config = _read_json(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return spec_from_config(config)
    spec, _ = spec_shape(config)
    bits = config_bits(config)
    spec.weight_groups = _groups_from_tensors(_held_safetensors(config, files, bits, spec.tie_word_embeddings))
    _int8_embedding_held(spec, files)
    spec.weight_source = "checkpoint headers"
    spec.quantization = describe_config_quant(config)
    return spec


def _held_safetensors(config: dict, files: list[Path], bits: int, tied: bool) -> list[tuple]:
    """Rows of `_safetensors_tensors` over all files, each quantized module priced as the loader holds it."""
    from deltaserve.weights.held import held_rows
    from deltaserve.weights.hf import read_safetensors_header

    rows = [t for f in files for t in _safetensors_tensors(f, bits)]
    shapes = {name: entry[1] for f in files for name, entry in read_safetensors_header(f).items()}
    return held_rows(config, rows, shapes, tied)


def _int8_embedding_held(spec: ModelMemorySpec, files: list[Path]) -> None:
    """With dequantize_weights, an 8-bit compressed-tensors embedding stays int8 (models/layers.Int8Embedding): one
    byte a weight plus a float32 scale per group (and an offset, asymmetric), not params x dtype; a tied lm_head over a
    4-bit embedding shares its dequantized table, and one over an int8-held embedding multiplies its codes
    (weights/held.py: 0 bytes)."""
    from deltaserve.weights.hf import read_safetensors_header

    head = next((g for g in spec.weight_groups if g.name == "lm_head"), None)
    if head is not None and head.stored_bytes == 0 and not head.float_params:
        head.held_dequantized_bytes = 0  # tied: it shares the embedding's dequantized table or its int8 codes
    index = {name: entry for f in files for name, entry in read_safetensors_header(f).items()}
    embedding = next((g for g in spec.weight_groups if g.name == "embedding"), None)
    scale = next((n for n in index if n.endswith("embed_tokens.weight_scale")), None)
    if embedding is None or scale is None:
        return
    stem = scale[: -len("weight_scale")]
    packed, plain = index.get(stem + "weight_packed"), index.get(stem + "weight")
    if packed is not None:
        eight_bit = packed[2] == embedding.params  # 8 bits a weight: as many bytes as weights
    else:
        eight_bit = plain is not None and plain[0] == "I8"
    if eight_bit:  # a float32 offset per group too where the scheme stores zero points (asymmetric)
        per_group = 8 if stem + "weight_zero_point" in index else 4
        embedding.held_dequantized_bytes = embedding.params + math.prod(index[scale][1]) * per_group


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: missing (a model folder needs a config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: not valid JSON ({e})") from None


def _safetensors_tensors(path: Path, bits: int):
    """(name, params, stored_bytes, is_float) per tensor from the header alone (8-byte length + JSON)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SpecError(f"{path}: truncated safetensors file (no header)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * 1024**2 or length > path.stat().st_size - 8:
            raise SpecError(f"{path}: corrupt safetensors header length {length}")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpecError(f"{path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        for name, info in header.items():
            start, end = info["data_offsets"]
            numel = math.prod(info["shape"])
            dtype = info["dtype"]
            if dtype in FLOAT_DTYPES and not _is_quant_part(name):
                yield name, numel, end - start, True
                continue
            if name.endswith(".weight_shape"):
                f.seek(8 + length + start)
                shape = struct.unpack(f"<{numel}q", f.read(end - start)) if dtype == "I64" else ()
                params = math.prod(shape) if shape else 0
            elif name.endswith(("weight_packed", "qweight")) and not _has_shape(header, name):
                params = numel * 32 // bits
            elif name.endswith(".weight") or dtype.startswith("F8"):
                params = numel
            else:
                params = 0  # scales, zero points, group indices: part of their weight
            yield name, params, end - start, False


def _is_quant_part(name: str) -> bool:
    return name.endswith(("weight_scale", "weight_zero_point", "weight_global_scale", "input_scale", ".scales",
                          ".qzeros", ".g_idx"))


def _has_shape(header: dict, name: str) -> bool:
    return name.endswith("weight_packed") and name[: -len("weight_packed")] + "weight_shape" in header


def _group_of(name: str) -> str:
    if VISION_RE.search(name) or name.startswith("v.") or name.startswith("mm."):
        return "vision"
    if MTP_RE.match(name) or ".nextn." in name:
        return "mtp"
    if "embed_tokens" in name or name.startswith("token_embd"):
        return "embedding"
    if name.startswith("lm_head") or name.startswith("output."):
        return "lm_head"
    return "layers"


def _groups_from_tensors(tensors) -> list[WeightGroup]:
    """Groups from (name, params, stored bytes, held as floats?[, bytes held packed[, the same on CUDA in bfloat16[,
    in the int8-activation panels]]]) per tensor (a variant not given: as packed)."""
    groups: dict[str, WeightGroup] = {}
    for name, params, nbytes, is_float, *held in tensors:
        key = _group_of(name)
        g = groups.setdefault(key, WeightGroup(key, 0, 0, 0, 0, excluded=key in ("vision", "mtp"), torch_int4_bytes=0,
                                               panel_bytes=0))
        g.params += params
        g.stored_bytes += nbytes
        if is_float:
            g.float_params += params
        else:
            packed = held[0] if held else nbytes
            g.quantized_bytes += packed
            g.torch_int4_bytes += held[1] if len(held) > 1 else packed
            g.panel_bytes += held[2] if len(held) > 2 else packed
    order = ("embedding", "lm_head", "layers", "vision", "mtp")
    return [groups[k] for k in order if k in groups]


def _spec_from_gguf(path: Path, tied_heads: bool | None = None) -> ModelMemorySpec:
    """The config the loader synthesizes from the GGUF metadata (weights/gguf.py gguf_config, one synthesis for
    both: the ledger prices the model the loader builds); weight bytes from the tensor infos. `tied_heads`: whether
    the int8-activation swap takes a vocabulary projection tied to an 8-bit embedding (None: this CPU's answer,
    kernels/int4_int8.swaps_tied_heads)."""
    from deltaserve.weights import CheckpointError
    from deltaserve.weights.gguf import gguf_config, mtp_from, open_gguf, tensor_name  # the loader's reader and names

    try:
        reader = open_gguf(path)
    except CheckpointError as e:
        raise SpecError(f"{path}: not a readable GGUF file ({e.problem})") from None
    try:
        config = gguf_config(reader, path)
    except CheckpointError as e:
        raise SpecError(f"{path}: {e.problem}") from None
    spec, _ = spec_shape(config)
    first_mtp = mtp_from(reader)  # blocks from there on are the MTP head's: its group, not the layers'
    tied = config["tie_word_embeddings"]
    spec.weight_groups = _groups_from_tensors((tensor_name(t.name, first_mtp), *_gguf_held(t, tied, tied_heads)[1:])
                                              for t in reader.tensors)
    spec.weight_source = "checkpoint headers"
    spec.quantization = "gguf " + ", ".join(sorted({t.tensor_type.name for t in reader.tensors}))
    return spec


def _gguf_held(t, tied: bool, tied_heads: bool | None) -> tuple:
    """(name, params, stored bytes, held as floats?, bytes held packed[, on CUDA in bfloat16, in the int8-activation
    panels]) of one GGUF tensor.

    What weights/gguf.py keeps packed (kernels/int4.py: half a byte per weight, per 32 the block's float16 scale (and
    Q4_1's float16 offset) or float32 products of two scales (Q4_K, IQ4_XS), the level table of IQ4_NL / IQ4_XS; a
    Q8_0 / Q6_K / Q5_K matrix a byte per weight plus a float32 scale per group (32; Q6_K 16) and Q5_K's float32
    offset per 32, an embedding's shared by a tied lm_head: weights/gguf_int8.held_bytes) is counted at that size;
    the rest in the compute dtype. On CUDA in bfloat16 the affine 4-bit matrices torch's int4 kernel takes are held
    in its layout (gguf.int4_torch_held_bytes), and the 8-bit linears, dequantized there, in bfloat16. On CPU with
    int8 activations the layers the swap takes hold its panels, K-quants as compact as the file
    (weights/gguf_panels.py; a tied head where `tied_heads`, None: this CPU's answer). An untied 4-bit embedding is
    held packed on every device (models/layers.Int4Embedding); a `tied` one as floats."""
    from deltaserve.weights.gguf import int4_held_bytes, int4_torch_held_bytes, int8_held_bytes, kept_int4, kept_int8
    from deltaserve.weights.gguf_panels import int4_panel_bytes, int8_panel_bytes

    params, shape, kind = int(t.n_elements), tuple(int(d) for d in reversed(t.shape)), t.tensor_type
    if kept_int4(kind, t.name, shape, tied):
        if t.name.startswith("token_embd"):
            held = int4_held_bytes(params, kind)
            return t.name, params, int(t.n_bytes), False, held, held, held
        matrices = shape[0] if len(shape) == 3 else 1  # stacked experts: one packed matrix each
        packed = int4_held_bytes(params, kind, matrices)
        return (t.name, params, int(t.n_bytes), False, packed, int4_torch_held_bytes(shape, kind),
                int4_panel_bytes(kind, t.name, shape, packed))
    if kept_int8(kind, t.name, shape):
        held = int8_held_bytes(params, kind)
        panels = int8_panel_bytes(kind, t.name, shape, held, tied, tied_heads)
        if t.name.startswith("token_embd"):
            return t.name, params, int(t.n_bytes), False, held, held, panels
        return t.name, params, int(t.n_bytes), False, held, 2 * params, panels
    return t.name, params, int(t.n_bytes), True
