"""Running one drawn case: the checkpoint through the real engine (deltaserve.engine.Engine), every request's
log-probabilities (prefill's last position and each greedy decode step) against transformers on the format's own
dequantization, within the float32 bound of tests/tolerance.py.

The engine reports log-probabilities (the chosen token and the top 20), not logits. logprob = logit - logsumexp, so
where every logit is within e of the oracle's, every log-probability is within 2e: the bound compared is
2 * config_rtol * max|oracle logits| of that position. A greedy choice is checked too: the engine's token must be
the oracle's argmax to within 2e of logit (a near-tie may go either way, nothing further).

Weights stored in bfloat16 (or a GGUF F16 / quantized type, or GPTQ / AWQ packed) need no term of their own: the oracle holds the very values
the checkpoint stores (formats.py loads the rounded or dequantized tensors into it) and the engine computes in float32
from them, so the two differ by float32 rounding alone. A 16-bit KV cache is the engine's own rounding, which the
oracle does not share: `kv_rtol` bounds it. So are int8 activations (a case drawn with --activation-dtype int8): each
checked log-probability's own bound from tests/int8_bound.py (the rounding of every swapped layer's input, propagated
by the oracle's gradient) is added to it."""

from __future__ import annotations

import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.request import SamplingParams
from deltaserve.weights import CheckpointError
from . import formats
from .draw import MOE_FAMILIES, Case, ImageCase, Request, draw_case
from tests.int8_bound import differences, logprob_bounds, swapped_layers
from tests.test_engine_support import run_all
from tests.tolerance import config_rtol

TOP_LOGPROBS = 20
# unit roundoff of the KV cache's storage: round to nearest in a 16-bit float keeps 11 (float16) or 8 (bfloat16)
# significant bits; float32 storage rounds nothing the float32 arithmetic had not already
KV_UNIT_ROUNDOFF = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


@dataclass
class Result:
    case: Case
    failures: list[str] = field(default_factory=list)
    refusal: str | None = None  # the engine's CheckpointError at load (a failure too: every draw is valid)
    cached_tokens: int = 0  # prompt tokens the follow-ups took from the prefix cache
    drafted: int = 0  # draft tokens verified (a speculating case), and those accepted
    accepted: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures


def replay_command(seed: int) -> str:
    return f".venv/bin/python -m tests.fuzz --seed {seed}"


def run_seed(seed: int) -> Result:
    return run_case(draw_case(seed))


def run_case(case: Case) -> Result:
    """Save, load, serve the case's requests and compare; a Result naming every difference found."""
    result = Result(case)
    if case.image is not None:
        result.failures.extend(run_image_case(case.seed, case.image))
    with tempfile.TemporaryDirectory(prefix=f"fuzz{case.seed}_") as tmp:
        ref, path = formats.save(case, Path(tmp))
        settings = {"device": "cpu", "kv_dtype": "float32", "max_total_tokens": 2048, **case.engine}
        try:
            engine = Engine(EngineConfig(model=str(path), **settings), log=None)
        except CheckpointError as e:
            # every drawn config is valid and of a family we load: a refusal, however clean, is a finding
            result.refusal = str(e)
            result.failures.append(f"refused a valid checkpoint: {result.refusal!r}")
            return result
        if case.fixed_drafts:
            engine.speculation.adaptive = False
        kv_dtype = engine.config.kv_dtype  # "auto" resolved: float16 on CPU (config.cpu_kv_dtype)
        int8_layers = swapped_layers(engine.runner.model)  # empty but under --activation-dtype int8
        prompts = [random_ids(case, i, r.prompt_len) for i, r in enumerate(case.batch)]
        outputs = run_all(engine, [(ids, params(r)) for ids, r in zip(prompts, case.batch)])
        check_outputs(result, ref, "batch", prompts, outputs, kv_dtype, int8_layers)
        for j, r in enumerate(case.follow_ups):
            source = prompts[j % len(prompts)]
            ids = source[:r.shared_prefix] + random_ids(case, 100 + j, r.prompt_len - r.shared_prefix)
            out = run_all(engine, [(ids, params(r))])
            check_outputs(result, ref, f"follow-up {j} (shares {r.shared_prefix})", [ids], out, kv_dtype, int8_layers)
            result.cached_tokens += out[0][-1].cached_tokens if out[0] else 0
        if engine.speculation is not None:
            result.drafted, result.accepted = engine.speculation.drafted_total, engine.speculation.accepted_total
        del engine
    return result


def run_image_case(seed: int, image: ImageCase) -> list[str]:
    """The multimodal checkpoint saved by transformers (its processor config by transformers' image processor), each
    image file through our preprocessing and model and through transformers' processor and model
    (vision_support.ImageOracle: the last prompt row's logits, within its float32 bound)."""
    from tests.vision_support import ImageOracle, image_file, make_oracle_checkpoint

    problems = []
    with tempfile.TemporaryDirectory(prefix=f"fuzz{seed}_image_") as tmp:
        make_oracle_checkpoint(Path(tmp), image.vision, image.min_pixels, image.max_pixels, image.text)
        oracle = ImageOracle(tmp)
        for index, (width, height, kind, pixels_seed) in enumerate(image.images):
            got, expected, bound = oracle.compare(image_file(width, height, pixels_seed, kind), seed=seed + index)
            error = (got - expected).abs().max().item()
            if not error <= bound:
                problems.append(f"image {index} ({width}x{height} {kind}): logits off by {error:.3g} > bound "
                                f"{bound:.3g}")
    return problems


def random_ids(case: Case, index: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(case.seed * 1000 + index)
    return torch.randint(0, case.config["vocab_size"], (length,), generator=generator).tolist()


def params(r: Request) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS)


def rtol(case: Case, ref, context: int) -> float:
    """config_rtol. GPTQ / AWQ oracles need no term of their own since seed 251: formats.py takes the packages'
    dequantization in float64 (exact), not their float16 forward, whose rounding of every weight could flip an MoE
    router's choice and move a log-probability by 0.5 where no smooth bound reaches."""
    return config_rtol(ref.config, context=context)


def kv_rtol(ref, sequence: list[int], kv_dtype: str) -> float:
    """Bound on the relative logit error (as tests/tolerance.py measures it: against max|oracle logits|) that storing
    each attention layer's K and V in `kv_dtype` adds, from the oracle's own q and k over `sequence`.

    Storing rounds each element: k~ = k (1 + d), v~ = v (1 + d'), |d|, |d'| <= u (u = 2^-11 for float16, 2^-8 for
    bfloat16; the cache holds K after the rotary, and nothing the models compute comes near float16's overflow or
    subnormal range). One head of one attention layer, one query q:
    - scores s_j = c q.k_j (c = head_dim^-0.5) move by |c sum_i q_i k_ji d_ji| <= u c sum_i |q_i k_ji|
      <= u c |q| |k_j| (Cauchy-Schwarz) <= D := u c max|q| max|k|, the norms per head over every position (the rotary
      turns pairs of coordinates, so |q| and |k| are the norms of q_proj's or q_norm's output);
    - softmax: p~_j = p_j exp(ds_j) / sum_l p_l exp(ds_l), so p~_j / p_j lies in [exp(-2D), exp(2D)] and
      |p~_j - p_j| <= (exp(2D) - 1) p_j;
    - the value sum: |sum_j p~_j v~_j - sum_j p_j v_j| <= sum_j |p~_j - p_j| |v~_j| + sum_j p_j |v_j| |d'_j|
      <= ((exp(2D) - 1)(1 + u) + u) max_j |v_j|: a relative error of the attention output on the scale of its values.
    That is one more stage error of the kind tolerance.py adds through the network (to first order the errors of
    successive stages add, the norms keep the scale), on our side only: the sum over the attention layers of
    (exp(2 D_layer) - 1)(1 + u) + u, D_layer with the largest q and k norms of any head. float32 storage adds 0."""
    u = KV_UNIT_ROUNDOFF[kv_dtype]
    if u == 0.0:
        return 0.0
    return sum((math.expm1(2 * u * span) * (1 + u) + u) for span in attention_spans(ref, sequence))


def attention_spans(ref, sequence: list[int]) -> list[float]:
    """Per attention layer of the oracle: c max|q| max|k| over heads and positions of `sequence` (kv_rtol's D / u),
    from q_norm / k_norm's outputs where the layer norms its heads, else q_proj / k_proj's."""
    norms: dict[str, list[float]] = {}
    hooks = []
    for name, module in ref.named_modules():
        if not (hasattr(module, "q_proj") and hasattr(module, "k_proj") and hasattr(module, "scaling")):
            continue  # GDN layers and everything else: not attention
        norms[name] = [0.0, 0.0, module.scaling]
        for index, part in enumerate(("q", "k")):
            source = getattr(module, f"{part}_norm", None) or getattr(module, f"{part}_proj")

            def record(_module, _args, out, name=name, index=index, head_dim=module.head_dim):
                largest = out.detach().double().reshape(-1, head_dim).norm(dim=-1).max().item()
                norms[name][index] = max(norms[name][index], largest)

            hooks.append(source.register_forward_hook(record))
    try:
        with torch.no_grad():
            ref(torch.tensor([sequence]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [scale * q * k for q, k, scale in norms.values()]


def check_outputs(result: Result, ref, label: str, prompts: list[list[int]], outputs: list[list],
                  kv_dtype: str = "float32", int8_layers: dict | None = None) -> None:
    for i, (ids, events) in enumerate(zip(prompts, outputs)):
        where = f"{label} request {i} (prompt {len(ids)})"
        last = events[-1] if events else None
        if last is None or last.finish_reason != "length":
            result.failures.append(f"{where}: finished {last and last.finish_reason!r}: {last and last.error}")
            continue
        tokens = [t for e in events for t in e.token_ids]
        logprobs = [lp for e in events for lp in (e.logprobs or [])]
        result.failures.extend(f"{where}: {p}" for p in compare(result.case, ref, ids, tokens, logprobs, kv_dtype,
                                                                    int8_layers))


def compare(case: Case, ref, prompt: list[int], tokens: list[int], logprobs: list,
            kv_dtype: str = "float32", int8_layers: dict | None = None) -> list[str]:
    """Differences of the engine's log-probabilities from the oracle's at each generated position, the engine's KV
    cache stored in `kv_dtype`, the inputs of `int8_layers` (int8_bound.swapped_layers) rounded to int8.

    An MoE family with a 16-bit KV cache that differs gets a second oracle: transformers with its K (after the
    rotary, as the cache holds it) and V rounded to that dtype, within the float32 bound alone. A router's top-k
    choice is discontinuous, so where the KV rounding moves a router logit across a near-tie the expert changes and a
    log-probability moves by O(1), which kv_rtol's smooth bound cannot cover (seed 1844: a top-1 router under a
    bfloat16 cache, 2.8 off the exact oracle; transformers with its K/V rounded chose the same expert and token as
    we did). Agreeing with either oracle passes."""
    if len(logprobs) != len(tokens):
        return [f"{len(tokens)} tokens but {len(logprobs)} logprobs"]
    sequence = prompt + tokens[:-1]
    with torch.no_grad():
        logits = ref(torch.tensor([sequence]), use_cache=False).logits[0, len(prompt) - 1:].double()
    # per step: the argmax, the chosen token, then the top ids, each with the int8 rounding's bound (0: float32)
    checked = [[int(logits[step].argmax()), token] + [tid for tid, _, _ in lp.top]
               for step, (token, lp) in enumerate(zip(tokens, logprobs))]
    int8 = (logprob_bounds(ref, int8_layers, sequence, len(prompt) - 1, checked) if int8_layers
            else [[0.0] * len(ids) for ids in checked])
    problems = differences(logits, tokens, logprobs, rtol(case, ref, len(sequence)) + kv_rtol(ref, sequence, kv_dtype),
                           int8)
    if problems and kv_dtype != "float32" and case.family in MOE_FAMILIES:
        rounded = kv_rounded_logits(ref, sequence, kv_dtype)[len(prompt) - 1:]
        if not differences(rounded, tokens, logprobs, rtol(case, ref, len(sequence)), int8):
            return []
    return problems


def kv_rounded_logits(ref, sequence: list[int], kv_dtype: str) -> torch.Tensor:
    """The oracle's logits [len(sequence), vocab] (float64) with every attention layer's K after the rotary and its V
    rounded to `kv_dtype`, as the engine's cache stores them: each attention module's apply_rotary_pos_emb (looked up
    in its modeling module at call time) wrapped, and v_proj's output rounded."""
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[kv_dtype]
    attention = [m for m in ref.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "scaling")]
    modules = {sys.modules[type(m).__module__] for m in attention}
    originals = {module: module.apply_rotary_pos_emb for module in modules}

    def wrap(original):
        def rounded(q, k, *args, **kwargs):
            q, k = original(q, k, *args, **kwargs)
            return q, k.to(dtype).to(k.dtype)
        return rounded

    hooks = [m.v_proj.register_forward_hook(lambda _m, _a, out: out.to(dtype).to(out.dtype)) for m in attention]
    try:
        for module, original in originals.items():
            module.apply_rotary_pos_emb = wrap(original)
        with torch.no_grad():
            return ref(torch.tensor([sequence]), use_cache=False).logits[0].double()
    finally:
        for module, original in originals.items():
            module.apply_rotary_pos_emb = original
        for hook in hooks:
            hook.remove()
