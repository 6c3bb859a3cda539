"""GPTQ- and AWQ-layout 4-bit checkpoints -> Int4Codes: AutoRound's exports (quant_method "auto-round", packing_format
"auto_round", "auto_round:gptqmodel", "auto_round:auto_gptq", "auto_round:auto_awq"), AutoGPTQ's (quant_method
"gptq") and AutoAWQ's GEMM layout (quant_method "awq", version "gemm", which AutoRound's auto_awq export writes).

GPTQ, per module: `qweight` int32 [in / 8, out] (eight 4-bit codes per word along the input, lowest row in the
lowest bits), `qzeros` int32 [groups, out / 8] (the same along the output), `scales` [groups, out], `g_idx` [in]
(each input column's group; activation order when not sorted). w = scale * (code - zero). AutoGPTQ's convention, and
AutoRound's "auto_gptq" packing, store zero - 1. `extra_config` (AutoRound) overrides bits / group per module.

AWQ, per module: `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], eight codes per word along
the output in AWQ's interleaved order (the word's nibble p, bits 4p, holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][p]),
`scales` [groups, out]; the zero itself is stored, no g_idx. w = scale * (code - zero).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from deltaserve.kernels.int4 import Int4Codes
from deltaserve.weights.errors import CheckpointError

QUANT_METHODS = ("auto-round", "autoround", "gptq", "awq")
RAW_ZERO_PACKINGS = ("auto_round", "auto_round:gptqmodel")  # AutoRound's formats that store the zero itself
PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column i of each 8 sits in nibble AWQ_ORDER[i] of its word
AWQ_VERSIONS = ("gemm",)  # gemv / gemv_fast / marlin / exllama pack another layout


def is_gptq_layout(config: dict) -> bool:
    """Whether config.json declares an AutoRound / AutoGPTQ checkpoint."""
    return (config.get("quantization_config") or {}).get("quant_method") in QUANT_METHODS


def is_awq(qc: dict) -> bool:
    """Whether the modules are packed in AWQ's layout (module docstring)."""
    return qc.get("quant_method") == "awq" or "awq" in str(qc.get("packing_format", ""))


def zero_offset(qc: dict) -> int:
    """What to add to a stored zero: 1 where the format stores zero - 1."""
    if qc["quant_method"] == "gptq":
        return 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    return 0 if qc.get("packing_format", "auto_round:auto_gptq") in RAW_ZERO_PACKINGS else 1


def module_parts(names) -> dict[str, list[str]]:
    """module -> the stored names `decode` turns into its weight (a module has a qweight)."""
    names = set(names)
    modules = {n[: -len(".qweight")] for n in names if n.endswith(".qweight")}
    return {m: [f"{m}.{p}" for p in PARTS if f"{m}.{p}" in names] for m in modules}


def decode(config: dict, tensors: dict[str, torch.Tensor], path: Path, held=None) -> dict:
    """`tensors` with every packed module's parts replaced by one `<module>.weight` Int4Codes, in place: each
    module's parts leave as its weight arrives, passed through `held` (e.g. packed) when given."""
    qc = config["quantization_config"]
    awq = is_awq(qc)
    version = str(qc.get("version", "gemm")).lower()
    if qc["quant_method"] == "awq" and version not in AWQ_VERSIONS:
        raise CheckpointError(path, f"AWQ version {qc.get('version')!r} is not supported; supported: "
                                    f"{', '.join(AWQ_VERSIONS)}")
    offset = 0 if awq else zero_offset(qc)
    extra = qc.get("extra_config") or {}
    out = tensors
    for module in sorted(n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")):
        parts = {p: out.pop(f"{module}.{p}", None) for p in PARTS}
        own = extra.get(module) or extra.get(module.replace("model.language_model.", "model.")) or {}
        bits = int(own.get("bits", qc.get("bits", qc.get("w_bit", 4))))
        if bits != 4:
            raise CheckpointError(path, f"{module} has {bits}-bit {'AWQ' if awq else 'GPTQ'}-layout weights; "
                                        f"supported: 4")
        weight = awq_codes(module, parts, path) if awq else module_codes(module, parts, offset, path)
        out[f"{module}.weight"] = weight if held is None else held(weight)
    stray = [n for n in out if n.rpartition(".")[2] in PARTS]
    if stray:
        raise CheckpointError(path, f"tensor {stray[0]} is not consumed ({len(stray)} such tensors)")
    return out


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> uint8 codes [R, 8 W], the lowest 4 bits of each word first."""
    raw = words.contiguous().view(torch.uint8)
    if sys.byteorder == "big":
        raw = raw.view(words.shape[0], -1, 4).flip(-1).reshape(words.shape[0], -1)
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).view(words.shape[0], -1)


def module_codes(module: str, parts: dict, offset: int, path: Path) -> Int4Codes:
    """One module's Int4Codes from its qweight / qzeros / scales / g_idx."""
    for p in ("qzeros", "scales"):
        if parts[p] is None:
            raise CheckpointError(path, f"tensor {module}.{p} is missing")
    qweight, scales = parts["qweight"], parts["scales"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n) or k % groups:
        raise CheckpointError(path, f"tensor {module}.scales has shape {tuple(scales.shape)}, expected "
                                    f"[groups dividing {k}, {n}]")
    group = k // groups
    if tuple(parts["qzeros"].shape) != (groups, n // 8):
        raise CheckpointError(path, f"tensor {module}.qzeros has shape {tuple(parts['qzeros'].shape)}, expected "
                                    f"{(groups, n // 8)}")
    codes = nibbles(qweight.t())  # [N, K]
    zeros = nibbles(parts["qzeros"]).t().float() + offset  # [N, groups]
    scale = scales.t().float()
    perm = None
    g_idx = parts["g_idx"]
    if g_idx is not None:
        g_idx = g_idx.long()
        if tuple(g_idx.shape) != (k,):
            raise CheckpointError(path, f"tensor {module}.g_idx has shape {tuple(g_idx.shape)}, expected {(k,)}")
        if not torch.equal(g_idx, torch.arange(k) // group):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], torch.arange(k) // group):
                raise CheckpointError(path, f"tensor {module}.g_idx does not put {group} columns in each group")
            codes = codes[:, perm]
    return Int4Codes(codes.contiguous(), scale, -zeros * scale, group, perm=perm)


def awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """[R, N] codes in AWQ's nibble order (nibbles of its words) -> [R, N] in column order."""
    rows, n = codes.shape
    return codes.view(rows, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, n)


def awq_codes(module: str, parts: dict, path: Path) -> Int4Codes:
    """One AWQ-layout module's Int4Codes from its qweight / qzeros / scales."""
    for p in ("qzeros", "scales"):
        if parts[p] is None:
            raise CheckpointError(path, f"tensor {module}.{p} is missing")
    if parts["g_idx"] is not None:
        raise CheckpointError(path, f"tensor {module}.g_idx is not part of the AWQ layout")
    qweight, scales = parts["qweight"], parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n) or not groups or k % groups:
        raise CheckpointError(path, f"tensor {module}.scales has shape {tuple(scales.shape)}, expected "
                                    f"[groups dividing {k}, {n}]")
    if tuple(parts["qzeros"].shape) != (groups, n // 8):
        raise CheckpointError(path, f"tensor {module}.qzeros has shape {tuple(parts['qzeros'].shape)}, expected "
                                    f"{(groups, n // 8)}")
    codes = awq_columns(nibbles(qweight)).t()  # [N, K]
    zeros = awq_columns(nibbles(parts["qzeros"])).t().float()  # [N, groups]
    scale = scales.t().float()
    return Int4Codes(codes.contiguous(), scale, -zeros * scale, k // groups)
