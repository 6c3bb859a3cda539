"""Make the tiny Qwen3.5 GGUF fixtures under tests/data/gguf with llama.cpp's own tools (run by hand, not in CI).

    python tests/data/make_gguf_fixtures.py LLAMA_CPP_DIR

LLAMA_CPP_DIR is a llama.cpp source tree whose llama-quantize and llama-debug are built in LLAMA_CPP_DIR/build/bin
(cmake -B build && cmake --build build --target llama-quantize llama-debug). The script saves a tiny random Qwen3.5
hybrid (transformers' Qwen3_5TextConfig) with a tiny byte-level BPE tokenizer, converts it with
LLAMA_CPP_DIR/convert_hf_to_gguf.py to Q8_0 (gguf-py's quantizer) and F32, quantizes the F32 file with
llama-quantize to each type in TYPES, and runs llama-debug --save-logits on each quantized file with PROMPT: the
prompt's token ids and llama.cpp's own logits at its last position go to <fixture>.llamacpp.json beside it (the
second peer of tests/test_weights_gguf_quantized.py). Every matrix row is a multiple of 256 so the K-quants and
IQ4_XS apply to every matrix (llama-quantize would otherwise fall back to another type). Tiny Qwen3.5-MoE and
Qwen3-Next models (norms randomized) are converted to Q8_0 too, with llama-debug's logits beside them, and
quantized by llama-quantize to Q4_0. The fitted MTP hybrid (tests/data/mtp_fitted) is converted with its
multi-token-prediction head, at the converter's Q8_0 (`mtp_fixture`), and so is a tiny Qwen3-Next whose head's layer
is a mixture of experts (`next_mtp_fixture`).

The converter identifies a BPE pre-tokenizer by hashing its output on a fixed text and refuses unknown ones; our
tiny tokenizer uses Qwen2's split regex, so the script runs the converter in-process with that lookup answering
"qwen2" (the one patch; nothing else of the converter is touched).
"""

import json
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

OUT = Path(__file__).resolve().parent / "gguf"
TYPES = ("Q4_K", "IQ4_XS")  # the field's IQ4_XS, and the K-quant with a per-block min (offsets)
PROMPT = "Hello world, the quick brown fox jumps over the lazy dog."
VOCAB = 384
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXT = ("The quick brown fox jumps over the lazy dog. A delta rule updates a state; attention reads a cache. "
        "Hello world, hello GGUF. 0123456789 ") * 50


def config() -> Qwen3_5TextConfig:
    """A two-layer hybrid (one GDN layer, one gated attention layer) whose every row length is 256 or 512."""
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, layer_types=["linear_attention", "full_attention"],
        initializer_range=0.05, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True))


def moe_config() -> Qwen3_5MoeTextConfig:
    """The Qwen3.5 MoE layout (qwen35moe): a GDN and an attention layer, each with 4 routed experts (top 2) and a
    gated shared expert; rows of 128 (Q8_0 needs multiples of 32)."""
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, layer_types=["linear_attention", "full_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96, initializer_range=0.05,
        tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True))


def next_config() -> Qwen3NextConfig:
    """Qwen3-Next (qwen3next): fused in_proj_qkvz / in_proj_ba, MoE on every layer (llama.cpp's qwen3next has no
    dense MLP layer)."""
    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, initializer_range=0.05, tie_word_embeddings=False,
        max_position_embeddings=4096, partial_rotary_factor=0.25)


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights and dt_bias off their initial 0 / 1 (a missed +1 on a norm would not show otherwise)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of VOCAB tokens trained on TEXT, split like Qwen2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(QWEN2_SPLIT, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 1, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def convert(llama_cpp: Path, model_dir: Path, out: Path, outtype: str = "f32", mtp: bool = False) -> None:
    """Run llama.cpp's converter in-process, its BPE pre-tokenizer lookup answering "qwen2"; `mtp`: the checkpoint's
    multi-token-prediction head written too (the converter's default; --no-mtp otherwise)."""
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    for name in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
        del sys.modules[name]  # an installed gguf imported earlier (deltaserve's reader): the tree's own instead
    from conversion.base import TextModel  # llama.cpp's converter package

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", outtype, *([] if mtp else ["--no-mtp"]),
                "--outfile", str(out)]
    try:
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.argv = argv


def main() -> None:
    """Build the model, convert, quantize each type into OUT."""
    llama_cpp = Path(sys.argv[1]).resolve()
    work = Path("/tmp/deltaserve_gguf_fixture")
    model_dir = work / "hf"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config()).eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer().save_pretrained(model_dir)
    OUT.mkdir(exist_ok=True)
    # the converter's own Q8_0 (gguf-py's quantizer): the fixture that needs no llama.cpp build
    convert(llama_cpp, model_dir, OUT / "tiny-qwen35-q8_0.gguf", "q8_0")
    f32 = work / "tiny-qwen35-f32.gguf"
    convert(llama_cpp, model_dir, f32)
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    for kind in TYPES:
        out = OUT / f"tiny-qwen35-{kind.lower()}.gguf"
        # --pure: every tensor in this one type (no mixed recipe); output.weight too
        subprocess.run([str(quantize), "--pure", "--allow-requantize", str(f32), str(out), kind], check=True)
        save_llamacpp_logits(llama_cpp, out)
    # the other two hybrid layouts llama.cpp's converter writes, at its own Q8_0
    for arch, cls, make in (("qwen35moe", Qwen3_5MoeForCausalLM, moe_config),
                            ("qwen3next", Qwen3NextForCausalLM, next_config)):
        torch.manual_seed(1)
        folder = work / arch
        randomized(cls(make()).eval()).save_pretrained(folder, safe_serialization=True)
        tokenizer().save_pretrained(folder)
        out = OUT / f"tiny-{arch}-q8_0.gguf"
        convert(llama_cpp, folder, out, "q8_0")
        save_llamacpp_logits(llama_cpp, out)
        # and 4-bit by llama-quantize (Q4_0: rows of 128 are too short for the K-quants), stacked experts included
        f32 = work / f"tiny-{arch}-f32.gguf"
        convert(llama_cpp, folder, f32)
        subprocess.run([str(quantize), "--pure", str(f32), str(OUT / f"tiny-{arch}-q4_0.gguf"), "Q4_0"], check=True)
    mtp_fixture(llama_cpp, work)
    next_mtp_fixture(llama_cpp, work)


def mtp_fixture(llama_cpp: Path, work: Path) -> Path:
    """The fitted MTP hybrid (tests/data/mtp_fitted) converted with its head (the converter's default) at its own
    Q8_0: tiny-mtp-fitted-q8_0.gguf. Its word-level tokenizer is read as a plain fast tokenizer (transformers would
    otherwise take Qwen3.5's class for it, which adds a token past the model's 160)."""
    folder = work / "mtp_fitted"
    shutil.copytree(Path(__file__).resolve().parent / "mtp_fitted", folder, dirs_exist_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    out = OUT / "tiny-mtp-fitted-q8_0.gguf"
    convert(llama_cpp, folder, out, "q8_0", mtp=True)
    return out


def next_mtp_fixture(llama_cpp: Path, work: Path) -> Path:
    """A tiny Qwen3-Next with an MTP head whose decoder layer is a mixture of experts (tests/test_speculative_mtp.py
    make_qwen3_next_mtp_checkpoint, seeded: the test makes the same checkpoint again as its reference), converted
    with its head at the converter's Q8_0: tiny-qwen3next-mtp-q8_0.gguf."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_speculative_mtp import make_qwen3_next_mtp_checkpoint

    folder = work / "qwen3next_mtp"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    make_qwen3_next_mtp_checkpoint(folder)
    shutil.rmtree(folder / "donor")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    out = OUT / "tiny-qwen3next-mtp-q8_0.gguf"
    convert(llama_cpp, folder, out, "q8_0", mtp=True)
    return out


def save_llamacpp_logits(llama_cpp: Path, gguf_file: Path) -> None:
    """llama-debug's token ids for PROMPT and its logits at the last position -> <gguf_file>.llamacpp.json."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(llama_cpp / "build" / "bin" / "llama-debug"), "-m", str(gguf_file), "-p", PROMPT,
                        "--save-logits", "--logits-output-dir", tmp, "-c", "256", "-t", "1", "--no-warmup"],
                       check=True)
        base = Path(tmp) / f"llamacpp-{gguf_file.stem}"
        logits = np.fromfile(f"{base}.bin", dtype=np.float32)
        tokens = np.fromfile(f"{base}-tokens.bin", dtype=np.int32)
    record = {"tool": "llama-debug --save-logits", "prompt": PROMPT, "tokens": tokens.tolist(),
              "last_logits": [float(x) for x in logits]}
    gguf_file.with_suffix(".llamacpp.json").write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
