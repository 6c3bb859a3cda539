"""The memory shape of a model (ModelMemorySpec): everything the ledger needs, nothing about the math.

`spec_from_config` estimates weight bytes from a config.json and a quantization scheme (what `deltaserve plan` does
with a config.json alone); budget/headers.py reads exact bytes from a checkpoint's headers. The vision tower and
MTP head are counted apart from the language model: the MTP head is never loaded, the tower is the ledger's own
line unless --language-model-only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deltaserve.budget.errors import SpecError
from deltaserve.budget.quant import QuantScheme, QuantRules, float_dtype
from deltaserve.config import DTYPE_BYTES

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
NESTED_TYPES = ("qwen3_5", "qwen3_5_moe")  # vision-language checkpoints: the LM lives in text_config
GATED_ATTENTION_TYPES = HYBRID_TYPES  # q_proj also produces the output gate: 2 x heads x head_dim
QK_NORM_TYPES = ("qwen3",) + HYBRID_TYPES
IMAGE_MAX_ASPECT_RATIO = 200  # longer side / shorter side the family's image processor accepts (images.py refuses more)


@dataclass
class WeightGroup:
    """One group of checkpoint tensors (embedding, lm_head, layers, vision, mtp) and what it costs."""

    name: str
    params: int  # logical parameter count (dequantized element count)
    stored_bytes: int  # bytes in the checkpoint; quantized tensors at their packed size
    float_params: int  # elements stored as floats: held in the compute dtype after loading
    quantized_bytes: int  # bytes held when not dequantized: packed codes with their scales / offsets
    excluded: bool = False  # not in the language model's weights line (vision tower: its own line; mtp: unloaded)
    held_dequantized_bytes: int | None = None  # held with dequantize_weights when not params x dtype (INT8 embedding)
    # quantized_bytes with the 4-bit matrices torch's int4 kernel takes held in its layout (CUDA, bfloat16:
    # kernels/int4_torch.py); None: the same as quantized_bytes
    torch_int4_bytes: int | None = None
    # quantized_bytes with the layers the int8-activation swap takes held in its panels (CPU, --activation-dtype int8:
    # GGUF's K-quants as compact as the file, weights/gguf_panels.py); None: the same as quantized_bytes
    panel_bytes: int | None = None


@dataclass
class VisionShape:
    """A vision tower's sizes (Qwen3.5 family): what its workspace and its image tokens cost."""

    hidden_size: int
    intermediate_size: int
    depth: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    in_channels: int
    out_hidden_size: int

    def max_image_tokens(self, max_pixels: int) -> int:
        """Language-model tokens of the largest image the resize (to at most max_pixels) can produce.

        The resize keeps each side at least one factor (patch x merge), so a thin image can pass max_pixels: at the
        processor's 200:1 limit its short side is held at one factor and its long side reaches
        sqrt(200 x max_pixels) (rounded up, as the min_pixels branch rounds)."""
        side = self.patch_size * self.merge_size
        thin = -(-(math.isqrt(IMAGE_MAX_ASPECT_RATIO * max_pixels) + 1) // side)
        return max(max_pixels // (side * side), thin, 1)

    def workspace_elements(self, max_pixels: int) -> int:
        """Elements live while the tower encodes its largest image: per patch its pixels, the residual, the norm,
        q k v (and their rotated copies), the attention output and the MLP's hidden (attention itself runs
        block-wise, never [patches, patches]); then the merged rows and the output."""
        tokens = self.max_image_tokens(max_pixels)
        patches = tokens * self.merge_size ** 2
        h, i = self.hidden_size, self.intermediate_size
        patch_pixels = self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        merged = h * self.merge_size ** 2
        return patches * (patch_pixels + 9 * h + 2 * i) + tokens * (2 * merged + self.out_hidden_size)


@dataclass
class ModelMemorySpec:
    """The memory shape of a model: everything the ledger needs, nothing about the math."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    attention_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    gdn_layers: int = 0
    gdn_conv_dim: int = 0  # key_dim * 2 + value_dim: channels of the causal conv
    gdn_conv_kernel: int = 0  # conv width W; the state keeps W - 1 inputs
    gdn_num_v_heads: int = 0  # Hv
    gdn_key_head_dim: int = 0  # Dk
    gdn_value_head_dim: int = 0  # Dv
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0
    tie_word_embeddings: bool = False
    weight_groups: list[WeightGroup] = field(default_factory=list)
    weight_source: str = "estimated from config + quantization scheme"
    quantization: str = "none"
    vision: VisionShape | None = None  # a multimodal checkpoint's tower (its weights: the "vision" group)

    @property
    def weight_bytes(self) -> int:
        """Checkpoint bytes of what is loaded (excluded groups left out)."""
        return sum(g.stored_bytes for g in self.weight_groups if not g.excluded)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """K and V of every attention layer for one token."""
        return self.attention_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def state_bytes_per_slot(self, state_dtype: str) -> int:
        """Conv state (W - 1 inputs) and recurrent state [Hv, Dk, Dv] of every GDN layer for one request."""
        return self.gdn_layers * self.state_elements_per_layer() * DTYPE_BYTES[state_dtype]

    def state_elements_per_layer(self) -> int:
        conv = self.gdn_conv_dim * max(self.gdn_conv_kernel - 1, 0)
        return conv + self.gdn_num_v_heads * self.gdn_key_head_dim * self.gdn_value_head_dim


def spec_from_config(config: dict, *, quant: str | None = None, embed_quant: str | None = None,
                     lm_head_quant: str | None = None) -> ModelMemorySpec:
    """The memory shape of a model from its config.json; weight bytes estimated from the quantization scheme.

    `quant` overrides the config's quantization_config for the decoder's linear layers; `embed_quant` /
    `lm_head_quant` quantize the embedding / lm_head (field notes: INT8 embedding, INT4 lm_head).
    """
    spec, text = spec_shape(config)
    rules = QuantRules(config, quant, embed_quant, lm_head_quant)
    dtype = float_dtype(config, text)
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


def spec_shape(config: dict) -> tuple[ModelMemorySpec, dict]:
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
            if bias:  # q, k, v and (transformers' attention_bias; a GGUF's o_bias says apart) o_proj
                o_bias = h if text.get("o_bias", True) else 0
                yield a + "biases", q_out + 2 * spec.num_kv_heads * d + o_bias, 1, 1, False
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
