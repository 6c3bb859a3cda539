"""The sampler against transformers' own logits processors, OpenAI's penalty formula, and its own seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from deltaserve.engine.request import SamplingParams
from deltaserve.engine.sampler import _apply_penalties, _filtered_probs, sample

VOCAB = 50


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def hf_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' sampling warpers, in the order generate() applies them."""
    scores = x.clone().unsqueeze(0)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    for w in warpers:
        scores = w(None, scores)
    return scores.softmax(-1)[0]


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=12, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=2.0, top_k=20, top_p=0.9, min_p=0.05),
]


def test_filtered_distributions_equal_transformers_warpers():
    x = logits(len(CASES))
    ours = _filtered_probs(x, CASES)  # every row with its own settings, in one batch
    for i, p in enumerate(CASES):
        ref = hf_probs(x[i], p)
        assert torch.equal(ours[i] > 0, ref > 0), p
        assert torch.allclose(ours[i] / ours[i].sum(), ref, atol=1e-6), p


@pytest.mark.parametrize("scale", [4.0, 1.0, 0.05])  # peaked, middling, flat: top-p ends early, late, near the end
def test_top_p_from_a_few_candidates_equals_transformers(monkeypatch, scale):
    """A wide row (past the candidates top-p looks at first), and candidate counts that end just before, at and just
    after the first token top-p drops: the same tokens stay as transformers' warpers keep."""
    from deltaserve.engine import sampler

    vocab = 2000
    x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
    for p in (SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.0, top_k=700, top_p=0.5)):
        ref = hf_probs(x[0], p)
        kept = int((ref > 0).sum())
        assert 1 < kept < vocab
        for n in (1, kept - 1, kept, kept + 1, 256, vocab):
            monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", max(n, 1))
            ours = _filtered_probs(x, [p])[0]
            assert torch.equal(ours > 0, ref > 0), (p, n)
            assert torch.allclose(ours, ref, atol=1e-6), (p, n)


def test_draws_follow_the_filtered_distribution():
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=0)
    x = logits(1, seed=3)
    draws = 4000
    rows = [Row(p, torch.Generator().manual_seed(i)) for i in range(draws)]
    tokens = torch.tensor([s.token_id for s in sample(x.expand(draws, VOCAB), rows)])
    expected = hf_probs(x[0], p)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts[expected == 0].sum() == 0  # never a token the filters removed
    sigma = (draws * expected * (1 - expected)).sqrt()
    assert ((counts - draws * expected).abs() <= 5 * sigma + 1).all()


def test_repetition_penalty_equals_transformers_and_openai_penalties_follow_their_formula():
    x = logits(2, seed=5)
    prompt, output = [3, 4, 4, 9], [9, 9, 17, 3, 30]
    rows = [Row(SamplingParams(repetition_penalty=1.3), prompt_ids=prompt, output_ids=output),
            Row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=prompt, output_ids=output)]
    ours = _apply_penalties(x, rows)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), x[:1].clone())
    assert torch.allclose(ours[0], ref[0])
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).double()
    openai = x[1].double() - counts * 0.25 - (counts > 0).double() * 0.5  # platform.openai.com, "penalties"
    assert torch.allclose(ours[1].double(), openai, atol=1e-6)
    assert torch.equal(x, logits(2, seed=5))  # the raw logits are left alone (logprobs read them)


def test_greedy_is_argmax_and_logprobs_are_of_the_raw_distribution():
    x = logits(3, seed=1)
    rows = [Row(SamplingParams(temperature=0, logprobs=3)), Row(SamplingParams(top_k=1, logprobs=0)),
            Row(SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2), prompt_ids=[int(x[2].argmax())])]
    out = sample(x, rows)
    raw = x.double().log_softmax(-1)
    assert out[0].token_id == int(x[0].argmax()) and out[1].token_id == int(x[1].argmax())
    assert out[2].token_id != int(x[2].argmax())  # the penalty moved the choice ...
    assert out[2].logprob == pytest.approx(raw[2, out[2].token_id].item(), abs=1e-5)  # ... not the logprob
    assert [t for t, _ in out[0].top] == raw[0].topk(3).indices.tolist()
    assert [lp for _, lp in out[0].top] == pytest.approx(raw[0].topk(3).values.tolist(), abs=1e-5)
    assert out[1].top == [] and out[1].logprob == pytest.approx(raw[1].max().item(), abs=1e-5)


def test_same_seed_same_tokens_whatever_the_batch():
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    x = logits(6, seed=9)

    def draws(batch_rows: list[int], position: int, steps: int = 20) -> list[int]:
        # `position` holds the seeded request; the others are unseeded neighbours with their own generators.
        gens = [torch.Generator().manual_seed(1000 + i) for i in range(len(batch_rows))]
        gens[position] = torch.Generator().manual_seed(p.seed)
        rows = [Row(p if i == position else SamplingParams(temperature=1.5, top_k=7), gens[i])
                for i in range(len(batch_rows))]
        out = []
        for _ in range(steps):
            picks = sample(x[batch_rows], rows)
            out.append(picks[position].token_id)
        return out

    alone = draws([0], 0)
    assert draws([3, 0, 5], 1) == alone
    assert draws([2, 4, 1, 3, 5, 0], 5) == alone
    assert len(set(alone)) > 1


def test_grammar_masks_only_constrained_rows():
    """Constrained rows write JSON valid for their schema; unconstrained rows draw what they draw alone."""
    import json

    import jsonschema

    from deltaserve.engine.grammar import Grammars
    from deltaserve.budget import default_model_path
    from deltaserve.text.structured import schema_grammar
    from deltaserve.weights import read_tokenizer

    tok = read_tokenizer(default_model_path())
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "kind"],
              "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["red", "green blue"]}}}
    grammars = Grammars(tok, tok.vocab_size, frozenset(tok.eos_token_ids))

    @dataclass
    class GrammarRow(Row):
        grammar: object = None

    def rows(constrained: bool):
        out = []
        for i in range(4):
            params = SamplingParams(temperature=0.0 if i % 2 else 1.0)
            row = GrammarRow(params, torch.Generator().manual_seed(i))
            if constrained and i < 2:
                row.grammar = (grammars, grammars.matcher(schema_grammar(schema)))
            out.append(row)
        return out

    mixed, alone = rows(True), rows(False)
    eos = set(tok.eos_token_ids)
    for step in range(40):
        x = torch.randn(4, tok.vocab_size, generator=torch.Generator().manual_seed(step)) * 3
        got = sample(x, mixed)
        ref = sample(x[2:], alone[2:])
        assert [s.token_id for s in got[2:]] == [s.token_id for s in ref]
        for row, s in zip(mixed + alone[2:], got + ref):
            if not row.output_ids or row.output_ids[-1] not in eos:
                row.output_ids.append(s.token_id)
    for row in mixed[:2]:
        assert row.output_ids[-1] in eos, "the grammar ends the output with EOS once the object is complete"
        jsonschema.validate(json.loads(tok.decode(row.output_ids)), schema)


def test_logit_bias_is_added_to_the_logits_per_row():
    # Oracle: the same sampler on the unbiased logits plus the bias written out by hand, same seed, one row alone;
    # the biased row sits in a batch beside an unbiased one, which must not feel it.
    x = logits(2, seed=3)
    bias = {7: 100.0, 11: -100.0, 20: 2.5}
    biased = SamplingParams(temperature=0.7, logit_bias=tuple(bias.items()), logprobs=1)
    plain = SamplingParams(temperature=0.7, logprobs=1)
    by_hand = x[0].clone()
    for token, b in bias.items():
        by_hand[token] += b
    for seed in range(20):
        rows = [Row(biased, torch.Generator().manual_seed(seed)), Row(plain, torch.Generator().manual_seed(99))]
        batch = sample(x, rows)
        alone = sample(by_hand.unsqueeze(0), [Row(plain, torch.Generator().manual_seed(seed))])
        neighbour = sample(x[1:], [Row(plain, torch.Generator().manual_seed(99))])
        assert batch[0].token_id == alone[0].token_id and batch[1].token_id == neighbour[0].token_id
        assert batch[0].token_id != 11  # -100 on a logit of scale 3: never drawn
        # logprobs stay those of the raw model distribution, as the module documents
        assert batch[0].logprob == pytest.approx(torch.log_softmax(x[0], -1)[batch[0].token_id].item(), abs=1e-6)
    greedy = sample(x[:1], [Row(SamplingParams(temperature=0, logit_bias=((11, 100.0),)))])
    assert greedy[0].token_id == 11


@pytest.mark.parametrize("bias", [((3, 100.5),), ((3, -101.0),), ((-1, 1.0),)])
def test_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
