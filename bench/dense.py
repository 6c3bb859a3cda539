"""SmolLM2-135M (the built-in GGUF) prefill and batch-1 decode, deltaserve vs transformers, in one run.

transformers reads the file dequantized to float32. deltaserve runs through its Engine (the path `serve` takes:
scheduler, paged KV pool, sampler), one request at a time, twice: "packed" keeps the file's 4-bit blocks packed
and multiplies them in float32 (kernels/int4.py, the CPU default; the dequantized model's logits to float32
rounding) and "fp32" holds the weights dequantized to float32 (`--dequantize-weights`). transformers runs `forward`
and `generate`. With `--llama-cpp DIR` (bench/llamacpp.py), llama.cpp's llama-bench runs the same Q4_1 file too.
- prefill tok/s: prompt tokens / time to the first token of one request (the whole prompt in one chunk);
- decode tok/s: (new tokens - 1) / (time from the first to the last token), batch 1, greedy, EOS ignored;
- bytes per token: the weight bytes each side holds (a batch-1 step reads every one: the head is tied to the
  embedding), and the GB/s that decode rate reaches, next to torch.sum over a float32 tensor of the same size
  (a plain read of those bytes on this machine: the memory limit a decode step can approach).

    OMP_NUM_THREADS=2 .venv/bin/python bench/dense.py --prefill 512,2048 --decode 128
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

VOCAB_LOW = 1000  # random prompt ids start here, past SmolLM2's special tokens


def prompt(tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_LOW, 49152, (tokens,), generator=g).tolist()


class Ours:
    def __init__(self, path: str, longest: int, dequantize: bool):
        from deltaserve.config import EngineConfig
        from deltaserve.engine.engine import Engine

        config = EngineConfig(model=path, device="cpu", max_total_tokens=4 * longest, dequantize_weights=dequantize,
                              prefill_chunk_tokens=longest, max_running_requests=4,
                              prefix_cache=False)  # each repeat reads its prompt again, as llama-bench does
        self.engine = Engine(config, log=None)
        self.weight_bytes = self.engine.measured_bytes()["weights"]

    def _run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds from the first to the last token)."""
        from deltaserve.engine.request import SamplingParams

        start = time.perf_counter()
        stream = self.engine.submit(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        first = last = None
        produced = 0
        while self.engine.step():
            for out in stream.drain():
                produced += len(out.token_ids)
                now = time.perf_counter()
                first = first or now
                last = now
        assert produced == new_tokens, (produced, new_tokens)
        return first - start, last - first

    def prefill(self, ids: list[int]) -> float:
        return self._run(ids, 1)[0]

    def decode(self, ids: list[int], new_tokens: int) -> float:
        return self._run(ids, new_tokens)[1]


class Theirs:
    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, ids: list[int], new_tokens: int) -> float:
        marks = []

        def mark(input_ids, scores):
            marks.append(time.perf_counter())
            return scores

        from transformers import LogitsProcessorList

        self.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                            logits_processor=LogitsProcessorList([mark]))
        return marks[-1] - marks[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", default="512,2048", help="prompt lengths for prefill, comma-separated")
    parser.add_argument("--decode", type=int, default=128, help="new tokens for the batch-1 decode run")
    parser.add_argument("--decode-prompt", type=int, default=16, help="prompt tokens before the decode run")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-bench (or LLAMA_CPP_DIR)")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.prefill.split(",")]
        if any(n < 1 for n in lengths) or args.decode < 2 or args.repeats < 1:
            raise ValueError
    except ValueError:
        print("error: --prefill must be positive ints, --decode >= 2, --repeats >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    import llamacpp

    from deltaserve.engine.loader import default_model_path

    path = default_model_path()
    peer = llamacpp.tree(args.llama_cpp)
    peer_rates = (llamacpp.run_bench(peer, path, prompts=lengths, gen=args.decode, threads=args.threads,
                                     repeats=args.repeats) if peer else {})
    longest = max(lengths + [args.decode_prompt + args.decode])
    sides = {"transformers": Theirs(path), "deltaserve packed": Ours(str(path), longest, False),
             "deltaserve fp32": Ours(str(path), longest, True)}
    warm = prompt(64, 0)
    for side in sides.values():
        side.prefill(warm)
    print(f"{path.name}, {torch.get_num_threads()} threads, best of {args.repeats}; tok/s, and the ratio to "
          f"transformers")
    print(f"{'what':<22}" + "".join(f"{name:>17}" for name in sides) + "".join(f"{'x ' + n.split()[-1]:>11}"
                                                                                for n in list(sides)[1:])
          + f"{'llama.cpp':>11}")
    cells = [(f"prefill {n} tokens", n, lambda side, ids: side.prefill(ids), prompt(n, n), f"pp{n}")
             for n in lengths]
    cells.append((f"decode {args.decode} (batch 1)", args.decode - 1,
                  lambda side, ids: side.decode(ids, args.decode), prompt(args.decode_prompt, 1), f"tg{args.decode}"))
    for label, tokens, run, ids, peer_key in cells:
        best = {name: float("inf") for name in sides}
        for _ in range(args.repeats):  # alternate the sides so all see the same machine load
            for name, side in sides.items():
                best[name] = min(best[name], run(side, ids))
        rates = [tokens / best[name] for name in sides]
        if peer_key.startswith("tg"):
            decode_rates = dict(zip(sides, rates))
        print(f"{label:<22}" + "".join(f"{r:>17.1f}" for r in rates)
              + "".join(f"{r / rates[0]:>10.2f}x" for r in rates[1:])
              + (f"{peer_rates[peer_key]:>11.1f}" if peer_key in peer_rates else f"{'-':>11}"), flush=True)
    for name, side in sides.items():
        if isinstance(side, Ours):
            reached = side.weight_bytes * decode_rates[name] / 1e9
            limit = plain_read_gbps(side.weight_bytes, args.repeats)
            print(f"{name}: {side.weight_bytes / 1e6:.1f} MB per decode token, {reached:.1f} GB/s; a plain read "
                  f"of the same bytes: {limit:.1f} GB/s ({reached / limit:.0%})")
    return 0


def plain_read_gbps(nbytes: int, repeats: int) -> float:
    """GB/s of torch.sum over a float32 tensor of `nbytes` (best of `repeats`, after one warm-up read)."""
    data = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


if __name__ == "__main__":
    sys.exit(main())
