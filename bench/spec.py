"""Speculative decoding with prompt lookup (--speculative ngram) on vs off, batch-1 decode, one run.

The workload is code editing: the prompt holds a source file of this repository and asks for it back with one
name changed, so the answer repeats most of the prompt (what coding agents do with the files they edit). Both sides
run the same Engine on the built-in SmolLM2 GGUF (or --model), greedy, alternated --repeats times (a shared machine's
speed drifts within minutes), and the outputs must be equal token for token (speculation is lossless).
- decode tok/s: (new tokens - 1) / (time from the first to the last token);
- acceptance: accepted / drafted draft tokens; tokens per verifying step: what one such step emitted on average;
- step cost: a verifying step's wall time over a plain decode step's (the figures engine/speculative.py's
  draft-length policy is priced with).

    OMP_NUM_THREADS=2 .venv/bin/python bench/spec.py --tokens 192
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import results

ROOT = Path(__file__).resolve().parent.parent


def edit_prompt(tokenizer, path: Path, lines: int) -> list[int]:
    source = "\n".join(path.read_text().splitlines()[:lines])
    ask = (f"Here is a Python file:\n```python\n{source}\n```\nRewrite the whole file with the function `sample` "
           f"renamed to `pick`. Output only the code.")
    return tokenizer.encode_chat([{"role": "user", "content": ask}])


def run_once(eng, prompt: list[int], tokens: int) -> dict:
    from deltaserve.engine.request import SamplingParams

    stream = eng.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    out, first, plain, verify = [], None, [], []
    spec = eng.speculation
    while not stream.finished:
        before = spec.verify_steps_total if spec else 0
        started = time.perf_counter()
        eng.step()
        elapsed = time.perf_counter() - started
        got = [t for o in stream.drain() for t in o.token_ids]
        if first is None and got:
            first = time.perf_counter()
        elif got:
            (verify if spec and spec.verify_steps_total > before else plain).append(elapsed)
        out += got
    return {"tokens": out, "decode_s": time.perf_counter() - first, "plain_steps": plain, "verify_steps": verify}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--file", default="deltaserve/engine/sampler.py")
    parser.add_argument("--lines", type=int, default=60)
    args = parser.parse_args(argv)
    run = results.Run("spec", "Prompt-lookup speculation on vs off: batch-1 decode of a code-editing answer", argv)
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine

    common = dict(model=args.model, device="cpu", max_total_tokens=8192, max_running_requests=4, prefix_cache=False)
    off = Engine(EngineConfig(**common), log=None)
    on = Engine(EngineConfig(**common, speculative="ngram", speculative_tokens=args.k), log=None)
    prompt = edit_prompt(off.tokenizer, ROOT / args.file, args.lines)
    print(f"prompt {len(prompt)} tokens ({args.file}, {args.lines} lines), {args.tokens} new tokens, k {args.k}")
    rates = {"off": [], "ngram": []}
    steps = {"plain": [], "verify": []}
    for _ in range(args.repeats):
        a = run_once(off, prompt, args.tokens)
        drafted, accepted, verifies = (on.speculation.drafted_total, on.speculation.accepted_total,
                                       on.speculation.verify_steps_total)
        b = run_once(on, prompt, args.tokens)
        if a["tokens"] != b["tokens"]:
            sys.exit("speculation changed the greedy output: a bug")
        rates["off"].append((len(a["tokens"]) - 1) / a["decode_s"])
        rates["ngram"].append((len(b["tokens"]) - 1) / b["decode_s"])
        steps["plain"] += a["plain_steps"]
        steps["verify"] += b["verify_steps"]
        drafted = on.speculation.drafted_total - drafted
        accepted = on.speculation.accepted_total - accepted
        verifies = on.speculation.verify_steps_total - verifies
    off_rate, on_rate = statistics.median(rates["off"]), statistics.median(rates["ngram"])
    acceptance = accepted / max(drafted, 1)
    plain_ms = statistics.median(steps["plain"]) * 1000
    verify_ms = statistics.median(steps["verify"]) * 1000 if steps["verify"] else float("nan")
    rows = [["off", round(off_rate, 1), "", "", round(plain_ms, 2)],
            [f"ngram k={args.k}", round(on_rate, 1), round(acceptance, 3), round((accepted + verifies) / max(verifies, 1),
                                                                                 2), round(verify_ms, 2)]]
    columns = ["speculative", "decode tok/s", "acceptance", "tokens per verifying step", "step ms (median)"]
    for row in [columns] + rows:
        print("  ".join(str(c) for c in row))
    print(f"speed-up x{on_rate / off_rate:.2f}; a verifying step costs {verify_ms / plain_ms:.2f} plain steps")
    run.table(f"batch-1 greedy decode, {len(prompt)}-token code-editing prompt, {args.tokens} new tokens", columns,
              rows)
    run.note(f"speed-up x{on_rate / off_rate:.2f}; greedy outputs identical on and off; a verifying step costs "
             f"{verify_ms / plain_ms:.2f} plain decode steps (medians)")
    run.note(f"machine load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
             f"on {os.cpu_count()} logical CPUs: other work shared the cores, so absolute rates are low and noisy; "
             f"on and off alternate, so the ratio is the figure to read")
    run.save()


if __name__ == "__main__":
    main(sys.argv[1:])
