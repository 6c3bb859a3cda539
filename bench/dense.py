"""SmolLM2-135M (the built-in GGUF) prefill and batch-1 decode, deltaserve vs transformers, in one run.

transformers reads the file dequantized to float32. deltaserve runs through its Engine (the path `serve` takes:
scheduler, paged KV pool, sampler), one request at a time, twice: "packed" keeps the file's 4-bit blocks packed
and multiplies them by int8 activations (kernels/int4_int8.py, the CPU default; `--float32-activations` adds the
float32 packed path, kernels/int4.py, the dequantized model's logits to float32 rounding) and "fp32" holds the
weights dequantized to float32 (`--dequantize-weights`). transformers runs `forward`
and `generate`. With `--llama-cpp DIR` (bench/llamacpp.py), llama.cpp's llama-bench runs the same Q4_1 file too:
one run of each test alternated with ours (a shared VM's speed drifts within minutes), its best of --repeats; with
`--ik-llama-cpp DIR` ik_llama.cpp's llama-bench likewise (with its load-time repacking, -rtr 1).
- prefill tok/s: prompt tokens / time to the first token of one request (the whole prompt in one chunk);
- decode tok/s: (new tokens - 1) / (time from the first to the last token), batch 1, greedy, EOS ignored;
- with --decode-depth N, decode tok/s again after an N-token prompt (llama-bench tg with -d N): a step's attention
  reads N cached rows per layer (SmolLM2's float16 cache: 23 KB a token over its 30 layers, 94 MB at 4,096);
- bytes per token: the weight bytes each side holds (a batch-1 step reads every one: the head is tied to the
  embedding), and the GB/s that decode rate reaches, next to torch.sum over a float32 tensor of the same size
  (a plain read of those bytes on this machine: the memory limit a decode step can approach).

The W4A16 row (issue 17): a compressed-tensors checkpoint (pack-quantized, symmetric 4-bit, group --w4a16-group,
lm_head left float as the library's W4A16 preset does) written by compressed-tensors' own compressor, run packed (on
float32 activations, the path the logits check holds to float32 rounding) and dequantized to float32
(`--dequantize-weights`), alternated in one run. Its weights are SmolLM2's own (read from the GGUF) where the group
divides SmolLM2's widths (group 64); SmolLM2's 576-wide hidden state is not a multiple of 128, so at group 128 it is a
random Llama of SmolLM2's shape with the hidden size rounded up to 640 (10 heads of 64, 2 KV heads; 30 layers, MLP
1536, vocab 49152, tied head). Then the logits check: one prompt's logits packed vs dequantized, within the float32
bound the W4A16 tests use (tests/tolerance.py), and whether the decode runs' greedy tokens are identical. Needs
`compressed-tensors` (the [test] extra).

The Q8_0 and IQ4_NL rows (`--formats q8_0,iq4_nl`, need `--llama-cpp`: its llama-quantize --allow-requantize makes
each file from the built-in Q4_1 one, so its values are the Q4_1 file's, requantized): deltaserve's default (the
codes held as they are, times int8 activations by integer dot products: 8-bit codes, or IQ4_NL's 4-bit codes looked
up to their integer levels), its float32-activation path over the same codes, and the weights dequantized to float32
(what a Q8_0 linear became before 8-bit weights were held), with llama.cpp and ik_llama.cpp on the same file.

    OMP_NUM_THREADS=2 .venv/bin/python bench/dense.py --prefill 512,2048 --decode 128
    OMP_NUM_THREADS=2 .venv/bin/python bench/dense.py --formats w4a16 --prefill 512 --decode 64   # a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import results

VOCAB_LOW = 1000  # random prompt ids start here, past SmolLM2's special tokens


def prompt(tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_LOW, 49152, (tokens,), generator=g).tolist()


class Ours:
    def __init__(self, path: str, longest: int, dequantize: bool, prefill_dtype: str = "float32",
                 activation_dtype: str | None = None, config=None):  # None: the default (int8 on CPU)
        """An Engine on `path` sized for prompts of `longest` tokens, or on `config` when given (bench/real_size.py:
        the defaults `serve` takes)."""
        from deltaserve.config import EngineConfig
        from deltaserve.engine.engine import Engine

        chosen = {} if activation_dtype is None else {"activation_dtype": activation_dtype}
        config = config or EngineConfig(
            model=path, device="cpu", max_total_tokens=4 * longest, dequantize_weights=dequantize,
            prefill_chunk_tokens=longest, max_running_requests=4, prefill_dtype=prefill_dtype, **chosen,
            prefix_cache=False)  # each repeat reads its prompt again, as llama-bench does
        self.engine = Engine(config, log=None)
        self.weight_bytes = self.engine.measured_bytes()["weights"]
        self.tokens: list[int] = []  # the last run's generated ids

    def _run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds from the first to the last token)."""
        from deltaserve.engine.request import SamplingParams

        start = time.perf_counter()
        stream = self.engine.submit(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        first = last = None
        self.tokens = []
        while self.engine.step():
            for out in stream.drain():
                self.tokens += out.token_ids
                now = time.perf_counter()
                first = first or now
                last = now
        assert len(self.tokens) == new_tokens, (len(self.tokens), new_tokens)
        return first - start, last - first

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Every position's logits [len(ids), vocab] of one prefill through the loaded model (fresh caches)."""
        from deltaserve.models.batch import allocate_caches, single_sequence_batch

        model = self.engine.loaded.model
        caches = allocate_caches(model.geometry, len(ids), 1, torch.float32)
        with torch.inference_mode():
            return model(single_sequence_batch(ids, 0, torch.arange(len(ids)), all_logits=True), caches)

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
    parser.add_argument("--decode-depth", type=int, default=0,
                        help="also a batch-1 decode after this many cached tokens (llama-bench tg -d N beside it: "
                             "decode where attention reads a long context, as an agent's turn does); 0: none [0]")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default="gguf,w4a16",
                        help="tables to run: gguf (SmolLM2's Q4_1 file), w4a16 (compressed-tensors), q8_0 and iq4_nl "
                             "(the Q4_1 file requantized by llama.cpp's llama-quantize: need --llama-cpp) "
                             "[gguf,w4a16]")
    parser.add_argument("--w4a16-group", type=int, default=128, help="the W4A16 checkpoint's group size [128]")
    parser.add_argument("--llama-cpp", help="a llama.cpp tree with build/bin/llama-bench (or LLAMA_CPP_DIR)")
    parser.add_argument("--ik-llama-cpp", help="an ik_llama.cpp tree with build/bin/llama-bench (or IK_LLAMA_CPP_DIR)")
    parser.add_argument("--bf16-prefill", action="store_true",
                        help="add a deltaserve column with --prefill-dtype bfloat16 (opt-in; CPUs with AVX512-BF16)")
    parser.add_argument("--float32-activations", action="store_true",
                        help="add a deltaserve column with --activation-dtype float32 (the exact path; the default "
                             "is int8)")
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    try:
        lengths = [int(x) for x in args.prefill.split(",")]
        if (any(n < 1 for n in lengths) or args.decode < 2 or args.repeats < 1 or not formats
                or set(formats) - {"gguf", "w4a16", *REQUANTIZED} or args.w4a16_group not in (32, 64, 128, 256)
                or (set(formats) & set(REQUANTIZED) and not (args.llama_cpp or os.environ.get("LLAMA_CPP_DIR")))):
            raise ValueError
    except ValueError:
        print("error: --prefill must be positive ints, --decode >= 2, --repeats >= 1, --formats of gguf, w4a16, "
              "q8_0 and iq4_nl (the last two need --llama-cpp), --w4a16-group 32, 64, 128 or 256", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    longest = max(lengths + [args.decode_prompt + args.decode, args.decode_depth + args.decode])
    cells = [(f"prefill {n} tokens", n, lambda side, ids: side.prefill(ids), prompt(n, n), f"pp{n}")
             for n in lengths]
    cells.append((f"decode {args.decode} (batch 1)", args.decode - 1,
                  lambda side, ids: side.decode(ids, args.decode), prompt(args.decode_prompt, 1), f"tg{args.decode}"))
    if args.decode_depth:
        cells.append((f"decode {args.decode} at depth {args.decode_depth}", args.decode - 1,
                      lambda side, ids: side.decode(ids, args.decode), prompt(args.decode_depth, 2),
                      f"tg{args.decode}@{args.decode_depth}"))
    ok = True
    run = results.Run("dense", f"SmolLM2-135M ({args.formats}): prefill and batch-1 decode, deltaserve vs "
                      f"transformers{' and llama.cpp' if args.llama_cpp else ''}"
                      f"{' and ik_llama.cpp' if args.ik_llama_cpp else ''}, {args.threads} threads", argv)
    if "gguf" in formats:
        gguf_table(args, lengths, longest, cells, run)
    for kind in (f for f in formats if f in REQUANTIZED):
        with tempfile.TemporaryDirectory(prefix=f"{kind}-") as folder:
            requantized_table(args, kind, Path(folder), longest, cells, run)
    if "w4a16" in formats:
        with tempfile.TemporaryDirectory(prefix="w4a16-") as folder:
            ok = w4a16_table(args, Path(folder), longest, cells, run)
    run.save()
    return 0 if ok else 1


def gguf_table(args, lengths: list[int], longest: int, cells: list, run: results.Run | None = None) -> None:
    """SmolLM2's Q4_1 GGUF: transformers, deltaserve packed and fp32, and llama.cpp when given."""
    import llamacpp

    from deltaserve.budget import default_model_path

    path = default_model_path()
    peer, ik_peer = llamacpp.tree(args.llama_cpp), llamacpp.ik_tree(args.ik_llama_cpp)
    peers = {}
    if peer:
        peers["llama.cpp"] = lambda test: llamacpp.run_one(peer, path, test, args.threads)
    if ik_peer:
        peers["ik_llama.cpp"] = lambda test: llamacpp.run_one(ik_peer, path, test, args.threads, llamacpp.IK_ARGS)
    sides = {"transformers": Theirs(path), "deltaserve packed": Ours(str(path), longest, False),
             "deltaserve fp32": Ours(str(path), longest, True)}
    if args.float32_activations:
        sides["deltaserve f32-act"] = Ours(str(path), longest, False, activation_dtype="float32")
    if args.bf16_prefill:  # it rounds float32 activations: under the int8 default it has nothing to round
        sides["deltaserve bf16-prefill"] = Ours(str(path), longest, False, "bfloat16", activation_dtype="float32")
    title = (f"{path.name}, {torch.get_num_threads()} threads, best of {args.repeats} (the peers' runs alternated "
             f"with ours); tok/s, the ratio to transformers, and deltaserve's default side / each peer")
    print(title)
    plain = {}
    decode_rates = run_table(sides, cells, args.repeats, peers or {"llama.cpp": None}, run=run, title=title,
                             plain=plain)
    print_bytes(sides, decode_rates, args.repeats, run, plain)


REQUANTIZED = {"q8_0": "Q8_0", "iq4_nl": "IQ4_NL"}  # --formats -> llama-quantize's type


def requantized_table(args, kind: str, folder: Path, longest: int, cells: list,
                      run: results.Run | None = None) -> None:
    """The built-in file requantized by llama-quantize (REQUANTIZED[kind]): ours (int8 activations, float32
    activations, dequantized float32), llama.cpp and ik_llama.cpp when given, alternated."""
    import llamacpp

    from deltaserve.budget import default_model_path

    peer, ik_peer = llamacpp.tree(args.llama_cpp), llamacpp.ik_tree(args.ik_llama_cpp)
    path = llamacpp.quantize(peer, default_model_path(), folder / f"smollm2-135m-{kind}.gguf", REQUANTIZED[kind],
                             requantize=True)
    peers = {"llama.cpp": lambda test: llamacpp.run_one(peer, path, test, args.threads)}
    if ik_peer:
        peers["ik_llama.cpp"] = lambda test: llamacpp.run_one(ik_peer, path, test, args.threads, llamacpp.IK_ARGS)
    sides = {"deltaserve fp32": Ours(str(path), longest, True), "deltaserve packed": Ours(str(path), longest, False),
             "deltaserve f32-act": Ours(str(path), longest, False, activation_dtype="float32")}
    title = (f"{path.name} (llama-quantize --allow-requantize of the built-in Q4_1 file), {torch.get_num_threads()} "
             f"threads, best of {args.repeats} (the peers' runs alternated with ours); tok/s, the ratio to the "
             f"dequantized float32 side, and deltaserve's default side (packed: the file's codes x int8 activations) / "
             f"each peer")
    print("\n" + title)
    plain = {}
    decode_rates = run_table(sides, cells, args.repeats, peers, run=run, title=title, plain=plain)
    print_bytes(sides, decode_rates, args.repeats, run, plain)


def w4a16_table(args, folder: Path, longest: int, cells: list, run: results.Run | None = None) -> bool:
    """The W4A16 compressed-tensors checkpoint packed vs dequantized, then the logits check; False when it fails."""
    started = time.perf_counter()
    source = write_w4a16_checkpoint(folder, args.w4a16_group)
    made = time.perf_counter() - started
    # float32 activations: the logits check holds the packed path to the dequantized model at float32 rounding
    sides = {"deltaserve fp32": Ours(str(folder), longest, True),
             "deltaserve packed": Ours(str(folder), longest, False, activation_dtype="float32")}
    title = (f"W4A16 compressed-tensors, group {args.w4a16_group}, {source} (written by compressed-tensors' "
             f"compressor in {made:.0f} s), {torch.get_num_threads()} threads, best of {args.repeats}; tok/s, and "
             f"packed / dequantized (fp32)")
    print("\n" + title)
    plain = {}
    decode_rates = run_table(sides, cells, args.repeats, {}, run=run, title=title, plain=plain)
    print_bytes(sides, decode_rates, args.repeats, run, plain)
    return logits_check(sides["deltaserve packed"], sides["deltaserve fp32"], folder, run)


def run_table(sides: dict, cells: list, repeats: int, peers: dict, run: results.Run | None = None,
              title: str = "", plain: dict | None = None) -> dict:
    """Print one row per cell (tok/s per side, the ratio of each to the first side, and per peer its best and our
    first packed side's ratio to it);
    the decode rates by side. peers: name -> run(test) -> the peer's tok/s of one run, or None for a column of "-"
    (a peer not given); no peers, no peer columns. `plain`: filled with each side's best plain read of its weight
    bytes (GB/s), one read after each of its short-context decode runs (the same minutes of a shared VM's load)."""
    width = max(20, *(len(name) + 2 for name in sides))
    ratio_width = max(11, *(len(name.split()[-1]) + 3 for name in sides))
    print(f"{'what':<22}" + "".join(f"{name:>{width}}" for name in sides)
          + "".join(f"{'x ' + n.split()[-1]:>{ratio_width}}" for n in list(sides)[1:])
          + "".join(f"{name:>13}{'x ' + name.split('.')[0].split('_')[0]:>9}" for name in peers))
    warm = prompt(min(64, *(len(ids) for *_, ids, _ in cells)), 0)
    for side in sides.values():
        side.prefill(warm)  # warm-up: first-call costs (kernel loads, allocations) out of the timings
    decode_rates = {}
    rows = []  # the printed table, for the JSON record
    ours = next((name for name in sides if name.endswith("packed")), None)
    for label, tokens, measure, ids, peer_key in cells:
        best = {name: float("inf") for name in sides}
        peer_best = {name: 0.0 for name in peers}
        for _ in range(repeats):  # alternate the sides, the peers too, so all see the same machine load
            for name, side in sides.items():
                best[name] = min(best[name], measure(side, ids))
                if plain is not None and isinstance(side, Ours) and peer_key.startswith("tg") and "@" not in peer_key:
                    plain[name] = max(plain.get(name, 0.0), plain_read_gbps(side.weight_bytes, 1))
            for name, peer_run in peers.items():
                if peer_run is not None:
                    peer_best[name] = max(peer_best[name], peer_run(peer_key))
        rates = [tokens / best[name] for name in sides]
        if peer_key.startswith("tg") and "@" not in peer_key:  # the short-context decode: its bytes per token
            decode_rates = dict(zip(sides, rates))
        printed, row_peers = "", []
        for name in peers:
            ratio = tokens / best[ours] / peer_best[name] if peer_best[name] and ours else None
            printed += ((f"{peer_best[name]:>13.1f}" if peer_best[name] else f"{'-':>13}")
                        + (f"{ratio:>8.2f}x" if ratio else f"{'-':>9}"))
            row_peers += [results.rounded(peer_best[name]) if peer_best[name] else None,
                          results.rounded(ratio, 2) if ratio else None]
        print(f"{label:<22}" + "".join(f"{r:>{width}.1f}" for r in rates)
              + "".join(f"{r / rates[0]:>{ratio_width - 1}.2f}x" for r in rates[1:]) + printed, flush=True)
        rows.append([label, *(results.rounded(r) for r in rates),
                     *(results.rounded(r / rates[0], 2) for r in rates[1:]), *row_peers])
    if run is not None:
        run.table(title, ["what, tok/s", *sides, *(f"x {n.split()[-1]}" for n in list(sides)[1:]),
                          *(c for name in peers for c in (name, f"{ours} / {name}"))], rows)
    return decode_rates


def print_bytes(sides: dict, decode_rates: dict, repeats: int, run: results.Run | None = None,
                plain: dict | None = None) -> None:
    """Each side's bytes per decode token and the GB/s its decode rate reaches, beside a plain read of those bytes
    (`plain`: run_table's reads, alternated with the decode runs; else best of `repeats` now)."""
    for name, side in sides.items():
        if isinstance(side, Ours):
            reached = side.weight_bytes * decode_rates[name] / 1e9
            limit = plain[name] if plain and name in plain else plain_read_gbps(side.weight_bytes, repeats)
            line = (f"{name}: {side.weight_bytes / 1e6:.1f} MB per decode token, {reached:.1f} GB/s; a plain read "
                    f"of the same bytes: {limit:.1f} GB/s ({reached / limit:.0%})")
            print(line)
            if run is not None:
                run.note(line)


def write_w4a16_checkpoint(folder: Path, group: int) -> str:
    """A pack-quantized W4A16 checkpoint of SmolLM2's shape in `folder`, made by compressed-tensors' own
    compressor (module docstring); what its weights are, in words."""
    import transformers

    from deltaserve.budget import default_model_path

    gguf = default_model_path()
    config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if config.hidden_size % group == 0 and config.intermediate_size % group == 0:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
        source = f"SmolLM2-135M's weights ({gguf.name} dequantized)"
    else:
        hidden = math.ceil(config.hidden_size / group) * group
        heads = hidden // config.head_dim
        kv_heads = max(d for d in range(1, heads + 1) if heads % d == 0 and 3 * d <= heads)  # SmolLM2: 9 / 3
        config = transformers.LlamaConfig(**{**config.to_dict(), "hidden_size": hidden, "num_attention_heads": heads,
                                             "num_key_value_heads": kv_heads, "head_dim": config.head_dim})
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        source = (f"a random Llama of SmolLM2's shape, hidden {hidden} ({heads} heads, {kv_heads} KV heads; "
                  f"SmolLM2's 576 is not a multiple of {group})")
    save_w4a16(model.eval(), folder, group)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return source


def save_w4a16(model: torch.nn.Module, folder: Path, group: int, ignore: tuple[str, ...] = ("lm_head",)) -> None:
    """`model` (its Linear layers but those in `ignore`) pack-quantized to symmetric 4-bit groups of `group` by
    compressed-tensors' own compressor, saved with its config in `folder` (no tokenizer)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    qconfig = QuantizationConfig.model_validate(dict(config_groups={"group_0": {"targets": ["Linear"],
                                                                                "weights": scheme}},
                                                     ignore=list(ignore), format="pack-quantized",
                                                     quantization_status="frozen"))
    apply_quantization_config(model, qconfig, show_progress=False)
    minmax_qparams_(model)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    with contextlib.redirect_stderr(io.StringIO()):  # its per-module progress bar
        compressor.compress_model(model)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    save_file(state, folder / "model.safetensors")
    compressor.update_config(str(folder))


def minmax_qparams_(model: torch.nn.Module) -> None:
    """Each group's scale from its min / max (a minmax observer's), computed by the library
    (as tests/test_weights_compressed_tensors.py does)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight, args = module.weight.detach(), scheme.weights
        groups = weight.view(weight.shape[0], -1, args.group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale.data.copy_(scale)


def logits_check(packed: Ours, dequantized: Ours, folder: Path, run: results.Run | None = None) -> bool:
    """Packed vs dequantized logits over one 512-token prompt within the W4A16 tests' float32 bound
    (tests/tolerance.py: both sides compute the same weights in float32, in different orders); the decode runs'
    greedy tokens compared. True when the logits hold."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tolerance import logits_rtol

    config = json.loads((folder / "config.json").read_text())
    ids = prompt(512, 7)
    got, want = packed.logits(ids), dequantized.logits(ids)
    error = ((got - want).abs().max() / want.abs().max()).item()
    bound = logits_rtol(config["num_hidden_layers"], max(config["hidden_size"], config["intermediate_size"],
                                                         len(ids)))
    same = packed.tokens == dequantized.tokens
    line = (f"logits check (512-token prompt): max|packed - fp32| / max|fp32| = {error:.2e}, bound {bound:.2e}: "
            f"{'holds' if error <= bound else 'FAILS'}; the decode runs' greedy tokens "
            f"{'identical' if same else 'differ'} ({len(packed.tokens)} tokens)")
    print(line)
    if run is not None:
        run.note(line)
    return error <= bound


def plain_read_gbps(nbytes: int, repeats: int) -> float:
    """GB/s of torch.sum over a float32 tensor of `nbytes` (best of `repeats`, after one warm-up read), held as our
    weights are (deltaserve/models/arena.py: one buffer of transparent huge pages where the platform gives them; in
    4 KB pages a plain read here is ~15% slower)."""
    from deltaserve.models import arena

    if arena.huge_pages_available():
        data = arena.huge_page_buffer(nbytes // 4 * 4).view(torch.float32)
        data.fill_(1.0)
    else:
        data = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


if __name__ == "__main__":
    sys.exit(main())
