"""compressed-tensors checkpoints (quant_method "compressed-tensors"): packed integer weights -> Int4Codes /
Int8Rows / float tensors under the plain `<module>.weight` name the models load.

Formats: `pack-quantized` (int32 words, value + 2^(bits-1) in `bits` bits each, lowest column in the lowest
bits; an asymmetric zero point packed the same way along the output dimension), `int-quantized` /
`naive-quantized` (one int8 per value), `dense` (plain floats). Schemes: integer weights of 4 or 8 bits, per
group (any group size dividing the input) or per channel, symmetric or asymmetric, activation-ordered groups
(`weight_g_idx`), activations left in float (W4A16 / W8A16). Anything else (FP8, NVFP4, 2-bit, quantized
activations) is refused by name: a silently wrong weight is the worst bug.

What each becomes: a 4-bit matrix an Int4Codes (kernels/int4.py: the model holds it packed or dequantizes it);
an 8-bit one an Int8Rows (kernels/int8.py): an embedding's table stays 8-bit (rows widened on gather), a linear is
held 8-bit on CPU where 4-bit ones are held packed (weights/hf.held_int4; models/layers.Int8Linear), else
dequantized.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from deltaserve.kernels.int4 import Int4Codes
from deltaserve.kernels.int8 import Int8Rows
from deltaserve.weights.errors import CheckpointError

QUANT_METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "dense")
BITS = (4, 8)
STRATEGIES = ("group", "channel")
CLASSES = ("Linear", "Embedding")
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
STRAY_PARTS = ("input_scale", "input_zero_point", "weight_global_scale", "input_global_scale", "output_scale",
               "k_scale", "v_scale")


def is_compressed_tensors(config: dict) -> bool:
    """Whether config.json declares a compressed-tensors checkpoint."""
    return (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


class Scheme:
    """One config group's weight settings, checked: bits, group size (0: per channel), symmetric, format."""

    def __init__(self, name: str, group: dict, default_format: str, path: Path):
        w = group.get("weights") or {}
        self.name, self.targets = name, list(group.get("targets") or [])
        self.format = group.get("format") or default_format
        what = f"quantization_config config_groups.{name}"
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(path, f"{what} quantizes activations; only weight-only schemes (W4A16, W8A16) "
                                        f"are supported")
        if w.get("type", "int") != "int":
            raise CheckpointError(path, f"{what} has weights of type {w.get('type')!r} (FP8 / NVFP4 / MXFP4 "
                                        f"are not supported); supported: int")
        if w.get("num_bits") not in BITS:
            raise CheckpointError(path, f"{what} has {w.get('num_bits')}-bit weights; supported: 4, 8")
        if w.get("strategy") not in STRATEGIES:
            raise CheckpointError(path, f"{what} has weight strategy {w.get('strategy')!r}; supported: "
                                        f"{', '.join(STRATEGIES)}")
        if self.format not in FORMATS:
            raise CheckpointError(path, f"{what} has format {self.format!r}; supported: {', '.join(FORMATS)}")
        self.bits = int(w["num_bits"])
        self.group_size = int(w.get("group_size") or 0) if w["strategy"] == "group" else 0
        self.symmetric = bool(w.get("symmetric", True))
        self.actorder = w.get("actorder")


def _target_matches(target: str, module: str) -> bool:
    """compressed-tensors' rule: `re:` a regex matched at the start, else an exact module name or a class name
    (Linear / Embedding, told apart here by name: only an embed_tokens module is an Embedding)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == "Embedding":
        return module.endswith("embed_tokens")
    if target == "Linear":
        return not module.endswith("embed_tokens")
    return module == target


def module_parts(names) -> dict[str, list[str]]:
    """module -> the stored names `decode` turns into its weight (a module has a weight_packed or weight_scale)."""
    names = set(names)
    modules = {n.rpartition(".")[0] for n in names if n.endswith((".weight_packed", ".weight_scale"))}
    return {m: [f"{m}.{p}" for p in (*PARTS, "weight") if f"{m}.{p}" in names] for m in modules}


def decode(config: dict, tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, held=None) -> dict:
    """`tensors` with every quantized module's parts replaced by one `<module>.weight` (see the module doc), in
    place: each module's parts leave as its weight arrives, passed through `held` (e.g. packed) when given, so no
    second full copy of the model is ever held."""
    qc = config["quantization_config"]
    default_format = qc.get("format") or "dense"
    schemes = [Scheme(name, group, default_format, path) for name, group in (qc.get("config_groups") or {}).items()]
    ignore = list(qc.get("ignore") or [])
    quantized = (".weight_packed", ".weight_scale")
    modules = sorted({name.rpartition(".")[0] for name in tensors if name.endswith(quantized)})
    out = tensors
    for module in modules:
        parts = {p: out.pop(f"{module}.{p}") for p in PARTS if f"{module}.{p}" in out}
        scheme = _scheme_of(module, schemes, ignore, path)
        weight = _module_weight(module, parts, out.pop(f"{module}.weight", None), scheme, path, dtype)
        out[f"{module}.weight"] = weight if held is None else held(weight, module)
    stray = [n for n in out if n.rpartition(".")[2] in STRAY_PARTS + PARTS]
    if stray:
        raise CheckpointError(path, f"tensor {stray[0]} is not consumed by any supported scheme "
                                    f"({len(stray)} such tensors)")
    return out


def module_bits(config: dict, module: str) -> int | None:
    """The weight bits config_groups gives a stored quantized module (the loader's own matching), None when the
    config gives it no supported scheme (the loader then refuses it)."""
    scheme = module_scheme(config, module)
    return None if scheme is None else scheme.bits


def module_scheme(config: dict, module: str) -> Scheme | None:
    """The scheme config_groups gives a stored quantized module (the loader's own matching), None when none."""
    qc = config["quantization_config"]
    try:
        schemes = [Scheme(name, group, qc.get("format") or "dense", Path("config.json"))
                   for name, group in (qc.get("config_groups") or {}).items()]
        return _scheme_of(module, schemes, [], Path("config.json"))
    except CheckpointError:
        return None


def _scheme_of(module: str, schemes: list[Scheme], ignore: list[str], path: Path) -> Scheme:
    # Checkpoints name modules as saved (model.language_model.* in a multimodal one): match that name.
    if any(_target_matches(t, module) for t in ignore):
        raise CheckpointError(path, f"module {module} is in quantization_config.ignore but stored quantized")
    # compressed-tensors' precedence: an exact module name, then a `re:` pattern, then a class name.
    for kind in (lambda t: not t.startswith("re:") and t not in CLASSES, lambda t: t.startswith("re:"),
                 lambda t: t in CLASSES):
        for scheme in schemes:
            if any(kind(t) and _target_matches(t, module) for t in scheme.targets):
                return scheme
    raise CheckpointError(path, f"module {module} is stored quantized but no quantization_config.config_groups "
                                f"entry targets it")


def _module_weight(module: str, parts: dict, weight, scheme: Scheme, path: Path, dtype: torch.dtype):
    """One module's weight: Int4Codes (4-bit), Int8Rows (8-bit; its activation order as `perm`) or a float tensor (an
    8-bit embedding with activation-ordered groups, which a lookup cannot take)."""
    if "weight_scale" not in parts:
        raise CheckpointError(path, f"tensor {module}.weight_scale is missing")
    # [N, K] stored values + 2^(b-1) (uint8): a 4-bit code straight from the nibbles, no wider copy of the matrix
    q = _offset_values(module, parts, weight, scheme, path)
    n, k = q.shape
    group = scheme.group_size or k
    if k % group:
        raise CheckpointError(path, f"{module}: {k} input columns are not a multiple of the group size {group}")
    groups = k // group
    scale = parts["weight_scale"]
    if tuple(scale.shape) != (n, groups):
        raise CheckpointError(path, f"tensor {module}.weight_scale has shape {tuple(scale.shape)}, expected "
                                    f"{(n, groups)} for a [{n}, {k}] weight in groups of {group}")
    zero = _zero_point(module, parts, scheme, n, groups, path)
    perm = _act_order(module, parts, k, group, path)
    if perm is not None:
        q = q[:, perm]
    if scheme.bits == 4 and scheme.symmetric:  # codes 0..15: w = scale * (code - 8), the scale kept as stored
        return Int4Codes(q.contiguous(), scale, None, group, perm=perm)
    scale = scale.float()
    if scheme.bits == 4:  # w = scale * (code - 8 - zero)
        return Int4Codes(q.contiguous(), scale, -(8 + zero) * scale, group, perm=perm)
    rows = Int8Rows((q.to(torch.int16) - 128).to(torch.int8), scale, -zero * scale, group, perm)
    if module.endswith("embed_tokens") and perm is not None:
        return rows.dequantize(dtype)
    return rows


def _offset_values(module: str, parts: dict, weight, scheme: Scheme, path: Path) -> torch.Tensor:
    """The module's values + 2^(bits-1) as uint8 [N, K] (how pack-quantized stores them)."""
    if scheme.format == "pack-quantized":
        if "weight_packed" not in parts or "weight_shape" not in parts:
            raise CheckpointError(path, f"{module}: pack-quantized needs weight_packed and weight_shape")
        shape = tuple(int(d) for d in parts["weight_shape"].tolist())
        return _unpack(module, parts["weight_packed"], scheme.bits, shape, path)
    if weight is None or weight.is_floating_point():
        raise CheckpointError(path, f"{module}: format {scheme.format} needs an integer {module}.weight")
    return (weight.to(torch.int16) + (1 << (scheme.bits - 1))).to(torch.uint8)


def _unpack(module: str, packed: torch.Tensor, bits: int, shape: tuple[int, ...], path: Path,
            dim: int = 1) -> torch.Tensor:
    """int32 words -> the stored values [shape] (uint8, value + 2^(bits-1)): element i at bits i*bits of the
    little-endian stream."""
    if packed.dtype != torch.int32:
        raise CheckpointError(path, f"{module}: packed tensor has dtype {packed.dtype}, expected int32")
    if dim == 0:
        packed, shape = packed.t(), shape[::-1]
    rows, cols = shape
    per_word = 32 // bits
    if tuple(packed.shape) != (rows, -(-cols // per_word)):
        raise CheckpointError(path, f"{module}: packed tensor has shape {tuple(packed.shape)}, expected "
                                    f"{(rows, -(-cols // per_word))} for {bits}-bit values of shape {shape}")
    # reshape first: a word tensor with a size-1 dim can be "contiguous" with a last stride > 1, which view refuses
    raw = packed.contiguous().reshape(-1).view(torch.uint8).view(rows, -1)
    if sys.byteorder == "big":
        raw = raw.view(rows, -1, 4).flip(-1).reshape(rows, -1)
    if bits == 4:
        raw = torch.stack((raw & 0xF, raw >> 4), dim=-1).view(rows, -1)
    values = raw[:, :cols]
    return values.t() if dim == 0 else values


def _zero_point(module: str, parts: dict, scheme: Scheme, n: int, groups: int, path: Path) -> torch.Tensor:
    """[N, groups] float32 zero points (0 when symmetric)."""
    zp = parts.get("weight_zero_point")
    if scheme.symmetric or zp is None:
        if not scheme.symmetric:
            raise CheckpointError(path, f"tensor {module}.weight_zero_point is missing (asymmetric scheme)")
        return torch.zeros(n, groups)
    if scheme.format == "pack-quantized":
        stored = _unpack(module + ".weight_zero_point", zp, scheme.bits, (n, groups), path, dim=0)
        return stored.float() - (1 << (scheme.bits - 1))
    if tuple(zp.shape) != (n, groups):
        raise CheckpointError(path, f"tensor {module}.weight_zero_point has shape {tuple(zp.shape)}, "
                                    f"expected {(n, groups)}")
    return zp.float()


def _act_order(module: str, parts: dict, k: int, group: int, path: Path) -> torch.Tensor | None:
    """The column permutation sorting columns by group (Int4Codes.perm), None without g_idx."""
    g_idx = parts.get("weight_g_idx")
    if g_idx is None:
        return None
    g_idx = g_idx.long()
    if tuple(g_idx.shape) != (k,):
        raise CheckpointError(path, f"tensor {module}.weight_g_idx has shape {tuple(g_idx.shape)}, expected {(k,)}")
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(k) // group):
        raise CheckpointError(path, f"tensor {module}.weight_g_idx does not put exactly {group} columns "
                                    f"in each group")
    return perm
