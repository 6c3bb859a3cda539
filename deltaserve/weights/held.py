"""What the loader holds for each quantized module of a safetensors checkpoint, from its headers alone: the ledger's
weights line (budget/headers.py) must equal the bytes the loaded model keeps, not the bytes on disk.

On CPU with 4-bit matrices packed (the default), loading keeps
- a 4-bit linear (compressed-tensors, GPTQ, AWQ) whose shape and group the kernel takes as kernels/int4.held_bytes:
  half a byte a weight and, per group, a symmetric compressed-tensors module's scale as stored (2 bytes for the
  usual 16-bit scale: the checkpoint's own size), or a float32 scale and offset (8 bytes: asymmetric schemes, where
  a 16-bit scale times a zero point needs float32, and the GPTQ / AWQ layouts);
- an 8-bit embedding as int8 codes with a float32 scale per group, and an offset where asymmetric
  (models/layers.Int8Embedding);
- an 8-bit linear as int8 codes with a float32 scale per group, and a float32 offset per group where the scheme is
  asymmetric (models/layers.Int8Linear; on CUDA in bfloat16, where torch's int4 layout holds the 4-bit ones, it is
  dequantized);
- every other quantized module (a 4-bit embedding, a group the kernel does not take) dequantized to the compute
  dtype;
and a tied lm_head over a quantized embedding: over an 8-bit table held int8, it multiplies the same codes
(models/layers.Int8Linear: nothing more to hold); over a 4-bit one, packed on its own; otherwise dequantized. The
parts (scales, zero points, g_idx, weight_shape) cost nothing beyond their module.
"""

from __future__ import annotations

import math

from deltaserve.kernels import int4_torch
from deltaserve.kernels.int4 import held_bytes, packable
from deltaserve.weights import compressed_tensors

MAIN_PARTS = ("weight_packed", "qweight")  # a module's codes; its `weight` when stored unpacked (int-quantized)
SIDE_PARTS = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "qzeros", "scales", "g_idx")

# (name, params, stored bytes, held as floats?[, bytes held when not floats[, the same on CUDA in bfloat16]])
Row = tuple


def quantization_config(config: dict) -> dict:
    """The checkpoint's quantization_config (top level, or a multimodal config's text_config), {} when none."""
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}


def held_rows(config: dict, rows: list[Row], shapes: dict[str, tuple[int, ...]], tied: bool) -> list[Row]:
    """`rows` (one per stored tensor) with every quantized module priced as loaded (module docstring)."""
    qc = quantization_config(config)
    if not qc:
        return rows
    params = {row[0]: row[1] for row in rows}
    mains = {name.rpartition(".")[0]: name for name in params
             if name.endswith(MAIN_PARTS) or (name.endswith(".weight") and name[:-6] + "weight_scale" in params)}
    # a module's weight count sits on one of its rows (weight_shape, or the codes when no shape is stored)
    counts = {module: sum(params.get(f"{module}.{part}", 0) for part in (main.rpartition(".")[2], *SIDE_PARTS))
              for module, main in mains.items()}
    stored = {row[0]: row[2] for row in rows}
    forms = {module: (main, counts[module], *(_held_form(config, qc, module, counts[module], shapes, stored, cuda)
                                              for cuda in (False, True)))
             for module, main in mains.items()}
    out = []
    for name, p, nbytes, is_float, *held in rows:
        module, _, part = name.rpartition(".")
        if module in forms and forms[module][0] == name:
            _, count, form, torch_form = forms[module]
            out.append((name, count, nbytes, form is None) + (() if form is None else (form, torch_form)))
        elif module in forms and part in SIDE_PARTS:
            out.append((name, 0, nbytes, False, 0))
        else:
            out.append((name, p, nbytes, is_float, *held))
    embedding = next((m for m in forms if m.endswith("embed_tokens")), None)
    if tied and embedding is not None and not any(name.startswith("lm_head.") for name in params):
        out.append(_tied_head(config, qc, embedding, forms[embedding][1], shapes, stored))
    return out


def _geometry(module: str, params: int, shapes: dict) -> tuple[int, int, int] | None:
    """(out rows N, input columns K, group size) from the scale's shape: `weight_scale` [N, groups]
    (compressed-tensors), `scales` [groups, N] (GPTQ / AWQ); None when they do not describe a matrix (the loader
    refuses such a module by name)."""
    if module + ".weight_scale" in shapes:
        scale = shapes[module + ".weight_scale"]
        n, groups = (scale[0], scale[1] if len(scale) > 1 else 1) if scale else (0, 0)
    else:
        groups, n = shapes[module + ".scales"] if len(shapes[module + ".scales"]) == 2 else (0, 0)
    if not n or not groups or params % n or (params // n) % groups:
        return None
    k = params // n
    return n, k, k // groups


def _symmetric_scale_bytes(config: dict, qc: dict, module: str, shapes: dict, stored: dict) -> int | None:
    """A symmetric compressed-tensors module's stored scale element size (the loader keeps it as stored), else None."""
    if qc.get("quant_method") != compressed_tensors.QUANT_METHOD:
        return None
    scheme = compressed_tensors.module_scheme({**config, "quantization_config": qc}, module)
    if scheme is None or not scheme.symmetric:
        return None
    name = module + ".weight_scale"
    count = math.prod(shapes.get(name) or (0,))
    return stored[name] // count if count and name in stored else None


def _bits(config: dict, qc: dict, module: str) -> int | None:
    if qc.get("quant_method") == compressed_tensors.QUANT_METHOD:
        return compressed_tensors.module_bits({**config, "quantization_config": qc}, module)
    return 4  # the GPTQ-layout and AWQ loaders take 4 bits only


def module_held_bytes(n: int, k: int, group: int, bits: int, embedding: bool, act_order: bool = False,
                      symmetric_scale_bytes: int | None = None, torch_int4: bool = False) -> int | None:
    """Bytes one quantized [n, k] module (`group` inputs a scale; k: per channel) is held in when not as floats (the
    module docstring's rules); None: dequantized to the compute dtype. The one price the checkpoint-header ledger
    (held_rows) and the config-only estimate (budget/spec.spec_from_config) both use. `symmetric_scale_bytes`: a
    symmetric compressed-tensors module's stored scale size (kept as stored, no offsets); None: float32 scale and
    offset. `torch_int4`: the price on CUDA in bfloat16, where torch's int4 layout holds the 4-bit matrices its
    kernel takes (kernels/int4_torch.py)."""
    if bits == 4 and not embedding and packable((n, k), group):
        return _packed_bytes(n, k, group, symmetric_scale_bytes, torch_int4)
    if bits == 8 and embedding and not act_order and group and k % group == 0:
        return n * k + n * (k // group) * (4 if symmetric_scale_bytes is not None else 8)
    if bits == 8 and not embedding and group and k % group == 0:
        if torch_int4:  # CUDA in bfloat16: dequantized (models/layers._held_int8), 2 bytes a weight
            return 2 * n * k
        return n * k + n * (k // group) * (4 if symmetric_scale_bytes is not None else 8)
    return None


def tied_head_held_bytes(n: int, k: int, group: int, bits: int, symmetric_scale_bytes: int | None = None,
                         act_order: bool = False, torch_int4: bool = False) -> int | None:
    """Bytes the lm_head tied to a quantized [n, k] embedding is held in when not as floats: nothing over a table
    held int8 (the head multiplies its codes, models/layers.Int8Linear), packed from a 4-bit table
    (models/layers._held_int4), None (floats) from any other."""
    if bits == 8 and module_held_bytes(n, k, group, bits, True, act_order) is not None:
        return 0
    if bits == 4 and packable((n, k), group):
        return _packed_bytes(n, k, group, symmetric_scale_bytes, torch_int4)
    return None


def _packed_bytes(n: int, k: int, group: int, symmetric_scale_bytes: int | None, torch_int4: bool = False) -> int:
    """A packed 4-bit [n, k] matrix's bytes; with `torch_int4`, torch's int4 layout where its kernel takes it."""
    if torch_int4 and int4_torch.takes((n, k), group):
        return int4_torch.held_bytes(n, k, group, symmetric=symmetric_scale_bytes is not None)
    if symmetric_scale_bytes is None:
        return held_bytes(n * k, group)
    return held_bytes(n * k, group, scale_bytes=symmetric_scale_bytes, offsets=False)


def _held_form(config: dict, qc: dict, module: str, params: int, shapes: dict, stored: dict,
               torch_int4: bool = False) -> int | None:
    """Bytes the module is held in when not as floats (`torch_int4`: on CUDA in bfloat16); None: dequantized to the
    compute dtype."""
    if module + ".weight_scale" not in shapes and module + ".scales" not in shapes:
        return None
    geometry = _geometry(module, params, shapes)
    if geometry is None:
        return None
    n, k, group = geometry
    return module_held_bytes(n, k, group, _bits(config, qc, module), module.endswith("embed_tokens"),
                             act_order=module + ".weight_g_idx" in shapes,
                             symmetric_scale_bytes=_symmetric_scale_bytes(config, qc, module, shapes, stored),
                             torch_int4=torch_int4)


def _tied_head(config: dict, qc: dict, embedding: str, count: int, shapes: dict, stored: dict) -> Row:
    """The lm_head row of a tied quantized embedding: nothing over an embedding held int8 (it shares the codes),
    packed when the embedding is 4-bit and packable, else float (the held bytes on CPU, then on CUDA in bfloat16)."""
    geometry = _geometry(embedding, count, shapes)
    held = [None if geometry is None else tied_head_held_bytes(
        *geometry, _bits(config, qc, embedding), _symmetric_scale_bytes(config, qc, embedding, shapes, stored),
        act_order=embedding + ".weight_g_idx" in shapes, torch_int4=cuda) for cuda in (False, True)]
    return ("lm_head.weight", count, 0, True) if held[0] is None else ("lm_head.weight", count, 0, False, *held)
