"""The CUDA path in one run, on a lent GPU: fla's GDN kernels against our portable chunk, the tiny hybrid's GPU
forward against the CPU float32 path, the engine on the GPU (greedy output, ledger predicted vs measured), and a
4-bit GGUF held packed on the GPU (llama-quantize's Q4_K fixture) against the same file packed on the CPU.

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
    """A 4-bit GGUF held packed on the GPU (kernels/int4.py widens tiles with torch ops there) against the same file
    packed on the CPU (the C++ kernel, which the CPU suite holds to transformers): logits, argmax, and the bytes the
    packed layers hold on the GPU against the ledger's weights line."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.loader import load_model
    from deltaserve.models.batch import allocate_caches, single_sequence_batch
    from deltaserve.models.layers import Int4Linear

    def last_logits(device: str) -> tuple[torch.Tensor, int, int]:
        loaded = load_model(path, device=device, dequantize=False)
        model = loaded.model
        packed = [m for m in model.modules() if isinstance(m, Int4Linear)]
        held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        caches = allocate_caches(model.geometry, len(prompt), 1, torch.float32, device=device)
        batch = single_sequence_batch(prompt, 0, torch.arange(len(prompt)))
        batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                              if isinstance(getattr(batch, f.name), torch.Tensor)})
        with torch.no_grad():
            return model(batch, caches)[-1].float().cpu(), len(packed), held

    want, _, _ = last_logits("cpu")
    got, packed_layers, held = last_logits(DEVICE)
    eng = Engine(EngineConfig(model=str(path), device=DEVICE, max_total_tokens=4096), log=lambda _: None)
    return {"file": path.name, "packed_layers_on_device": packed_layers, "logits_rel": rel_err(got, want),
            "argmax_equal": bool(got.argmax() == want.argmax()), "state_dict_bytes": held,
            "ledger_weights_bytes": eng.budget.line("weights").bytes}


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
    args = parser.parse_args(argv)
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

    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "fla": installed("flash-linear-attention"), "causal_conv1d": installed("causal-conv1d")}
    report["gdn"] = section(lambda: [gdn_kernels(n) for n in args.lengths])
    q4k = Path(__file__).resolve().parent.parent / "tests" / "data" / "gguf" / "tiny-qwen35-q4_k.gguf"
    report["packed_int4"] = section(lambda: packed_int4(q4k, list(range(3, 200))))
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
    text = json.dumps(report, indent=1)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cuda_check.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
