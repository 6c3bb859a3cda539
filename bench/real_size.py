"""Issue 53's benchmark: a real-size Qwen3.5 GGUF, deltaserve (default flags, through its Engine) against ik_llama.cpp
at its best CPU settings and llama.cpp, on the same file, every side alternated, min-median-max of the repeats.

    OMP_NUM_THREADS=2 python bench/real_size.py --file PATH --llama-cpp DIR --ik-llama-cpp DIR2 [--repeats 3]

PATH: a file from bench/make_real_quantized.py (llama.cpp's converter + llama-quantize) or bench/make_real_size.py
(written block by block; the 27B class). Sides:
- deltaserve: an Engine with the defaults `serve` takes on a CPU (int8 activations, the packed weights, the native
  decode stack), `--context-length` the longest prompt here plus the decode, the prefix cache off (each repeat
  reads its prompt again, as llama-bench does); submit, step, drain: the path `serve` takes without HTTP.
- ik_llama.cpp: its llama-bench with `-rtr 1 -thp 1` (repack the weights at load into its interleaved rows; the
  model on transparent huge pages), flash attention at its default (on);
- llama.cpp: its llama-bench with `-fa 1`.
Rows: prefill 512 tok/s; batch-1 decode tok/s of --decode tokens after a short prompt and after --depth tokens
(llama-bench: tg, and ik's `-gp N,n` / llama.cpp's `-d N`); time to first token (s) at each --ttft prompt (the
peers: prompt / their pp rate); decode's GB/s (the weight bytes a step reads x tok/s) beside a plain read of a
buffer of --plain-read-gb (torch.sum over float32 on huge pages, alternated with the runs); load time and peak RSS
(ours: Engine construction and VmHWM; the peers: `/usr/bin/time -v` around one llama-bench run). llama-bench's own
JSON rows are kept in the record (`peer_json`).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import llamacpp
import results
from dense import Ours, plain_read_gbps, prompt

IK_FLAGS = ("-rtr", "1", "-thp", "1")  # ik_llama.cpp's best CPU settings; its flash attention is on by default
LLAMA_FLAGS = ("-fa", "1")


def vm_hwm_mib() -> float:
    """This process's peak resident set (MiB)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


def our_engine(path: Path, context: int):
    """(Ours over an Engine at the CPU defaults but the context length and the prefix cache, seconds to load)."""
    from deltaserve.config import EngineConfig

    start = time.perf_counter()
    ours = Ours(str(path), context, False, config=EngineConfig(model=str(path), device="cpu", context_length=context,
                                                               prefix_cache=False))
    return ours, time.perf_counter() - start


class Peer:
    """One llama-bench binary with its flags: each call is one llama-bench run of one test, its JSON row kept."""

    def __init__(self, name: str, root: Path, flags: tuple[str, ...], gguf: Path, threads: int):
        self.name, self.root, self.flags, self.gguf, self.threads = name, root, flags, gguf, threads
        self.rows: list[dict] = []

    def args(self, test: str) -> list[str]:
        return llamacpp.one_test_args(self.root, self.gguf, test, self.threads, self.flags)

    def rate(self, test: str) -> float:
        row = llamacpp.run_json(self.args(test))[-1]
        self.rows.append({"test": test, **row})
        return float(row["avg_ts"])

    def peak_rss_mib(self) -> float:
        """Max RSS of one llama-bench pp512 run (load, repack, run) from /usr/bin/time -v."""
        done = subprocess.run(["/usr/bin/time", "-v", *self.args("pp512")], capture_output=True, text=True,
                              check=True)
        return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) / 1024


def spread(values: list[float], digits: int = 1) -> str:
    """min / median / max as one cell."""
    return " / ".join(f"{v:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", required=True, help="the GGUF (bench/make_real_quantized.py, make_real_size.py)")
    parser.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-bench (or LLAMA_CPP_DIR)")
    parser.add_argument("--ik-llama-cpp", help="an ik_llama.cpp tree with build/bin/llama-bench (or IK_LLAMA_CPP_DIR)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=64, help="new tokens of each decode run")
    parser.add_argument("--depth", type=int, default=8192, help="the long decode row's prompt (0: none)")
    parser.add_argument("--ttft", default="8192,32768", help="prompt lengths of the time-to-first-token rows")
    parser.add_argument("--plain-read-gb", type=float, default=1.0)
    parser.add_argument("--rows", default="prefill,decode,depth,ttft",
                        help="which rows to run (a 32K time to first token is minutes a side: run it apart)")
    args = parser.parse_args(argv)
    rows_wanted = set(args.rows.split(","))
    ttfts = [int(t) for t in args.ttft.split(",") if t]
    if args.repeats < 1 or args.decode < 2 or args.depth < 0:
        print("error: --repeats >= 1, --decode >= 2, --depth >= 0", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    path = Path(args.file)
    run = results.Run("real_size", f"{path.name}: deltaserve vs ik_llama.cpp and llama.cpp, {args.threads} threads",
                      argv)
    peers = [Peer(name, root, flags, path, args.threads) for name, root, flags in
             (("ik_llama.cpp", llamacpp.ik_tree(args.ik_llama_cpp), IK_FLAGS),
              ("llama.cpp", llamacpp.tree(args.llama_cpp), LLAMA_FLAGS)) if root]
    context = max([512, args.depth + args.decode, *ttfts]) + 16  # the longest prompt this run sends
    ours, load_s = our_engine(path, context)
    load_hwm = vm_hwm_mib()
    held = ours.weight_bytes  # a batch-1 step reads every held matrix; an untied embedding table one row of it
    model = ours.engine.runner.model
    if not getattr(model, "tie_word_embeddings", True):
        held -= sum(t.numel() * t.element_size() for t in model.model.embed_tokens.state_dict().values())
    print(f"{path.name}: {path.stat().st_size / 2**20:,.0f} MiB file, deltaserve holds "
          f"{ours.weight_bytes / 2**20:,.0f} MiB of weights, reads {held / 2**20:,.0f} MiB a decode step; loaded in "
          f"{load_s:.1f} s, peak RSS {load_hwm:,.0f} MiB")
    ours.decode(prompt(64, 0), 4)  # first-call costs (prefill and decode paths) out of the timings
    cells = [("prefill 512, tok/s", "pp512")] if "prefill" in rows_wanted else []
    cells += [(f"decode {args.decode}, tok/s", f"tg{args.decode}")] if "decode" in rows_wanted else []
    if args.depth and "depth" in rows_wanted:
        cells.append((f"decode {args.decode} after {args.depth:,}, tok/s", f"tg{args.decode}@{args.depth}"))
    cells += [(f"time to first token at {n:,}, s", f"ttft{n}") for n in ttfts] if "ttft" in rows_wanted else []
    figures = {cell: {side: [] for side in ["deltaserve", *(p.name for p in peers)]} for _, cell in cells}
    plain = []
    for repeat in range(args.repeats):
        for label, cell in cells:
            figures[cell]["deltaserve"].append(ours_figure(ours, cell, args.decode))
            for peer in peers:
                try:
                    figures[cell][peer.name].append(peer_figure(peer, cell))
                except subprocess.CalledProcessError as error:
                    print(f"  {peer.name} {cell} failed: {error.stderr[-300:]}")
            print(f"  repeat {repeat + 1} {label}: " + ", ".join(f"{side} {v[-1]:.2f}" for side, v in
                                                                  figures[cell].items() if v), flush=True)
        plain.append(plain_read_gbps(int(args.plain_read_gb * 1e9), 2))
    hwm = vm_hwm_mib()
    names = ["deltaserve", *(p.name for p in peers)]
    header = ["what (min / median / max)", *names, *(f"deltaserve / {p.name} (medians)" for p in peers)]
    rows = []
    for label, cell in cells:
        row = [label, *(spread(figures[cell][n], 2 if cell.startswith("ttft") else 1) if figures[cell][n] else None
                        for n in names)]
        for p in peers:
            ours_m, theirs = statistics.median(figures[cell]["deltaserve"]), figures[cell][p.name]
            ratio = (theirs and (statistics.median(theirs) / ours_m if cell.startswith("ttft")
                                 else ours_m / statistics.median(theirs)))
            row.append(results.rounded(ratio, 2) if ratio else None)
        rows.append(row)
    if f"tg{args.decode}" in figures:
        decode = figures[f"tg{args.decode}"]["deltaserve"]
        rows.append([f"decode GB/s (of {held / 1e9:.2f} GB a step), beside a plain read",
                     f"{spread([held * r / 1e9 for r in decode])} (plain read {spread(plain)})",
                     *([None] * (2 * len(peers)))])
    peaks = {p.name: p.peak_rss_mib() for p in peers}
    rows.append(["peak RSS, MiB", f"{hwm:,.0f} ({load_hwm:,.0f} after load)",
                 *(f"{peaks[p.name]:,.0f}" for p in peers), *([None] * len(peers))])
    rows.append(["load, s", results.rounded(load_s), *([None] * (2 * len(peers)))])
    title = (f"{path.name} ({path.stat().st_size / 2**20:,.0f} MiB), {args.threads} threads, {args.repeats} "
             f"repeats alternated")
    print("\n" + title)
    for row in [header, *rows]:
        print("  ".join("-" if v is None else str(v) for v in row))
    run.table(title, header, rows)
    run.note("flags: deltaserve " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                             (("context_length", context), ("threads", args.threads)))
             + " --no-prefix-cache (else its defaults); " + "; ".join(f"{p.name} llama-bench -t {args.threads} "
                                                                      + " ".join(p.flags) for p in peers)
             + ". Ratios: ours / theirs for rates, theirs / ours for times (above 1: deltaserve is faster).")
    run.record["peer_json"] = {p.name: p.rows for p in peers}
    run.save()
    return 0


def ours_figure(ours: Ours, cell: str, decode: int) -> float:
    """One run of one cell on our side: tok/s, or seconds for a ttft cell."""
    if cell.startswith("ttft"):
        return ours.prefill(prompt(int(cell[4:]), 7))
    kind, _, depth = cell.partition("@")
    n = int(kind[2:])
    if kind.startswith("pp"):
        return n / ours.prefill(prompt(n, 1))
    return (n - 1) / ours.decode(prompt(int(depth) if depth else 16, 2), n)


def peer_figure(peer: Peer, cell: str) -> float:
    if cell.startswith("ttft"):
        n = int(cell[4:])
        return n / peer.rate(f"pp{n}")
    return peer.rate(cell)


if __name__ == "__main__":
    sys.exit(main())
