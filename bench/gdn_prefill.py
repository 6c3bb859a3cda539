"""GDN-layer prefill throughput: our chunked gated delta rule vs our token-by-token loop vs transformers'
torch_chunk_gated_delta_rule, in one run, with ratios and long-prompt retention.

"chunked" is what the model calls on this CPU: the fused C++ kernel (kernels/fused_cpu.py, built here as the engine
builds it at start); "portable" is the same arithmetic as PyTorch ops (what runs where the C++ cannot be built).

    OMP_NUM_THREADS=2 .venv/bin/python bench/gdn_prefill.py --lengths 1024,4096,16384,32768 --shapes 27b,tiny

A cell of a slow baseline whose estimated time exceeds --max-seconds (or memory --max-gib) prints "skipped".
"""

import argparse
import ctypes
import math
import sys
import time

import torch
import torch.nn.functional as F

import results
from deltaserve.kernels import fused_cpu, gated_delta_prefill
from deltaserve.kernels.gated_delta import CPU_CHUNK_SIZE, chunk_gated_delta_rule, recurrent_gated_delta_rule_step

# (key heads, value heads, key dim, value dim) per GDN layer
SHAPES = {
    "27b": (16, 48, 128, 128),   # Qwen3.5-27B linear-attention layers
    "tiny": (2, 4, 32, 32),
}
PROBE_TOKENS = 256
GLIBC_M_TRIM_THRESHOLD, GLIBC_M_MMAP_MAX = -1, -4   # mallopt parameters (malloc.h)


def make_inputs(tokens, shape, seed=0):
    """Random layer inputs with the model's gate parametrisation (g = -exp(A_log) softplus(a + dt_bias))."""
    key_heads, value_heads, key_dim, value_dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, key_heads, key_dim, generator=gen)
    k = torch.randn(tokens, key_heads, key_dim, generator=gen)
    v = torch.randn(tokens, value_heads, value_dim, generator=gen)
    a_log = torch.empty(value_heads).uniform_(0.01, 16, generator=gen).log()
    g = -a_log.exp() * F.softplus(torch.randn(tokens, value_heads, generator=gen) - 4.0)
    beta = torch.randn(tokens, value_heads, generator=gen).sigmoid()
    return q, k, v, g, beta


def run_chunked(q, k, v, g, beta, chunk_size):
    if chunk_size:
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)
    else:
        gated_delta_prefill(q, k, v, g, beta)                      # what the model calls


def run_portable(q, k, v, g, beta, chunk_size):
    with fused_cpu.disabled():
        run_chunked(q, k, v, g, beta, chunk_size)


def run_token_loop(q, k, v, g, beta):
    shape = (1, v.shape[1], q.shape[2], v.shape[2])
    state = torch.zeros(shape)
    for t in range(q.shape[0]):
        _, state = recurrent_gated_delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                   beta[t:t + 1], state)


def run_transformers(q, k, v, g, beta):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)


def transformers_gib(tokens, shape):
    """Rough peak of transformers' torch chunk path: ~12 [T, Hv, D] float32 tensors and ~4 [T, Hv, 64]."""
    _, value_heads, key_dim, _ = shape
    return tokens * value_heads * (12 * key_dim + 4 * 64) * 4 / 2**30


def best_seconds(fn, inputs, repeats):
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*inputs)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384,32768", help="prompt tokens, comma-separated")
    parser.add_argument("--shapes", default="27b,tiny", help=f"comma-separated from {sorted(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timed runs per cell")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help=f"0: the dispatcher's choice (CPU: {CPU_CHUNK_SIZE})")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="skip slow-baseline cells estimated longer")
    parser.add_argument("--max-gib", type=float, default=6.0, help="skip transformers cells estimated larger")
    parser.add_argument("--tune-malloc", action="store_true",
                        help="glibc mallopt: keep freed memory instead of faulting it in afresh (applies to all rows)")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        shapes = [s.strip() for s in args.shapes.split(",")]
        if any(n < 1 for n in lengths) or any(s not in SHAPES for s in shapes) or args.repeats < 1:
            raise ValueError
    except ValueError:
        print(f"error: --lengths must be positive ints, --shapes from {sorted(SHAPES)}, --repeats >= 1",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tune_malloc:
        # freed memory stays in the heap (no mmap per big tensor, no trim), so it is not faulted in again
        libc = ctypes.CDLL("libc.so.6")
        if not (libc.mallopt(GLIBC_M_TRIM_THRESHOLD, 2**31 - 1) and libc.mallopt(GLIBC_M_MMAP_MAX, 0)):
            print("error: --tune-malloc needs glibc's mallopt", file=sys.stderr)
            return 2

    run = results.Run("gdn_prefill", "GDN layer prefill: chunked kernel vs token loop vs transformers", argv)
    fused = fused_cpu.load(print) is not None

    from transformers import Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
          f"chunk {args.chunk_size or CPU_CHUNK_SIZE}, malloc tuned: {args.tune_malloc}, fused C++ kernel: {fused}")
    print(f"Qwen3_5TextConfig() defaults: linear_num_key_heads={cfg.linear_num_key_heads} "
          f"linear_num_value_heads={cfg.linear_num_value_heads} linear_key_head_dim={cfg.linear_key_head_dim} "
          f"linear_value_head_dim={cfg.linear_value_head_dim} linear_conv_kernel_dim={cfg.linear_conv_kernel_dim}")
    for name in shapes:
        print(f"shape {name}: key heads, value heads, Dk, Dv = {SHAPES[name]}")
    print(f"{'shape':>5} {'tokens':>7} {'chunked':>10} {'portable':>9} {'token-loop':>11} {'hf-chunk':>10} "
          f"{'chunk/loop':>11} {'chunk/hf':>9}   (tok/s)")

    rows = []
    for name in shapes:
        shape = SHAPES[name]
        probe = make_inputs(PROBE_TOKENS, shape)
        run_chunked(*probe, args.chunk_size)                       # warm up
        run_transformers(*probe)
        loop_per_token = best_seconds(run_token_loop, [x[:32] for x in probe], 1) / 32
        hf_per_token = best_seconds(run_transformers, probe, 1) / PROBE_TOKENS
        chunked_rate = {}
        for tokens in lengths:
            inputs = make_inputs(tokens, shape)
            chunked_rate[tokens] = tokens / best_seconds(lambda *x: run_chunked(*x, args.chunk_size), inputs,
                                                         args.repeats)
            portable_rate = tokens / best_seconds(lambda *x: run_portable(*x, args.chunk_size), inputs, args.repeats)
            loop_rate = hf_rate = None
            # estimates come from the probe, then from the longest cell measured so far
            if loop_per_token * tokens <= args.max_seconds:
                loop_rate = tokens / best_seconds(run_token_loop, inputs, args.repeats)
                loop_per_token = 1 / loop_rate
            if hf_per_token * tokens <= args.max_seconds and transformers_gib(tokens, shape) <= args.max_gib:
                hf_rate = tokens / best_seconds(run_transformers, inputs, args.repeats)
                hf_per_token = 1 / hf_rate
            del inputs
            cells = [f"{chunked_rate[tokens]:10.0f}", f"{portable_rate:9.0f}"]
            cells += [f"{r:{w}.0f}" if r else f"{'skipped':>{w}}" for r, w in ((loop_rate, 11), (hf_rate, 10))]
            cells += [f"{chunked_rate[tokens] / r:{w}.2f}x" if r else f"{'-':>{w + 1}}"
                      for r, w in ((loop_rate, 10), (hf_rate, 8))]
            print(f"{name:>5} {tokens:7d} " + " ".join(cells), flush=True)
            rows.append([name, tokens, round(chunked_rate[tokens]), round(portable_rate),
                         round(loop_rate) if loop_rate else None, round(hf_rate) if hf_rate else None,
                         results.rounded(chunked_rate[tokens] / loop_rate, 2) if loop_rate else None,
                         results.rounded(chunked_rate[tokens] / hf_rate, 2) if hf_rate else None])
        lo, hi = min(lengths), max(lengths)
        if hi > lo:
            print(f"{name:>5} chunked throughput at {hi} vs {lo} tokens: "
                  f"{100 * chunked_rate[hi] / chunked_rate[lo]:.0f}%")
    run.table(f"one layer, tok/s; {torch.get_num_threads()} threads, float32, chunk {args.chunk_size or CPU_CHUNK_SIZE}"
              f", fused C++ kernel: {fused}", ["shape", "tokens", "chunked", "portable", "token loop",
                                               "transformers' torch chunk", "chunk / loop", "chunk / transformers"],
              rows)
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
