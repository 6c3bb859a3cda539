"""A served perplexity: the built-in SmolLM2 Q4_1 file's perplexity over real text (the Python standard library's
own source, the files bench/perplexity.py scores), from `/v1/completions` prompt log-probabilities (`echo`,
`logprobs`, `max_tokens` 0, as lm-evaluation-harness asks), equals the in-process figure (the model's logits of
the whole chunk at once, bench/perplexity.py's `Ours`) within the float32 bound, on the default path (int8
activations) and on `--activation-dtype float32`.

The server scores a prompt a few dozen rows a step and the in-process side in one pass, so the two differ by the
order of float32 sums only; each scored position may move by 2 x the logits bound (tests/tolerance.py: |d logit|
<= b max|logit| gives |d log-softmax| <= 2 b max|logit|), and so may their mean, the log of the perplexity. On the
int8 path that order also moves activations across int8 rounding boundaries, and a flip early in 30 layers carries
to the logits: single positions there differ by the int8 path's own noise (tests/int8_bound.py), not the float32
bound, so the int8 side is held to the float32 bound on the perplexity (their mean) only."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import openai
import pytest
import torch

from deltaserve.budget import default_model_path
from server_util import running_server
from tolerance import logits_rtol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import perplexity  # noqa: E402  (bench/perplexity.py: its text, its chunking and its in-process side)

CHUNKS = 2  # of perplexity.CONTEXT (512) tokens: 510 scored positions
SMOLLM2_LAYERS, SMOLLM2_WIDEST = 30, 1536  # SmolLM2-135M: 30 layers, intermediate 1536 (over hidden 576, context 512)


def served_nll(url: str, chunk: list[int]) -> torch.Tensor:
    """The scored positions' negative log-likelihoods from the server's prompt log-probabilities."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    reply = client.completions.create(model=None, prompt=chunk, echo=True, logprobs=1, max_tokens=0)
    logprobs = reply.choices[0].logprobs.token_logprobs
    assert len(logprobs) == len(chunk) and logprobs[0] is None
    first = perplexity.CONTEXT // 2
    return -torch.tensor(logprobs[first + 1:perplexity.CONTEXT], dtype=torch.float64)


@pytest.mark.parametrize("activation", ["int8", "float32"])
def test_a_served_perplexity_equals_the_in_process_one(tmp_path, activation):
    ours = perplexity.Ours(str(default_model_path()), activation)
    ids = ours.engine.tokenizer.encode(perplexity.text())
    chunks = [ids[c * perplexity.CONTEXT:(c + 1) * perplexity.CONTEXT] for c in range(CHUNKS)]
    inproc, bounds = [], []
    for chunk in chunks:
        losses, logits = perplexity.scored(ours.logits(chunk), chunk)
        inproc.append(losses)
        bounds.append(2 * logits_rtol(SMOLLM2_LAYERS, SMOLLM2_WIDEST) * logits.abs().amax(-1))
    del ours
    args = ("--max-total-tokens", "2048", "--max-running-requests", "2", "--activation-dtype", activation)
    with running_server(tmp_path, *args) as server:
        served = [served_nll(server.url, chunk) for chunk in chunks]
    served, inproc, bound = torch.cat(served), torch.cat(inproc), torch.cat(bounds)
    gap = (served - inproc).abs()
    print(f"{activation}: perplexity served {math.exp(served.mean()):.4f}, in process {math.exp(inproc.mean()):.4f}; "
          f"largest position gap {gap.max():.2e} ({(gap / bound).max():.3f}x its bound), mean bound {bound.mean():.3f}")
    inside = (gap <= bound).float().mean().item()
    print(f"{activation}: {100 * inside:.1f}% of the scored positions within their own bound")
    assert (served.mean() - inproc.mean()).abs() <= bound.mean()
    if activation == "float32":
        assert inside == 1.0
