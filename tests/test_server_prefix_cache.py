"""The prefix cache through the server, driven by the `openai` client: a chat that resends its history and
sub-agents that share one long system prompt get `usage.prompt_tokens_details.cached_tokens`, and their answers
equal those of a server started with --no-prefix-cache; on the tiny hybrid, the chat's message boundaries reach the
cache (its GDN checkpoints sit there)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import openai
import pytest

from server_util import running_server
from test_engine_support import HYBRID_VOCAB, make_hybrid_checkpoint

# The exact paths (a float32 KV cache, float32 activations): a cached prefix's K/V were computed in another step than
# a fresh prefill's, equal to float32 rounding, and int8 activations (the CPU default) can turn such a difference into
# a greedy flip at a near-tie (README: int8 is not batch-invariant); the answers must be equal, not near
POOL = ("--max-total-tokens", "8192", "--max-running-requests", "4", "--kv-dtype", "float32",
        "--activation-dtype", "float32")
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WORDS = ("river market bridge harbour lantern orchard meadow quarry tower village granary mill forge chapel "
         "square fountain gate wall road field").split()


def text_of_words(count: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed * 3 + i * i) % len(WORDS)] for i in range(count))


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        cached = stack.enter_context(running_server(tmp_path_factory.mktemp("cached"), *POOL))
        plain = stack.enter_context(running_server(tmp_path_factory.mktemp("plain"), *POOL, "--no-prefix-cache"))
        yield tuple(openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
                    for s in (cached, plain)) + (cached,)


def ask(client, messages):
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                            max_tokens=6, temperature=0)
    return answer.choices[0].message.content, answer.usage


def test_ten_turn_chat_resending_its_history(clients):
    cached, plain, server = clients
    messages = [{"role": "system", "content": "You describe towns. " + text_of_words(150, 1)}]
    previous_prompt = None
    for turn in range(10):
        messages.append({"role": "user", "content": f"Turn {turn}: " + text_of_words(12, turn)})
        got, usage = ask(cached, messages)
        want, plain_usage = ask(plain, messages)
        assert got == want and plain_usage.prompt_tokens_details.cached_tokens == 0
        if previous_prompt is not None:
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * previous_prompt, (turn, usage)
        previous_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": got})
    assert server.metric("deltaserve_prefix_cache_hit_tokens_total") > 0
    assert server.post("/flush_cache", json={}).status_code == 200
    assert server.metric("deltaserve_prefix_cache_pages") == 0


def test_six_sub_agents_sharing_a_system_prompt(clients):
    cached, plain, server = clients
    system = {"role": "system", "content": "You are a careful surveyor. " + text_of_words(1000, 5)}
    shared = ask(plain, [system, {"role": "user", "content": "x"}])[1].prompt_tokens - 12  # the task's few tokens
    for agent in range(6):
        messages = [system, {"role": "user", "content": f"Task {agent}: survey the " + text_of_words(8, agent)}]
        got, usage = ask(cached, messages)
        assert got == ask(plain, messages)[0]
        if agent >= 2:
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * shared, (agent, usage)


@pytest.fixture(scope="module")
def hybrid_clients(tmp_path_factory):
    """The tiny hybrid behind a Qwen3 chat template (its word-level vocabulary reads the words `t0`..`t159`)."""
    folder = tmp_path_factory.mktemp("hybrid")
    make_hybrid_checkpoint(folder)
    args = ("--model", str(folder), "--chat-template", str(TEMPLATES / "qwen3.jinja"), "--checkpoint-slots", "8",
            *POOL)
    with contextlib.ExitStack() as stack:
        cached = stack.enter_context(running_server(tmp_path_factory.mktemp("hcached"), *args))
        plain = stack.enter_context(running_server(tmp_path_factory.mktemp("hplain"), *args, "--no-prefix-cache"))
        yield tuple(openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=600)
                    for s in (cached, plain)) + (cached,)


def words(count: int, seed: int) -> str:
    return " ".join(f"t{1 + (i * 37 + seed * 11 + i * i) % (HYBRID_VOCAB - 1)}" for i in range(count))


def test_hybrid_sub_agents_hit_the_system_message_end(hybrid_clients):
    """On a hybrid a hit needs the GDN state at its exact end: the server passes the chat's message boundaries, so
    the first sub-agent already leaves a checkpoint where the system message ends and the second hits there (no
    branch point exists yet to hit at); a resent chat hits where the previous prompt ended."""
    cached, plain, server = hybrid_clients
    system = {"role": "system", "content": words(300, 1)}
    through_system = server.post("/tokenize", json={"messages": [system], "add_generation_prompt": False})
    through_system = through_system.json()["count"]
    assert through_system > 300
    for agent in range(3):
        messages = [system, {"role": "user", "content": words(20, 10 + agent)}]
        got, usage = ask(cached, messages)
        assert got == ask(plain, messages)[0]
        hit = usage.prompt_tokens_details.cached_tokens
        assert hit == 0 if agent == 0 else through_system <= hit < usage.prompt_tokens, (agent, usage)
    previous = usage.prompt_tokens
    messages += [{"role": "assistant", "content": got}, {"role": "user", "content": words(12, 99)}]
    got, usage = ask(cached, messages)
    assert got == ask(plain, messages)[0] and usage.prompt_tokens_details.cached_tokens >= previous
