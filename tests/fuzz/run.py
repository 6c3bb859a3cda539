"""Running one drawn case: the checkpoint through the real engine (deltaserve.engine.Engine), every request's
log-probabilities (prefill's last position and each greedy decode step) against transformers on the format's own
dequantization, within the float32 bound of tests/tolerance.py.

The engine reports log-probabilities (the chosen token and the top 20), not logits. logprob = logit - logsumexp, so
where every logit is within e of the oracle's, every log-probability is within 2e: the bound compared is
2 * config_rtol * max|oracle logits| of that position. A greedy choice is checked too: the engine's token must be
the oracle's argmax to within 2e of logit (a near-tie may go either way, nothing further)."""

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
from .draw import Case, Request, draw_case
from tests.test_engine_support import run_all
from tests.tolerance import config_rtol

TOP_LOGPROBS = 20
FLOAT16_ULP = 2.0 ** -11  # the GPTQ / AWQ packages dequantize in float16 (tests/test_weights_gptq.py)
SEQUENTIAL_LINEARS = 4  # a token's path through one layer: qkv (or GDN in_proj), o (out_proj), gate/up, down


@dataclass
class Result:
    case: Case
    failures: list[str] = field(default_factory=list)
    refusal: str | None = None  # a clean CheckpointError from the engine's load
    cached_tokens: int = 0  # prompt tokens the follow-ups took from the prefix cache

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
    with tempfile.TemporaryDirectory(prefix=f"fuzz{case.seed}_") as tmp:
        ref, path = formats.save(case, Path(tmp))
        settings = dict(device="cpu", kv_dtype="float32", max_total_tokens=2048, **case.engine)
        try:
            engine = Engine(EngineConfig(model=str(path), **settings), log=None)
        except CheckpointError as e:
            message = str(e)
            result.refusal = message
            if "\n" in message:
                result.failures.append(f"refusal is not one line: {message!r}")
            return result
        prompts = [random_ids(case, i, r.prompt_len) for i, r in enumerate(case.batch)]
        outputs = run_all(engine, [(ids, params(r)) for ids, r in zip(prompts, case.batch)])
        check_outputs(result, ref, "batch", prompts, outputs)
        for j, r in enumerate(case.follow_ups):
            source = prompts[j % len(prompts)]
            ids = source[:r.shared_prefix] + random_ids(case, 100 + j, r.prompt_len - r.shared_prefix)
            out = run_all(engine, [(ids, params(r))])
            check_outputs(result, ref, f"follow-up {j} (shares {r.shared_prefix})", [ids], out)
            result.cached_tokens += out[0][-1].cached_tokens if out[0] else 0
        del engine
    return result


def random_ids(case: Case, index: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(case.seed * 1000 + index)
    return torch.randint(0, case.config["vocab_size"], (length,), generator=generator).tolist()


def params(r: Request) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS)


def rtol(case: Case, ref, context: int) -> float:
    """config_rtol, plus the float16 rounding of each packed weight where the package dequantizes in float16."""
    bound = config_rtol(ref.config, context=context)
    if case.fmt.kind in ("gptq", "awq"):
        bound += SEQUENTIAL_LINEARS * ref.config.num_hidden_layers * FLOAT16_ULP
    return bound


def check_outputs(result: Result, ref, label: str, prompts: list[list[int]], outputs: list[list]) -> None:
    for i, (ids, events) in enumerate(zip(prompts, outputs)):
        where = f"{label} request {i} (prompt {len(ids)})"
        last = events[-1] if events else None
        if last is None or last.finish_reason != "length":
            result.failures.append(f"{where}: finished {last and last.finish_reason!r}: {last and last.error}")
            continue
        tokens = [t for e in events for t in e.token_ids]
        logprobs = [lp for e in events for lp in (e.logprobs or [])]
        result.failures.extend(f"{where}: {p}" for p in compare(result.case, ref, ids, tokens, logprobs))


def compare(case: Case, ref, prompt: list[int], tokens: list[int], logprobs: list) -> list[str]:
    """Differences of the engine's log-probabilities from the oracle's at each generated position."""
    if len(logprobs) != len(tokens):
        return [f"{len(tokens)} tokens but {len(logprobs)} logprobs"]
    sequence = prompt + tokens[:-1]
    with torch.no_grad():
        logits = ref(torch.tensor([sequence]), use_cache=False).logits[0, len(prompt) - 1:].double()
    expected = logits.log_softmax(-1)
    bound = rtol(case, ref, len(sequence))
    problems = []
    for step, (token, lp) in enumerate(zip(tokens, logprobs)):
        logit_error = bound * logits[step].abs().max().item()
        gap = (logits[step].max() - logits[step, token]).item()
        if gap > 2 * logit_error:
            problems.append(f"step {step}: greedy token {token} is not the oracle's argmax "
                            f"{int(logits[step].argmax())} (logit gap {gap:.3g}, allowed {2 * logit_error:.3g})")
        worst = max(abs(value - expected[step, tid].item()) for tid, value in [(token, lp.logprob)] +
                    [(tid, value) for tid, _, value in lp.top])
        if worst > 2 * logit_error:
            problems.append(f"step {step}: logprob off by {worst:.3g} > bound {2 * logit_error:.3g} "
                            f"(rtol {bound:.3g})")
    return problems
