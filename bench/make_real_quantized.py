"""The 2B-class Qwen3.5 the way a user's file is made: random weights in the family's real shapes, saved by
transformers, converted by llama.cpp's own convert_hf_to_gguf.py and quantized by its own llama-quantize.

    python bench/make_real_quantized.py --llama-cpp DIR --mix Q4_K_M     # prints the path; made once, then cached

The shape is bench/make_real_size.py's `2b` (hidden 2048, 24 layers at 3 GDN : 1 gated attention, head_dim 256, GDN
key / value heads of dim 128, vocabulary 248,320, tied embeddings). Weights are transformers' own initialisation
(normal, std 0.02), drawn in bfloat16 so that the model never passes through 8 GB of float32; every parameter that
initialisation leaves constant (norms, dt_bias) gets a spread, so that no layer is degenerate. The tokenizer is
SmolLM2's (49,152 tokens; the converter pads the vocabulary to 248,320 with its own placeholder tokens). The float16
GGUF the converter writes stays in the cache beside the quantized files (llama-quantize makes each mix from it: its
own choice of Q6_K / Q5_K tensors per mix, not ours). bench/llamacpp.py says how to build the llama.cpp tree.

Files go to ~/.cache/deltaserve/real-size/<key>/ (key: this script's hash), never into the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
MIXES = ("Q4_K_M", "IQ4_XS", "Q4_0")
SPREAD = 0.2  # a constant parameter's draw: c + N(0, SPREAD^2) (norms around one, dt_bias around its value)


def cache_folder() -> Path:
    key = hashlib.sha256(HERE.read_bytes()).hexdigest()[:12]
    return Path.home() / ".cache" / "deltaserve" / "real-size" / key


def config_2b():
    """bench/make_real_size.py's 2B class as a transformers config."""
    from transformers import Qwen3_5TextConfig

    sys.path.insert(0, str(HERE.parent))
    from make_real_size import GDN_DIM, HEAD_DIM, SIZES, VOCAB

    s = SIZES["2b"]
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        full_attention_interval=4, linear_num_key_heads=s["k_heads"], linear_num_value_heads=s["v_heads"],
        linear_key_head_dim=GDN_DIM, linear_value_head_dim=GDN_DIM, num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=HEAD_DIM, tie_word_embeddings=s["tied"],
        max_position_embeddings=262144, initializer_range=0.02)


def save_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The random 2B-class model saved by transformers (bfloat16 safetensors) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    from deltaserve.budget import default_model_path

    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3_5ForCausalLM(config_2b()).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and bool((p == p.reshape(-1)[0]).all()):
                p.add_(torch.randn_like(p) * SPREAD)
    model.save_pretrained(folder)
    smollm2 = default_model_path()
    AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name).save_pretrained(folder)
    return folder


def make(root: Path, mix: str) -> Path:
    """The quantized file (and on the way the checkpoint and the float16 GGUF, each made once)."""
    import shutil

    sys.path.insert(0, str(HERE.parent))
    import llamacpp

    folder = cache_folder()
    out = folder / f"qwen35-2b-llamacpp-{mix.lower()}.gguf"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    f16 = folder / "qwen35-2b-llamacpp-f16.gguf"
    if not f16.exists():
        checkpoint = folder / "hf.partial"
        shutil.rmtree(checkpoint, ignore_errors=True)
        save_checkpoint(checkpoint)
        llamacpp.convert(root, checkpoint, f16.with_suffix(".partial"), outtype="f16").rename(f16)
        shutil.rmtree(checkpoint)
    llamacpp.quantize(root, f16, out.with_suffix(".partial"), mix).rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-quantize (or LLAMA_CPP_DIR)")
    parser.add_argument("--mix", choices=MIXES, default="Q4_K_M")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    import llamacpp

    root = llamacpp.tree_with(args.llama_cpp, "llama-quantize")
    if root is None:
        raise SystemExit("error: give --llama-cpp DIR (or LLAMA_CPP_DIR): llama.cpp's converter and llama-quantize "
                         "make this file")
    print(make(root, args.mix))


if __name__ == "__main__":
    main()
