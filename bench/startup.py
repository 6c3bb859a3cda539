"""How long `deltaserve serve` takes from its start to GET /health 200, and how much it holds then.

Starts the server (extra flags after --serve-args) --repeats times on 127.0.0.1, one at a time, and prints each
start's seconds to /health 200 and the process's resident memory (VmRSS) at that moment, then the best and the
median. The C++ kernels should be built already (a first start compiles them once, ~1 min each): the figure is a
user's every start, not the first one.

    python bench/startup.py [--repeats 5] [--port 8941] [--serve-args --no-prefix-cache ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import results
from vllm_peer import stop

ROOT = Path(__file__).resolve().parent.parent


def one_start(port: int, serve_args: list[str], timeout_s: float = 600) -> tuple[float, int]:
    """(seconds from Popen to /health 200, VmRSS in bytes then) of one start; the server is stopped after."""
    argv = [sys.executable, "-m", "deltaserve.cli", "serve", "--port", str(port), *serve_args]
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"error: the server exited while starting (code {process.returncode}): {argv}")
            if time.perf_counter() - started > timeout_s:
                raise SystemExit(f"error: no /health 200 after {timeout_s:.0f} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        seconds = time.perf_counter() - started
        with open(f"/proc/{process.pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return seconds, rss
    finally:
        stop(process)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=8941)
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="flags for deltaserve serve")
    args = parser.parse_args(argv)
    run = results.Run("startup", "Start to GET /health 200, and resident memory then", argv)
    times, rss = [], []
    for i in range(args.repeats):
        seconds, resident = one_start(args.port, args.serve_args)
        times.append(seconds)
        rss.append(resident)
        print(f"start {i + 1}: /health 200 after {seconds:.2f} s, {resident / 2**20:,.0f} MiB resident", flush=True)
    print(f"best {min(times):.2f} s, median {statistics.median(times):.2f} s to /health 200; "
          f"median {statistics.median(rss) / 2**20:,.0f} MiB resident")
    run.table(f"deltaserve serve {' '.join(args.serve_args)}".strip() + f", {args.repeats} starts",
              ["start", "seconds to /health 200", "MiB resident"],
              [[i + 1, results.rounded(t, 2), round(r / 2**20)] for i, (t, r) in enumerate(zip(times, rss))]
              + [["best / median", results.rounded(min(times), 2), round(statistics.median(rss) / 2**20)]])
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
