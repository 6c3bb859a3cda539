"""Speculative decoding with prompt lookup (--speculative ngram) on vs off, batch-1 decode, one run.

The workload is code editing: each prompt holds a source file of this repository (--file: three by default) and asks
for it back with one name changed, what coding agents do with the files they edit. What the built-in 135M model
answers is less than that: it begins the file (its imports, the first definition and docstring) and soon loops on
one line of its own (`token_id = None` again and again); the drafter gains on both, and how soon the loop starts
moves one answer's figure a lot (one float32 ULP of attention rounding turned one int8 answer into a loop 60
tokens earlier: x1.14 -> x2.0), hence several files, their tokens and times summed. Both sides
run the same Engine on the built-in SmolLM2 GGUF (or --model), greedy, alternated --repeats times (a shared machine's
speed drifts within minutes), and the outputs must be equal token for token (speculation is lossless) under
--activation-dtype float32; under int8 (the engine's CPU default for packed 4-bit weights) a greedy token at a
near-tie may change with the rows a step holds, which differ on and off, so outputs that differ are counted, not fatal.
- decode tok/s: (new tokens - 1) / (time from the first to the last token);
- acceptance: accepted / drafted draft tokens; tokens per verifying step: what one such step emitted on average;
- step cost: a verifying step's wall time over a plain decode step's (the figures engine/speculative.py's
  draft-length policy is priced with).

A second table (--mixed N, 0 skips it): N requests submitted at once, half code-editing prompts (other files of this
repository, shorter), half questions whose answers repeat little of the prompt, run to the end with speculation on
(its draft-length policy, engine/speculative.py, free to draft less or not at all) vs off, alternated; throughput
is all requests' new tokens over the wall time from submission to the last token. Speculation must not lose there.

With --llama-cpp DIR (bench/llamacpp.py; or LLAMA_CPP_DIR), llama.cpp's prompt-lookup decoding (its llama-lookup,
greedy, the same number of drafts) reads the same prompt text from the same GGUF file, beside its plain decode
(llama-bench tg at the prompt's depth), alternated with ours.

    OMP_NUM_THREADS=2 .venv/bin/python bench/spec.py --tokens 192

With --method mtp (issue 40's workload (b)), the drafter is the checkpoint's own MTP head (--speculative mtp) on
models that have one (or --model): tests/data/make_mtp_fitted.py's hybrids, taught a fixed successor table, their
heads fitted to their own greedy continuations. First its weight-bound size (--size bench: 12 layers of hidden 512,
~156 MiB held in float32, one head layer beside them, as a served model's step is bound by reading its weights;
fitted once, ~3 minutes, and kept under build/), then the committed tiny fixture tests/data/mtp_fitted (hidden 64,
a 0.2 ms step that is interpreter time, so a head pass costs as much as a target step: a floor, not a served
model). Each: --mtp-prompts random 16-token prompts from seeds 0.. (held out: the fits trained on seeds >= 1000),
each decoded --tokens, speculation on vs off alternated prompt by prompt; decode tok/s over all of them,
acceptance, identical outputs. Then prompt lookup (ngram) on the first model where the answer repeats the prompt
(what workload (a) measures where a model copies what it was shown: [the model's answer to a held-out prompt p, p]
is answered with that answer again). Then --mixed requests at once on the first model, MTP on vs off alternated:
throughput (every step pays the head's pass over the kept rows, one pass for all the requests, unless the step is
too crowded for drafts to pay: engine/speculative.py observing_pays).

    OMP_NUM_THREADS=2 .venv/bin/python bench/spec.py --method mtp --tokens 24
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
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


QUESTIONS = ["Explain how a hash map handles collisions, with an example.",
             "Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "What are the main causes of inflation? Answer in a few paragraphs.",
             "Describe the water cycle to a ten-year-old.",
             "Compare TCP and UDP: when would you pick each?",
             "Give me a plan for learning to play the guitar in three months.",
             "Why is the sky blue? Explain the physics.",
             "List ten ideas for a weekend trip and say why each is good."]
MIXED_FILES = ["deltaserve/engine/sampler.py", "deltaserve/engine/speculative.py", "deltaserve/models/batch.py",
               "deltaserve/kernels/decode_cpu.py", "deltaserve/engine/runner.py", "deltaserve/cache/kv_pool.py",
               "deltaserve/engine/grammar.py", "deltaserve/models/llama.py"]


def mixed_prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts: code-editing ones (30 lines of a file) and questions, alternating."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(edit_prompt(tokenizer, ROOT / MIXED_FILES[i // 2 % len(MIXED_FILES)], 30))
        else:
            out.append(tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i // 2 % len(QUESTIONS)]}]))
    return out


def run_mixed(eng, prompts: list[list[int]], tokens: int) -> dict:
    from deltaserve.engine.request import SamplingParams

    started, cpu = time.perf_counter(), time.process_time()
    streams = [eng.submit(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)) for p in prompts]
    outs = [[] for _ in streams]
    while not all(s.finished for s in streams):
        eng.step()
        for out, stream in zip(outs, streams):
            out += [t for o in stream.drain() for t in o.token_ids]
    return {"tokens": outs, "seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


def mixed_pair(args, off, on, prompts: list[list[int]], label: str, what: str) -> dict:
    """All `prompts` at once, run to the end by `off` and `on` in turn, --repeats times: throughput medians (the
    table, printed), their ratio, and the median ratio of process CPU seconds (steadier than wall time on a shared
    machine at one thread)."""
    through = {"off": [], "on": []}
    cpu_ratios = []
    drafted, accepted = on.speculation.drafted_total, on.speculation.accepted_total
    for _ in range(args.repeats):
        a = run_mixed(off, prompts, args.mixed_tokens)
        b = run_mixed(on, prompts, args.mixed_tokens)
        same_output(a["tokens"], b["tokens"], args, what)
        new = sum(map(len, a["tokens"]))
        through["off"].append(new / a["seconds"])
        through["on"].append(new / b["seconds"])
        cpu_ratios.append(a["cpu_s"] / b["cpu_s"])
        print(f"  pair: wall x{a['seconds'] / b['seconds']:.3f}, process CPU time x{cpu_ratios[-1]:.3f}")
    drafted = on.speculation.drafted_total - drafted
    accepted = on.speculation.accepted_total - accepted
    t_off, t_on = statistics.median(through["off"]), statistics.median(through["on"])
    rows = [["off", round(t_off, 1), ""], [label, round(t_on, 1), f"{accepted} / {drafted}"]]
    columns = ["speculative", "throughput tok/s", "accepted / drafted"]
    for row in [columns] + rows:
        print("  ".join(str(c) for c in row))
    return {"columns": columns, "rows": rows, "ratio": t_on / t_off, "cpu_ratio": statistics.median(cpu_ratios)}


def decode_table(label: str, off_rate: float, on_rate: float, drafted: int, accepted: int, verifies: int,
                 steps: dict) -> tuple[list, list, float, float]:
    """The batch-1 table, off vs on (printed): (columns, rows, plain step ms, verifying step ms), medians."""
    plain_ms = statistics.median(steps["plain"]) * 1000
    verify_ms = statistics.median(steps["verify"]) * 1000 if steps["verify"] else float("nan")
    columns = ["speculative", "decode tok/s", "acceptance", "tokens per verifying step", "step ms (median)"]
    rows = [["off", round(off_rate, 1), "", "", round(plain_ms, 2)],
            [label, round(on_rate, 1), round(accepted / max(drafted, 1), 3),
             round((accepted + verifies) / max(verifies, 1), 2), round(verify_ms, 2)]]
    for row in [columns] + rows:
        print("  ".join(str(c) for c in row))
    print(f"speed-up x{on_rate / off_rate:.2f}; a verifying step costs {verify_ms / plain_ms:.2f} plain steps")
    return columns, rows, plain_ms, verify_ms


def llama_lookup(root: Path, gguf: Path, prompt_file: Path, tokens: int, k: int, threads: int) -> dict:
    """llama.cpp's lookup decoding, greedy: its decode rate and acceptance, as it prints them."""
    done = subprocess.run([str(root / "build" / "bin" / "llama-lookup"), "-m", str(gguf), "-f", str(prompt_file),
                           "-n", str(tokens), "--temp", "0", "-t", str(threads), "-c", "4096",
                           "--spec-draft-n-max", str(k)], capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    rate = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    accept = re.search(r"accept\s*=\s*([\d.]+)%", text)
    if done.returncode or not rate:
        raise RuntimeError(f"llama-lookup failed (exit {done.returncode}): {text[-400:]}")
    return {"rate": float(rate.group(3)), "acceptance": float(accept.group(1)) / 100 if accept else None}


def batch_one(args, run, off, on, peer) -> None:
    """The batch-1 table: each file's code-editing prompt decoded with speculation off and on, alternated (and
    llama.cpp's lookup beside them with a peer); rates over all the files' tokens, so that one answer's luck (a
    135M model soon loops, and how soon moves the figure) weighs as one file of several."""
    import llamacpp

    files = args.file.split(",")
    prompts = [edit_prompt(off.tokenizer, ROOT / f, args.lines) for f in files]
    print(f"prompts {', '.join(str(len(p)) for p in prompts)} tokens ({', '.join(files)}, {args.lines} lines each), "
          f"{args.tokens} new tokens, k {args.k}")
    seconds = {"off": [0.0] * len(files), "ngram": [0.0] * len(files)}
    new = [0] * len(files)
    steps = {"plain": [], "verify": []}
    peer_rates = {"plain": [], "lookup": [], "acceptance": []}
    prompt_files = []
    if peer is not None:
        from deltaserve.budget import default_model_path

        gguf = Path(args.model) if args.model and args.model.endswith(".gguf") else default_model_path()
        folder = Path(tempfile.mkdtemp())
        for n, prompt in enumerate(prompts):
            prompt_files.append(folder / f"prompt{n}.txt")
            prompt_files[-1].write_text(off.tokenizer.decode(prompt))
    drafted, accepted, verifies = (on.speculation.drafted_total, on.speculation.accepted_total,
                                   on.speculation.verify_steps_total)
    for _ in range(args.repeats):
        for n, prompt in enumerate(prompts):
            if peer is not None:  # llama.cpp beside ours, in the same alternation
                try:
                    got = llama_lookup(peer, gguf, prompt_files[n], args.tokens, args.k, args.threads)
                    plain_rate = llamacpp.run_one(peer, gguf, f"tg{args.tokens}@{len(prompt)}", args.threads)
                except (RuntimeError, subprocess.CalledProcessError) as error:  # a build that cannot run here
                    print(f"llama.cpp skipped: {str(error)[-300:]}")
                    run.note(f"llama.cpp's llama-lookup did not run here: {str(error)[-200:]}")
                    peer = None
                else:
                    peer_rates["plain"].append(plain_rate)
                    peer_rates["lookup"].append(got["rate"])
                    peer_rates["acceptance"].append(got["acceptance"])
            a = run_once(off, prompt, args.tokens)
            b = run_once(on, prompt, args.tokens)
            same_output(a["tokens"], b["tokens"], args, f"the code-editing answer to {files[n]}")
            seconds["off"][n] += a["decode_s"]
            seconds["ngram"][n] += b["decode_s"]
            new[n] += len(a["tokens"]) - 1
            steps["plain"] += a["plain_steps"]
            steps["verify"] += b["verify_steps"]
    drafted = on.speculation.drafted_total - drafted
    accepted = on.speculation.accepted_total - accepted
    verifies = on.speculation.verify_steps_total - verifies
    off_rate, on_rate = sum(new) / sum(seconds["off"]), sum(new) / sum(seconds["ngram"])
    per_file = ", ".join(f"{f} x{seconds['off'][n] / seconds['ngram'][n]:.2f}" for n, f in enumerate(files))
    print(f"per file: {per_file}")
    columns, rows, plain_ms, verify_ms = decode_table(f"ngram k={args.k}", off_rate, on_rate, drafted, accepted,
                                                      verifies, steps)
    if peer is not None:  # harmonic means over the runs: tokens over time, as ours
        lp = len(peer_rates["plain"]) / sum(1 / r for r in peer_rates["plain"])
        ll = len(peer_rates["lookup"]) / sum(1 / r for r in peer_rates["lookup"])
        known = [a for a in peer_rates["acceptance"] if a is not None]
        acc = statistics.mean(known) if known else None
        rows += [["llama.cpp plain (llama-bench tg at the prompt's depth)", round(lp, 1), "", "", ""],
                 [f"llama.cpp llama-lookup k={args.k}", round(ll, 1), "" if acc is None else round(acc, 3), "", ""]]
        print(f"llama.cpp: plain {lp:.1f} tok/s, lookup {ll:.1f} tok/s (x{ll / lp:.2f}), acceptance {acc}")
    run.table(f"batch-1 greedy decode, {len(files)} code-editing prompts ({', '.join(str(len(p)) for p in prompts)} "
              f"tokens), {args.tokens} new tokens each", columns, rows)
    run.note(f"speed-up x{on_rate / off_rate:.2f} over all {len(files)} answers ({per_file}); {outputs_note()}; "
             f"a verifying step costs {verify_ms / plain_ms:.2f} plain decode steps (medians)")


DIFFERED: list[str] = []  # int8 runs: the outputs speculation changed at a near-tie


def same_output(off_tokens: list, on_tokens: list, args, what: str) -> None:
    """Speculation is lossless: under float32 activations a differing output is a bug (exit); under int8 a near-tie
    may go the other way with the step's rows, so it is counted (DIFFERED) and said in the record's note."""
    if off_tokens == on_tokens:
        return
    if args.activation_dtype == "float32":
        sys.exit(f"speculation changed the greedy output of {what}: a bug")
    DIFFERED.append(what)
    print(f"  int8: speculation on and off differ for {what} (a near-tie the step's rows moved)")


def outputs_note() -> str:
    return ("greedy outputs identical on and off" if not DIFFERED else
            f"greedy outputs differed on and off in {len(DIFFERED)} of the pairs (int8 activations: a near-tie the "
            f"step's rows moved)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--file", default="deltaserve/engine/sampler.py,deltaserve/engine/speculative.py,"
                                          "deltaserve/models/batch.py",
                        help="the files of the code-editing prompts, comma-separated [three of this repository]")
    parser.add_argument("--lines", type=int, default=60)
    parser.add_argument("--mixed", type=int, default=16, help="requests of the mixed load (0: skip it) [16]")
    parser.add_argument("--mixed-tokens", type=int, default=48)
    parser.add_argument("--batch1", action=argparse.BooleanOptionalAction, default=True,
                        help="the batch-1 table (--no-batch1: the mixed load alone) [on]")
    parser.add_argument("--activation-dtype", default="float32",
                        help="the engines' --activation-dtype [float32: outputs on and off must be equal; under int8, "
                             "the CPU default, a greedy token at a near-tie can change with the rows a step holds, so "
                             "differing outputs are counted instead]")
    parser.add_argument("--llama-cpp", default=None, help="a llama.cpp tree with build/bin/llama-lookup")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads [2]")
    parser.add_argument("--method", choices=["ngram", "mtp"], default="ngram", help="the drafter [ngram]")
    parser.add_argument("--mtp-prompts", type=int, default=8, help="with --method mtp: prompts decoded [8]")
    args = parser.parse_args(argv)
    if args.method == "mtp":
        return mtp_main(args, argv)
    run = results.Run("spec", "Prompt-lookup speculation on vs off: batch-1 decode of a code-editing answer", argv)
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine

    import llamacpp

    peer = llamacpp.tree_with(args.llama_cpp, "llama-lookup")
    common = dict(model=args.model, device="cpu", max_total_tokens=8192 + 1024 * args.mixed,
                  max_running_requests=max(4, args.mixed), prefix_cache=False, activation_dtype=args.activation_dtype)
    off = Engine(EngineConfig(**common, speculative="off"), log=None)
    on = Engine(EngineConfig(**common, speculative="ngram", speculative_tokens=args.k), log=None)
    if args.batch1:
        batch_one(args, run, off, on, peer)
    if args.mixed:
        prompts = mixed_prompts(off.tokenizer, args.mixed)
        mixed = mixed_pair(args, off, on, prompts, f"ngram k={args.k}", "the mixed load")
        print(f"mixed load: x{mixed['ratio']:.2f} (process CPU time x{mixed['cpu_ratio']:.2f})")
        run.table(f"{args.mixed} requests at once ({', '.join(str(len(p)) for p in prompts[:2])}.. prompt tokens), "
                  f"{args.mixed_tokens} new tokens each, greedy", mixed["columns"], mixed["rows"])
        run.note(f"mixed load: speculation x{mixed['ratio']:.2f} throughput (medians of {args.repeats} alternated "
                 f"runs; {outputs_note()})")
    run.note(f"machine load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
             f"on {os.cpu_count()} logical CPUs (on and off alternate, so the ratio is the figure to read)")
    run.save()


def bench_mtp_model() -> Path:
    """The weight-bound fitted-MTP hybrid (tests/data/make_mtp_fitted.py --size bench): made once (~3 minutes on 2
    cores) and kept under build/, keyed by the fixture script's bytes (a changed script makes a new one)."""
    import hashlib

    script = ROOT / "tests" / "data" / "make_mtp_fitted.py"
    folder = ROOT / "build" / f"mtp-fitted-bench-{hashlib.sha256(script.read_bytes()).hexdigest()[:12]}"
    done = folder / "FITTED"  # written last: a fit cut short is made again
    if not done.exists():
        print(f"fitting the weight-bound MTP hybrid into {folder} (once; a few minutes)", flush=True)
        subprocess.run([sys.executable, str(script), "--size", "bench", "--out", str(folder)], check=True)
        done.write_text("tests/data/make_mtp_fitted.py --size bench\n")
    return folder


def mtp_main(args, argv) -> None:
    """Workload (b): the MTP head drafting on a model that has one (module docstring)."""
    run = results.Run("spec", "MTP speculation on vs off: batch-1 decode of the fitted-MTP hybrids", argv)
    models = [args.model] if args.model else [str(bench_mtp_model()), str(ROOT / "tests" / "data" / "mtp_fitted")]
    for model in models:
        mtp_pair(args, run, model)
    if not args.model:
        repeat_pair(args, run, models[0])
    if args.mixed:
        mtp_mixed(args, run, models[0])
    run.note(f"machine load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
             f"on {os.cpu_count()} logical CPUs")
    run.save()


def alternated(args, off, on, prompts: list[list[int]], tokens: int, label: str, what: str) -> dict:
    """Each prompt decoded --repeats times by `off` and `on` in turn (batch 1, greedy, outputs compared): the
    decode_table (printed), the speed-up over all of them, the draft counts, and the outputs (off's, in order)."""
    spec = on.speculation
    seconds = {"off": 0.0, "on": 0.0}
    new = 0
    drafted, accepted, verifies = spec.drafted_total, spec.accepted_total, spec.verify_steps_total
    steps = {"plain": [], "verify": []}
    outputs = []
    for _ in range(args.repeats):
        for prompt in prompts:
            a = run_once(off, prompt, tokens)
            b = run_once(on, prompt, tokens)
            same_output(a["tokens"], b["tokens"], args, what)
            outputs.append(a["tokens"])
            seconds["off"] += a["decode_s"]
            seconds["on"] += b["decode_s"]
            new += len(a["tokens"]) - 1
            steps["plain"] += a["plain_steps"]
            steps["verify"] += b["verify_steps"]
    drafted, accepted = spec.drafted_total - drafted, spec.accepted_total - accepted
    off_rate, on_rate = new / seconds["off"], new / seconds["on"]
    table = decode_table(label, off_rate, on_rate, drafted, accepted, spec.verify_steps_total - verifies, steps)
    return {"table": table, "speed_up": on_rate / off_rate, "drafted": drafted, "accepted": accepted,
            "outputs": outputs}


def mtp_pair(args, run, model: str) -> None:
    """One model's table: --mtp-prompts held-out prompts decoded with speculation off and on, alternated."""
    import torch

    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine

    common = dict(model=model, device="cpu", max_total_tokens=4096, max_running_requests=4, prefix_cache=False)
    off = Engine(EngineConfig(**common, speculative="off"), log=None)
    on = Engine(EngineConfig(**common, speculative="mtp", speculative_tokens=args.k), log=None)
    name, held = Path(model).name, off.measured_bytes()["weights"] / 2**20
    print(f"{name}: {held:.1f} MiB of weights held")
    vocab = off.vocab_size
    prompts = [torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
               for seed in range(args.mtp_prompts)]
    pair = alternated(args, off, on, prompts, args.tokens, f"mtp k={args.k}", f"an MTP prompt ({name})")
    columns, rows, plain_ms, verify_ms = pair["table"]
    run.table(f"batch-1 greedy decode, {len(prompts)} held-out 16-token prompts x {args.repeats}, {args.tokens} new "
              f"tokens each, {name} ({held:.1f} MiB of weights)", columns, rows)
    run.note(f"{name}: speed-up x{pair['speed_up']:.2f}; {outputs_note()}; accepted {pair['accepted']} of "
             f"{pair['drafted']} drafts; a verifying step costs {verify_ms / plain_ms:.2f} plain decode steps "
             f"(medians)")
    del off, on


def repeat_pair(args, run, model: str) -> None:
    """Prompt lookup where the answer repeats the prompt, on the weight-bound fitted hybrid: its greedy answer to a
    held-out prompt p (a chain it learnt) is put before p, and the answer to [answer, p] is that answer again, as a
    coding agent's answer repeats the file it was shown. What workload (a) measures where the model copies (the
    built-in 135M model does not: module docstring)."""
    import torch

    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine

    common = dict(model=model, device="cpu", max_total_tokens=4096, max_running_requests=4, prefix_cache=False)
    off = Engine(EngineConfig(**common, speculative="off"), log=None)
    on = Engine(EngineConfig(**common, speculative="ngram", speculative_tokens=args.k), log=None)
    tokens = 2 * args.tokens
    prompts = []
    for seed in range(args.mtp_prompts):
        p = torch.randint(0, off.vocab_size, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
        prompts.append(run_once(off, p, tokens)["tokens"] + p)
    pair = alternated(args, off, on, prompts, tokens, f"ngram k={args.k}", "a repeating prompt")
    columns, rows, plain_ms, verify_ms = pair["table"]
    repeated = sum(out == prompt[:tokens] for out, prompt in zip(pair["outputs"], prompts * args.repeats))
    total = len(prompts) * args.repeats
    run.table(f"batch-1 greedy decode, prompt lookup where the answer repeats the prompt: {len(prompts)} prompts "
              f"[its answer, a held-out 16-token prompt] x {args.repeats}, {tokens} new tokens each, "
              f"{Path(model).name}", columns, rows)
    run.note(f"{Path(model).name}, answers repeating the prompt ({repeated} of {total} answers equal the {tokens} "
             f"tokens the prompt begins with): ngram speed-up x{pair['speed_up']:.2f}; {outputs_note()}; accepted "
             f"{pair['accepted']} of {pair['drafted']} drafts; a verifying step costs {verify_ms / plain_ms:.2f} plain "
             f"decode steps")


def mtp_mixed(args, run, model: str) -> None:
    """--mixed requests at once (held-out prompts, seeds 100..), speculation on vs off, alternated: throughput."""
    import torch

    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine

    common = dict(model=model, device="cpu", max_total_tokens=2048 + 128 * args.mixed,
                  max_running_requests=args.mixed, prefix_cache=False)
    off = Engine(EngineConfig(**common, speculative="off"), log=None)
    on = Engine(EngineConfig(**common, speculative="mtp", speculative_tokens=args.k), log=None)
    prompts = [torch.randint(0, off.vocab_size, (16,), generator=torch.Generator().manual_seed(100 + i)).tolist()
               for i in range(args.mixed)]
    mixed = mixed_pair(args, off, on, prompts, f"mtp k={args.k}", "the MTP mixed load")
    print(f"MTP mixed load: x{mixed['ratio']:.2f}")
    run.table(f"{args.mixed} requests at once, 16-token held-out prompts, {args.mixed_tokens} new tokens each, greedy, "
              f"{Path(model).name}", mixed["columns"], mixed["rows"])
    run.note(f"MTP mixed load: speculation x{mixed['ratio']:.2f} throughput (medians of {args.repeats} alternated "
             f"runs; {outputs_note()})")


if __name__ == "__main__":
    main(sys.argv[1:])
