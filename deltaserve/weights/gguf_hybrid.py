"""llama.cpp's GGUF form of the Gated-DeltaNet hybrids (qwen35, qwen35moe, qwen3next), mapped back to transformers'.

llama.cpp's converter (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase) stores, per GDN layer:
A_log as -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the conv kernel squeezed to [channels, kernel], every
RMSNorm weight but the GDN output norm plus one (transformers' Qwen3.5 norms scale by 1 + w; llama.cpp's by w),
and, when there are more value heads than key heads, the value heads reordered from grouped-by-key-head to tiled
(rows of the v part of in_proj_qkv, of in_proj_z / in_proj_a / in_proj_b, A_log, dt_bias, the conv's v channels;
columns of out_proj). Each is undone here, so the tensors equal the checkpoint the converter read.

The MoE layers (Qwen2MoeModel's part of the converter): the routed experts stacked into one 3-D tensor per
projection (`ffn_{gate,up,down}_exps`, [experts, out, in]) are split back into per-expert matrices; the router,
the shared expert and its gate keep their own tensors. Qwen3-Next (Qwen3NextModel) splits in_proj_qkvz, stored per
key head as [q, k, v, z], into attn_qkv (all q, all k, all v) and attn_gate (all z): fused back here
(`qkvz_order`); in_proj_ba is stored as is (`ssm_ba`).
"""

import numpy as np

ARCHITECTURES = {
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
}
LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_dt": "linear_attn.dt",  # ssm_dt.bias -> linear_attn.dt_bias (see hf_name)
    "ssm_ba": "linear_attn.in_proj_ba",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [experts, out, in]: split by expert_names
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
STACKED_EXPERTS = tuple(f"mlp.experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
QKVZ_PARTS = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")
BARE_NAMES = {"ssm_a": "linear_attn.A_log"}  # tensors with no .weight / .bias suffix
PLUS_ONE_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm",
                  "pre_fc_norm_embedding", "pre_fc_norm_hidden", "mtp.norm")
# The MTP head's own tensors as the converter names them in its block (its layer's are a decoder layer's names)
NEXTN_NAMES = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
               "shared_head_norm": "norm"}


SSM_KEYS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size")


def hybrid_config(arch: str, meta, required, config: dict) -> dict:
    """`config` (the common keys) completed with the hybrid's GDN, layer pattern and rotary keys; `required(key)`
    raises the one-line error for a missing key."""
    for key in SSM_KEYS:
        required(key)
    v_heads = meta("ssm.time_step_rank")
    recurrent = meta("attention.recurrent_layers")  # with MTP blocks: one entry each past the decoder's
    if recurrent is not None:
        recurrent = recurrent[:config["num_hidden_layers"]]
    else:
        interval = meta("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(config["num_hidden_layers"])]
    head_dim = config["head_dim"]
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
            "partial_rotary_factor": meta("rope.dimension_count", head_dim) / head_dim}
    sections = meta("rope.dimension_sections")
    if arch in ("qwen35", "qwen35moe") and sections:
        rope.update(mrope_section=[s for s in sections if s][:3], mrope_interleaved=True)
    architecture, model_type = ARCHITECTURES[arch]
    config.update(
        architectures=[architecture], model_type=model_type, rope_parameters=rope,
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
        linear_conv_kernel_dim=meta("ssm.conv_kernel"), linear_key_head_dim=meta("ssm.state_size"),
        linear_num_key_heads=meta("ssm.group_count"), linear_num_value_heads=v_heads,
        linear_value_head_dim=meta("ssm.inner_size") // v_heads)
    if meta("expert_count"):
        config.update(num_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
                      moe_intermediate_size=meta("expert_feed_forward_length"),
                      shared_expert_intermediate_size=meta("expert_shared_feed_forward_length"))
    return config


def mtp_name(gguf_name: str, index: int, layer_name) -> str | None:
    """The checkpoint name of a tensor of MTP block `index` (blk.{L + index}.*, L the decoder's layers): llama.cpp's
    converter (conversion/qwen.py, _QwenMtpMixin) writes mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm
    as blk.{L}.nextn.{eh_proj, enorm, hnorm, shared_head_norm} and mtp.layers.{i}.* as blk.{L + i}.*, every norm
    plus one like the model's (undone by to_checkpoint). `layer_name`: the decoder layers' mapping (gguf.hf_name)."""
    parts = gguf_name.split(".")
    if len(parts) == 5 and parts[2] == "nextn" and parts[3] in NEXTN_NAMES:
        return f"mtp.{NEXTN_NAMES[parts[3]]}.{parts[4]}"
    inner = layer_name(".".join(["blk", "0", *parts[2:]]))
    if inner is None or not inner.startswith("model.layers.0."):
        return None
    return f"mtp.layers.{index}.{inner[len('model.layers.0.'):]}"


def value_head_order(config: dict, head_dim: int) -> np.ndarray | None:
    """perm with gguf_rows = hf_rows[perm] over num_value_heads * head_dim rows (None: no reorder was applied).

    The converter reshapes [key_heads, values_per_key, head_dim] to [values_per_key, key_heads, head_dim]."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if k_heads == v_heads or config["model_type"] == "qwen3_next":
        return None
    index = np.arange(v_heads * head_dim).reshape(k_heads, v_heads // k_heads, head_dim)
    return index.transpose(1, 0, 2).reshape(-1)


def row_order(config: dict, hf: str) -> np.ndarray | None:
    """perm with stored_rows = hf_rows[perm] for a GDN tensor's output rows, None when stored in HF order."""
    if ".linear_attn." not in hf:
        return None
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        order = value_head_order(config, config["linear_value_head_dim"])
        return None if order is None else np.concatenate([np.arange(2 * key_dim), 2 * key_dim + order])
    if hf.endswith("in_proj_z.weight"):
        return value_head_order(config, config["linear_value_head_dim"])
    if hf.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return value_head_order(config, 1)
    return None


def column_order(config: dict, hf: str) -> np.ndarray | None:
    """perm with stored_columns = hf_columns[perm] (out_proj's value-head inputs), None when in HF order."""
    if hf.endswith("linear_attn.out_proj.weight"):
        return value_head_order(config, config["linear_value_head_dim"])
    return None


def to_checkpoint(config: dict, hf: str, values: np.ndarray) -> np.ndarray:
    """A dequantized tensor in HF shape (reversed ne) mapped back to the checkpoint's values and layout."""
    rows = row_order(config, hf)
    if rows is not None:
        values = _unpermute(values, rows, axis=0)
    columns = column_order(config, hf)
    if columns is not None:
        values = _unpermute(values, columns, axis=1)
    if hf.endswith("A_log"):
        values = np.log(-values.astype(np.float64)).astype(np.float32)
    elif hf.endswith("conv1d.weight"):
        values = values[:, None, :]
    elif hf.endswith("shared_expert_gate.weight") and values.ndim == 1:  # llama-quantize writes it as {n_embd}
        values = values[None, :]
    elif hf.endswith(".weight") and hf[:-len(".weight")].endswith(PLUS_ONE_NORMS):
        values = values - np.float32(1)
    return values


def _unpermute(values: np.ndarray, perm: np.ndarray, axis: int) -> np.ndarray:
    """x with x.take(perm, axis) == values: the inverse of a gather by perm."""
    out = np.empty_like(values)
    index = [slice(None)] * values.ndim
    index[axis] = perm
    out[tuple(index)] = values
    return out


def expert_names(hf: str, experts: int) -> list[str] | None:
    """The per-expert names of a stacked expert tensor (model.layers.L.mlp.experts.E.P.weight), None for others."""
    if not hf.endswith(STACKED_EXPERTS):
        return None
    stem, _, leaf = hf[: -len(".weight")].rpartition(".")
    return [f"{stem}.{e}.{leaf}.weight" for e in range(experts)]


def qkvz_part(config: dict, hf: str) -> bool:
    """Whether `hf` is one of the two halves of a Qwen3-Next in_proj_qkvz."""
    return config["model_type"] == "qwen3_next" and hf.endswith(QKVZ_PARTS)


def qkvz_order(config: dict) -> np.ndarray:
    """perm with in_proj_qkvz = cat([in_proj_qkv, in_proj_z])[perm]: per key head, its q, k, v and z rows."""
    kh, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    vd = config["linear_num_value_heads"] // kh * config["linear_value_head_dim"]
    q, k = np.arange(kh * dk).reshape(kh, dk), kh * dk + np.arange(kh * dk).reshape(kh, dk)
    v = 2 * kh * dk + np.arange(kh * vd).reshape(kh, vd)
    z = 2 * kh * dk + kh * vd + np.arange(kh * vd).reshape(kh, vd)
    return np.concatenate([q, k, v, z], axis=1).reshape(-1)
