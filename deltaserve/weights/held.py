"""What the loader holds for each quantized module of a safetensors checkpoint, from its headers alone: the ledger's
weights line (models/spec.py) must equal the bytes the loaded model keeps, not the bytes on disk.

On CPU with 4-bit matrices packed (the default), loading keeps
- a 4-bit linear (compressed-tensors, GPTQ, AWQ) whose shape and group the kernel takes as kernels/int4.held_bytes:
  half a byte a weight and a float32 scale and offset per group (the checkpoint's 16-bit scale and packed zero
  point become 8 bytes a group);
- an 8-bit embedding as int8 codes with a float32 scale and offset per group (models/layers.Int8Embedding);
- every other quantized module (a 4-bit embedding, an 8-bit linear, a group the kernel does not take) dequantized to
  the compute dtype;
and a tied lm_head over a quantized embedding: over an 8-bit table held int8, it multiplies the same codes
(models/layers.Int8Linear: nothing more to hold); over a 4-bit one, packed on its own; otherwise dequantized. The
parts (scales, zero points, g_idx, weight_shape) cost nothing beyond their module.
"""

from __future__ import annotations

from deltaserve.kernels.int4 import held_bytes, packable
from deltaserve.weights import compressed_tensors

MAIN_PARTS = ("weight_packed", "qweight")  # a module's codes; its `weight` when stored unpacked (int-quantized)
SIDE_PARTS = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "qzeros", "scales", "g_idx")

Row = tuple  # (name, params, stored bytes, held as floats?[, bytes held when not floats])


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
    forms = {module: (main, counts[module], _held_form(config, qc, module, counts[module], shapes))
             for module, main in mains.items()}
    out = []
    for name, p, nbytes, is_float, *held in rows:
        module, _, part = name.rpartition(".")
        if module in forms and forms[module][0] == name:
            _, count, form = forms[module]
            out.append((name, count, nbytes, form is None) + (() if form is None else (form,)))
        elif module in forms and part in SIDE_PARTS:
            out.append((name, 0, nbytes, False, 0))
        else:
            out.append((name, p, nbytes, is_float, *held))
    embedding = next((m for m in forms if m.endswith("embed_tokens")), None)
    if tied and embedding is not None and not any(name.startswith("lm_head.") for name in params):
        out.append(_tied_head(config, qc, embedding, forms[embedding][1], shapes))
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


def _bits(config: dict, qc: dict, module: str) -> int | None:
    if qc.get("quant_method") == compressed_tensors.QUANT_METHOD:
        return compressed_tensors.module_bits({**config, "quantization_config": qc}, module)
    return 4  # the GPTQ-layout and AWQ loaders take 4 bits only


def _held_form(config: dict, qc: dict, module: str, params: int, shapes: dict) -> int | None:
    """Bytes the module is held in when not as floats; None: dequantized to the compute dtype."""
    if module + ".weight_scale" not in shapes and module + ".scales" not in shapes:
        return None
    geometry = _geometry(module, params, shapes)
    if geometry is None:
        return None
    n, k, group = geometry
    bits = _bits(config, qc, module)
    embedding = module.endswith("embed_tokens")
    if bits == 4 and not embedding and packable((n, k), group):
        return held_bytes(params, group)
    if bits == 8 and embedding and module + ".weight_g_idx" not in shapes:
        return params + n * (k // group) * 8
    return None


def _tied_head(config: dict, qc: dict, embedding: str, count: int, shapes: dict) -> Row:
    """The lm_head row of a tied quantized embedding: nothing over an embedding held int8 (it shares the codes),
    packed when the embedding is 4-bit and packable, else float."""
    geometry = _geometry(embedding, count, shapes)
    if geometry is None:
        return "lm_head.weight", count, 0, True
    n, k, group = geometry
    bits = _bits(config, qc, embedding)
    if bits == 8 and _held_form(config, qc, embedding, count, shapes) is not None:
        return "lm_head.weight", count, 0, False, 0
    if bits == 4 and packable((n, k), group):
        return "lm_head.weight", count, 0, False, held_bytes(count, group)
    return "lm_head.weight", count, 0, True
