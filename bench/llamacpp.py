"""llama.cpp as a peer in the bench scripts: its own converter and its own `llama-bench`, from a llama.cpp source
tree you built yourself (nothing of it is part of deltaserve). Give the tree with `--llama-cpp DIR` (or the
environment variable LLAMA_CPP_DIR); the scripts run without it and print "-" in its column.

    cmake -S DIR -B DIR/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build DIR/build --target llama-bench llama-perplexity llama-lookup llama-quantize -j

On a CPU that lists AMX but whose tiles fault in this VM (llama.cpp's Q4_1 AMX kernel died with SIGILL at
`tileloadd` on the Sapphire Rapids VMs here, 2026-12-06), configure without AMX (-march=native then turns it off):

    cmake -S DIR -B DIR/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
        "-DCMAKE_C_FLAGS=-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
        "-DCMAKE_CXX_FLAGS=-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

ik_llama.cpp (github ikawrakow/ik_llama.cpp; `--ik-llama-cpp DIR`) builds the same way (it has no AMX code).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path


def tree(given: str | None, variable: str = "LLAMA_CPP_DIR") -> Path | None:
    """The llama.cpp source tree with a built llama-bench (given, or in the environment `variable`), or None (then
    the peer is skipped)."""
    root = given or os.environ.get(variable)
    if not root:
        return None
    root = Path(root)
    if not bench_binary(root).exists():
        raise SystemExit(f"error: {root} has no build/bin/llama-bench: build it first (see bench/llamacpp.py)")
    return root


def tree_with(given: str | None, binary: str) -> Path | None:
    """The llama.cpp source tree with build/bin/<binary> built (e.g. llama-perplexity), or None when none is given."""
    root = given or os.environ.get("LLAMA_CPP_DIR")
    if not root:
        return None
    if not (Path(root) / "build" / "bin" / binary).exists():
        raise SystemExit(f"error: {root} has no build/bin/{binary}: build it first (see bench/llamacpp.py)")
    return Path(root)


def bench_binary(root: Path) -> Path:
    return root / "build" / "bin" / "llama-bench"


def convert(root: Path, hf_folder: Path, out: Path, outtype: str = "f32") -> Path:
    """An HF checkpoint to GGUF with llama.cpp's own converter (MTP heads left out)."""
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_folder), "--outfile", str(out),
                    "--outtype", outtype, "--no-mtp"], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    return out


def ik_tree(given: str | None) -> Path | None:
    """An ik_llama.cpp source tree (github ikawrakow/ik_llama.cpp, the fork with the faster CPU kernels) with a built
    llama-bench, from --ik-llama-cpp DIR or IK_LLAMA_CPP_DIR; None skips it. Built like llama.cpp's (the module
    docstring); its llama-bench takes the same arguments and writes the same JSON."""
    return tree(given, "IK_LLAMA_CPP_DIR")


# ik_llama.cpp's own best CPU setting: repack the quantized weights at load into its interleaved rows (-rtr 1)
IK_ARGS = ("-rtr", "1")


def quantize(root: Path, gguf: Path, out: Path, kind: str = "Q4_0", requantize: bool = False) -> Path:
    """A GGUF quantized by llama.cpp's own llama-quantize (build/bin/llama-quantize), e.g. f32 -> Q4_0;
    `requantize`: from an already quantized file (--allow-requantize, e.g. the built-in Q4_1 -> Q8_0)."""
    binary = root / "build" / "bin" / "llama-quantize"
    if not binary.exists():
        raise SystemExit(f"error: {root} has no build/bin/llama-quantize: build it first (see bench/llamacpp.py)")
    subprocess.run([str(binary), *(["--allow-requantize"] if requantize else []), str(gguf), str(out), kind],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return out


def run_bench(root: Path, gguf: Path, *, prompts: list[int] = (), gen: int = 0, threads: int = 2,
              repeats: int = 2, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """tokens/s per test from llama-bench, the best of its `repeats` runs (as our side's best of its runs):
    {"pp512": ..., "tg128": ...}."""
    return rates(run_json(bench_args(root, gguf, prompts, gen, threads, repeats, extra)))


def bench_args(root: Path, gguf: Path, prompts: list[int], gen: int, threads: int, repeats: int,
               extra: tuple[str, ...]) -> list[str]:
    """llama-bench's command line for these tests, JSON out."""
    return [str(bench_binary(root)), "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-o", "json", *extra,
            "-p", ",".join(map(str, prompts)) if prompts else "0", "-n", str(gen)]


def run_json(args: list[str]) -> list[dict]:
    """llama-bench's own JSON rows of one run."""
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def rates(rows: list[dict]) -> dict[str, float]:
    """{test name: best tokens/s} of llama-bench's rows ("pp512", "tg128", "tg128@4096" after a depth)."""
    out = {}
    for row in rows:
        name = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        if str(row.get("test", "")).startswith("tg") and "@pp" in str(row["test"]):  # ik_llama.cpp's -gp
            name = f"tg{row['n_gen']}@{row['n_prompt']}"
        elif row.get("n_depth"):  # llama.cpp's -d
            name += f"@{row['n_depth']}"
        out[name] = max(map(float, row.get("samples_ts") or [row["avg_ts"]]))
    return out


@functools.cache
def takes_gp(root: Path) -> bool:
    """Whether the tree's llama-bench has ik_llama.cpp's -gp (asked once per tree)."""
    return "-gp <" in subprocess.run([str(bench_binary(root)), "--help"], capture_output=True, text=True).stdout


def run_one(root: Path, gguf: Path, test: str, threads: int, extra: tuple[str, ...] = ()) -> float:
    """tokens/s of one llama-bench run of one test ("pp512", "tg128", or "tg128@4096": after 4,096 cached tokens, its
    -d): a bench alternates it with its own side's runs, so that both see the same machine (on a shared 2-core VM
    llama.cpp's tg128 moved between 133 and 166 tok/s within an hour)."""
    return rates(run_json(one_test_args(root, gguf, test, threads, extra)))[test]


def one_test_args(root: Path, gguf: Path, test: str, threads: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The llama-bench command line of one run of `test` (run_one's; bench/real_size.py keeps the JSON it prints)."""
    kind, _, depth = test.partition("@")
    n = int(kind[2:])
    if depth and takes_gp(root):  # ik_llama.cpp's -gp N,n: its tg after an N-token prompt
        return bench_args(root, gguf, [], 0, threads, 1, (*extra, "-gp", f"{depth},{n}"))
    extra = (*extra, "-d", depth) if depth else extra  # llama.cpp's -d N
    return bench_args(root, gguf, [n] if kind.startswith("pp") else [], n if kind.startswith("tg") else 0, threads,
                      1, extra)
