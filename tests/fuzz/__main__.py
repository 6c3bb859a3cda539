"""Long runs and replays of the differential fuzzer, from the repository root:

    .venv/bin/python -m tests.fuzz --seed 1234          # replay one case, every difference printed
    .venv/bin/python -m tests.fuzz -n 500 --start 0     # seeds 0..499 (what `make fuzz N=500` runs)
    .venv/bin/python -m tests.fuzz --seed 18 --explain  # each generated position's bound and its parts

Prints each failing case with the command that replays it, then a summary: cases run, failures, refusals, and the
counts per family and per format."""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' bare imports, as pytest's rootdir does
os.environ.setdefault("TQDM_DISABLE", "1")  # the compressors' progress bars

from .draw import draw_case  # noqa: E402
from .run import replay_command, run_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument("-n", type=int, default=50, help="cases to run from --start (default 50)")
    parser.add_argument("--start", type=int, default=0, help="first seed of a long run")
    parser.add_argument("--explain", action="store_true",
                        help="print each generated position's bound, its parts and the worst difference's share of it")
    args = parser.parse_args()
    seeds = args.seed or range(args.start, args.start + args.n)
    counts = {"family": collections.Counter(), "format": collections.Counter(), "activation": collections.Counter(),
              "speculative": collections.Counter()}
    failed, refused, cache_hits, started = [], [], 0, time.monotonic()
    drafts = collections.Counter()  # draft tokens verified and accepted, per method
    for seed in seeds:
        case = draw_case(seed)
        print(case.summary(), flush=True)
        counts["family"][case.family] += 1
        if case.image is not None:
            counts["family"][case.image.family] += 1
        counts["format"][case.fmt.label().split("-")[0] if case.fmt.kind != "safetensors" else case.fmt.label()] += 1
        counts["activation"][case.engine["activation_dtype"]] += 1
        method = case.engine.get("speculative", "off")
        counts["speculative"][method] += 1
        try:
            result = run_case(case, explain=args.explain)
            for line in result.explained or ():
                print(f"  {line}")
            problems, refusal = result.failures, result.refusal
            cache_hits += result.cached_tokens > 0
            drafts[f"{method} drafted"] += result.drafted
            drafts[f"{method} accepted"] += result.accepted
        except Exception:  # noqa: BLE001 -- a crash is a finding: report it and go on to the next seed
            problems, refusal = [traceback.format_exc().rstrip().splitlines()[-1]], None
            traceback.print_exc()
        if refusal:  # counted among the failures too (every draw is valid)
            refused.append(seed)
            print(f"  refused: {refusal}")
        if problems:
            failed.append(seed)
            print(f"  FAILED: {len(problems)} differences; replay: {replay_command(seed)}")
            for problem in problems[:8]:
                print(f"    {problem}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\n{len(seeds)} cases at {commit} in {time.monotonic() - started:.0f} s: {len(failed)} failed, "
          f"{len(refused)} of them refusals, {cache_hits} served a follow-up from the prefix cache")
    for what, counter in counts.items():
        print(f"  per {what}: " + ", ".join(f"{k} {v}" for k, v in sorted(counter.items())))
    if drafts:
        print("  draft tokens: " + ", ".join(f"{k} {v}" for k, v in sorted(drafts.items())))
    if failed:
        print("  failing seeds: " + " ".join(map(str, failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
