"""Prefix cache on an agent-like trace, tiny random hybrid (tests' 4-layer Qwen3.5), with and without the cache.

The trace: a conversation that resends its whole history each turn, growing to `--max-tokens` of history over
`--turns` turns, then `--agents` sub-agents that share the conversation's first `--system` tokens. For each request:
time to the first token (the request's prefill and its first token, max_tokens=1 so decode does not count), the
prompt tokens the cache supplied; at the end, the checkpoint pool's bytes and the hit rate over reusable tokens
(tokens a previous request of the trace already sent as the same prefix).

    OMP_NUM_THREADS=2 .venv/bin/python bench/prefix_cache.py --turns 10 --max-tokens 16384
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's deltaserve, and the tests' tiny hybrid

from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt  # noqa: E402

from deltaserve.engine.request import SamplingParams  # noqa: E402


def trace(turns: int, max_tokens: int, system: int, agents: int) -> list[list[int]]:
    """The prompts in order: a growing conversation, then sub-agents on its system prompt."""
    history = random_prompt(system, 0, HYBRID_VOCAB)
    step = max(1, (max_tokens - system) // max(turns - 1, 1))
    prompts = []
    for turn in range(turns):
        prompts.append(list(history))
        history += random_prompt(step, turn + 1, HYBRID_VOCAB)  # the answer and the next user message
    shared = prompts[0][:system]
    prompts += [shared + random_prompt(64, 100 + a, HYBRID_VOCAB) for a in range(agents)]
    return prompts


def reusable(prompts: list[list[int]]) -> list[int]:
    """For each prompt, the longest prefix it shares with an earlier prompt of the trace."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        out.append(best)
    return out


def run(eng, prompts: list[list[int]]) -> list[tuple[float, int]]:
    """(seconds to the first token, cached tokens) per prompt, one request at a time."""
    results = []
    for p in prompts:
        started = time.perf_counter()
        stream = eng.submit(p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while not stream.finished:
            eng.step()
        outs = stream.drain()
        results.append((time.perf_counter() - started, outs[-1].cached_tokens))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--agents", type=int, default=4)
    args = ap.parse_args()
    prompts = trace(args.turns, args.max_tokens, args.system, args.agents)
    pool = args.max_tokens + 4096
    with tempfile.TemporaryDirectory() as folder:
        make_hybrid_checkpoint(Path(folder))
        common = dict(max_total_tokens=pool, max_running_requests=2, prefill_chunk_tokens=512)
        cached = engine(folder, prefix_cache=True, **common)
        plain = engine(folder, prefix_cache=False, **common)
        with_cache, without = run(cached, prompts), run(plain, prompts)
        ckpt = cached.checkpoint_pool
        reuse = reusable(prompts)
        print(f"{'prompt':>7} {'tokens':>7} {'reusable':>8} {'cached':>7} {'TTFT cached s':>13} "
              f"{'TTFT plain s':>12} {'speedup':>7}")
        for i, p in enumerate(prompts):
            (t, hit), (t0, _) = with_cache[i], without[i]
            print(f"{i:>7} {len(p):>7} {reuse[i]:>8} {hit:>7} {t:>13.3f} {t0:>12.3f} {t0 / t:>7.1f}")
        hit_rate = sum(h for _, h in with_cache) / max(sum(reuse), 1)
        print(f"hit rate over reusable tokens: {hit_rate:.1%}; checkpoint pool: {ckpt.used_slots}/{ckpt.num_slots} "
              f"checkpoints, {ckpt.bytes:,} bytes ({ckpt.bytes // ckpt.num_slots:,} per checkpoint)")


if __name__ == "__main__":
    main()
