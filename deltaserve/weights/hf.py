"""Hugging Face model folders: config.json, (sharded) safetensors, generation_config.json."""

import json
import struct
from pathlib import Path

import tokenizers
import torch
from safetensors import safe_open

from deltaserve.kernels.int4 import Int4Codes, pack, packable
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.text.tokenizer import Tokenizer
from deltaserve.weights import compressed_tensors, gptq
from deltaserve.weights.errors import CheckpointError
from deltaserve.weights.progress import LoadProgress

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEADER_LIMIT_BYTES = 100 * 1024 * 1024  # safetensors' own cap on the JSON header


def read_json(path: Path, *, required: bool) -> dict:
    """The JSON object in `path`; {} when absent and not required."""
    if not path.is_file():
        if required:
            raise CheckpointError(path.parent, f"no {path.name} in this folder (not an HF model folder?)")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(path, f"expected a JSON object, got {type(value).__name__}")
    return value


def read_hf_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of an HF folder: tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    chat_template.jinja, and the eos ids of generation_config.json and config.json."""
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(folder, "no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:
        raise CheckpointError(tokenizer_file, f"not a valid tokenizer.json: {e}") from e
    config = read_json(folder / "tokenizer_config.json", required=False)
    specials = read_json(folder / "special_tokens_map.json", required=False)
    jinja_file = folder / "chat_template.jinja"
    chat_template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
    model_configs = [read_json(folder / name, required=False) for name in ("generation_config.json", "config.json")]
    return Tokenizer.from_hf(backend, config, specials, chat_template, model_configs)


def read_hf_config(folder: Path) -> dict:
    """config.json of an HF model folder."""
    return read_json(folder / "config.json", required=True)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: the shards named by the index, or model.safetensors, or every *.safetensors."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index_path, "has no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(folder, f"no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)")
    for file in files:
        if not file.is_file():
            raise CheckpointError(file, f"missing shard (named in {INDEX_FILE})")
    return files


def read_safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, nbytes) from one file's header, checked against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(file, f"truncated safetensors file ({size} bytes, no header)")
        (header_bytes,) = struct.unpack("<Q", head)
        if header_bytes > min(HEADER_LIMIT_BYTES, size - 8):
            raise CheckpointError(file, f"not a safetensors file or truncated (header of {header_bytes} bytes "
                                        f"in a file of {size})")
        try:
            header = json.loads(f.read(header_bytes))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(file, f"corrupt safetensors header: {e}") from e
    index = {}
    data_bytes = size - 8 - header_bytes
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        if end > data_bytes:
            raise CheckpointError(file, f"truncated safetensors file: tensor {name} ends at data byte {end}, "
                                        f"the file holds {data_bytes}")
        index[name] = (entry["dtype"], tuple(entry["shape"]), end - start)
    return index


def read_hf_index(folder: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, nbytes) over all weight files, headers only."""
    index = {}
    for file in safetensors_files(folder):
        index.update(read_safetensors_header(file))
    return index


def load_hf(folder: Path, dtype: torch.dtype, skip_prefixes: tuple[str, ...], keep_int4: bool = False):
    """(config, tensors, tokenizer, generation_config, skipped) of an HF folder.

    Floating-point tensors are converted to `dtype` (not a quantized module's parts); a quantized checkpoint's modules
    (weights/compressed_tensors.py, weights/gptq.py) become one `<module>.weight` each, decoded (and packed, with
    `keep_int4`) as soon as a module's last part is read: its raw parts are then let go, so the loader never holds the
    checkpoint twice. Skipped groups are named with their bytes on disk.
    """
    config = read_hf_config(folder)
    check_quant_method(config, folder)
    generation_config = read_json(folder / "generation_config.json", required=False)
    files = safetensors_files(folder)
    tokenizer = read_hf_tokenizer(folder)
    headers = [read_safetensors_header(file) for file in files]  # a clear message for a truncated shard first
    decoder = _decoder(config, folder, dtype, keep_int4)
    kept = [name for header in headers for name in header if not _skipped(name, skip_prefixes)]
    modules = decoder[0](kept) if decoder else {}
    owner = {part: module for module, parts in modules.items() for part in parts}
    waiting = {module: set(parts) for module, parts in modules.items()}
    tensors, skipped, skipped_bytes = {}, {}, {}
    progress = LoadProgress(folder.name, sum(h[n][2] for h in headers for n in h), len(files))
    for number, (file, header) in enumerate(zip(files, headers), 1):
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():
                    prefix = _skipped(name, skip_prefixes)
                    if prefix is not None:
                        skipped[prefix] = skipped.get(prefix, 0) + 1
                        skipped_bytes[prefix] = skipped_bytes.get(prefix, 0) + header[name][2]
                        continue
                    tensor = shard.get_tensor(name)
                    progress.read(header[name][2])
                    module = owner.get(name)
                    # a quantized module's parts stay as stored: its decoder chooses (a symmetric 4-bit scale is
                    # held as the checkpoint stores it, the price weights/held.py gives it)
                    cast = tensor.is_floating_point() and module is None
                    tensors[name] = tensor.to(dtype) if cast else tensor
                    if module is not None:
                        waiting[module].discard(name)
                        if not waiting[module]:
                            tensors.update(decoder[1]({n: tensors.pop(n) for n in modules[module]}))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(file, f"cannot read safetensors: {e}") from e
        progress.file_done(number)
    if decoder:
        tensors = decoder[1](tensors)  # every module is decoded by now: this names any part left unconsumed
    return config, tensors, tokenizer, generation_config, [f"{p}* ({n} tensors, {skipped_bytes[p]:,} bytes)"
                                                           for p, n in skipped.items()]


def _skipped(name: str, skip_prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in skip_prefixes if name.startswith(p)), None)


def _decoder(config: dict, folder: Path, dtype: torch.dtype, keep_int4: bool):
    """(module_parts, decode) of the checkpoint's quantization format, None for a plain checkpoint; decode turns a
    dict of tensors into the same with each complete module's parts replaced by its held weight (held_int4)."""
    def held(tensor, name: str = ""):
        return held_int4(tensor, dtype, keep_int4, name)

    if compressed_tensors.is_compressed_tensors(config):
        return compressed_tensors.module_parts, lambda t: compressed_tensors.decode(config, t, folder, dtype, held)
    if gptq.is_gptq_layout(config):
        return gptq.module_parts, lambda t: gptq.decode(config, t, folder, held)
    return None


def held_int4(tensor, dtype: torch.dtype, keep_int4: bool, name: str = ""):
    """An Int4Codes as the model should get it: packed (kernels/int4.PackedInt4, half a byte a weight, where
    Int4Codes takes one) when asked and the packed layer takes its shape and group size (activation-ordered columns
    included: the layer permutes its input), else dequantized to `dtype` (exact). An Int8Rows (module `name`) stays
    8-bit when it is an embedding (always: the lookup widens its rows) or when asked, else is dequantized."""
    if isinstance(tensor, Int8Rows):
        return tensor if keep_int4 or name.endswith("embed_tokens") else tensor.dequantize(dtype)
    if not isinstance(tensor, Int4Codes):
        return tensor
    if keep_int4 and packable(tensor.shape, tensor.group_size):
        return pack(tensor)
    return tensor.dequantize(dtype)


def check_quant_method(config: dict, folder: Path) -> None:
    """Refuse a quantization_config we cannot decode before reading any tensor."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if qc and qc.get("quant_method") not in (compressed_tensors.QUANT_METHOD, *gptq.QUANT_METHODS):
        raise CheckpointError(folder / "config.json", f"quantization_config quant_method {qc.get('quant_method')!r} "
                                                      f"is not supported; supported: {compressed_tensors.QUANT_METHOD}, "
                                                      f"{', '.join(gptq.QUANT_METHODS)}")
