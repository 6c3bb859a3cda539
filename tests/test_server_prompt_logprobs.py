"""Prompt log-probabilities through a real server, driven by the `openai` client: `/v1/completions` with `echo`,
`logprobs` and `max_tokens` 0 (lm-evaluation-harness's log-likelihood requests) returns each prompt token's
log-probability and top alternatives, held to transformers' log-softmax on the same weights within the float32
bound (tests/tolerance.py: |d logit| <= b max|logit| gives |d log-softmax| <= 2 b max|logit|), on the tiny hybrid
(its GDN state carried across the steps a long prompt is scored in) and the tiny dense model."""

from __future__ import annotations

import contextlib

import openai
import pytest
import torch

from deltaserve.budget.lines import PROMPT_LOGPROB_ROWS
from server_util import running_server
from test_engine_support import HYBRID_VOCAB, make_dense_checkpoint, make_hybrid_checkpoint
from tolerance import config_rtol

CONTEXT = 1024
EXACT = ("--dtype", "float32", "--kv-dtype", "float32", "--state-dtype", "float32", "--activation-dtype", "float32",
         "--max-total-tokens", "4096", "--max-running-requests", "4", "--context-length", str(CONTEXT),
         "--prefill-chunk-tokens", "128")
TOP = 3


@pytest.fixture(scope="module", params=["hybrid", "dense"])
def served(request, tmp_path_factory):
    """(openai client, transformers oracle) of one tiny checkpoint behind a float32 server (prefix cache on)."""
    folder = tmp_path_factory.mktemp(request.param)
    oracle = (make_hybrid_checkpoint if request.param == "hybrid" else make_dense_checkpoint)(folder)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(running_server(tmp_path_factory.mktemp("log"), "--model", str(folder), *EXACT))
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600), oracle


def prompt_ids(length: int, seed: int) -> list[int]:
    return [1 + (i * 37 + seed * 11 + i * i) % (HYBRID_VOCAB - 1) for i in range(length)]


def oracle_logprobs(oracle, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-softmax of every position [T, vocab], and the float32 bound on each row's log-probs."""
    with torch.no_grad():
        logits = oracle(torch.tensor([ids])).logits[0].float()
    bound = 2 * config_rtol(oracle.config, len(ids)) * logits.abs().amax(-1)
    return logits.log_softmax(-1), bound


def check_prompt(choice, ids: list[int], oracle) -> None:
    """The echoed prompt's tokens, first null, each next token's log-prob and top-N within the bound."""
    lp = choice.logprobs
    want, bound = oracle_logprobs(oracle, ids)
    assert lp.tokens[: len(ids)] == [f"t{t}" for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for t in range(1, len(ids)):
        row = want[t - 1]  # token t is predicted from the row of position t - 1
        assert abs(lp.token_logprobs[t] - float(row[ids[t]])) <= bound[t - 1], t
        top = lp.top_logprobs[t]
        assert len(top) == TOP
        kth = float(row.topk(TOP).values[-1])
        for name, value in top.items():
            assert abs(value - float(row[int(name[1:])])) <= bound[t - 1], (t, name)
            assert value >= kth - 2 * bound[t - 1], (t, name)  # among the top N, up to ties within the bound
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)])


def test_prompt_logprobs_match_transformers(served):
    client, oracle = served
    model = client.models.list().data[0].id
    # one short prompt, and one scored over several steps (PROMPT_LOGPROB_ROWS a step) and prefill chunks
    for ids in (prompt_ids(9, 1), prompt_ids(3 * PROMPT_LOGPROB_ROWS + 17, 2)):
        answer = client.completions.create(model=model, prompt=ids, echo=True, logprobs=TOP, max_tokens=0)
        choice = answer.choices[0]
        assert choice.finish_reason == "length" and answer.usage.completion_tokens == 0
        assert len(choice.logprobs.tokens) == len(ids) and choice.text == " ".join(f"t{t}" for t in ids)
        check_prompt(choice, ids, oracle)
        again = client.completions.create(model=model, prompt=ids, echo=True, logprobs=TOP, max_tokens=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # no prefix hit skips a scored position
        assert again.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs


def test_generated_tokens_follow_the_prompts(served):
    client, oracle = served
    model = client.models.list().data[0].id
    ids = prompt_ids(40, 3)
    answer = client.completions.create(model=model, prompt=ids, echo=True, logprobs=TOP, max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 4 and all(v is not None for v in lp.token_logprobs[1:])
    check_prompt(answer.choices[0], ids, oracle)
    generated = [int(name[1:]) for name in lp.tokens[len(ids):]]
    want, bound = oracle_logprobs(oracle, ids + generated)
    for j, token in enumerate(generated):
        row = len(ids) - 1 + j
        assert abs(lp.token_logprobs[len(ids) + j] - float(want[row, token])) <= bound[row]


def test_bad_prompt_logprob_requests_are_400s_naming_the_limit(served):
    client, _ = served
    model = client.models.list().data[0].id
    cases = [
        (dict(prompt=prompt_ids(5, 4), echo=True, logprobs=1, max_tokens=0, n=2), "n must be 1"),
        (dict(prompt=prompt_ids(CONTEXT + 1, 5), echo=True, logprobs=1, max_tokens=0), f"{CONTEXT} tokens"),
        (dict(prompt=prompt_ids(5, 6), max_tokens=0), "needs echo true and logprobs"),
        (dict(prompt=prompt_ids(5, 6), echo=True, logprobs=1, max_tokens=0, stream=True), "not streamed"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=model, **kwargs)
        assert message in str(error.value), (kwargs.keys(), str(error.value))
