"""The memory shape of a model (budget.ModelMemorySpec), from its config.json or from its checkpoint's headers.

`spec_from_config` estimates weight bytes from the config and a quantization scheme (what `deltaserve plan` does
with a config.json alone); `spec_from_checkpoint` reads exact bytes from safetensors headers or GGUF tensor
infos without touching tensor data. The vision tower and MTP head are counted apart from the language model: the
MTP head is never loaded, the tower is the ledger's own line (budget.py) unless --language-model-only.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from deltaserve.budget import ModelMemorySpec, VisionShape, WeightGroup
from deltaserve.config import DTYPE_BYTES

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
NESTED_TYPES = ("qwen3_5", "qwen3_5_moe")  # vision-language checkpoints: the LM lives in text_config
GATED_ATTENTION_TYPES = HYBRID_TYPES  # q_proj also produces the output gate: 2 x heads x head_dim
QK_NORM_TYPES = ("qwen3",) + HYBRID_TYPES
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
VISION_RE = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")
MTP_RE = re.compile(r"^(model\.)?mtp\.")
GGUF_ARCHS = {"llama": "llama", "qwen3": "qwen3", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",
              "qwen3next": "qwen3_next"}


class SpecError(ValueError):
    """The model cannot be described: unsupported type, missing field, unreadable header."""


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


def spec_from_config(config: dict, *, quant: str | None = None, embed_quant: str | None = None,
                     lm_head_quant: str | None = None) -> ModelMemorySpec:
    """The memory shape of a model from its config.json; weight bytes estimated from the quantization scheme.

    `quant` overrides the config's quantization_config for the decoder's linear layers; `embed_quant` /
    `lm_head_quant` quantize the embedding / lm_head (field notes: INT8 embedding, INT4 lm_head).
    """
    spec, text = _shape(config)
    rules = _QuantRules(config, quant, embed_quant, lm_head_quant)
    dtype = _float_dtype(config, text)
    prefix = "model.language_model." if spec.model_type in NESTED_TYPES else "model."
    groups = {"embedding": [], "lm_head": [], "layers": []}
    embedding = rules.embedding()
    groups["embedding"].append((prefix + "embed_tokens", spec.vocab_size, spec.hidden_size, embedding))
    if not spec.tie_word_embeddings:
        groups["lm_head"].append(("lm_head", spec.vocab_size, spec.hidden_size, rules.linear("lm_head")))
    for name, out_f, in_f, count, is_linear in _layer_tensors(spec, text, prefix):
        scheme = rules.linear(name) if is_linear else None
        groups["layers"].extend([(name, out_f, in_f, scheme)] * count)
    groups["layers"].append((prefix + "norm", spec.hidden_size, 1, None))
    spec.weight_groups = [_estimate_group(n, items, dtype) for n, items in groups.items() if items]
    if spec.tie_word_embeddings and embedding is not None:
        spec.weight_groups.insert(1, _tied_head_estimate(spec.vocab_size, spec.hidden_size, embedding))
    spec.weight_groups += _excluded_estimates(config, text, dtype)
    spec.quantization = rules.describe()
    return spec


def spec_from_checkpoint(path: str | Path) -> ModelMemorySpec:
    """Exact weight bytes from a checkpoint folder (safetensors), a .gguf file, or an estimate from a config.json."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: no such file or folder")
    if path.is_file() and path.suffix == ".gguf":
        return _spec_from_gguf(path)
    if path.is_file():
        return spec_from_config(_read_json(path))
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists() and len(ggufs) == 1:
        return _spec_from_gguf(ggufs[0])
    config = _read_json(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return spec_from_config(config)
    spec, _ = _shape(config)
    bits = _config_bits(config)
    spec.weight_groups = _groups_from_tensors(_held_safetensors(config, files, bits, spec.tie_word_embeddings))
    _int8_embedding_held(spec, files)
    spec.weight_source = "checkpoint headers"
    spec.quantization = _describe_config_quant(config)
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
    byte a weight plus a float32 scale and offset per group, not params x dtype; a tied lm_head over a 4-bit embedding
    shares its dequantized table, and one over an int8-held embedding multiplies its codes (weights/held.py: 0
    bytes)."""
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
    if eight_bit:
        embedding.held_dequantized_bytes = embedding.params + math.prod(index[scale][1]) * 2 * 4


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: missing (a model folder needs a config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: not valid JSON ({e})") from None


def _shape(config: dict) -> tuple[ModelMemorySpec, dict]:
    """The architecture numbers (no weights yet) and the text config they came from."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecError(f"model_type {model_type!r} is not supported: supported are {', '.join(SUPPORTED_MODEL_TYPES)}")
    text = {**config, **config.get("text_config", {})} if model_type in NESTED_TYPES else config
    try:
        hidden, layers, heads = text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]
        kinds = _layer_kinds(text, model_type)
        spec = ModelMemorySpec(
            model_type=model_type, vocab_size=text["vocab_size"], hidden_size=hidden, num_layers=layers,
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            attention_layers=kinds.count("attention"), num_attention_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or hidden // heads, intermediate_size=text.get("intermediate_size", 0),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )
        vision = config.get("vision_config")
        if vision and model_type in NESTED_TYPES:
            spec.vision = VisionShape(
                hidden_size=vision.get("hidden_size", 1152), intermediate_size=vision.get("intermediate_size", 4304),
                depth=vision.get("depth", 27), patch_size=vision.get("patch_size", 16),
                merge_size=vision.get("spatial_merge_size", 2),
                temporal_patch_size=vision.get("temporal_patch_size", 2), in_channels=vision.get("in_channels", 3),
                out_hidden_size=vision.get("out_hidden_size", hidden))
        if model_type in HYBRID_TYPES:
            spec.gdn_layers = kinds.count("gdn")
            spec.gdn_num_v_heads, spec.gdn_key_head_dim = text["linear_num_value_heads"], text["linear_key_head_dim"]
            spec.gdn_value_head_dim = text["linear_value_head_dim"]
            spec.gdn_conv_kernel = text["linear_conv_kernel_dim"]
            key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
            spec.gdn_conv_dim = 2 * key_dim + spec.gdn_num_v_heads * spec.gdn_value_head_dim
        if text.get("num_experts"):
            spec.num_experts, spec.num_experts_per_tok = text["num_experts"], text["num_experts_per_tok"]
            spec.moe_intermediate_size = text["moe_intermediate_size"]
            spec.shared_expert_intermediate_size = text.get("shared_expert_intermediate_size", 0)
            spec.moe_layers = sum(_is_moe_layer(text, i) for i in range(layers))
    except KeyError as e:
        raise SpecError(f"config of model_type {model_type!r} lacks {e.args[0]!r}") from None
    return spec, text


def _layer_kinds(text: dict, model_type: str) -> list[str]:
    n = text["num_hidden_layers"]
    if model_type not in HYBRID_TYPES:
        return ["attention"] * n
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise SpecError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}")
    return ["attention" if t == "full_attention" else "gdn" for t in types]


def _is_moe_layer(text: dict, i: int) -> bool:
    step = text.get("decoder_sparse_step", 1)
    return i not in (text.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _layer_tensors(spec: ModelMemorySpec, text: dict, prefix: str):
    """(name, out_features, in_features, count, is_linear) for every decoder tensor, in checkpoint names."""
    h, d = spec.hidden_size, spec.head_dim
    q_out = spec.num_attention_heads * d * (2 if spec.model_type in GATED_ATTENTION_TYPES else 1)
    bias = bool(text.get("attention_bias", False))
    kinds = _layer_kinds(text, spec.model_type)
    for i, kind in enumerate(kinds):
        p = f"{prefix}layers.{i}."
        yield p + "input_layernorm", h, 1, 1, False
        yield p + "post_attention_layernorm", h, 1, 1, False
        if kind == "attention":
            a = p + "self_attn."
            yield a + "q_proj", q_out, h, 1, True
            yield a + "k_proj", spec.num_kv_heads * d, h, 1, True
            yield a + "v_proj", spec.num_kv_heads * d, h, 1, True
            yield a + "o_proj", h, spec.num_attention_heads * d, 1, True
            if bias:
                yield a + "biases", q_out + 2 * spec.num_kv_heads * d + h, 1, 1, False
            if spec.model_type in QK_NORM_TYPES:
                yield a + "q_norm", d, 1, 1, False
                yield a + "k_norm", d, 1, 1, False
        else:
            g, hv, dv = p + "linear_attn.", spec.gdn_num_v_heads, spec.gdn_value_head_dim
            yield g + "in_proj_qkv", spec.gdn_conv_dim, h, 1, True
            yield g + "in_proj_z", hv * dv, h, 1, True
            yield g + "in_proj_b", hv, h, 1, True
            yield g + "in_proj_a", hv, h, 1, True
            yield g + "conv1d", spec.gdn_conv_dim, spec.gdn_conv_kernel, 1, False
            yield g + "dt_bias_A_log", 2 * hv, 1, 1, False
            yield g + "norm", dv, 1, 1, False
            yield g + "out_proj", h, hv * dv, 1, True
        m = p + "mlp."
        if spec.num_experts and _is_moe_layer(text, i):
            e, ei = spec.num_experts, spec.moe_intermediate_size
            yield m + "gate", e, h, 1, True
            yield m + "experts.0.gate_proj", ei, h, e, True
            yield m + "experts.0.up_proj", ei, h, e, True
            yield m + "experts.0.down_proj", h, ei, e, True
            if spec.shared_expert_intermediate_size:
                si = spec.shared_expert_intermediate_size
                yield m + "shared_expert.gate_proj", si, h, 1, True
                yield m + "shared_expert.up_proj", si, h, 1, True
                yield m + "shared_expert.down_proj", h, si, 1, True
                yield m + "shared_expert_gate", 1, h, 1, True
        else:
            inter = text["intermediate_size"]
            yield m + "gate_proj", inter, h, 1, True
            yield m + "up_proj", inter, h, 1, True
            yield m + "down_proj", h, inter, 1, True


def _estimate_group(name: str, items, dtype_bytes: int, excluded: bool = False) -> WeightGroup:
    """A group's bytes on disk (the scheme's checkpoint size) and held (what a load of that checkpoint keeps:
    weights/held.py, the price the checkpoint-header ledger uses, so a plan from config.json alone equals it)."""
    params = stored = float_params = quantized = quantized_torch = 0
    held_dequantized = None
    for _, out_f, in_f, scheme in items:
        params += out_f * in_f
        if scheme is None:
            float_params += out_f * in_f
            stored += out_f * in_f * dtype_bytes
            continue
        stored += scheme.tensor_bytes(out_f, in_f)
        held = scheme.held_bytes(out_f, in_f, embedding=name == "embedding")
        if held is None:
            float_params += out_f * in_f
        else:
            quantized += held
            quantized_torch += scheme.held_bytes(out_f, in_f, embedding=name == "embedding", torch_int4=True)
            if name == "embedding":  # an 8-bit table stays int8 with --dequantize-weights too
                held_dequantized = held
    return WeightGroup(name, params, stored, float_params, quantized, excluded, held_dequantized, quantized_torch)


def _tied_head_estimate(vocab: int, hidden: int, embedding: QuantScheme) -> WeightGroup:
    """The lm_head tied to a quantized embedding: its own weight once loaded (weights/held.py), nothing on disk;
    packed from a 4-bit table (dequantized, it shares the embedding's floats), floats from any other."""
    held = embedding.tied_head_held_bytes(vocab, hidden)
    if held is None:
        return WeightGroup("lm_head", vocab * hidden, 0, vocab * hidden, 0)
    return WeightGroup("lm_head", vocab * hidden, 0, 0, held, held_dequantized_bytes=0,
                       torch_int4_bytes=embedding.tied_head_held_bytes(vocab, hidden, torch_int4=True))


def _excluded_estimates(config: dict, text: dict, dtype_bytes: int) -> list[WeightGroup]:
    """Vision tower and MTP head: on disk, not loaded when only the language model is served."""
    groups = []
    vision = config.get("vision_config")
    if vision:
        vh, vi = vision.get("hidden_size", 1152), vision.get("intermediate_size", 4304)
        merged = vh * vision.get("spatial_merge_size", 2) ** 2
        block = 4 * vh * vh + 2 * vh * vi + 9 * vh + vi  # qkv, proj, fc1, fc2, biases, two LayerNorms
        patch_pixels = vision.get("temporal_patch_size", 2) * vision.get("patch_size", 16) ** 2
        patch = vh * vision.get("in_channels", 3) * patch_pixels
        merger = merged * merged + vision.get("out_hidden_size", text["hidden_size"]) * merged + 2 * merged
        params = vision.get("depth", 27) * block + patch + vision.get("num_position_embeddings", 2304) * vh + merger
        groups.append(WeightGroup("vision", params, params * dtype_bytes, params, 0, excluded=True))
    mtp_layers = text.get("mtp_num_hidden_layers") or config.get("mtp_num_hidden_layers") or 0
    if mtp_layers:
        h, d = text["hidden_size"], text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        attn = (3 * text["num_attention_heads"] + 2 * text["num_key_value_heads"]) * d * h
        mlp = 3 * h * text.get("intermediate_size", 0) if not text.get("num_experts") else 3 * h * (
            text["num_experts"] * text["moe_intermediate_size"] + text.get("shared_expert_intermediate_size", 0))
        params = mtp_layers * (attn + mlp + 2 * h * h + 6 * h)  # + fc (2h -> h) and norms
        groups.append(WeightGroup("mtp", params, params * dtype_bytes, params, 0, excluded=True))
    return groups


def _float_dtype(config: dict, text: dict, default: str = "bfloat16") -> int:
    """Bytes of the dtype the config names (its own or its text_config's), `default` where it names none."""
    name = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return DTYPE_BYTES.get(str(name or default), DTYPE_BYTES[default])


def _scale_bytes(config: dict) -> int:
    """Bytes of a compressed-tensors scale: stored in the model's dtype (float32 where the config names none, as
    transformers then builds the model)."""
    return _float_dtype(config, config.get("text_config") or {}, default="float32")


class _QuantRules:
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


def _config_bits(config: dict) -> int:
    qc = config.get("quantization_config") or {}
    for group in qc.get("config_groups", {}).values():
        if (group.get("weights") or {}).get("num_bits"):
            return group["weights"]["num_bits"]
    return qc.get("bits", 4)


def _describe_config_quant(config: dict) -> str:
    qc = config.get("quantization_config")
    return f"{qc.get('quant_method', 'quantized')} (from config)" if qc else "none"


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
    """Groups from (name, params, stored bytes, held as floats?[, bytes held packed[, the same on CUDA in bfloat16]])
    per tensor."""
    groups: dict[str, WeightGroup] = {}
    for name, params, nbytes, is_float, *held in tensors:
        key = _group_of(name)
        g = groups.setdefault(key, WeightGroup(key, 0, 0, 0, 0, excluded=key in ("vision", "mtp"), torch_int4_bytes=0))
        g.params += params
        g.stored_bytes += nbytes
        if is_float:
            g.float_params += params
        else:
            g.quantized_bytes += held[0] if held else nbytes
            g.torch_int4_bytes += held[-1] if held else nbytes
    order = ("embedding", "lm_head", "layers", "vision", "mtp")
    return [groups[k] for k in order if k in groups]


def _spec_from_gguf(path: Path) -> ModelMemorySpec:
    """Config synthesized from the GGUF metadata ({arch}.* keys); weight bytes from the tensor infos."""
    from deltaserve.weights import CheckpointError
    from deltaserve.weights.gguf import open_gguf  # the loader's reader (parsed once for the spec and the load)

    try:
        reader = open_gguf(path)
    except CheckpointError as e:
        raise SpecError(f"{path}: not a readable GGUF file ({e.problem})") from None
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.token_count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise SpecError(f"{path}: GGUF architecture {arch!r} is not supported: supported are {', '.join(GGUF_ARCHS)}")
    names = {t.name for t in reader.tensors}
    spec, _ = _shape(gguf_config(meta, names))
    spec.weight_groups = _groups_from_tensors(_gguf_held(t) for t in reader.tensors)
    spec.weight_source = "checkpoint headers"
    spec.quantization = "gguf " + ", ".join(sorted({t.tensor_type.name for t in reader.tensors}))
    return spec


def _gguf_held(t) -> tuple:
    """(name, params, stored bytes, held as floats?, bytes held packed[, on CUDA in bfloat16]) of one GGUF tensor.

    What weights/gguf.py keeps packed (kernels/int4.py: half a byte per weight, per 32 the block's float16 scale (and
    Q4_1's float16 offset) or float32 products of two scales (Q4_K, IQ4_XS), the level table of IQ4_NL / IQ4_XS; a
    Q8_0 embedding a byte per weight plus a float32 scale and offset per 32, shared by a tied lm_head) is counted at
    that size; the rest in the compute dtype. On CUDA in bfloat16 the affine 4-bit matrices torch's int4 kernel takes
    are held in its layout (gguf.int4_torch_held_bytes)."""
    from deltaserve.weights.gguf import int4_held_bytes, int4_torch_held_bytes, int8_held_bytes, kept_int4, kept_int8

    params, shape = int(t.n_elements), tuple(int(d) for d in reversed(t.shape))
    if kept_int4(t.tensor_type, t.name, shape):
        matrices = shape[0] if len(shape) == 3 else 1  # stacked experts: one packed matrix each
        return (t.name, params, int(t.n_bytes), False, int4_held_bytes(params, t.tensor_type, matrices),
                int4_torch_held_bytes(shape, t.tensor_type))
    if kept_int8(t.tensor_type, t.name, shape):
        return t.name, params, int(t.n_bytes), False, int8_held_bytes(params)
    return t.name, params, int(t.n_bytes), True


def gguf_config(meta: dict, tensor_names: set[str]) -> dict:
    """A HF-style config dict from GGUF metadata values (key -> contents())."""
    arch = meta["general.architecture"]

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        return max(value) if isinstance(value, list) else value  # per-layer arrays (hybrids): the attention value

    hidden, heads = key("embedding_length"), key("attention.head_count")
    vocab = key("vocab_size") or meta.get("tokenizer.ggml.token_count") or len(meta.get("tokenizer.ggml.tokens", []))
    config = {
        "model_type": GGUF_ARCHS[arch], "hidden_size": hidden, "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length") or key("expert_shared_feed_forward_length") or 0, "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length") or hidden // heads, "vocab_size": vocab,
        "max_position_embeddings": key("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        # llama.cpp's converter: d_state = key head dim, n_group = key heads, dt_rank = value heads.
        for name in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size"):
            if key(name) is None:
                raise SpecError(f"GGUF metadata lacks {arch}.{name}, which a {arch} model needs")
        v_heads = key("ssm.time_step_rank")
        config.update(linear_conv_kernel_dim=key("ssm.conv_kernel"), linear_key_head_dim=key("ssm.state_size"),
                      linear_num_key_heads=key("ssm.group_count"), linear_num_value_heads=v_heads,
                      linear_value_head_dim=key("ssm.inner_size") // v_heads,
                      full_attention_interval=key("full_attention_interval", 4))
        recurrent = meta.get(f"{arch}.attention.recurrent_layers")
        if recurrent:  # the converter's per-layer truth; its full_attention_interval may be a default
            config["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent]
    return config
