"""Soak: one server, many requests mixing clients that stay, clients that leave mid-request and malformed ones.

Half the clients stay (a greedy completion of one of 8 prompts, streamed or not: each must equal that prompt's
answer alone), 30% leave at a seeded random moment (after a few stream events, or after a fraction of a second,
queued, prefilling or decoding by then), 20% send what must be refused (wrong types, not JSON, an oversize prompt or
body, a wrong or missing key, text/plain). Prints: failures among the clients that stayed, 5xx answers (seen by the
clients and counted by the server), the server's RSS after the first 10% of requests and at the end, and whether
its pools are full again. Exit code 0 when all of that holds.

    OMP_NUM_THREADS=2 .venv/bin/python bench/soak.py --requests 2000               # the built-in model
    OMP_NUM_THREADS=2 .venv/bin/python bench/soak.py --requests 2000 --tiny hybrid # the tests' tiny hybrid
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's deltaserve, the tests' clients and tiny models

import results  # noqa: E402
import traffic  # noqa: E402
from server_util import running_server  # noqa: E402
from test_engine_support import HYBRID_VOCAB, make_dense_checkpoint, make_hybrid_checkpoint  # noqa: E402

KEY = "soak-key"
MAX_BODY_BYTES = 65536
BUILT_IN_VOCAB = 49152  # SmolLM2's


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--at-once", type=int, default=16, help="clients in flight at once (16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", choices=["dense", "hybrid"], help="the tests' tiny model instead of the built-in")
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    args = parser.parse_args()
    run = results.Run("soak", f"Soak: {args.requests} requests from {args.at_once} clients through a real server "
                      f"({args.tiny or 'built-in'} model)")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_args, vocab = [], BUILT_IN_VOCAB
        if args.tiny:
            (make_dense_checkpoint if args.tiny == "dense" else make_hybrid_checkpoint)(folder)
            model_args, vocab = ["--model", str(folder)], HYBRID_VOCAB
        with running_server(folder, *model_args, "--api-key", KEY, "--max-total-tokens", str(args.max_total_tokens),
                            "--max-body-bytes", str(MAX_BODY_BYTES), headers={"Authorization": f"Bearer {KEY}"}) as s:
            print(f"soak: {args.requests} requests, {args.at_once} at once, seed {args.seed}, model "
                  f"{args.tiny or 'built-in'}, commit {_commit()}, {time.strftime('%Y-%m-%d')}", flush=True)
            result = asyncio.run(traffic.soak(
                s.url, KEY, args.requests, seed=args.seed, at_once=args.at_once, max_body_bytes=MAX_BODY_BYTES,
                vocab=vocab, progress=lambda done, total: print(f"  {done}/{total}", flush=True)))
            internal = s.log.read_text(errors="replace").count("internal error")
    print(report(result, internal))
    run.note(f"verdict: {'pass' if result.ok and not internal else 'FAIL'}; {internal} internal errors in the log")
    run.save()
    return 0 if result.ok and not internal else 1


def report(r: traffic.SoakResult, internal_errors: int) -> str:
    mib = 1 << 20
    growth = (r.rss_end_bytes - r.rss_warm_bytes) / r.rss_warm_bytes * 100 if r.rss_warm_bytes else float("nan")
    lines = [
        f"requests:            {r.requests} in {r.seconds:.0f} s ({', '.join(f'{k} {v}' for k, v in r.by_kind.items())})",
        f"statuses:            {', '.join(f'{k}: {v}' for k, v in r.by_status.items())}",
        f"normal failures:     {len(r.normal_failures)}" + (f" (first: {r.normal_failures[0]})" if r.normal_failures
                                                           else ""),
        f"malformed not 4xx:   {len(r.malformed_failures)}",
        f"5xx:                 {r.client_5xx} seen by clients, {r.server_5xx:.0f} counted by the server",
        f"internal errors:     {internal_errors} in the server log",
        f"disconnects:         {r.disconnects:.0f} counted by the server",
        f"RSS:                 {r.rss_warm_bytes / mib:.1f} MiB after warm-up, {r.rss_end_bytes / mib:.1f} MiB at the "
        f"end ({growth:+.1f}%)",
        f"pools full at end:   {r.pools_full}",
        f"verdict:             {'PASS' if r.ok and not internal_errors else 'FAIL'}",
    ]
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
