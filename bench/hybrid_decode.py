"""Batch-1 decode of the tiny hybrid model (bench/hybrid_prefill.py's), deltaserve vs llama.cpp, in one run.

deltaserve runs through its Engine (the path `serve` takes: scheduler, paged KV pool, state pool, sampler) on the
checkpoint saved by transformers; with `--llama-cpp DIR` (bench/llamacpp.py) llama.cpp's llama-bench decodes the
same weights, converted to an f32 GGUF by its own converter. decode tok/s: (new tokens - 1) / (time from the first
to the last token), greedy, EOS ignored, best of --repeats on each side (llama.cpp's runs alternated with ours: a
shared VM's speed drifts within minutes). Bytes per token: the weights a batch-1 step reads (all
but the embedding table, of which it reads one row), and the GB/s that rate reaches next to a plain read of the
same bytes (bench/dense.py's plain_read_gbps).

    OMP_NUM_THREADS=2 python bench/hybrid_decode.py --decode 128 [--llama-cpp DIR]

With `--w4a16` (issue 41's second table) the same weights are 4-bit on every side: ours a W4A16 checkpoint written by
compressed-tensors' own compressor (symmetric groups of 32, lm_head too: this model's 49,152 x 512 output matrix is
most of a decode step's bytes, and llama-quantize quantizes it as well), run on our default path (int8 activations)
and with `--activation-dtype float32`; llama.cpp and (with `--ik-llama-cpp DIR`) ik_llama.cpp the f32 GGUF quantized
to Q4_0 (blocks of 32) by llama.cpp's own llama-quantize (ik_llama.cpp without its load-time repacking here: -rtr 1
stops at GGML_ASSERT(nrc_x%16 == 0) in iqk_gemm_legacy_quants.cpp on this model's prefill). Rows: prefill 512 and
batch-1 decode, every side alternated, best of --repeats; the sides round the same weights differently (llama-quantize
makes the output matrix Q6_K), so each side's bytes are printed.

    OMP_NUM_THREADS=2 python bench/hybrid_decode.py --w4a16 --llama-cpp DIR --ik-llama-cpp DIR2
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
    parser.add_argument("--ik-llama-cpp", help="with --w4a16: an ik_llama.cpp tree with build/bin/llama-bench")
    parser.add_argument("--w4a16", action="store_true", help="the 4-bit table instead (module docstring)")
    parser.add_argument("--prefill", type=int, default=512, help="with --w4a16: prompt tokens of the prefill row")
    args = parser.parse_args(argv)
    if args.decode < 2 or args.repeats < 1 or args.prefill < 1:
        print("error: --decode >= 2, --repeats >= 1, --prefill >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.w4a16:
        return w4a16(args, argv)
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


def w4a16(args, argv) -> int:
    """The 4-bit table: ours (W4A16, int8 activations: the default, and float32) vs llama.cpp and ik_llama.cpp
    (Q4_0)."""
    import shutil

    import llamacpp
    from dense import save_w4a16
    from transformers import Qwen3_5ForCausalLM

    run = results.Run("hybrid_decode", "Tiny hybrid 4-bit: prefill and batch-1 decode, deltaserve (W4A16) vs "
                      "llama.cpp and ik_llama.cpp (Q4_0)", argv)
    peer, ik_peer = llamacpp.tree(args.llama_cpp), llamacpp.ik_tree(args.ik_llama_cpp)
    longest = max(args.prefill, args.decode_prompt + args.decode)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_checkpoint(Path(tmp) / "hybrid")
        quantized = Path(tmp) / "hybrid-w4a16"
        quantized.mkdir()
        save_w4a16(Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), quantized, 32, ignore=())
        for name in Path(folder).iterdir():
            if "token" in name.name or name.name == "special_tokens_map.json":
                shutil.copy(name, quantized / name.name)
        sides = {"deltaserve": Ours(str(quantized), longest, False),
                 "deltaserve f32-act": Ours(str(quantized), longest, False, activation_dtype="float32")}
        peers, sizes = {}, {name: side.weight_bytes for name, side in sides.items()}
        if peer:
            f32 = llamacpp.convert(peer, folder, Path(tmp) / "hybrid-f32.gguf")
            q4 = llamacpp.quantize(peer, f32, Path(tmp) / "hybrid-q4_0.gguf", "Q4_0")
            sizes["GGUF Q4_0 file"] = q4.stat().st_size
            peers["llama.cpp"] = lambda test: llamacpp.run_one(peer, q4, test, args.threads)
            if ik_peer:
                peers["ik_llama.cpp"] = lambda test: llamacpp.run_one(ik_peer, q4, test, args.threads)
        cells = [(f"prefill {args.prefill}", args.prefill, lambda side, ids: side.prefill(ids),
                  prompt(args.prefill, args.prefill), f"pp{args.prefill}"),
                 (f"decode {args.decode} (batch 1)", args.decode - 1, lambda side, ids: side.decode(ids, args.decode),
                  prompt(args.decode_prompt, 1), f"tg{args.decode}")]
        for side in sides.values():
            side.prefill(prompt(64, 0))  # first-call costs out of the timings
        header = ["what, tok/s", *sides, *peers, *(f"deltaserve / {name}" for name in peers),
                  *(f"f32-act / {name}" for name in peers)]
        print(f"tiny hybrid 4-bit, {args.threads} threads, best of {args.repeats}, every side alternated")
        print("  ".join(header))
        rows = []
        for label, tokens, timed, ids, test in cells:
            best = {name: float("inf") for name in sides}
            peer_best = {name: 0.0 for name in peers}
            for _ in range(args.repeats):
                for name, side in sides.items():
                    best[name] = min(best[name], timed(side, ids))
                for name, peer_run in peers.items():
                    try:
                        peer_best[name] = max(peer_best[name], peer_run(test))
                    except Exception as error:  # noqa: BLE001 - a peer that cannot read the file: its column says so
                        print(f"  {name} failed: {str(getattr(error, 'stderr', '') or error)[-300:]}")
            rates = {name: tokens / best[name] for name in sides}
            row = [label, *(results.rounded(r) for r in rates.values()),
                   *(results.rounded(peer_best[n]) if peer_best[n] else None for n in peers),
                   *(results.rounded(rates["deltaserve"] / peer_best[n], 2) if peer_best[n] else None
                     for n in peers),
                   *(results.rounded(rates["deltaserve f32-act"] / peer_best[n], 2) if peer_best[n] else None
                     for n in peers)]
            print("  ".join("-" if v is None else str(v) for v in row), flush=True)
            rows.append(row)
    title = (f"tiny hybrid (hidden 512, 8 layers 3:1 GDN:attention) 4-bit, {args.threads} threads, best of "
             f"{args.repeats}")
    run.table(title, header, rows)
    run.note("bytes: " + ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in sizes.items())
             + " (ours: the weights held, the embedding table float32: a step reads one row of it)")
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
