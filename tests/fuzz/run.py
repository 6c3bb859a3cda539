"""Running one drawn case: the checkpoint through the real engine (deltaserve.engine.Engine), every request's
log-probabilities (prefill's last position and each greedy decode step) against transformers on the format's own
dequantization, within the float32 bound of tests/tolerance.py.

The engine reports log-probabilities (the chosen token and the top 20), not logits. logprob = logit - logsumexp, so
where every logit is within e of the oracle's, every log-probability is within 2e: the bound compared is
2 * config_rtol * max|oracle logits| of that position. A greedy choice is checked too: the engine's token must be
the oracle's argmax to within 2e of logit (a near-tie may go either way, nothing further).

Weights stored in bfloat16 (or a GGUF F16 / quantized type, or GPTQ / AWQ packed) need no term of their own: the oracle holds the very values
the checkpoint stores (formats.py loads the rounded or dequantized tensors into it) and the engine computes in float32
from them, so the two differ by float32 rounding alone. A 16-bit KV cache is a rounding the oracle shares: transformers
runs with K and V rounded where the engine's cache rounds them (kv_rounded_logits), held to the float32 bound; the
worst case of that rounding (`kv_rtol`) is only a ceiling against the exact oracle. int8 activations (a case drawn
with --activation-dtype int8) are not shared: each checked log-probability's own bound from tests/int8_bound.py (the
rounding of every swapped layer's input, propagated by the oracle's gradient) is added to it."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.request import SamplingParams
from deltaserve.weights import CheckpointError
from . import formats
from .kv_oracle import kv_rounded_logits, kv_rounded_oracle, kv_rtol  # noqa: F401 -- kv_rounded_logits: the tests'
from .draw import GDN_FAMILIES, MOE_FAMILIES, Case, ImageCase, Request, draw_case
from tests.int8_bound import differences, logprob_bounds, swapped_layers
from tests.test_engine_support import run_all
from tests.tolerance import config_rtol

TOP_LOGPROBS = 20


@dataclass
class Result:
    case: Case
    failures: list[str] = field(default_factory=list)
    refusal: str | None = None  # the engine's CheckpointError at load (a failure too: every draw is valid)
    cached_tokens: int = 0  # prompt tokens the follow-ups took from the prefix cache
    drafted: int = 0  # draft tokens verified (a speculating case), and those accepted
    accepted: int = 0
    explained: list[str] | None = None  # with run_case(explain=True): each generated position's bound and its parts

    @property
    def ok(self) -> bool:
        return not self.failures


def replay_command(seed: int) -> str:
    return f".venv/bin/python -m tests.fuzz --seed {seed}"


def run_seed(seed: int) -> Result:
    return run_case(draw_case(seed))


def run_case(case: Case, explain: bool = False) -> Result:
    """Save, load, serve the case's requests and compare; a Result naming every difference found (and with
    `explain`, listing each generated position's bound and its parts)."""
    result = Result(case, explained=[] if explain else None)
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
        computed = [ids + tokens_of(out)[:-1] for ids, out in zip(prompts, outputs)]  # what the cache may hold
        for j, r in enumerate(case.follow_ups):
            source = prompts[j % len(prompts)]
            ids = source[:r.shared_prefix] + random_ids(case, 100 + j, r.prompt_len - r.shared_prefix)
            out = run_all(engine, [(ids, params(r))])
            label = f"follow-up {j} (shares {r.shared_prefix})"
            check_outputs(result, ref, label, [ids], out, kv_dtype, int8_layers)
            cached = out[0][-1].cached_tokens if out[0] else 0
            result.failures.extend(f"{label}: {p}" for p in cache_hit_problems(case, ids, computed, cached))
            result.cached_tokens += cached
            computed.append(ids + tokens_of(out[0])[:-1])
        if engine.speculation is not None:
            result.drafted, result.accepted = engine.speculation.drafted_total, engine.speculation.accepted_total
            result.failures.extend(speculation_problems(case, result.drafted, result.accepted))
        del engine
    return result


def tokens_of(events: list) -> list[int]:
    return [t for e in events for t in e.token_ids]


def cache_hit_problems(case: Case, ids: list[int], computed: list[list[int]], cached: int) -> list[str]:
    """The prefix cache's hit checked against what the case sent before (`computed`: each earlier request's prompt
    and generated tokens whose K/V were computed; the pool of 2048 tokens evicts none of them). A dense model hits as
    deep as a stored sequence matches, to the token, and at most the prompt less its last token (prefix.py); a
    hybrid hits at a GDN checkpoint, which a small checkpoint pool may have evicted: never deeper than that match."""
    limit = len(ids) - 1
    match = min(limit, max((common_prefix(ids, seq) for seq in computed), default=0))
    if case.family in GDN_FAMILIES:
        return [] if cached <= match else [f"{cached} prompt tokens from the cache, deeper than the {match} it shares"]
    return [] if cached == match else [f"{cached} prompt tokens from the cache, expected {match} (shared, to the token)"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def speculation_problems(case: Case, drafted: int, accepted: int) -> list[str]:
    """A speculating case drafts: with fixed drafts (an MTP head, the adaptive policy off) every decode step with
    room for a draft after its token (a request of 3 tokens or more) verifies some; and never accepts more than it
    drafted. An adaptive case may decide no draft pays, and prompt lookup drafts only where an n-gram recurs."""
    problems = [] if accepted <= drafted else [f"{accepted} drafts accepted of {drafted} drafted"]
    if case.fixed_drafts and any(r.max_tokens >= 3 for r in case.batch + case.follow_ups) and drafted == 0:
        problems.append(f"drawn with fixed {case.engine['speculative']} drafts but none was drafted")
    return problems


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


def check_outputs(result: Result, ref, label: str, prompts: list[list[int]], outputs: list[list],
                  kv_dtype: str = "float32", int8_layers: dict | None = None) -> None:
    """Each request's events: finished by its length, and compare's differences, named by `label`."""
    for i, (ids, events) in enumerate(zip(prompts, outputs)):
        where = f"{label} request {i} (prompt {len(ids)})"
        last = events[-1] if events else None
        if last is None or last.finish_reason != "length":
            result.failures.append(f"{where}: finished {last and last.finish_reason!r}: {last and last.error}")
            continue
        tokens = tokens_of(events)
        logprobs = [lp for e in events for lp in (e.logprobs or [])]
        explained = [] if result.explained is not None else None
        result.failures.extend(f"{where}: {p}" for p in compare(result.case, ref, ids, tokens, logprobs, kv_dtype,
                                                                    int8_layers, explained))
        if explained is not None:
            result.explained.extend(f"{where} {line}" for line in explained)


def compare(case: Case, ref, prompt: list[int], tokens: list[int], logprobs: list,
            kv_dtype: str = "float32", int8_layers: dict | None = None, explain: list[str] | None = None) -> list[str]:
    """Differences of the engine's log-probabilities from the oracle's at each generated position, the engine's KV
    cache stored in `kv_dtype`, the inputs of `int8_layers` (int8_bound.swapped_layers) rounded to int8; with
    `explain`, a line per generated position appended to it: the bound's parts and the worst difference's share.

    The oracle rounds where the engine rounds: under a 16-bit KV cache it is transformers with every attention
    layer's K (after the rotary) and V rounded to that dtype (kv_rounded_logits; the engine's attention reads every
    row as its cache stores it, a fresh prompt's own rows included), held to the float32 bound plus each checked
    log-probability's midpoint bound (kv_oracle.kv_rounded_oracle: an element within float32 rounding of a midpoint
    may round either way; seed 32, a bfloat16 cache, was 2.65 times the float32 bound off the rounded oracle at a
    74-token prompt's end without it). kv_rtol's worst
    case stays a sanity ceiling against the exact oracle, not for the MoE families: a router's top-k choice is
    discontinuous, so where the KV rounding moves a router logit across a near-tie the expert changes and a
    log-probability moves by O(1) where no smooth bound reaches (seed 1844: a top-1 router under a bfloat16 cache,
    2.8 off the exact oracle; transformers with its K/V rounded chose the same expert and token as we did)."""
    if len(logprobs) != len(tokens):
        return [f"{len(tokens)} tokens but {len(logprobs)} logprobs"]
    sequence = prompt + tokens[:-1]
    first = len(prompt) - 1
    with torch.no_grad():
        exact = ref(torch.tensor([sequence]), use_cache=False).logits[0, first:].double()
    bound = rtol(case, ref, len(sequence))
    logits = exact if kv_dtype == "float32" else kv_rounded_logits(ref, sequence, kv_dtype)[first:]
    # per step: the argmax, the chosen token, then the top ids, each with the int8 rounding's bound (0: float32)
    # ... and the oracle's top k + 1 (top_k_problems)
    checked = [[int(logits[step].argmax()), token] + [tid for tid, _, _ in lp.top]
               + logits[step].topk(min(len(lp.top) + 1, logits.shape[-1])).indices.tolist()
               for step, (token, lp) in enumerate(zip(tokens, logprobs))]
    int8 = (logprob_bounds(ref, int8_layers, sequence, first, checked) if int8_layers
            else [[0.0] * len(ids) for ids in checked])
    midpoints = [[0.0] * len(ids) for ids in checked]
    problems = differences(logits, tokens, logprobs, bound, int8) + top_k_problems(logits, logprobs, bound, int8)
    if kv_dtype != "float32" and (problems or explain is not None):  # a wider bound only where it could matter
        midpoints = kv_rounded_oracle(ref, sequence, kv_dtype, bound, first, checked)[1]
    extra = [[a + b for a, b in zip(x, y)] for x, y in zip(int8, midpoints)]
    if problems:
        problems = differences(logits, tokens, logprobs, bound, extra) + top_k_problems(logits, logprobs, bound, extra)
    ceiling = kv_rtol(ref, sequence, kv_dtype) if kv_dtype != "float32" and case.family not in MOE_FAMILIES else 0.0
    if ceiling:
        problems += [f"beyond the KV rounding's worst case ({ceiling:.3g}) from the exact oracle: {p}"
                     for p in differences(exact, tokens, logprobs, bound + ceiling, extra)]
    if explain is not None:
        explain.extend(explain_steps(logits, tokens, logprobs, bound, int8, midpoints, kv_dtype, ceiling))
    return problems


def top_k_problems(logits: torch.Tensor, logprobs: list, bound: float, extra: list[list[float]]) -> list[str]:
    """The engine's reported top k ids against the oracle's: an id of the oracle's top k whose log-prob exceeds the
    oracle's (k + 1)-th by more than both can move (each 2 bound max|logit| plus its int8 / KV midpoint part; any id
    below the (k + 1)-th by the largest part computed at that step) is in the engine's top k. `extra[step]` holds the
    parts of [argmax, token, reported ids..., the oracle's top k + 1 ids] (compare's order)."""
    problems = []
    for step, lp in enumerate(logprobs):
        k = len(lp.top)
        if k == 0 or k >= logits.shape[-1]:
            continue
        expected = logits[step].log_softmax(-1)
        logit_error = 2 * bound * logits[step].abs().max().item()
        ids = logits[step].topk(k + 1).indices.tolist()
        parts = extra[step][2 + k:]
        below = logit_error + max(extra[step])  # the (k + 1)-th or any id under it, risen
        reported = {tid for tid, _, _ in lp.top}
        for tid, part in zip(ids[:k], parts[:k]):
            gap = (expected[tid] - expected[ids[k]]).item()
            if tid not in reported and gap > logit_error + part + below:
                problems.append(f"step {step}: the oracle's top-{k} id {tid} (log-prob {expected[tid].item():.4g}, "
                                f"{gap:.3g} above its {k + 1}th, allowed {logit_error + part + below:.3g}) is not "
                                f"among the engine's top {k}")
                break
    return problems


def explain_steps(logits: torch.Tensor, tokens: list[int], logprobs: list, bound: float, int8: list[list[float]],
                  midpoints: list[list[float]], kv_dtype: str, ceiling: float) -> list[str]:
    """A line per generated position: the log-prob bound's parts (float32: 2 rtol max|logit|; the largest int8 and KV
    midpoint parts), the KV ceiling (not in the bound), and the worst checked log-prob's difference as a share of
    its bound (what a planted bug must push above 1)."""
    expected = logits.log_softmax(-1)
    lines = []
    for step, (token, lp) in enumerate(zip(tokens, logprobs)):
        largest = logits[step].abs().max().item()
        float32 = 2 * bound * largest
        pairs = [(token, lp.logprob)] + [(tid, value) for tid, _, value in lp.top]
        shares = [abs(value - expected[step, tid].item()) / (float32 + a + b)
                  for (tid, value), a, b in zip(pairs, int8[step][1:], midpoints[step][1:])]
        lines.append(f"step {step}: float32 {float32:.3g} (rtol {bound:.3g} x 2 x max|logit| {largest:.3g}), "
                     f"int8 up to {max(int8[step][1:], default=0.0):.3g}, KV {kv_dtype} oracle"
                     + (f" + midpoints up to {max(midpoints[step][1:]):.3g} (worst-case ceiling rtol {ceiling:.3g})"
                        if kv_dtype != "float32" else "") + f"; worst difference {max(shares):.3g} of its bound")
    return lines
