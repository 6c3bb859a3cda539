"""Whole-model prefill throughput, deltaserve vs transformers, on one tiny random hybrid model, in one run.

The model: Qwen3.5-style, hidden 512, 8 layers in a 3:1 GDN:attention pattern, 4 key / 8 value GDN heads of 64,
8 attention heads / 2 KV heads of 64, vocab 49152 (SmolLM2's), float32. Both sides read the same weights. A
prefill is one forward over the whole prompt that fills the caches and returns the last token's logits
(transformers: use_cache=True, logits_to_keep=1, its torch chunked GDN fallback and SDPA attention).

The roofline is the fp32 FLOP rate given by --peak-gflops (default: a decoder-shaped sgemm measured at start; the
issue's figure for this machine kind was 96, a machine seen later measured 187): FLOPs per
prompt = 2 * (decoder parameters) * tokens + 2 * vocab * hidden (one logits row) + causal attention (2 * heads *
head_dim * tokens^2 per attention layer). GDN's own state FLOPs are left out, so the fraction is an upper bound.

With `--llama-cpp DIR` (bench/llamacpp.py) llama.cpp reads the same weights too: the checkpoint saved with the
SmolLM2 tokenizer, converted to an f32 GGUF by llama.cpp's own converter (--no-mtp), timed by its llama-bench.

    python bench/hybrid_prefill.py --lengths 512 16384 [--llama-cpp DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import results

HIDDEN = 512
LAYERS = 8
VOCAB = 49152
INTERMEDIATE = 1536


def tiny_hybrid_config():
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        full_attention_interval=4, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=65536, initializer_range=0.02,
    )
    config._attn_implementation = "sdpa"
    return config


def measured_sgemm_gflops(tokens: int = 2048) -> float:
    """This machine's fp32 matmul rate on a decoder-shaped GEMM, for reading the roofline column."""
    a, b = torch.randn(tokens, HIDDEN), torch.randn(HIDDEN, INTERMEDIATE)
    warm_until = time.perf_counter() + 2.0  # a shared VM's cores take a moment to come up to speed
    while time.perf_counter() < warm_until:
        a @ b
    seconds, _ = best_seconds([lambda: a @ b], 30)[0]
    return 2 * tokens * HIDDEN * INTERMEDIATE / seconds / 1e9


def build_pair():
    """(transformers model, deltaserve model) sharing one set of random weights."""
    from transformers import Qwen3_5ForCausalLM

    from deltaserve.models import build_model

    torch.manual_seed(0)
    ref = Qwen3_5ForCausalLM(tiny_hybrid_config()).eval()
    config = json.loads(ref.config.to_json_string())
    ours = build_model(config, dict(ref.state_dict()))
    return ref, ours


def flops_per_prompt(ours, tokens: int) -> float:
    decoder = sum(p.numel() for name, p in ours.named_parameters()
                  if not name.startswith(("model.embed_tokens", "lm_head")))
    attn = [layer.self_attn for layer in ours.model.layers if layer.kind == "full_attention"]
    attention = sum(2 * a.num_heads * a.head_dim * tokens * tokens for a in attn)
    return 2 * decoder * tokens + 2 * VOCAB * HIDDEN + attention


def prefill_ours(ours, ids: torch.Tensor) -> torch.Tensor:
    from deltaserve.models.batch import allocate_caches, single_sequence_batch

    caches = allocate_caches(ours.geometry, len(ids), 1, torch.float32)
    return ours(single_sequence_batch(ids.tolist(), 0, torch.arange(len(ids))), caches)


def prefill_transformers(ref, ids: torch.Tensor) -> torch.Tensor:
    return ref(ids[None], use_cache=True, logits_to_keep=1).logits[0]


def best_seconds(fns, repeats: int) -> list[tuple[float, torch.Tensor]]:
    """Per function, the fastest of `repeats` runs and what it returned; runs alternate so both see the same load."""
    best = [float("inf")] * len(fns)
    outs = [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return list(zip(best, outs))


def llama_cpp_rates(args, ref) -> dict[int, float]:
    """Prompt tokens -> llama.cpp prefill tok/s on the same weights (empty without --llama-cpp)."""
    import tempfile
    from pathlib import Path

    import llamacpp

    root = llamacpp.tree(args.llama_cpp)
    if root is None:
        return {}
    from transformers import AutoTokenizer

    from deltaserve.budget import default_model_path

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hybrid"
        ref.save_pretrained(folder)
        smollm2 = default_model_path()
        AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name).save_pretrained(folder)
        gguf = llamacpp.convert(root, folder, Path(tmp) / "hybrid-f32.gguf")
        rates = llamacpp.run_bench(root, gguf, prompts=args.lengths, threads=torch.get_num_threads(), repeats=1)
    return {n: rates[f"pp{n}"] for n in args.lengths if f"pp{n}" in rates}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 16384], help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=0, help="timed runs per side (default: 3 up to 4K, else 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-bench (or LLAMA_CPP_DIR)")
    parser.add_argument("--peak-gflops", type=float, default=0.0,
                        help="fp32 FLOP rate of the roofline (default: measured here at start)")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.lengths):
        print("error: --lengths must be at least 2 tokens", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)

    run = results.Run("hybrid_prefill", "Tiny hybrid model, whole-model prefill, against transformers and llama.cpp",
                      argv)
    args.peak_gflops = args.peak_gflops or measured_sgemm_gflops()
    from deltaserve.kernels import fused_cpu

    fused_cpu.load(print)  # as the engine does at start: the fused CPU kernels, built once per machine
    ref, ours = build_pair()
    print(f"tiny hybrid: hidden {HIDDEN}, {LAYERS} layers {ours.model.layer_types.count('linear_attention')} GDN "
          f"+ {ours.model.layer_types.count('full_attention')} attention, vocab {VOCAB}, fp32, "
          f"{torch.get_num_threads()} threads, roofline {args.peak_gflops:.0f} GFLOP/s")
    peer_rates = llama_cpp_rates(args, ref)
    print(f"{'tokens':>7} {'transformers tok/s':>19} {'deltaserve tok/s':>17} {'ratio':>6} {'roofline tok/s':>15} "
          f"{'of roofline':>12} {'max |dlogit|':>13} {'llama.cpp tok/s':>16} {'ratio':>6}")
    rows = []
    with torch.inference_mode():
        warm = torch.randint(0, VOCAB, (64,))
        prefill_ours(ours, warm), prefill_transformers(ref, warm)
        for n in args.lengths:
            ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
            repeats = args.repeats or (3 if n <= 4096 else 2)
            (t_ref, expected), (t_ours, got) = best_seconds(
                [lambda: prefill_transformers(ref, ids), lambda: prefill_ours(ours, ids)], repeats)
            diff = (got[-1] - expected[-1]).abs().max().item()
            roofline = n / (flops_per_prompt(ours, n) / (args.peak_gflops * 1e9))
            print(f"{n:>7} {n / t_ref:>19,.0f} {n / t_ours:>17,.0f} {t_ref / t_ours:>5.2f}x {roofline:>15,.0f} "
                  f"{n / t_ours / roofline:>11.0%} {diff:>13.2e} " + (
                      f"{peer_rates[n]:>16,.0f} {n / t_ours / peer_rates[n]:>5.2f}x" if n in peer_rates
                      else f"{'-':>16} {'-':>6}"), flush=True)
            rows.append([n, round(n / t_ref), round(n / t_ours), results.rounded(t_ref / t_ours, 2), round(roofline),
                         results.rounded(100 * n / t_ours / roofline), float(f"{diff:.2e}"),
                         round(peer_rates[n]) if n in peer_rates else None,
                         results.rounded(n / t_ours / peer_rates[n], 2) if n in peer_rates else None])
    run.table(f"fp32, {torch.get_num_threads()} threads, roofline {args.peak_gflops:.0f} GFLOP/s",
              ["tokens", "transformers tok/s", "deltaserve tok/s", "ratio", "roofline tok/s", "% of roofline",
               "max abs logit diff", "llama.cpp tok/s", "ours / llama.cpp"], rows)
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
