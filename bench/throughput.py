"""Serving throughput, deltaserve vs transformers, in one run: many requests submitted at once.

Workload (seeded): --requests requests, prompt lengths uniform in [--prompt-min, --prompt-max] tokens, output
lengths uniform in [--output-min, --output-max], greedy, EOS ignored so both sides make exactly those tokens.
- deltaserve: every request submitted at t=0 to one Engine (continuous batching, chunked prefill, paged KV); one
  run per --kv-dtypes entry (float32, and float16, the CPU default: storage only, the arithmetic stays float32).
- transformers: `generate` on left-padded batches of --hf-batch-size in arrival order; a batch runs until its
  longest output, and only each request's own tokens count. TTFT of a request = when its batch's first token
  came (batches run one after another, all requests waiting from t=0).
Models: SmolLM2-135M (the built-in GGUF: deltaserve keeps its 4-bit blocks packed, the CPU default, and with
`--weights packed,fp32` also runs it dequantized to float32, `--dequantize-weights`; transformers reads it dequantized
to float32) and the tiny hybrid of bench/hybrid_prefill.py (Qwen3.5-style, hidden 512, 8 layers 3:1, vocab 49152,
random float32 weights: --weights changes nothing there).

The roofline: useful FLOPs / wall time / --peak-gflops (default: a decoder-shaped fp32 sgemm measured at start,
as bench/hybrid_prefill.py does). Useful FLOPs
= 2 * decoder parameters per fed token + 2 * vocab * hidden per output token + causal attention (4 * heads *
head_dim per token per context position per attention layer); GDN state FLOPs are left out (an upper bound).

    python bench/throughput.py                        # the full workload, both models (tens of minutes)
    python bench/throughput.py --requests 8 --prompt-max 256 --output-max 64 --models hybrid
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import results as bench_results

sys.path.insert(0, str(Path(__file__).resolve().parent))


def workload(args) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request, from --seed."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.requests):
        p = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=g))
        o = int(torch.randint(args.output_min, args.output_max + 1, (1,), generator=g))
        # Ids 1000.. avoid special tokens of the SmolLM2 vocabulary.
        out.append((torch.randint(1000, 49152, (p,), generator=g).tolist(), o))
    return out


def useful_flops(config: dict, model, work) -> float:
    """The FLOPs the workload needs at least (see the module docstring)."""
    text = config.get("text_config") or config
    skip = ("model.embed_tokens", "lm_head")
    decoder = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(skip))
    # packed 4-bit weights are buffers, two weights a byte (counting parameters alone left them out)
    decoder += sum(2 * b.numel() for n, b in model.named_buffers() if n.endswith(".packed") and not n.startswith(skip))
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    attention_layers = len(model.geometry.attention_layers)
    total = 0.0
    for ids, o in work:
        fed = len(ids) + o - 1
        total += 2 * decoder * fed + 2 * text["vocab_size"] * text["hidden_size"] * o
        total += 4 * heads * head_dim * attention_layers * fed * (fed + 1) / 2
    return total


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_deltaserve(model_path: str, work, args, kv_dtype: str = "auto", dequantize: bool = False) -> dict:
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.request import SamplingParams

    pages = sum(-(-(len(ids) + o) // 16) for ids, o in work)
    config = EngineConfig(model=model_path, device="cpu", max_running_requests=args.max_running_requests,
                          max_total_tokens=pages * 16, max_queue=len(work), seed=args.seed,
                          prefill_chunk_tokens=args.prefill_chunk_tokens, kv_dtype=kv_dtype,
                          dequantize_weights=dequantize, prefix_cache=not args.no_prefix_cache)
    engine = Engine(config, log=None)
    start = time.perf_counter()
    streams = [engine.submit(ids, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)) for ids, o in work]
    first: list[float | None] = [None] * len(streams)
    produced = 0
    while engine.step():
        now = time.perf_counter() - start
        for i, s in enumerate(streams):
            for out in s.drain():
                produced += len(out.token_ids)
                if first[i] is None and out.token_ids:
                    first[i] = now
    wall = time.perf_counter() - start
    assert produced == sum(o for _, o in work), (produced, sum(o for _, o in work))
    return {"wall_s": wall, "output_tokens": produced, "ttft": first, "model": engine.runner.model,
            "config": engine.loaded.config}


class _FirstToken:
    """A logits processor that only notes when generate() has its first logits (the batch's TTFT)."""

    def __init__(self):
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def run_transformers(ref, work, args) -> dict:
    from transformers import LogitsProcessorList

    start = time.perf_counter()
    ttft, produced = [], 0
    for b in range(0, len(work), args.hf_batch_size):
        batch = work[b: b + args.hf_batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding, as generate() wants for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        steps = max(o for _, o in batch)
        marker = _FirstToken()
        with torch.inference_mode():
            ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([marker]))
        ttft += [marker.at - start] * len(batch)
        produced += sum(o for _, o in batch)
    return {"wall_s": time.perf_counter() - start, "output_tokens": produced, "ttft": ttft}


def smollm2():
    """(deltaserve model path, transformers model) for the built-in GGUF."""
    from transformers import AutoModelForCausalLM

    from deltaserve.budget import default_model_path

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return str(path), ref.eval()


def tiny_hybrid(folder: Path):
    """The hybrid of bench/hybrid_prefill.py saved as a checkpoint (with the SmolLM2 tokenizer)."""
    from hybrid_prefill import tiny_hybrid_config
    from transformers import Qwen3_5ForCausalLM

    from deltaserve.budget import default_model_path
    from deltaserve.weights import read_tokenizer

    torch.manual_seed(0)
    ref = Qwen3_5ForCausalLM(tiny_hybrid_config()).eval()
    ref.save_pretrained(folder)
    read_tokenizer(default_model_path()).backend.save(str(folder / "tokenizer.json"))
    return str(folder), ref


def report(name: str, ours: dict[str, dict], theirs: dict | None, flops: float, peak_gflops: float) -> list[str]:
    """One row per deltaserve run (by KV cache dtype) and transformers; each run's ratio to transformers."""
    rows = []
    sides = [(f"deltaserve {kv}", r) for kv, r in ours.items()] + [("transformers", theirs)]
    for side, r in sides:
        if r is None:
            continue
        tps = r["output_tokens"] / r["wall_s"]
        gflops = flops / r["wall_s"] / 1e9
        rows.append(f"{name:<8} {side:<26} {tps:>10.1f} {percentile(r['ttft'], 0.5):>9.1f} "
                    f"{percentile(r['ttft'], 0.95):>9.1f} {r['wall_s']:>8.1f} {gflops:>7.1f} "
                    f"{gflops / peak_gflops:>8.1%}")
    if theirs is not None:
        for kv, r in ours.items():
            ratio = (r["output_tokens"] / r["wall_s"]) / (theirs["output_tokens"] / theirs["wall_s"])
            rows.append(f"{name:<8} {'ratio ' + kv:<26} {ratio:>9.2f}x")
    return rows


def table_rows(name: str, result: dict, peak_gflops: float) -> list[list]:
    """report()'s rows as numbers, for the JSON record (bench/results.py)."""
    sides = [(f"deltaserve, KV {kv}", r) for kv, r in result["deltaserve"].items()]
    sides += [("transformers", result["transformers"])] if result["transformers"] is not None else []
    rows = []
    for side, r in sides:
        gflops = result["useful_gflop"] / r["wall_s"]
        rows.append([name, side, round(r["output_tokens"] / r["wall_s"], 1), round(percentile(r["ttft"], 0.5), 1),
                     round(percentile(r["ttft"], 0.95), 1), round(r["wall_s"], 1), round(gflops, 1),
                     round(100 * gflops / peak_gflops, 1)])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,hybrid", help="comma-separated: smollm2, hybrid")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=128)
    parser.add_argument("--prompt-max", type=int, default=1024)
    parser.add_argument("--output-min", type=int, default=128)
    parser.add_argument("--output-max", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=8, help="transformers' padded batch size")
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None, help="default: the engine's (512 CPU)")
    parser.add_argument("--kv-dtypes", default="float32,float16",
                        help="comma-separated KV cache dtypes, one deltaserve run each (float16 is the CPU "
                             "default, as llama.cpp's f16 cache is; float32 is exact against transformers)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--no-prefix-cache", action="store_true", help="deltaserve without its prefix cache")
    parser.add_argument("--weights", default="packed",
                        help="comma-separated, SmolLM2 only: packed (the default path), fp32 (--dequantize-weights)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak-gflops", type=float, default=0.0,
                        help="fp32 FLOP rate of the roofline (default: measured here at start)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if args.prompt_min > args.prompt_max or args.output_min > args.output_max or args.requests < 1:
        parser.error("need --requests >= 1, --prompt-min <= --prompt-max and --output-min <= --output-max")
    torch.set_num_threads(args.threads)
    run = bench_results.Run("throughput", "Serving throughput: many requests at once through the engine, against "
                            "transformers' generate", argv)
    from hybrid_prefill import measured_sgemm_gflops

    args.peak_gflops = args.peak_gflops or measured_sgemm_gflops()
    work = workload(args)
    print(f"{args.requests} requests, prompts {args.prompt_min}-{args.prompt_max}, outputs {args.output_min}-"
          f"{args.output_max} (seed {args.seed}): {sum(len(i) for i, _ in work):,} prompt + "
          f"{sum(o for _, o in work):,} output tokens; {args.threads} threads, transformers batches of "
          f"{args.hf_batch_size}; roofline {args.peak_gflops:.0f} GFLOP/s")
    lines = [f"{'model':<8} {'engine (KV dtype, weights)':<26} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p95':>9} "
             f"{'wall s':>8} "
             f"{'GFLOP/s':>7} {'roofline':>8}"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path, ref = smollm2() if name == "smollm2" else tiny_hybrid(Path(tmp) / "hybrid")
            ours, flops = {}, 0.0
            weights = args.weights.split(",") if name == "smollm2" else ["packed"]
            for w in weights:
                for kv in args.kv_dtypes.split(","):
                    key = kv if w == "packed" else f"{kv} fp32-w"
                    ours[key] = run_deltaserve(path, work, args, kv_dtype=kv, dequantize=w == "fp32")
                    flops = useful_flops(ours[key].pop("config"), ours[key].pop("model"), work)
                    print(f"{name} deltaserve (KV {kv}, {w} weights): "
                          f"{ours[key]['output_tokens'] / ours[key]['wall_s']:.1f} output tok/s, "
                          f"{ours[key]['wall_s']:.1f} s", flush=True)
            theirs = None if args.skip_transformers else run_transformers(ref, work, args)
            del ref
            rows = report(name, ours, theirs, flops, args.peak_gflops)
            lines += rows
            print("\n".join([lines[0]] + rows), flush=True)
            results[name] = {"deltaserve": ours, "transformers": theirs, "useful_gflop": flops / 1e9}
    print("\n" + "\n".join(lines))
    run.table(f"{args.requests} requests, prompts {args.prompt_min}-{args.prompt_max}, outputs {args.output_min}-"
              f"{args.output_max}, {args.threads} threads, roofline {args.peak_gflops:.0f} GFLOP/s",
              ["model", "engine", "output tok/s", "TTFT p50 s", "TTFT p95 s", "wall s", "GFLOP/s", "% of roofline"],
              [row for name, r in results.items() for row in table_rows(name, r, args.peak_gflops)])
    run.save()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
