"""Make the tiny Qwen3.5 GGUF fixtures under tests/data/gguf with llama.cpp's own tools (run by hand, not in CI).

    python tests/data/make_gguf_fixtures.py LLAMA_CPP_DIR

LLAMA_CPP_DIR is a llama.cpp source tree (e.g. vendor/llama.cpp of the llama-cpp-python sdist) whose
llama-quantize is built (see bench/llamacpp.py for the cmake line; target llama-quantize). The script saves a
tiny random Qwen3.5 hybrid (transformers' Qwen3_5TextConfig) with a tiny byte-level BPE tokenizer, converts it
with LLAMA_CPP_DIR/convert_hf_to_gguf.py to F32 and quantizes that with llama-quantize to each type in TYPES.
Every matrix row is a multiple of 256 so the K-quants and IQ4_XS apply to every matrix (llama-quantize would
otherwise fall back to another type).

The converter identifies a BPE pre-tokenizer by hashing its output on a fixed text and refuses unknown ones; our
tiny tokenizer uses Qwen2's split regex, so the script runs the converter in-process with that lookup answering
"qwen2" (the one patch; nothing else of the converter is touched).
"""

import runpy
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

OUT = Path(__file__).resolve().parent / "gguf"
TYPES = ("Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "IQ4_NL")
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


def convert(llama_cpp: Path, model_dir: Path, out: Path, outtype: str = "f32") -> None:
    """Run llama.cpp's converter in-process, its BPE pre-tokenizer lookup answering "qwen2"."""
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    from conversion.base import TextModel  # llama.cpp's converter package

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", outtype, "--no-mtp", "--outfile", str(out)]
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


if __name__ == "__main__":
    main()
