"""Weight quantization schemes as the ledger prices them: parsed from a flag or read from a config's
quantization_config, with what a tensor of each scheme costs on disk and held after loading (weights/held.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from deltaserve.budget.errors import SpecError
from deltaserve.config import DTYPE_BYTES

@dataclass(frozen=True)
class QuantScheme:
    """Integer weight quantization: `bits` per weight, one fp16 scale (+ packed zero) per `group_size` inputs."""

    bits: int
    group_size: int = 128  # -1: one scale per output channel
    symmetric: bool = True
    # bytes of a symmetric module's scale, which the loader keeps as stored (compressed-tensors: the model's dtype);
    # None: held as a float32 scale and offset a group (GPTQ / AWQ layouts; weights/held.py)
    kept_scale_bytes: int | None = 2

    def tensor_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes in the checkpoint."""
        groups = 1 if self.group_size <= 0 else math.ceil(in_features / self.group_size)
        packed = out_features * math.ceil(in_features * self.bits / 32) * 4
        scales = out_features * groups * 2
        zeros = 0 if self.symmetric else math.ceil(out_features * self.bits / 32) * 4 * groups
        return packed + scales + zeros + 16  # + the int64[2] weight_shape of compressed-tensors

    def held_bytes(self, out_features: int, in_features: int, embedding: bool, torch_int4: bool = False) -> int | None:
        """Bytes the loader holds this tensor in when not as floats (weights/held.py's price, the one the
        checkpoint-header ledger uses; `torch_int4`: on CUDA in bfloat16); None: dequantized to the compute dtype."""
        from deltaserve.weights.held import module_held_bytes

        group = in_features if self.group_size <= 0 else self.group_size
        return module_held_bytes(out_features, in_features, group, self.bits, embedding,
                                 symmetric_scale_bytes=self._kept_scale_bytes(), torch_int4=torch_int4)

    def tied_head_held_bytes(self, out_features: int, in_features: int, torch_int4: bool = False) -> int | None:
        """Bytes an lm_head tied to an embedding of this scheme is held in when not as floats; None: floats."""
        from deltaserve.weights.held import tied_head_held_bytes

        group = in_features if self.group_size <= 0 else self.group_size
        return tied_head_held_bytes(out_features, in_features, group, self.bits, self._kept_scale_bytes(),
                                    torch_int4=torch_int4)

    def _kept_scale_bytes(self) -> int | None:
        return self.kept_scale_bytes if self.symmetric else None

    def __str__(self) -> str:
        group = "channel" if self.group_size <= 0 else f"g{self.group_size}"
        return f"w{self.bits}a16-{group}" + ("" if self.symmetric else "-asym")


def parse_quant(text: str | None) -> QuantScheme | None:
    """'w4a16-g128', 'w8a16', 'int8' (per channel), 'int4' (g128), '-asym' suffix; 'none'/'bf16' -> None."""
    if text is None or text.lower() in ("none", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"):
        return None
    t = text.lower()
    if t in ("int8", "w8"):
        return QuantScheme(8, -1)
    if t in ("int4", "w4"):
        return QuantScheme(4, 128)
    m = re.fullmatch(r"w(\d+)a16(?:-g(\d+|channel))?(-asym)?", t)
    if not m or int(m.group(1)) not in (2, 3, 4, 8):
        raise SpecError(f"quantization {text!r} is not understood: use e.g. w4a16-g128, w8a16-g128, int8, int4, none")
    group = -1 if m.group(2) == "channel" else int(m.group(2) or 128)
    return QuantScheme(int(m.group(1)), group, m.group(3) is None)


def float_dtype(config: dict, text: dict, default: str = "bfloat16") -> int:
    """Bytes of the dtype the config names (its own or its text_config's), `default` where it names none."""
    name = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return DTYPE_BYTES.get(str(name or default), DTYPE_BYTES[default])


def _scale_bytes(config: dict) -> int:
    """Bytes of a compressed-tensors scale: stored in the model's dtype (float32 where the config names none, as
    transformers then builds the model)."""
    return float_dtype(config, config.get("text_config") or {}, default="float32")


class QuantRules:
    """Which scheme applies to a tensor: overrides first, then the config's quantization_config."""

    def __init__(self, config: dict, quant: str | None, embed_quant: str | None, lm_head_quant: str | None):
        self.override = quant is not None
        self.linear_scheme = parse_quant(quant) if quant is not None else None
        self.embed_override = parse_quant(embed_quant) if embed_quant is not None else None
        self.lm_head_override = parse_quant(lm_head_quant) if lm_head_quant is not None else None
        self.embed_given, self.lm_head_given = embed_quant is not None, lm_head_quant is not None
        self.groups: list[tuple[list[str], QuantScheme]] = []
        self.ignore: list[str] = []
        if not self.override:
            self._read_config(config.get("quantization_config") or {}, _scale_bytes(config))

    def _read_config(self, qc: dict, scale_bytes: int) -> None:
        method = qc.get("quant_method", "")
        if method == "compressed-tensors":
            for group in qc.get("config_groups", {}).values():
                w = group.get("weights") or {}
                if w.get("num_bits"):
                    size = -1 if w.get("strategy") == "channel" else (w.get("group_size") or -1)
                    self.groups.append((group.get("targets", []), QuantScheme(w["num_bits"], size,
                                                                               w.get("symmetric", True),
                                                                               scale_bytes)))
            self.ignore = qc.get("ignore", [])
        elif method in ("gptq", "awq", "auto-round", "autoround"):
            sym = qc.get("sym", not qc.get("zero_point", False))
            self.groups.append((["Linear"], QuantScheme(qc.get("bits", 4), qc.get("group_size", 128), sym,
                                                        kept_scale_bytes=None)))
            self.ignore = ["lm_head"] if not qc.get("lm_head", False) else []
        elif method:
            raise SpecError(f"quantization_config quant_method {method!r} is not supported for estimates: "
                            f"use compressed-tensors, gptq, awq or auto-round, or pass --quant")

    def _matches(self, patterns: list[str], name: str) -> bool:
        return any(re.match(p[3:], name) if p.startswith("re:") else name == p or name.endswith("." + p)
                   for p in patterns)

    def linear(self, name: str) -> QuantScheme | None:
        if name == "lm_head" and self.lm_head_given:
            return self.lm_head_override
        if self.override:
            router = name.endswith(".mlp.gate") or name.endswith("shared_expert_gate")
            return None if router or name == "lm_head" else self.linear_scheme
        if self._matches(self.ignore, name):
            return None
        # compressed-tensors' precedence (weights/compressed_tensors.py): an exact name, then `re:`, then a class
        for kind in (lambda t: not t.startswith("re:") and t not in ("Linear", "Embedding"),
                     lambda t: t.startswith("re:"), lambda t: t == "Linear"):
            for targets, scheme in self.groups:
                if any(kind(t) and (t == "Linear" or self._matches([t], name)) for t in targets):
                    return scheme
        return None

    def embedding(self) -> QuantScheme | None:
        if self.embed_given:
            return self.embed_override
        return next((s for targets, s in self.groups if "Embedding" in targets
                     or any("embed_tokens" in t for t in targets)), None)

    def describe(self) -> str:
        if self.override:
            linear = str(self.linear_scheme)
        else:  # the embedding's own group is named under "embedding", not as a linear scheme
            linear = ", ".join(dict.fromkeys(str(s) for t, s in self.groups if not self._embedding_group(t)))
        parts = [f"linear {linear or 'none'}"]
        if self.embed_given or self.embedding() is not None:
            parts.append(f"embedding {self.embedding() or 'none'}")
        if self.lm_head_given or (self.groups and not self.override):
            parts.append(f"lm_head {self.linear('lm_head') or 'none'}")
        return "; ".join(parts)

    @staticmethod
    def _embedding_group(targets: list[str]) -> bool:
        return bool(targets) and all(t == "Embedding" or "embed_tokens" in t for t in targets)


def config_bits(config: dict) -> int:
    qc = config.get("quantization_config") or {}
    for group in qc.get("config_groups", {}).values():
        if (group.get("weights") or {}).get("num_bits"):
            return group["weights"]["num_bits"]
    return qc.get("bits", 4)


def describe_config_quant(config: dict) -> str:
    qc = config.get("quantization_config")
    return f"{qc.get('quant_method', 'quantized')} (from config)" if qc else "none"
