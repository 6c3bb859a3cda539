"""The CUDA path in one run, on a lent GPU: fla's GDN kernels against our portable chunk, the tiny hybrid's GPU
forward against the CPU float32 path, the engine on the GPU (greedy output, ledger predicted vs measured), 4-bit
checkpoints on the GPU (llama-quantize's Q4_K fixture, and compressed-tensors folders given by --int4-checkpoints) in
float32 (packed layout) and bfloat16 (torch's int4 layout) against the same file packed on the CPU, 27B-shaped 4-bit
linears timed four ways (our packed layout, TorchInt4Linear's path, bf16 dense, torch's int4 kernel with its operand
prebuilt), a prefix-cache hit on the GPU (cached tokens, output equal to an engine without the cache), and MTP
speculation on the GPU (the fitted tiny hybrid: output equal to speculation off).

Nothing here runs in CI (CI has no GPU). The oracles are independent of the fast path: the portable chunked
gated delta rule in float32 on the same GPU (itself checked against a float64 token loop in the CPU tests), and
our model and engine on the CPU in float32 with the same weights (which the CPU suite holds to transformers'
Qwen3.5; transformers is only used here to make and save the random model).

    python bench/cuda_check.py [--out DIR]      # prints one JSON report, also written to DIR/cuda_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results  # noqa: E402
from gdn_prefill import SHAPES, make_inputs  # noqa: E402
from hybrid_prefill import tiny_hybrid_config  # noqa: E402

from deltaserve.kernels import gated_delta_decode, gated_delta_prefill  # noqa: E402
from deltaserve.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule_step  # noqa: E402


DEVICE = "cuda"  # --device cpu runs the same script on a CPU as a smoke test of the script itself


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def seconds(fn, repeats: int = 3) -> float:
    """Best wall time of `repeats` synchronised runs after one warm-up (Triton compiles on the first call)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def gdn_kernels(tokens: int) -> dict:
    """fla (bf16) and our portable chunk (float32 and bf16) on one 27B-shaped GDN layer."""
    q, k, v, g, beta = (x.to(DEVICE) for x in make_inputs(tokens, SHAPES["27b"]))
    ref_o, ref_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    fast_o, fast_state = gated_delta_prefill(qb, kb, vb, g, beta.bfloat16())
    port_o, port_state = chunk_gated_delta_rule(qb, kb, vb, g, beta.bfloat16(), chunk_size=64)
    out = {"tokens": tokens,
           "fla_bf16_vs_f32_output_rel": rel_err(fast_o, ref_o),
           "fla_bf16_vs_f32_state_rel": rel_err(fast_state, ref_state),
           "portable_bf16_vs_f32_output_rel": rel_err(port_o, ref_o),
           "portable_f32_tok_s": tokens / seconds(lambda: chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)),
           "fast_bf16_tok_s": tokens / seconds(lambda: gated_delta_prefill(qb, kb, vb, g, beta.bfloat16()))}
    batch = 64  # one decode step of 64 sequences from the prefill's final state
    state = ref_state.expand(batch, *ref_state.shape[1:]).contiguous()
    step = [x[-batch:] for x in (q, k, v, g, beta)]
    ref_step, _ = recurrent_gated_delta_rule_step(*step, state)
    fast_step, _ = gated_delta_decode(*(x.bfloat16() if x.dim() == 3 else x for x in step), state)
    out["decode_fla_vs_f32_rel"] = rel_err(fast_step, ref_step)
    return out


def model_forward(folder: Path, prompt: list[int]) -> dict:
    """Prefill logits of our model on the GPU (float32 portable path, bf16 fast path) against the same model on the
    CPU in float32, the path the CPU suite holds to transformers (transformers itself would call fla here, which
    crashes on CPU tensors, so it is not run in this script)."""
    from deltaserve.models import build_model
    from deltaserve.models.batch import allocate_caches, single_sequence_batch
    from deltaserve.weights import load_checkpoint

    def last_logits(device: str, dtype: torch.dtype) -> torch.Tensor:
        ckpt = load_checkpoint(str(folder))
        model = build_model(ckpt.config, ckpt.tensors, dtype=dtype, device=device)
        caches = allocate_caches(model.geometry, len(prompt), 1, dtype, device=device)
        batch = single_sequence_batch(prompt, 0, torch.arange(len(prompt)))
        batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                              if isinstance(getattr(batch, f.name), torch.Tensor)})
        with torch.no_grad():
            return model(batch, caches)[-1].float().cpu()

    want = last_logits("cpu", torch.float32)
    out = {"prompt_tokens": len(prompt)}
    for dtype in (torch.float32, torch.bfloat16):
        got = last_logits(DEVICE, dtype)
        name = str(dtype).removeprefix("torch.")
        out[f"{name}_logits_rel"] = rel_err(got, want)
        out[f"{name}_argmax_equal"] = bool(got.argmax() == want.argmax())
    return out


def engine_run(folder: Path, prompts: list[list[int]], log: list[str], dtype: str) -> dict:
    """The engine on the GPU: greedy tokens batched, ledger lines predicted vs measured, peak memory."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.request import SamplingParams

    if DEVICE != "cpu":
        torch.cuda.reset_peak_memory_stats()
    eng = Engine(EngineConfig(model=str(folder), device=DEVICE, dtype=dtype, max_total_tokens=65536),
                 log=log.append)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    streams = [eng.submit(p, params) for p in prompts]
    start = time.perf_counter()
    while not all(s.finished for s in streams):
        eng.step()
    elapsed = time.perf_counter() - start
    tokens = [[t for o in s.drain() for t in o.token_ids] for s in streams]
    return {"tokens": tokens, "seconds": elapsed, "budget": eng.budget.to_table(),
            "measured_lines": [line for line in log if line.startswith("measured")],
            "cuda_peak_allocated_bytes": torch.cuda.max_memory_allocated() if DEVICE != "cpu" else None,
            "dtype": eng.config.dtype, "kv_dtype": eng.config.kv_dtype}


def cpu_engine_tokens(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    from deltaserve.engine.engine import LLM
    from deltaserve.engine.request import SamplingParams

    llm = LLM(str(folder), device="cpu", kv_dtype="float32", max_total_tokens=65536)
    return [c.token_ids for c in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                                      ignore_eos=True))]


def packed_int4(path: Path, prompt: list[int]) -> dict:
    """A 4-bit checkpoint on the GPU against the same file packed on the CPU in float32 (the C++ kernel, which the CPU
    suite holds to transformers / the formats' own decompression): in float32 (the packed layout, widened by torch
    ops: kernels/int4.py) and in bfloat16, where the affine matrices take torch's int4 kernel (TorchInt4Linear,
    kernels/int4_torch.py) and, for comparison, the same bfloat16 model with the packed layout. Logits, argmax, which
    layers took which path, and the engine's ledger weights line against the bytes it measures on the GPU."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.loader import load_model
    from deltaserve.kernels import int4_torch
    from deltaserve.models.batch import allocate_caches, single_sequence_batch
    from deltaserve.models.layers import Int4Linear, TorchInt4Linear

    def last_logits(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        model = load_model(path, device=device, dtype=dtype, dequantize=False).model
        kinds = {"packed": sum(isinstance(m, Int4Linear) for m in model.modules()),
                 "torch_int4": sum(isinstance(m, TorchInt4Linear) for m in model.modules())}
        caches = allocate_caches(model.geometry, len(prompt), 1, dtype, device=device)
        batch = single_sequence_batch(prompt, 0, torch.arange(len(prompt)))
        batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                              if isinstance(getattr(batch, f.name), torch.Tensor)})
        with torch.no_grad():
            return model(batch, caches)[-1].float().cpu(), kinds

    want, _ = last_logits("cpu", torch.float32)
    out = {"file": path.name}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        got, kinds = last_logits(DEVICE, dtype)
        eng = Engine(EngineConfig(model=str(path), device=DEVICE, dtype=name, max_total_tokens=4096),
                     log=lambda _: None)
        out[name] = {"layers": kinds, "logits_rel": rel_err(got, want),
                     "argmax_equal": bool(got.argmax() == want.argmax()),
                     "ledger_weights_bytes": eng.budget.line("weights").bytes,
                     "measured_weights_bytes": eng.measured_bytes()["weights"]}
        del eng
    serves = int4_torch.serves
    int4_torch.serves = lambda device, dtype: False  # the same bfloat16 model on the packed layout's path
    try:
        got, kinds = last_logits(DEVICE, torch.bfloat16)
    finally:
        int4_torch.serves = serves
    out["bfloat16_packed_path"] = {"layers": kinds, "logits_rel": rel_err(got, want),
                                   "argmax_equal": bool(got.argmax() == want.argmax())}
    return out


def int4_speed(rows_list=(1, 16, 512)) -> dict:
    """27B-shaped 4-bit linears (group 128) on the GPU: our packed layout (kernels/int4.py widens tiles with torch ops
    off the CPU, multiplies in float32), the same weight dequantized to bf16 (F.linear), and torch's own CUDA int4
    kernel (_weight_int4pack_mm, bf16, w = (q - 8) * scale + zero) fed from the same codes. Error against the float64
    product of the dequantized weight; time per call."""
    import torch.nn.functional as F
    from deltaserve.kernels import int4_torch
    from deltaserve.kernels.int4 import Int4Codes, int4_linear, pack

    out = []
    gen = torch.Generator().manual_seed(0)
    for n, k in ((17408, 5120), (5120, 17408)):
        group = 128
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        # the field's form: symmetric, bf16 scales kept as the checkpoint stores them (kernels/int4.py)
        scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.001).bfloat16()
        c = Int4Codes(codes, scales, None, group)
        packed = pack(c)
        layout = int4_torch.convert(packed, DEVICE)  # symmetric: its bf16 scales alone, as TorchInt4Linear holds it
        packed = dataclasses.replace(packed, packed=packed.packed.to(DEVICE), scales=packed.scales.to(DEVICE))
        w64 = c.dequantize(torch.float64).to(DEVICE)
        wbf = w64.to(torch.bfloat16)
        tiny = None
        try:  # torch's int4 tinygemm layout: uint8 [n, k/2] (even column high nibble), scales+zeros [k/g, n, 2] bf16
            q = codes.to(torch.int32).to(DEVICE)
            w_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
            w_tiny = torch._convert_weight_to_int4pack(w_u8, 8)
            zeros = torch.zeros_like(scales)  # w = (q - 8) * scale + zero
            sz = torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16).to(DEVICE)
            tiny = (w_tiny, sz)
        except Exception as e:  # noqa: BLE001 - reported, the other columns still run
            tiny_error = f"{type(e).__name__}: {e}"
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(DEVICE)
            want = x.double() @ w64.t()
            r = {"n": n, "k": k, "rows": rows, "bytes_packed": packed.nbytes(), "bytes_bf16": wbf.numel() * 2}
            ours = int4_linear(x, packed)
            r["ours_f32_rel"] = rel_err(ours, want)
            r["ours_f32_ms"] = 1e3 * seconds(lambda: int4_linear(x, packed))
            xb = x.bfloat16()
            # what TorchInt4Linear runs (kernels/int4_torch.py): the operand's zeros made per call
            r["torch_layout_rel"] = rel_err(int4_torch.int4_linear(xb, layout), want)
            r["torch_layout_ms"] = 1e3 * seconds(lambda: int4_torch.int4_linear(xb, layout))
            r["bytes_torch_layout"] = layout.nbytes()
            r["dense_bf16_rel"] = rel_err(F.linear(xb, wbf), want)
            r["dense_bf16_ms"] = 1e3 * seconds(lambda: F.linear(xb, wbf))
            if tiny is not None:
                try:
                    got = torch._weight_int4pack_mm(xb, tiny[0], group, tiny[1])
                    r["torch_int4mm_rel"] = rel_err(got, want)
                    r["torch_int4mm_ms"] = 1e3 * seconds(lambda: torch._weight_int4pack_mm(xb, tiny[0], group, tiny[1]))
                except Exception as e:  # noqa: BLE001
                    r["torch_int4mm_error"] = f"{type(e).__name__}: {e}"
            else:
                r["torch_int4mm_error"] = tiny_error
            out.append(r)
        del w64, wbf, packed, tiny, layout
        if DEVICE != "cpu":
            torch.cuda.empty_cache()
    return {"layers": out}


def prefix_hit(folder: Path, prompt: list[int], dtype: str) -> dict:
    """The prefix cache on the GPU: a prompt, then the same prompt plus a new tail (a second chat turn). The second
    must take its prefix from the cache (KV pages shared, a GDN checkpoint restored) and produce the tokens an engine
    with the cache off produces."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.request import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    second = prompt + [(t * 7 + 3) % 200 for t in prompt[:300]]

    def run(eng, p):
        s = eng.submit(p, params)
        while not s.finished:
            eng.step()
        outs = s.drain()
        return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens

    cfg = dict(model=str(folder), device=DEVICE, dtype=dtype, max_total_tokens=65536)
    eng = Engine(EngineConfig(**cfg), log=lambda _: None)
    first_tokens, first_cached = run(eng, prompt)
    second_tokens, second_cached = run(eng, second)
    off = Engine(EngineConfig(**cfg, prefix_cache=False), log=lambda _: None)
    want = run(off, second)[0]
    return {"dtype": dtype, "prompt_tokens": [len(prompt), len(second)], "cached_tokens": [first_cached, second_cached],
            "second_equal_to_uncached": second_tokens == want,
            "first_divergence": next((i for i, (a, b) in enumerate(zip(second_tokens, want)) if a != b), None)}


def mtp_speculation(dtype: str) -> dict:
    """The checkpoint's MTP head on the GPU (tests/data/mtp_fitted, the fitted tiny hybrid): greedy output with
    --speculative mtp (every draft verified: the adaptive policy off) equal to speculation off on the same GPU, the
    drafts mostly accepted (the CPU suite sees > 0.5), and every page and state slot back. --speculative auto drafts
    with a head on CUDA only once this has passed on a GPU (budget/advice.py AUTO_MTP_DEVICES)."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.request import SamplingParams

    folder = Path(__file__).resolve().parent.parent / "tests" / "data" / "mtp_fitted"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (16,), generator=gen).tolist() for _ in range(6)]
    cfg = dict(model=str(folder), device=DEVICE, dtype=dtype, max_total_tokens=4096, max_running_requests=8,
               prefix_cache=False)  # every page back at the end

    def run(eng):
        streams = [eng.submit(p, params) for p in prompts]
        while not all(s.finished for s in streams):
            eng.step()
        return [[t for o in s.drain() for t in o.token_ids] for s in streams]

    want = run(Engine(EngineConfig(**cfg, speculative="off"), log=lambda _: None))
    on = Engine(EngineConfig(**cfg, speculative="mtp", speculative_tokens=3), log=lambda _: None)
    on.speculation.adaptive = False
    got = run(on)
    spec = on.speculation
    return {"dtype": dtype, "tokens_equal_to_off": [a == b for a, b in zip(got, want)],
            "drafted": spec.drafted_total, "accepted": spec.accepted_total,
            "pools_back": on.kv_pool.used_pages == 0 and on.state_pool.used_slots == 0}


def section(fn):
    """fn()'s result, or its error and traceback: one failing part does not hide the others' results."""
    try:
        return fn()
    except Exception as e:
        import traceback

        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for cuda_check.json")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--int4-checkpoints", nargs="*", default=[], type=Path,
                        help="more 4-bit checkpoints for the packed_int4 check (e.g. compressed-tensors folders made "
                             "by tests/test_weights_compressed_tensors.make_checkpoint)")
    args = parser.parse_args(argv)
    record = results.Run("cuda_check", "The CUDA path on a GPU: kernels, model and engine against the CPU", argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    from importlib.metadata import PackageNotFoundError, version
    from transformers import Qwen3_5ForCausalLM
    from tokenizers import Tokenizer, models

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    out = Path(args.out) / "cuda_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    class Report(dict):
        """Written out after every part: a run cut short by its time limit still leaves what it found."""

        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            out.write_text(json.dumps(self, indent=1))

    report = Report(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                    fla=installed("flash-linear-attention"), causal_conv1d=installed("causal-conv1d"))
    q4k = Path(__file__).resolve().parent.parent / "tests" / "data" / "gguf" / "tiny-qwen35-q4_k.gguf"
    report["packed_int4"] = [section(lambda p=p: packed_int4(p, [(7 * i + 3) % 157 for i in range(197)]))
                             for p in [q4k, *args.int4_checkpoints]]
    report["int4_speed"] = section(lambda: int4_speed((1, 16, 512) if DEVICE == "cuda" else (1,)))
    report["gdn"] = section(lambda: [gdn_kernels(n) for n in args.lengths])
    torch.manual_seed(0)
    config = tiny_hybrid_config()
    ref = Qwen3_5ForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ref.save_pretrained(folder)
        vocab = {f"t{i}": i for i in range(config.vocab_size)}
        Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, config.vocab_size, (1024,), generator=gen).tolist()
        report["model"] = section(lambda: model_forward(folder, prompt))
        prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (17, 300, 1200, 4000)]
        cpu = cpu_engine_tokens(folder, prompts)
        for dtype in ("float32", "bfloat16"):  # float32: the portable path on the GPU; bfloat16: fla where installed
            log: list[str] = []
            run = report[f"engine_{dtype}"] = section(lambda: engine_run(folder, prompts, log, dtype))
            if "tokens" in run:
                run["tokens_equal_to_cpu_float32"] = [a == b for a, b in zip(run["tokens"], cpu)]
                run["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                           for a, b in zip(run["tokens"], cpu)]
            report[f"prefix_{dtype}"] = section(lambda: prefix_hit(folder, prompts[3], dtype))
            report[f"mtp_{dtype}"] = section(lambda: mtp_speculation(dtype))
    print(json.dumps(report, indent=1))
    record.note(f"The report (the output below, and {out.name} beside this record) on {report['device']}: copy this "
                f"file into bench/results/ on the machine that keeps the repository.")
    record.save(Path(args.out))  # the lent machine returns only --out ($OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
