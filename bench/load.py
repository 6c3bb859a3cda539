"""How long `load_model(path, dequantize=False)` takes on a GGUF file and its peak memory, each repeat a fresh
process; with --before, another checkout's code alternated with this one's in the same run (e.g. the commit before a
change: `git archive <commit> deltaserve | tar -x -C DIR`).

    python bench/load.py --file PATH [--file PATH2] [--repeats 3] [--before DIR --before-name NAME] [--cache cold]

--cache warm (the default) reads the file once first so every repeat finds it in the page cache; cold evicts this
file's pages (POSIX_FADV_DONTNEED, no other file's) before each repeat, so the load reads the disk. The C++ kernels
should be built already (`make install`): the figure is a user's every start, not the first one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import results

ROOT = Path(__file__).resolve().parent.parent
ONE_LOAD = """
import json, resource, sys, time
from deltaserve.engine.loader import load_model
started = time.perf_counter()
load_model(sys.argv[1], dequantize=False)
seconds = time.perf_counter() - started
print(json.dumps({"load_s": seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def prepare(path: Path, cache: str) -> None:
    """The file in the page cache (warm) or out of it (cold)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if cache == "cold":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, 64 << 20):
                pass
    finally:
        os.close(fd)


def one_load(path: Path, tree: Path) -> dict:
    """{load_s, peak_rss_bytes} of one load in a fresh process importing deltaserve from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", ONE_LOAD, str(path)], env=env, capture_output=True, text=True,
                         check=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, action="append", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout's root (its deltaserve/ is imported)")
    parser.add_argument("--before-name", default="before", help="what the record calls it (e.g. its commit)")
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm")
    args = parser.parse_args()
    run = results.Run("load", f"load_model(dequantize=False) on {', '.join(p.name for p in args.file)}, "
                              f"{args.cache} page cache")
    sides = ([(args.before_name, args.before)] if args.before else []) + [("this checkout", ROOT)]
    rows = []
    for path in args.file:
        seen = {name: [] for name, _ in sides}
        for repeat in range(args.repeats):
            for name, tree in sides:  # alternated, so both meet the same machine
                prepare(path, args.cache)
                seen[name].append(one_load(path, tree))
                print(f"{path.name} {name} #{repeat + 1}: {seen[name][-1]['load_s']:.2f} s, "
                      f"peak RSS {seen[name][-1]['peak_rss_bytes'] / 2 ** 20:,.0f} MiB", flush=True)
        for name, _ in sides:
            loads = [s["load_s"] for s in seen[name]]
            peaks = [s["peak_rss_bytes"] / 2 ** 20 for s in seen[name]]
            rows.append([path.name, f"{path.stat().st_size / 2 ** 30:.2f}", name, spread(loads),
                         round(statistics.median(loads), 2), f"{min(peaks):,.0f} / {max(peaks):,.0f}"])
    run.table("load_model, seconds and peak RSS", ["file", "GiB", "code", "load s min / median / max",
                                                   "median s", "peak RSS MiB min / max"], rows)
    if args.before:
        run.note(f"{args.before_name}: the deltaserve/ in {args.before}, alternated with this checkout's")
    print("\n".join(" | ".join(str(c) for c in row) for row in rows))
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
