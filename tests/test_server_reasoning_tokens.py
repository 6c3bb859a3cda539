"""Reasoning tokens are counted by the engine, not re-tokenized from text: a real server with the Qwen3.5 family's
chat template (the prompt opens `<think>`) on the built-in SmolLM2, which copies `</think>` when asked to echo it.
The oracle is the generated tokens themselves (chat completions' logprobs, one entry per token of the same greedy
output) and transformers' tokenizer, which says which ids `</think>` is.
"""

from pathlib import Path

import openai
import pytest

from server_util import SMALL_POOL, hf_tokenizer, running_server

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen3_5.jinja"
MODEL = "SmolLM2-135M-Instruct"
ECHO = "Echo this: ok</think>done"  # greedy, SmolLM2 writes it back: some thinking, the marker, then an answer
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("reasoning"), *SMALL_POOL, "--chat-template", str(TEMPLATE)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def tokens_before_marker(client: openai.OpenAI, text: str) -> tuple[int, int]:
    """(generated tokens before `</think>`'s ids, all generated tokens) of the greedy output for `text`."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], temperature=0,
                                          max_tokens=MAX_TOKENS, logprobs=True)
    pieces = [t.token for t in chat.choices[0].logprobs.content]
    hf = hf_tokenizer()
    marker = [hf.decode([i]) for i in hf.encode("</think>", add_special_tokens=False)]
    assert len(marker) > 1  # several tokens here (one special token on Qwen3.5): the engine matches the sequence
    at = next((k for k in range(len(pieces)) if pieces[k:k + len(marker)] == marker), len(pieces))
    return at, chat.usage.completion_tokens


def test_reasoning_tokens_are_the_tokens_before_the_think_end(client):
    before, generated = tokens_before_marker(client, ECHO)
    assert 0 < before < generated  # the output thinks, closes its thinking and answers
    reply = client.responses.create(model=MODEL, input=ECHO, temperature=0, max_output_tokens=MAX_TOKENS)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[1].content[0].text == "done"
    assert reply.usage.output_tokens == generated
    assert reply.usage.output_tokens_details.reasoning_tokens == before
    with client.responses.stream(model=MODEL, input=ECHO, temperature=0, max_output_tokens=MAX_TOKENS) as stream:
        streamed = stream.get_final_response()
    assert streamed.usage.output_tokens_details.reasoning_tokens == before


def test_unclosed_thinking_is_all_reasoning_and_no_thinking_none(client):
    """Cut off before `</think>`, every generated token is thinking; with thinking off (effort none: the template
    writes an empty block) the same echo is the answer and no token is reasoning."""
    cut = client.responses.create(model=MODEL, input=ECHO, temperature=0, max_output_tokens=3)
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == 3
    off = client.responses.create(model=MODEL, input=ECHO, temperature=0, max_output_tokens=MAX_TOKENS,
                                  reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0
