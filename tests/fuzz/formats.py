"""Writing a drawn case's checkpoint in its format, each by the format's own tool, and returning the oracle:
transformers (float32) holding the weights that format's own tool decompresses the checkpoint to.

- safetensors: transformers' save_pretrained, float32 or bfloat16 (the oracle holds the bfloat16-rounded weights);
- compressed_tensors: compressed-tensors' own compressor (tests/test_weights_compressed_tensors.py's recipe), the
  oracle its own decompress_model;
- gptq / awq: every fitting decoder linear packed by AutoRound's packers (tests/test_weights_gptq.py's
  packed_module / awq_module), the oracle the packages' own dequantization;
- gguf: gguf-py's writer (tests/test_weights_gguf.py's write_gguf), names by gguf-py's TensorNameMap, llama's
  rotary permutation as llama.cpp's converter does it, each 2-D tensor quantized by gguf-py; the oracle gguf-py's
  dequantization.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

from .draw import Case, Format
from tests.random_parameters import draw_constant_parameters_
from tests.test_models_hybrid import randomize_, save_tiny_tokenizer

MODEL_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
}


def random_model(case: Case) -> torch.nn.Module:
    """The case's tiny random model: norms and dt_bias moved off their 0 / 1 initial values, and every other parameter
    the config initialises to a constant (attention biases) drawn (a bias left at zero proves nothing)."""
    config_cls, model_cls = MODEL_CLASSES[case.family]
    torch.manual_seed(case.seed)
    config = config_cls(**case.config)
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    randomize_(model)
    draw_constant_parameters_(model)
    return model


def save(case: Case, folder: Path) -> tuple[torch.nn.Module, Path]:
    """Write the case's checkpoint under `folder`; (the oracle, the path to give the engine)."""
    model = random_model(case)
    save_format = {"safetensors": save_safetensors, "compressed_tensors": save_compressed_tensors,
                   "gptq": save_gptq, "awq": save_gptq, "gguf": save_gguf}[case.fmt.kind]
    ref, path = save_format(model, case.fmt, folder, case.seed)
    if case.engine.get("speculative") == "mtp":  # a random MTP head beside the weights (draw.MTP_RATE)
        from tests.test_speculative_mtp import add_mtp_head

        add_mtp_head(path, seed=f"fuzz-mtp-{case.seed}")
    return ref, path


def save_safetensors(model, fmt: Format, folder: Path, seed: int):
    if fmt.dtype == "float32":
        model.save_pretrained(folder)
    else:  # a bfloat16 copy saved; the oracle takes its rounded weights, not its rounded rotary buffers
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
        model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    save_tiny_tokenizer(folder)
    return model, folder


def save_compressed_tensors(model, fmt: Format, folder: Path, seed: int):
    """test_weights_compressed_tensors.make_checkpoint's steps on a drawn scheme."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    from tests.test_weights_compressed_tensors import INT8_EMBED, minmax_qparams_, w

    groups = {"body": {"targets": ["Linear"], "weights": w(fmt.bits, fmt.group, fmt.symmetric)}}
    if fmt.int8_embedding:
        groups["embed"] = INT8_EMBED
    # in_proj_a / b and the shared expert's gate have fewer than 8 rows: the library's own unpacker fails on a
    # zero point packed from them (see the test above)
    ignore = ["lm_head", r"re:.*linear_attn\.in_proj_[ab]$", r"re:.*shared_expert_gate$"]
    if fmt.bits == 4 and not fmt.symmetric:  # Qwen3-Next's fused in_proj_ba: 2 Hv rows, as few as 2
        ignore.append(r"re:.*linear_attn\.in_proj_ba$")
    tied = model.config.tie_word_embeddings
    qconfig = QuantizationConfig.model_validate(dict(
        config_groups=groups, ignore=ignore, format="pack-quantized" if fmt.packed else "int-quantized",
        quantization_status="frozen"))
    apply_quantization_config(model, qconfig, show_progress=False)
    minmax_qparams_(model)
    compressor = ModelCompressor.from_pretrained_model(model, qconfig.format)
    compressor.compress_model(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    model.config.save_pretrained(folder)
    save_file(state, folder / "model.safetensors")
    compressor.update_config(str(folder))
    save_tiny_tokenizer(folder)

    compressor.decompress_model(model)
    ref = type(model)(model.config).eval()
    plain = ref.state_dict()
    # tied: the compressed model's lm_head still holds the float table it shared before compression
    keep = {k: v for k, v in model.state_dict().items() if k in plain and not (tied and k == "lm_head.weight")}
    ref.load_state_dict(keep, strict=not tied)
    ref.tie_weights()
    return ref, folder


def save_gptq(model, fmt: Format, folder: Path, seed: int):
    """test_weights_gptq.make_tiny_qwen3's steps on any family: each decoder linear whose shape the packer takes
    (in-features a multiple of the group, out-features of 32 for GPTQ, of 8 for AWQ) packed, the rest kept float."""
    from tests.test_weights_gptq import AWQ_CONFIGS, PACKINGS, awq_module, packed_module

    rng = np.random.default_rng(seed)
    group = fmt.group or 32
    packing = list(PACKINGS)[seed % len(PACKINGS)]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    packed = 0
    for i, (name, linear) in enumerate((n, m) for n, m in model.named_modules()
                                       if isinstance(m, torch.nn.Linear) and n != "lm_head"):
        n, k = linear.weight.shape
        if k % group or k % 32 or n % (8 if fmt.kind == "awq" else 32):
            continue
        if fmt.kind == "awq":
            tensors, expected = awq_module(n, k, group, symmetric=fmt.symmetric, seed=seed + i, exact=True)
        else:
            # the package's own forward (its dequantization) fails with a g_idx where out-features exceed in-features
            act_order = fmt.act_order and n <= k and bool(rng.integers(2))
            tensors, expected = packed_module(PACKINGS[packing], n, k, group, act_order=act_order, seed=seed + i,
                                                  exact=True)
        with torch.no_grad():
            linear.weight.copy_(expected)
        del state[name + ".weight"]
        state.update({f"{name}.{part}": t for part, t in ((p.split(".")[1], t) for p, t in tensors.items())})
        packed += 1
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data["quantization_config"] = (dict(AWQ_CONFIGS["auto_round:auto_awq" if seed % 2 else "awq"], group_size=group)
                                   if fmt.kind == "awq" else
                                   {"quant_method": "auto-round", "bits": 4, "group_size": group, "sym": False,
                                    "packing_format": packing})
    (folder / "config.json").write_text(json.dumps(data))
    save_file(state, folder / "model.safetensors")
    save_tiny_tokenizer(folder)
    return model, folder


def save_gguf(model, fmt: Format, folder: Path, seed: int):
    """llama / qwen3 as one GGUF file: each 2-D tensor in its drawn type (gguf-py's quantizer), norms F32."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from tests.test_weights_gguf import llama_cpp_permute, write_gguf

    config = model.config
    arch = config.model_type
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    stored, dequantized = {}, {}
    for index, (name, tensor) in enumerate(sorted(state.items())):
        base, _, suffix = name.rpartition(".")
        value = tensor.numpy().astype(np.float32)
        kind = Q[fmt.gguf_types[index % len(fmt.gguf_types)]] if value.ndim == 2 else Q.F32
        # block quantization runs along a row; the rotary permutation moves whole rows: quantize-then-permute
        # equals permute-then-quantize, so the oracle is the dequantized tensor in transformers' row order
        raw = value if kind == Q.F32 else value.astype(np.float16) if kind == Q.F16 else gguf.quants.quantize(value,
                                                                                                           kind)
        dequantized[name] = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(value.shape).copy())
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            raw = llama_cpp_permute(raw, heads)
        stored[f"{names.get_name(base)}.{suffix}"] = raw if kind in (Q.F32, Q.F16) else (raw, kind)
    path = write_gguf(folder / "model.gguf", stored, arch=arch, heads=config.num_attention_heads,
                      kv_heads=config.num_key_value_heads, hidden=config.hidden_size,
                      layers=config.num_hidden_layers)
    model.load_state_dict(dequantized, strict=not config.tie_word_embeddings)
    model.tie_weights()
    return model, path
