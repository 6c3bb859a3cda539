"""Perplexity of the built-in SmolLM2 Q4_1 GGUF over ~32K tokens of the Python standard library's own source, for
our float32 path, our int8-activation path (`--activation-dtype int8`) and llama.cpp's `llama-perplexity` on the same
file and text (issue 41: the int8 path must be no worse than llama.cpp's on the same file).

The text is the FILES below, read from the running Python's standard library (its version is recorded: another
Python's files differ) and joined in order; the first CHUNKS x CONTEXT tokens are scored. Both sides score as
llama-perplexity does: each chunk of CONTEXT tokens is read from an empty cache and only its second half's next-token
predictions are scored (positions CONTEXT/2 .. CONTEXT-2 predicting the following token); SmolLM2's GGUF adds no
BOS, so no token is replaced. Also printed: how often the int8 path's greedy token equals the float32 path's, over
all scored positions and over those where the float32 top-2 logit margin exceeds 1.

    OMP_NUM_THREADS=2 .venv/bin/python bench/perplexity.py --llama-cpp /path/to/llama.cpp

With `--requantize q8_0` (or iq4_nl) every side reads the built-in file requantized by llama.cpp's own llama-quantize
(--allow-requantize; bench/dense.py's q8_0 / iq4_nl rows): the int8 path on 8-bit codes, or on IQ4_NL's levels.

    OMP_NUM_THREADS=2 .venv/bin/python bench/perplexity.py --llama-cpp /path/to/llama.cpp --requantize q8_0
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

import llamacpp
import results

FILES = ("argparse.py", "textwrap.py", "difflib.py", "heapq.py", "shlex.py", "fractions.py", "bisect.py",
         "functools.py", "dataclasses.py", "string.py", "enum.py", "inspect.py")
CONTEXT = 512
CHUNKS = 64  # 32,768 tokens


def text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((lib / name).read_text() for name in FILES)


class Ours:
    def __init__(self, path: str, activation_dtype: str):
        from deltaserve.config import EngineConfig
        from deltaserve.engine.engine import Engine

        config = EngineConfig(model=path, device="cpu", max_total_tokens=4 * CONTEXT, prefill_chunk_tokens=CONTEXT,
                              activation_dtype=activation_dtype, prefix_cache=False)
        self.engine = Engine(config, log=lambda line: print(f"  [{activation_dtype}] {line}"))

    def logits(self, ids: list[int]) -> torch.Tensor:
        from deltaserve.models.batch import allocate_caches, single_sequence_batch

        model = self.engine.loaded.model
        caches = allocate_caches(model.geometry, len(ids), 1, torch.float32)
        with torch.inference_mode():
            return model(single_sequence_batch(ids, 0, torch.arange(len(ids)), all_logits=True), caches)


def scored(logits: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(negative log-likelihoods, logits) of the scored positions of one chunk."""
    first = CONTEXT // 2
    part = logits[first:CONTEXT - 1].double()
    target = torch.tensor(ids[first + 1:CONTEXT])
    return -torch.log_softmax(part, -1).gather(1, target[:, None])[:, 0], part


def llama_perplexity(root: Path, gguf: Path, corpus: Path, threads: int, chunks: int) -> tuple[float, str]:
    binary = root / "build" / "bin" / "llama-perplexity"
    done = subprocess.run([str(binary), "-m", str(gguf), "-f", str(corpus), "-c", str(CONTEXT), "--chunks",
                           str(chunks), "-t", str(threads), "-b", str(CONTEXT)], capture_output=True, text=True,
                          check=True)
    log = done.stdout + done.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    return float(found.group(1)), log


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-perplexity (or LLAMA_CPP_DIR)")
    parser.add_argument("--ik-llama-cpp", help="an ik_llama.cpp tree with build/bin/llama-perplexity (or "
                        "IK_LLAMA_CPP_DIR): its perplexity on the same file and text beside llama.cpp's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=CHUNKS)
    parser.add_argument("--requantize", choices=["q8_0", "iq4_nl"],
                        help="the built-in file requantized by llama-quantize (needs --llama-cpp)")
    args = parser.parse_args(argv)
    from deltaserve.budget import default_model_path

    with tempfile.TemporaryDirectory(prefix="ppl-") as folder:
        path = default_model_path()
        if args.requantize:
            root = llamacpp.tree_with(args.llama_cpp, "llama-quantize")
            if root is None:
                parser.error("--requantize needs --llama-cpp (its llama-quantize)")
            path = llamacpp.quantize(root, path, Path(folder) / f"smollm2-135m-{args.requantize}.gguf",
                                     args.requantize.upper(), requantize=True)
        return measure(args, path)


def measure(args, path: Path) -> int:
    kind = args.requantize.upper() if args.requantize else "Q4_1"
    run = results.Run("perplexity", f"SmolLM2-135M {kind} perplexity on the Python standard library's source: "
                      "float32 vs int8 activations vs llama.cpp")
    torch.set_num_threads(args.threads)
    corpus = text()
    digest = hashlib.sha256(corpus.encode()).hexdigest()[:12]
    print(f"text: {', '.join(FILES)} from Python {sys.version.split()[0]}'s standard library "
          f"({len(corpus):,} characters, sha256 {digest}); {args.chunks} chunks of {CONTEXT} tokens")
    sides = {dtype: Ours(str(path), dtype) for dtype in ("float32", "int8")}
    ids = sides["float32"].engine.tokenizer.encode(corpus)
    assert len(ids) >= args.chunks * CONTEXT, len(ids)
    nll = {dtype: [] for dtype in sides}
    agree = agree_margin = margin_count = total = 0
    seconds = {dtype: 0.0 for dtype in sides}
    for c in range(args.chunks):
        chunk = ids[c * CONTEXT:(c + 1) * CONTEXT]
        parts = {}
        for dtype, side in sides.items():  # alternated chunk by chunk
            start = time.perf_counter()
            logits = side.logits(chunk)
            seconds[dtype] += time.perf_counter() - start
            losses, parts[dtype] = scored(logits, chunk)
            nll[dtype].append(losses)
        top2 = parts["float32"].topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        same = parts["float32"].argmax(-1) == parts["int8"].argmax(-1)
        agree += int(same.sum())
        total += same.numel()
        wide = margin > 1.0
        margin_count += int(wide.sum())
        agree_margin += int(same[wide].sum())
    ppl = {dtype: math.exp(torch.cat(v).mean().item()) for dtype, v in nll.items()}
    rows = [["deltaserve --activation-dtype float32", round(ppl["float32"], 4), "-", round(seconds["float32"], 1)],
            ["deltaserve int8 activations (default)", round(ppl["int8"], 4),
             f"{100 * (ppl['int8'] / ppl['float32'] - 1):+.2f}%", round(seconds["int8"], 1)]]
    peers = [("llama.cpp", llamacpp.tree_with(args.llama_cpp, "llama-perplexity"))]
    ik_root = args.ik_llama_cpp or os.environ.get("IK_LLAMA_CPP_DIR")
    if ik_root:
        peers.append(("ik_llama.cpp", llamacpp.tree_with(ik_root, "llama-perplexity")))
    for peer, root in peers:
        if root is None:
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(corpus)
            f.flush()
            start = time.perf_counter()
            theirs, log = llama_perplexity(root, path, Path(f.name), args.threads, args.chunks)
            took = time.perf_counter() - start
        rows.append([f"{peer} llama-perplexity ({root.name})", round(theirs, 4),
                     f"{100 * (theirs / ppl['float32'] - 1):+.2f}%", round(took, 1)])
        for line in log.splitlines():
            if "tokens" in line and ("tokeniz" in line or "calculating" in line):
                print(f"  [{peer}] {line.strip()}")
    header = ["side", "perplexity", "vs float32", "seconds"]
    print(f"\n{len(ids):,} tokens in the text; scored {total:,} positions")
    for row in [header] + rows:
        print(f"{row[0]:<44} {row[1]!s:>11} {row[2]!s:>11} {row[3]!s:>8}")
    print(f"greedy token int8 == float32: {agree}/{total} ({100 * agree / total:.2f}%); where the float32 top-2 margin "
          f"> 1: {agree_margin}/{margin_count} ({100 * agree_margin / max(1, margin_count):.2f}%)")
    run.table("perplexity, 2 threads", header, rows)
    run.table("greedy agreement int8 vs float32", ["positions", "agree", "margin > 1", "agree there"],
              [[total, agree, margin_count, agree_margin]])
    run.note(f"Text: {', '.join(FILES)} from Python {sys.version.split()[0]}'s standard library, sha256 {digest}, "
             f"{args.chunks} chunks of {CONTEXT} tokens, the second half of each scored (llama-perplexity's rule).")
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
