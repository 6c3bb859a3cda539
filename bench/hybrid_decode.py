"""Batch-1 decode of the tiny hybrid model (bench/hybrid_prefill.py's), deltaserve vs llama.cpp, in one run.

deltaserve runs through its Engine (the path `serve` takes: scheduler, paged KV pool, state pool, sampler) on the
checkpoint saved by transformers; with `--llama-cpp DIR` (bench/llamacpp.py) llama.cpp's llama-bench decodes the
same weights, converted to an f32 GGUF by its own converter. decode tok/s: (new tokens - 1) / (time from the first
to the last token), greedy, EOS ignored, best of --repeats on each side (llama.cpp's runs alternated with ours: a
shared VM's speed drifts within minutes). Bytes per token: the weights a batch-1 step reads (all
but the embedding table, of which it reads one row), and the GB/s that rate reaches next to a plain read of the
same bytes (bench/dense.py's plain_read_gbps).

    OMP_NUM_THREADS=2 python bench/hybrid_decode.py --decode 128 [--llama-cpp DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import results
from dense import Ours, plain_read_gbps, prompt
from hybrid_prefill import tiny_hybrid_config


def save_checkpoint(folder: Path) -> Path:
    """The tiny hybrid (seed 0, as hybrid_prefill.py builds it) saved with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    from deltaserve.budget import default_model_path

    torch.manual_seed(0)
    Qwen3_5ForCausalLM(tiny_hybrid_config()).eval().save_pretrained(folder)
    smollm2 = default_model_path()
    AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name).save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=128, help="new tokens per decode run")
    parser.add_argument("--decode-prompt", type=int, default=16, help="prompt tokens before the decode run")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-bench (or LLAMA_CPP_DIR)")
    args = parser.parse_args(argv)
    if args.decode < 2 or args.repeats < 1:
        print("error: --decode >= 2, --repeats >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    run = results.Run("hybrid_decode", "Tiny hybrid f32, batch-1 decode, deltaserve vs llama.cpp", argv)
    import llamacpp

    peer = llamacpp.tree(args.llama_cpp)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_checkpoint(Path(tmp) / "hybrid")
        gguf = llamacpp.convert(peer, folder, Path(tmp) / "hybrid-f32.gguf") if peer else None
        ours = Ours(str(folder), args.decode_prompt + args.decode, False)
        model = ours.engine.runner.model
        embedding = model.model.embed_tokens.weight
        tied = getattr(model.lm_head, "weight", None) is embedding
        read = ours.weight_bytes - (0 if tied else embedding.numel() * embedding.element_size())
        ids = prompt(args.decode_prompt, 1)
        ours.prefill(prompt(64, 0))
        best, peer_rate = float("inf"), None
        for _ in range(args.repeats):  # alternated with llama.cpp's runs: both see the same machine load
            best = min(best, ours.decode(ids, args.decode))
            if peer:
                peer_rate = max(peer_rate or 0.0, llamacpp.run_one(peer, gguf, f"tg{args.decode}", args.threads))
    rate = (args.decode - 1) / best
    print(f"tiny hybrid (hidden 512, 8 layers 3:1 GDN:attention, vocab 49152, fp32), batch-1 decode of "
          f"{args.decode} tokens, {args.threads} threads, best of {args.repeats}")
    print(f"deltaserve {rate:.1f} tok/s" + (f", llama.cpp (f32 GGUF) {peer_rate:.1f} tok/s: {rate / peer_rate:.2f}x"
                                            if peer_rate else ", llama.cpp: - (no --llama-cpp)"))
    reached = read * rate / 1e9
    limit = plain_read_gbps(read, args.repeats)
    print(f"{read / 1e6:.1f} MB read per decode token, {reached:.1f} GB/s; a plain read of the same bytes: "
          f"{limit:.1f} GB/s ({reached / limit:.0%})")
    run.table(f"batch-1 decode of {args.decode} tokens, {args.threads} threads, best of {args.repeats}",
              ["deltaserve tok/s", "llama.cpp (f32 GGUF) tok/s", "ours / llama.cpp", "MB per token", "GB/s",
               "plain read GB/s"],
              [[results.rounded(rate), results.rounded(peer_rate) if peer_rate else None,
                results.rounded(rate / peer_rate, 2) if peer_rate else None, results.rounded(read / 1e6),
                results.rounded(reached), results.rounded(limit)]])
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
