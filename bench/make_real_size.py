"""Real-shaped Qwen3.5 GGUFs without a model hub: random blocks in the family's exact tensor names and shapes, written
block by block with gguf-py (a tensor at a time: a 15 GB file never passes through memory, nor through float weights).

    python bench/make_real_size.py --size 2b --mix q4_k_m     # prints the path; made once, then found in the cache

Shapes: `2b` is the 2B class of issue 53 (hidden 2048, 24 layers at 3 GDN : 1 gated attention, head_dim 256, GDN
key / value heads of dim 128, vocabulary 248,320, tied embeddings); `27b` the field's 27B (tests/data/
qwen3_5_27b_w4a16/config.json: hidden 5120, 64 layers, 24 / 4 heads, 16 / 48 GDN heads, untied). Mixes follow
llama-quantize's choices for the type named (llama.cpp's llama_tensor_get_type, simplified): q4_k_m puts the output
matrix (or tied embedding) in Q6_K, attn_v and ffn_down in Q6_K on the layers use_more_bits picks (the first and last
eighth, every third between) and the GDN attn_qkv in Q5_K, the rest Q4_K; iq4_xs IQ4_XS with the output in Q6_K;
q4_0 Q4_0 with the output in Q6_K. Every block's bytes are random, its float16 scales drawn so weights stay below
~0.1; norms, gates, A and dt with spread (no layer degenerate). The vocabulary is the tiny fixture's 384 byte-level
tokens then 247,936 plain placeholder tokens (no merges reach them; they decode as their own text), so prompts
tokenize and every sampled id decodes.

The file goes to ~/.cache/deltaserve/real-size/<key>/ (key: this script's hash), never into the repository. The
other path of issue 53, a model saved by transformers, converted by llama.cpp's convert_hf_to_gguf.py and quantized by
its llama-quantize, is not here yet.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

HERE = Path(__file__).resolve()
TOKENIZER_SOURCE = HERE.parent.parent / "tests" / "data" / "gguf" / "tiny-qwen35-q4_k.gguf"
SIZES = {  # hidden, layers, ffn, heads, kv heads, GDN key heads, GDN value heads, tied
    "2b": dict(hidden=2048, layers=24, ffn=6144, heads=8, kv_heads=2, k_heads=16, v_heads=16, tied=True),
    "27b": dict(hidden=5120, layers=64, ffn=17408, heads=24, kv_heads=4, k_heads=16, v_heads=48, tied=False),
}
VOCAB, HEAD_DIM, GDN_DIM, CONV = 248320, 256, 128, 4
BLOCK = {Q.Q4_0: (32, 18), Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210), Q.IQ4_XS: (256, 136)}
# (byte offset, float16 scale magnitude) of each type's super-scales: d * code range stays below ~0.1
SCALES = {Q.Q4_0: [(0, 0.01)], Q.Q4_K: [(0, 1e-4), (2, 1e-4)], Q.Q5_K: [(0, 5e-5), (2, 5e-5)], Q.Q6_K: [(208, 2e-5)],
          Q.IQ4_XS: [(0, 2e-5)]}
BODY = {"q4_k_m": Q.Q4_K, "iq4_xs": Q.IQ4_XS, "q4_0": Q.Q4_0}


def cache_path(size: str, mix: str) -> Path:
    key = hashlib.sha256(HERE.read_bytes()).hexdigest()[:12]
    return Path.home() / ".cache" / "deltaserve" / "real-size" / key / f"qwen35-{size}-{mix}.gguf"


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensors(size: str, mix: str):
    """(name, numpy shape [rows, cols] or [n], type) of every tensor, in llama.cpp's order per block."""
    s = SIZES[size]
    h, n = s["hidden"], s["layers"]
    body, qkv_dim, v_dim = BODY[mix], 2 * s["k_heads"] * GDN_DIM + s["v_heads"] * GDN_DIM, s["v_heads"] * GDN_DIM
    yield "token_embd.weight", (VOCAB, h), Q.Q6_K if s["tied"] else body
    yield "output_norm.weight", (h,), Q.F32
    if not s["tied"]:
        yield "output.weight", (VOCAB, h), Q.Q6_K
    for i in range(n):
        b, six = f"blk.{i}.", Q.Q6_K if mix == "q4_k_m" and more_bits(i, n) else body
        yield b + "attn_norm.weight", (h,), Q.F32
        yield b + "post_attention_norm.weight", (h,), Q.F32
        if i % 4 == 3:
            yield b + "attn_q.weight", (2 * s["heads"] * HEAD_DIM, h), body
            yield b + "attn_k.weight", (s["kv_heads"] * HEAD_DIM, h), body
            yield b + "attn_v.weight", (s["kv_heads"] * HEAD_DIM, h), six
            yield b + "attn_output.weight", (h, s["heads"] * HEAD_DIM), body
            yield b + "attn_q_norm.weight", (HEAD_DIM,), Q.F32
            yield b + "attn_k_norm.weight", (HEAD_DIM,), Q.F32
        else:
            yield b + "attn_qkv.weight", (qkv_dim, h), Q.Q5_K if mix == "q4_k_m" else body
            yield b + "attn_gate.weight", (v_dim, h), body
            yield b + "ssm_alpha.weight", (s["v_heads"], h), body
            yield b + "ssm_beta.weight", (s["v_heads"], h), body
            yield b + "ssm_a", (s["v_heads"],), Q.F32
            yield b + "ssm_dt.bias", (s["v_heads"],), Q.F32
            yield b + "ssm_conv1d.weight", (qkv_dim, CONV), Q.F32
            yield b + "ssm_norm.weight", (GDN_DIM,), Q.F32
            yield b + "ssm_out.weight", (h, v_dim), body
        yield b + "ffn_gate.weight", (s["ffn"], h), body
        yield b + "ffn_up.weight", (s["ffn"], h), body
        yield b + "ffn_down.weight", (h, s["ffn"]), six


def data(name: str, shape: tuple, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with sane float16 scales, or float32 values with spread for the 1-D and conv tensors."""
    if kind == Q.F32:
        if name.endswith("ssm_a"):  # A = -exp(A_log), decay rates spread over a decade
            return -np.exp(rng.uniform(0.0, 2.5, shape)).astype(np.float32)
        if name.endswith("ssm_dt.bias") or name.endswith("conv1d.weight"):
            return (rng.standard_normal(shape) * 0.3).astype(np.float32)
        return (1.0 + rng.standard_normal(shape) * 0.2).astype(np.float32)  # norms: spread around one
    per, width = BLOCK[kind]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // per, width), dtype=np.uint8)
    for at, scale in SCALES[kind]:
        d = (rng.random(blocks.shape[0]) * scale + scale / 4).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def metadata(writer: gguf.GGUFWriter, size: str, mix: str) -> None:
    """The qwen35 keys llama.cpp's converter writes, for this size; the tiny fixture's tokenizer grown to VOCAB."""
    s, a = SIZES[size], "qwen35."
    for key, value in {"block_count": s["layers"], "context_length": 262144, "embedding_length": s["hidden"],
                       "feed_forward_length": s["ffn"], "attention.head_count": s["heads"],
                       "attention.head_count_kv": s["kv_heads"], "attention.key_length": HEAD_DIM,
                       "attention.value_length": HEAD_DIM, "rope.dimension_count": HEAD_DIM // 4,
                       "ssm.conv_kernel": CONV, "ssm.state_size": GDN_DIM, "ssm.group_count": s["k_heads"],
                       "ssm.time_step_rank": s["v_heads"], "ssm.inner_size": s["v_heads"] * GDN_DIM,
                       "full_attention_interval": 4, "vocab_size": VOCAB}.items():
        writer.add_uint32(a + key, value)
    writer.add_float32(a + "rope.freq_base", 10_000_000.0)
    writer.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_array(a + "rope.dimension_sections", [11, 11, 10, 0])
    writer.add_array(a + "attention.recurrent_layers", [i % 4 != 3 for i in range(s["layers"])])
    writer.add_name(f"qwen35-{size}-{mix} (random, bench/make_real_size.py)")
    reader = gguf.GGUFReader(TOKENIZER_SOURCE)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    tokens += [f"<x{i}>" for i in range(len(tokens), VOCAB)]
    types += [1] * (VOCAB - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(reader.fields["tokenizer.ggml.merges"].contents()))
    writer.add_eos_token_id(int(reader.fields["tokenizer.ggml.eos_token_id"].contents()))
    writer.add_key_value("general.file_type", {"q4_k_m": 15, "iq4_xs": 30, "q4_0": 2}[mix], GGUFValueType.UINT32)


def make(size: str, mix: str, out: Path, seed: int = 0) -> Path:
    """Write the file tensor by tensor (infos first, then each tensor's blocks as drawn)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "qwen35")
    metadata(writer, size, mix)
    plan = list(tensors(size, mix))
    for name, shape, kind in plan:
        if kind == Q.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            per, width = BLOCK[kind]  # a quantized tensor's info takes its byte shape
            rows, cols = shape
            writer.add_tensor_info(name, (rows, cols // per * width), np.dtype(np.uint8), rows * cols // per * width,
                                   kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, kind in plan:
        writer.write_tensor_data(data(name, shape, kind, rng))
    writer.close()
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="2b")
    parser.add_argument("--mix", choices=list(BODY), default="q4_k_m")
    args = parser.parse_args()
    out = cache_path(args.size, args.mix)
    if not out.exists():
        make(args.size, args.mix, out)
    print(out)


if __name__ == "__main__":
    main()
