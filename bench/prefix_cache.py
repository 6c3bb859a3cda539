"""Prefix cache on an agent-like trace, tiny random hybrid (tests' 4-layer Qwen3.5), with and without the cache.

The trace: a main conversation that resends its whole history each turn, growing to `--max-tokens` of history over
`--turns` turns (each turn adds an answer and a user message), and `--agents` sub-agents that share its system
prompt (`--system` tokens), each with a task of its own that it carries on for `--agent-turns` turns, their turns
interleaved with the main conversation's. Each prompt comes with its message boundaries, as the server passes them.
For each request: time to the first token (the request's prefill and its first token, max_tokens=1 so decode does
not count; the least over `--repeat` identical engines per side) and the prompt tokens the cache supplied; then
the hit rate over reusable tokens (tokens an earlier request of the trace already sent as the same prefix), the
speedup at 8K tokens of history and beyond, and the checkpoint pool's bytes. With `--eviction lru marconi` the cached run is repeated once per eviction policy, on the
pools given (small pools make them evict), and each policy's hit rate and prefill tokens are printed.

    OMP_NUM_THREADS=2 .venv/bin/python bench/prefix_cache.py --turns 10 --max-tokens 16384
    OMP_NUM_THREADS=2 .venv/bin/python bench/prefix_cache.py --eviction lru marconi --checkpoint-slots 4 --no-plain
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's deltaserve, and the tests' tiny hybrid

from test_engine_support import HYBRID_VOCAB, engine, make_hybrid_checkpoint, random_prompt  # noqa: E402

from deltaserve.engine.request import SamplingParams  # noqa: E402
import results as bench_results  # noqa: E402

LONG_HISTORY_TOKENS = 8192  # the target speedup holds from this much history on


class Chat:
    """A conversation as token ids with the positions where its messages end."""

    def __init__(self, system: list[int]):
        self.ids = list(system)
        self.boundaries = [len(system)]

    def add(self, tokens: list[int]) -> None:
        self.ids += tokens
        self.boundaries.append(len(self.ids))

    def prompt(self) -> tuple[list[int], tuple[int, ...]]:
        """The ids and the boundaries the server would pass: the last message's end is the prompt's there (it
        precedes a generation prompt)."""
        return list(self.ids), tuple(b for b in self.boundaries if b < len(self.ids))


def trace(args) -> list[tuple[str, list[int], tuple[int, ...]]]:
    """(who, prompt ids, message boundaries) in the order they are sent."""
    system = random_prompt(args.system, 0, HYBRID_VOCAB)
    main = Chat(system)
    main.add(random_prompt(64, 1, HYBRID_VOCAB))  # the first user message
    step = max(2, (args.max_tokens - len(main.ids)) // max(args.turns - 1, 1))
    agents = [Chat(system) for _ in range(args.agents)]
    for a, chat in enumerate(agents):
        chat.add(random_prompt(64, 1000 + a, HYBRID_VOCAB))  # its task
    agent_turns = [(a, t) for t in range(args.agent_turns) for a in range(args.agents)]
    per_turn = -(-len(agent_turns) // max(args.turns - 1, 1))
    prompts = []
    for turn in range(args.turns):
        prompts.append(("main", *main.prompt()))
        main.add(random_prompt(step // 4, 10 + turn, HYBRID_VOCAB))  # the answer, sent back verbatim
        main.add(random_prompt(step - step // 4, 100 + turn, HYBRID_VOCAB))  # the next user message or tool output
        if turn >= 1:  # the sub-agents start once the main agent has planned
            for a, t in agent_turns[:per_turn]:
                prompts.append((f"agent{a}", *agents[a].prompt()))
                agents[a].add(random_prompt(96, 2000 + 10 * a + t, HYBRID_VOCAB))
                agents[a].add(random_prompt(160, 3000 + 10 * a + t, HYBRID_VOCAB))
            agent_turns = agent_turns[per_turn:]
    return prompts


def reusable(prompts: list[list[int]]) -> list[int]:
    """For each prompt, the longest prefix it shares with an earlier prompt of the trace (less its last token,
    which a request always computes for its logits)."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        out.append(min(best, len(p) - 1))
    return out


def send(eng, prompt: list[int], boundaries: tuple[int, ...]) -> tuple[float, float, int]:
    """(wall seconds to the first token, CPU seconds of this process meanwhile, cached tokens) of one request."""
    wall, cpu = time.perf_counter(), time.process_time()
    stream = eng.submit(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), boundaries=boundaries)
    while not stream.finished:
        eng.step()
    outs = stream.drain()
    return time.perf_counter() - wall, time.process_time() - cpu, outs[-1].cached_tokens


def run(engines: dict[str, list], sent) -> dict[str, list[tuple[float, float, int]]]:
    """Each prompt sent to every engine in turn, back to back: on a shared machine the load drifts, and the
    engines compared should meet the same load. Each side has identical copies (same settings, same requests
    before): a turn's times are the least over them, its cached tokens the same in each."""
    results = {name: [] for name in engines}
    for _, prompt, boundaries in sent:
        runs = {name: [] for name in engines}
        for copy in range(max(len(copies) for copies in engines.values())):
            for name, copies in engines.items():
                runs[name].append(send(copies[copy], prompt, boundaries))
        for name, got in runs.items():
            assert len({hit for _, _, hit in got}) == 1, f"copies of {name} hit differently: {got}"
            results[name].append((min(t for t, _, _ in got), min(c for _, c, _ in got), got[0][2]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--agent-turns", type=int, default=3)
    ap.add_argument("--checkpoint-slots", type=int, default=8)
    ap.add_argument("--pool-tokens", type=int, help="KV pool (default: --max-tokens + 4096)")
    ap.add_argument("--eviction", nargs="+", default=["marconi"], choices=["marconi", "lru"])
    ap.add_argument("--no-plain", action="store_true", help="skip the run without the cache (no TTFT ratios)")
    ap.add_argument("--repeat", type=int, default=3, help="identical engines per side; each turn's time is the "
                    "least of theirs (on a shared machine one run of a turn can stall 2x)")
    args = ap.parse_args()
    record = bench_results.Run("prefix_cache", "Prefix cache on the agent trace, by eviction policy")
    summary = []
    sent = trace(args)
    reuse = reusable([p for _, p, _ in sent])
    with tempfile.TemporaryDirectory() as folder:
        make_hybrid_checkpoint(Path(folder))
        common = dict(max_total_tokens=args.pool_tokens or args.max_tokens + 4096, max_running_requests=2,
                      prefill_chunk_tokens=512)
        engines = {}
        for policy in args.eviction:
            engines[policy] = [engine(folder, prefix_cache=True, checkpoint_slots=args.checkpoint_slots, **common)
                               for _ in range(args.repeat)]
            for copy in engines[policy]:
                copy.prefix_cache.eviction = policy
        if not args.no_plain:
            engines["plain"] = [engine(folder, prefix_cache=False, **common) for _ in range(args.repeat)]
        load = os.getloadavg()[0]
        results = run(engines, sent)
    print(f"load average (1 min) {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, on "
          f"{os.cpu_count()} CPUs")
    without = results.get("plain")
    for policy in args.eviction:
        with_cache, cached = results[policy], engines[policy][0]
        print(f"\n== eviction {policy}: checkpoint slots {args.checkpoint_slots}, KV pool {common['max_total_tokens']}")
        print(f"{'#':>3} {'who':>7} {'tokens':>7} {'reusable':>8} {'cached':>7} {'TTFT cached s':>13} "
              f"{'TTFT plain s':>12} {'speedup':>7} {'CPU s ratio':>11}")
        long_speedups, long_cpu = [], []
        for i, (who, p, _) in enumerate(sent):
            t, cpu, hit = with_cache[i]
            t0, cpu0 = (without[i][0], without[i][1]) if without else (float("nan"), float("nan"))
            print(f"{i:>3} {who:>7} {len(p):>7} {reuse[i]:>8} {hit:>7} {t:>13.3f} {t0:>12.3f} {t0 / t:>7.1f} "
                  f"{cpu0 / cpu:>11.1f}")
            if who == "main" and reuse[i] >= LONG_HISTORY_TOKENS and without:
                long_speedups.append(t0 / t)
                long_cpu.append(cpu0 / cpu)
        ckpt, cache = cached.checkpoint_pool, cached.prefix_cache
        hits = sum(h for _, _, h in with_cache)
        computed = sum(len(p) for _, p, _ in sent) - hits
        print(f"hit rate over reusable tokens: {hits / max(sum(reuse), 1):.1%} ({hits:,} of {sum(reuse):,}); "
              f"prompt tokens computed: {computed:,}; checkpoints evicted: {cache.evicted_checkpoints_total}, "
              f"pages evicted: {cache.evicted_pages_total}")
        print(f"checkpoint pool: {ckpt.used_slots}/{ckpt.num_slots} checkpoints, {ckpt.bytes:,} bytes "
              f"({ckpt.bytes_per_checkpoint:,} per checkpoint)")
        if long_speedups:
            print(f"TTFT speedup at >= {LONG_HISTORY_TOKENS} tokens of history: min {min(long_speedups):.1f}x, "
                  f"median {statistics.median(long_speedups):.1f}x over {len(long_speedups)} turns (CPU seconds: "
                  f"min {min(long_cpu):.1f}x, median {statistics.median(long_cpu):.1f}x)")
        speedups = [round(f(v), 1) if v else None for v in (long_speedups, long_cpu)
                    for f in (min, statistics.median)]
        summary.append([policy, round(100 * hits / max(sum(reuse), 1), 1), computed,
                        cache.evicted_checkpoints_total, cache.evicted_pages_total, *speedups])
    record.table(f"{len(sent)} requests, checkpoint slots {args.checkpoint_slots}, KV pool {common['max_total_tokens']}"
                 f", {args.repeat} engines a side; load average {load:.2f} at the start",
                 ["eviction", "hit rate over reusable tokens, %", "prompt tokens computed", "checkpoints evicted",
                  "pages evicted", f"TTFT speedup at >= {LONG_HISTORY_TOKENS} history, min",
                  "TTFT speedup, median", "CPU seconds speedup, min", "CPU seconds speedup, median"], summary)
    record.save()


if __name__ == "__main__":
    main()
