"""GGUF files: metadata -> HF-style config, tensors -> HF-named float tensors, vocabulary -> Tokenizer.

llama.cpp's converter renames every tensor, reverses shapes (ne order) and, for `llama`, permutes
the rows of attn_q / attn_k for its rotary layout; all three are undone here, exactly as
transformers' GGUF loader undoes them, so the tensors equal what transformers loads.
"""

import math
import mmap
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from deltaserve.kernels import gguf_blocks_cpu, int4_torch
from deltaserve.kernels.int4 import PackedInt4, PackedTable, held_bytes, packable
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.weights import gguf_hybrid, gguf_int8
from deltaserve.weights.gguf_int4 import held_scales, packed_int4
from deltaserve.weights.gguf_reader import PlainViewReader
from deltaserve.weights.errors import CheckpointError
from deltaserve.weights.gguf_tokenizer import gguf_tokenizer
from deltaserve.weights.progress import LoadProgress, log

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           **{arch: names[0] for arch, names in gguf_hybrid.ARCHITECTURES.items()}}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **gguf_hybrid.LAYER_NAMES,
}
HYBRID_MODEL_TYPES = {names[1] for names in gguf_hybrid.ARCHITECTURES.values()}
GGUF_MAGIC = b"GGUF"
Q4_BLOCK = 32  # weights per scale of every 4-bit GGUF type
READ_AHEAD_BYTES = 256 << 20  # how far past the tensor being made the file is asked for, in calls of at least half
# 4-bit types kept packed when asked (kernels/int4.py): the affine ones and the two with a level table
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.IQ4_NL, Q.IQ4_XS)
LUT_TYPES = (Q.IQ4_NL, Q.IQ4_XS)


# The last GGUF file parsed, by (path, inode, size, times): a start reads the same file's headers three times
# (the memory spec, the config, the weights), and parsing SmolLM2's 49,152-token vocabulary takes ~0.65 s each.
# The loader forgets it once the weights are built (its memory map and parsed fields are not kept for the server).
_PARSED: dict[tuple, GGUFReader] = {}


def open_gguf(path: Path) -> GGUFReader:
    """A GGUFReader on `path` (memory-mapped, no tensor data read), or one clear CheckpointError."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        stat = path.stat()
    except OSError as e:
        raise CheckpointError(path, f"cannot open: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise CheckpointError(path, "not a GGUF file (it does not start with the GGUF magic bytes)")
    key = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key in _PARSED:
        return _PARSED[key]
    try:
        reader = PlainViewReader(path)
    except Exception as e:
        raise CheckpointError(path, f"truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > stat.st_size:
            raise CheckpointError(path, f"truncated GGUF file: tensor {tensor.name} ends at byte "
                                        f"{tensor.data_offset + tensor.n_bytes}, the file has {stat.st_size}")
    _PARSED.clear()
    _PARSED[key] = reader
    return reader


def forget_parsed() -> None:
    """Drop the parsed file open_gguf keeps (the loader calls it once the model is built)."""
    _PARSED.clear()


def field(reader: GGUFReader, key: str, default=None):
    """One metadata value (str, int, float, bool or list), `default` when absent."""
    entry = reader.fields.get(key)
    if entry is None or not entry.types:
        return default
    value = entry.contents()
    if entry.types[0] == GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))  # the decimal the converter wrote, not its float32 neighbour
    return value


def architecture(reader: GGUFReader, path: Path) -> str:
    """`general.architecture`, checked against the ones we can load."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(path, f"unsupported GGUF architecture {arch!r}; "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def gguf_config(reader: GGUFReader, path: Path) -> dict:
    """An HF-style config.json dict synthesized from the GGUF metadata."""
    arch = architecture(reader, path)

    def meta(key, default=None):
        return field(reader, f"{arch}.{key}", default)

    def required(key):
        value = meta(key)
        if value is None:
            raise CheckpointError(path, f"GGUF metadata lacks {arch}.{key}")
        return value

    names = {t.name: t for t in reader.tensors}
    mtp = mtp_layers(reader)
    layers = required("block_count") - mtp
    hidden_size = required("embedding_length")
    heads = required("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list: only a uniform one fits these architectures
        if len(set(kv_heads)) != 1:
            raise CheckpointError(path, f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    embed = names.get("token_embd.weight")
    vocab_size = meta("vocab_size") or (int(embed.shape[1]) if embed is not None else None)
    if vocab_size is None:
        vocab_size = len(field(reader, "tokenizer.ggml.tokens", []))
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        # an all-MoE model (qwen35moe) has no dense MLP and no feed_forward_length
        "intermediate_size": meta("feed_forward_length") or (meta("expert_feed_forward_length")
                                                             and meta("expert_shared_feed_forward_length"))
        or required("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": meta("attention.key_length", hidden_size // heads),
        "hidden_act": "silu",
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 2048),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "o_bias": "blk.0.attn_output.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
    }
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": meta("rope.scaling.factor", 1.0)}
        original = meta("rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    if arch in gguf_hybrid.ARCHITECTURES:
        config = gguf_hybrid.hybrid_config(arch, meta, required, config)
        if mtp:
            config["mtp_num_hidden_layers"] = mtp
    return config


def mtp_layers(reader: GGUFReader) -> int:
    """The multi-token-prediction blocks a hybrid's GGUF holds after its decoder layers (`{arch}.nextn_predict_layers`:
    llama.cpp's converter writes a Qwen3.5 / Qwen3-Next checkpoint's mtp.* as blk.{L}.* unless told --no-mtp)."""
    arch = field(reader, "general.architecture")
    if arch not in gguf_hybrid.ARCHITECTURES:
        return 0
    return int(field(reader, f"{arch}.nextn_predict_layers", 0) or 0)


def mtp_from(reader: GGUFReader) -> int | None:
    """The first MTP block's index (the decoder's layer count), or None when the file has none."""
    n = mtp_layers(reader)
    return field(reader, f"{field(reader, 'general.architecture')}.block_count") - n if n else None


def hf_name(gguf_name: str, first_mtp: int | None = None) -> str | None:
    """The transformers parameter name of a GGUF tensor name, None when there is none. Blocks from `first_mtp` on are
    the MTP head's (gguf_hybrid.mtp_name)."""
    parts = gguf_name.split(".")
    if first_mtp is not None and len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() \
            and int(parts[1]) >= first_mtp:
        return gguf_hybrid.mtp_name(gguf_name, int(parts[1]) - first_mtp, hf_name)
    stem, dot, suffix = gguf_name.rpartition(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in gguf_hybrid.BARE_NAMES:
        return f"model.layers.{parts[1]}.{gguf_hybrid.BARE_NAMES[parts[2]]}"
    if stem.endswith(".ssm_dt") and suffix == "bias":  # the converter's name for dt_bias
        return f"{hf_name(stem + '.weight')[:-len('.weight')]}_bias"
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def tensor_name(gguf_name: str, first_mtp: int | None = None) -> str:
    """The name a tensor gets in a Checkpoint: its HF name, or its GGUF name if it has none (rope_freqs)."""
    return hf_name(gguf_name, first_mtp) or gguf_name


def read_gguf_index(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (GGUF type name, HF-order shape, bytes as stored), from the headers only."""
    reader = open_gguf(path)
    first_mtp = mtp_from(reader)
    return {tensor_name(t.name, first_mtp): (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                             int(t.n_bytes)) for t in reader.tensors}


def read_gguf_config(path: Path) -> dict:
    """The synthesized config of a GGUF file."""
    return gguf_config(open_gguf(path), path)


def read_gguf_tokenizer(path: Path):
    """The Tokenizer of a GGUF file, without reading tensor data."""
    return gguf_tokenizer(open_gguf(path), path)


def load_gguf(path: Path, dtype: torch.dtype, skip_prefixes: tuple[str, ...], keep_int4: bool = False):
    """(config, tensors, tokenizer, generation_config, skipped) of a GGUF file, tensors dequantized.

    With `keep_int4`, INT4_TYPES matrices come packed (kernels/int4.PackedInt4, made from their blocks, never
    dequantized; the block kernels built first where they can be, kernels/gguf_blocks_cpu.py), and Q8_0 / Q6_K /
    Q5_K matrices as Int8Rows (weights/gguf_int8.py: held 8-bit; a tied lm_head multiplies the embedding's codes).
    Stacked experts come as one matrix per expert; Qwen3-Next's two halves of in_proj_qkvz as one. The file is
    read ahead of the tensor being made, READ_AHEAD_BYTES at a time (_read_ahead)."""
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    tokenizer = gguf_tokenizer(reader, path)
    tensors, skipped, halves = {}, {}, {}
    first_mtp = mtp_from(reader)
    if keep_int4:
        gguf_blocks_cpu.load(log.info)
    progress = LoadProgress(path.name, sum(int(t.n_bytes) for t in reader.tensors))
    asked = 0  # the file's bytes before this offset are asked for already
    for tensor in reader.tensors:
        asked = _read_ahead(reader, asked, int(tensor.data_offset) + int(tensor.n_bytes) + READ_AHEAD_BYTES)
        name = tensor_name(tensor.name, first_mtp)
        prefix = next((p for p in skip_prefixes if name.startswith(p)), None)
        if prefix is not None:
            skipped[prefix] = skipped.get(prefix, 0) + 1
            continue
        progress.read(int(tensor.n_bytes))
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise CheckpointError(path, f"tensor {tensor.name} has GGUF type {tensor.tensor_type.name}, which we "
                                        f"cannot dequantize; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
        value = _read(tensor, name, config, dtype, keep_int4)
        _drop_pages(reader, tensor)
        if gguf_hybrid.qkvz_part(config, name):  # held back until its other half arrives
            halves[name] = value
            stem = name.rpartition(".linear_attn.")[0]
            qkv, z = (halves.get(f"{stem}.{part}") for part in gguf_hybrid.QKVZ_PARTS)
            if qkv is None or z is None:
                continue
            name, value = f"{stem}.linear_attn.in_proj_qkvz.weight", _fused_qkvz(config, qkv, z)
        experts = gguf_hybrid.expert_names(name, config.get("num_experts") or 0)
        for part_name, part in (zip(experts, _per_expert(value, len(experts))) if experts else [(name, value)]):
            tensors[part_name] = _held(part_name, part)
    progress.file_done(1)
    eos = tokenizer.eos_token_ids
    generation_config = {"bos_token_id": tokenizer.bos_token_id,
                         "eos_token_id": eos[0] if len(eos) == 1 else eos}
    return config, tensors, tokenizer, generation_config, [f"{p}* ({n} tensors)" for p, n in skipped.items()]


def _read(tensor, name: str, config: dict, dtype: torch.dtype, keep_int4: bool):
    """One GGUF tensor in HF layout: PackedInt4 (kept 4-bit), Int8Rows (kept 8-bit) or a `dtype` tensor, the
    converter's changes undone."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    kind = tensor.name.split(".")[-2] if "." in tensor.name else ""
    heads = None
    if config["model_type"] == "llama" and kind in ("attn_q", "attn_k"):
        heads = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
    hybrid = config["model_type"] in HYBRID_MODEL_TYPES
    kept = None
    if keep_int4 and kept_int4(tensor.tensor_type, tensor.name, shape, config["tie_word_embeddings"]):
        kept = packed_int4(tensor.data, tensor.tensor_type, (math.prod(shape[:-1]), shape[-1]))
    elif keep_int4 and kept_int8(tensor.tensor_type, tensor.name, shape):
        kept = gguf_int8.int8_rows(tensor.data, tensor.tensor_type, shape)
    if kept is not None:  # PackedInt4 or Int8Rows: rows reordered, the stored column order kept as `perm`
        if heads is not None:
            kept = kept.rows(torch.from_numpy(unpermute_rotary(np.arange(shape[0]), heads)))
        rows = gguf_hybrid.row_order(config, name) if hybrid else None
        if rows is not None:
            kept = kept.rows(torch.from_numpy(np.argsort(rows)))
        columns = gguf_hybrid.column_order(config, name) if hybrid else None
        if columns is not None:  # stored column j is the checkpoint's column columns[j]
            kept.perm = torch.from_numpy(columns.astype(np.int64))
        return kept
    values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if heads is not None:
        values = unpermute_rotary(values, heads)
    if hybrid:
        values = gguf_hybrid.to_checkpoint(config, name, values)
    return torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)


def _read_ahead(reader: GGUFReader, asked: int, until: int) -> int:
    """Ask the kernel to read the file's bytes from `asked` to `until` into the page cache now (MADV_WILLNEED: large
    asynchronous reads while the tensor before them is made); the new `asked`. Faulted in page by page instead, a
    file not in the page cache read at ~300 MB/s here where the disk gives 2.2 GB/s (the 27B's 14.7 GB: ~36 s of its
    load). Nothing where the platform has no madvise."""
    area = getattr(reader.data, "_mmap", None)
    if area is None or not hasattr(mmap, "MADV_WILLNEED"):
        return asked
    until = min(until, len(area))
    if until - asked < READ_AHEAD_BYTES // 2 and until < len(area):  # a short step: asked with a later, longer one
        return asked
    start = asked // mmap.PAGESIZE * mmap.PAGESIZE
    if until > start:
        area.madvise(mmap.MADV_WILLNEED, start, until - start)
    return max(asked, until)


def _drop_pages(reader: GGUFReader, tensor) -> None:
    """Unmap the file pages a read tensor touched from this process (they stay in the page cache): mapped, they count
    in its resident memory, and a 15 GB file read whole would hold its size beside the weights made from it. Pages
    a later read needs fault back in from the cache; where the platform has no madvise, nothing is dropped."""
    area = getattr(reader.data, "_mmap", None)
    if area is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(int(tensor.data_offset) + int(tensor.n_bytes), len(area))
    if end > start:
        area.madvise(mmap.MADV_DONTNEED, start, end - start)


def _held(name: str, value):
    """A tensor as the model gets it; a packed 4-bit embedding as a PackedTable (models/layers.Int4Embedding looks
    up its rows)."""
    if isinstance(value, PackedInt4) and name == "model.embed_tokens.weight":
        return PackedTable(value.packed, value.scales, value.offsets, value.group_size, value.lut, value.perm)
    return value


def _per_expert(value, experts: int) -> list:
    """A stacked [experts, out, in] tensor (PackedInt4: [experts x out, in]) as one matrix per expert."""
    if isinstance(value, PackedInt4):
        out = value.shape[0] // experts
        return [value.rows(torch.arange(e * out, (e + 1) * out)) for e in range(experts)]
    return list(value.unbind(0))


def _fused_qkvz(config: dict, qkv, z):
    """Qwen3-Next's in_proj_qkvz from its two GGUF halves (gguf_hybrid.qkvz_order)."""
    order = torch.from_numpy(gguf_hybrid.qkvz_order(config))
    if isinstance(qkv, PackedInt4) and isinstance(z, PackedInt4) and qkv.group_size == z.group_size and \
            qkv.scales.dtype == z.scales.dtype and (qkv.offsets is None) == (z.offsets is None) and (
            (qkv.lut is None and z.lut is None) or (qkv.lut is not None and z.lut is not None
                                                    and torch.equal(qkv.lut, z.lut))):
        offsets = None if qkv.offsets is None else torch.cat([qkv.offsets, z.offsets])
        both = PackedInt4(torch.cat([qkv.packed, z.packed]), torch.cat([qkv.scales, z.scales]), offsets,
                          qkv.group_size, qkv.lut)
        return both.rows(order)
    if isinstance(qkv, Int8Rows) and isinstance(z, Int8Rows) and qkv.group_size == z.group_size:
        return Int8Rows(torch.cat([qkv.codes, z.codes]), torch.cat([qkv.scales, z.scales]),
                        torch.cat([qkv.offsets, z.offsets]), qkv.group_size).rows(order)
    as_float = [t.dequantize() if isinstance(t, (PackedInt4, Int8Rows)) else t for t in (qkv, z)]
    return torch.cat(as_float)[order]


def unpermute_rotary(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows: per head, (2, dim/2) interleaved back to halves."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def kept_int4(kind: Q, gguf_name: str, shape: tuple[int, ...], tied: bool) -> bool:
    """Whether loading with `keep_int4` holds this tensor (HF-order `shape`; stacked experts [experts, out, in])
    packed: an INT4_TYPES matrix the CPU kernel takes, the embedding too unless `tied` (an untied one is looked up by
    row from its packed table, models/layers.Int4Embedding; a tied one is held as floats beside its packed head)."""
    return (kind in INT4_TYPES and not (tied and gguf_name.startswith("token_embd")) and len(shape) in (2, 3)
            and packable(shape[-2:], Q4_BLOCK))


def kept_int8(kind: Q, gguf_name: str, shape: tuple[int, ...]) -> bool:
    """Whether loading with `keep_int4` holds this tensor 8-bit (kernels/int8.py's Int8Rows, weights/gguf_int8.py): a
    Q8_0, Q6_K or Q5_K matrix, the embedding (models/layers.Int8Embedding) or a linear (Int8Linear, but dequantized
    on CUDA in bfloat16; on CPU int8 activations multiply its codes by integer dot products); stacked experts and
    1-D tensors are dequantized."""
    return kind in gguf_int8.TYPES and len(shape) == 2 and shape[1] % gguf_int8.GROUPS[kind] == 0


def int8_held_bytes(params: int, kind: Q = Q.Q8_0) -> int:
    """Bytes a kept 8-bit tensor of `params` weights holds, embedding or linear (gguf_int8.held_bytes)."""
    return gguf_int8.held_bytes(params, kind)


def int4_torch_held_bytes(shape: tuple[int, ...], kind: Q) -> int:
    """Bytes a kept INT4_TYPES tensor (HF-order `shape`; stacked experts [experts, out, in]) holds on CUDA in a
    bfloat16 model: each matrix in torch's int4 layout where its kernel takes it (kernels/int4_torch.py: affine
    types), else packed."""
    matrices = shape[0] if len(shape) == 3 else 1
    n, k = shape[-2:]
    if int4_torch.takes((n, k), Q4_BLOCK, kind in LUT_TYPES):
        return matrices * int4_torch.held_bytes(n, k, Q4_BLOCK, symmetric=not held_scales(kind)[1])
    return int4_held_bytes(n * k * matrices, kind, matrices)


def int4_held_bytes(params: int, kind: Q, matrices: int = 1) -> int:
    """Bytes a kept INT4_TYPES tensor of `params` weights in `matrices` matrices holds once packed
    (kernels/int4.held_bytes: the level table once per matrix)."""
    scale_bytes, offsets = held_scales(kind)
    return held_bytes(params, Q4_BLOCK, scale_bytes=scale_bytes, offsets=offsets) + \
        (matrices * 16 * 4 if kind in LUT_TYPES else 0)
