"""Shared helpers of the engine tests (no tests here): a tiny hybrid checkpoint, engines, and running them."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from deltaserve.config import EngineConfig
from deltaserve.engine.engine import Engine

HYBRID_VOCAB = 160


def make_hybrid_checkpoint(folder: Path):
    """A tiny random Qwen3.5 (GDN 3 : 1 attention) saved by transformers itself, with a word-level tokenizer.

    Returns the transformers model (the oracle); the checkpoint is in `folder`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(zlib.crc32(b"engine-hybrid"))
    config = Qwen3_5TextConfig(
        vocab_size=HYBRID_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, initializer_range=0.1, max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1], mrope_interleaved=True))
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    _save_word_tokenizer(folder)
    return model


def make_dense_checkpoint(folder: Path):
    """A tiny random Llama (the built-in SmolLM2's architecture) saved by transformers, with the same word-level
    tokenizer as the tiny hybrid: the dense model of tests that need many fast requests through a real server."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(zlib.crc32(b"engine-dense"))
    config = LlamaConfig(vocab_size=HYBRID_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                         max_position_embeddings=32768, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger norms: greedy output that varies (at the default init it repeats one token)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(4.0).add_(torch.randn_like(p))
    model.save_pretrained(folder)
    _save_word_tokenizer(folder)
    return model


def _save_word_tokenizer(folder: Path) -> None:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(HYBRID_VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))


def engine(model: str | None, **settings) -> Engine:
    """A quiet engine on CPU with a small, fixed KV pool, a float32 KV cache and no prefix cache unless told
    otherwise: these tests hold the engine to transformers' float32 arithmetic exactly; test_engine_kv16.py checks
    the 16-bit caches (the CPU default is float16) against the same oracle."""
    settings.setdefault("max_total_tokens", 8192)
    settings.setdefault("device", "cpu")
    settings.setdefault("kv_dtype", "float32")
    # the twin transformers model reads the engine's float weights; the packed default is held to the dequantized
    # model in test_models_dense and test_kernels_int4
    settings.setdefault("dequantize_weights", True)
    # The tests that hold every page to account after a run see the engine without the prefix cache;
    # test_prefix_cache.py turns it on.
    settings.setdefault("prefix_cache", False)
    return Engine(EngineConfig(model=model, **settings), log=None)


def run_all(eng: Engine, submitted: list[tuple[list[int], object]], on_step=None) -> list[list]:
    """Submit every (prompt_ids, params) at once, step until all finish; the outputs of each stream."""
    streams = [eng.submit(ids, params) for ids, params in submitted]
    outputs = [[] for _ in streams]
    steps = 0
    while not all(s.finished for s in streams):
        eng.step()
        steps += 1
        for stream, out in zip(streams, outputs):
            out.extend(stream.drain())
        if on_step is not None:
            on_step(steps)
    for stream, out in zip(streams, outputs):
        out.extend(stream.drain())
    return outputs


def tokens_of(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def text_of(outputs: list) -> str:
    return "".join(out.text for out in outputs)


def random_prompt(length: int, seed: int, vocab: int, low: int = 0) -> list[int]:
    return torch.randint(low, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
