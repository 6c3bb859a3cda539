"""The OpenAI-compatible server, end to end: a real `deltaserve serve` process (default SmolLM2) on 127.0.0.1,
driven by the official `openai` client, curl with bodies from files, concurrent streams and disconnecting clients.

Token counts are checked against transformers' own tokenizer of the same GGUF file; greedy texts against the
same request made another way (stream vs not, alone vs concurrent).
"""

import json
import subprocess
import threading
import time

import httpx
import openai
import pytest

from server_util import SMALL_POOL, assert_openai_error, hf_tokenizer, running_server

MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"
FREE_WAIT_S = 60  # a busy 2-core machine: the engine frees pages within one step, the poll allows slack


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server_api"), *SMALL_POOL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf_tok():
    return hf_tokenizer()


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _chat_ids(hf_tok, messages) -> list[int]:
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if not isinstance(ids, list) else ids


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    budget = server.get("/v1/budget").json()
    assert any(line["name"] == "kv_pool" for line in budget["lines"])


def test_chat_usage_matches_the_tokenizer_and_stream_matches_non_stream(client, model_name, hf_tok):
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10, temperature=0)
    expected_prompt = _chat_ids(hf_tok, MESSAGES)
    assert full.usage.prompt_tokens == len(expected_prompt)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 10
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=10, temperature=0, stream=True, logprobs=True,
        top_logprobs=2, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    streamed_tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(expected_prompt)
    assert usage.completion_tokens == len(streamed_tokens) == full.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in streamed_tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    # The token texts spell the completion (the last one may be the end-of-turn token, shown but not returned).
    assert "".join(t.token for t in streamed_tokens).startswith(text)


def test_completions_usage_logprobs_and_stream(client, model_name, hf_tok):
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    assert full.usage.prompt_tokens == len(hf_tok(PROMPT)["input_ids"])
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 6
    assert len(choice.logprobs.tokens) == 6 and "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0
    streamed = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    echoed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + choice.text


def test_stop_string_cuts_the_greedy_text(client, model_name):
    base = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = " " + words[2]
    cut = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == base[:base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_n_choices_and_seeds(client, model_name, hf_tok):
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=1234, n=2,
                  extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert all(c.finish_reason == "length" for c in first.choices)
    # Prompt tokens count once per prompt, completion tokens add up over the choices.
    assert first.usage.prompt_tokens == len(_chat_ids(hf_tok, MESSAGES))
    assert first.usage.completion_tokens == 2 * 6
    two_prompts = client.completions.create(model=model_name, prompt=[PROMPT, "Once upon a time"], max_tokens=3,
                                            temperature=0)
    assert [c.index for c in two_prompts.choices] == [0, 1]
    assert two_prompts.usage.completion_tokens == 6
    assert two_prompts.usage.prompt_tokens == len(hf_tok(PROMPT)["input_ids"]) + len(
        hf_tok("Once upon a time")["input_ids"])


def _curl(url: str, body_file, *extra: str) -> tuple[int, str]:
    """POST a body from a file with curl (as users send big prompts); (status, body)."""
    done = subprocess.run(["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", *extra, "-H",
                           "Content-Type: application/json", "-d", f"@{body_file}", url],
                          capture_output=True, text=True, timeout=300)
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body


def test_40k_token_body_with_curl_is_refused_with_the_arithmetic(server, model_name, hf_tok, tmp_path):
    prompt = " hello" * 40_000
    prompt_tokens = len(hf_tok(prompt)["input_ids"])
    assert prompt_tokens >= 40_000
    body_file = tmp_path / "body.json"
    body_file.write_text(json.dumps({"model": model_name, "prompt": prompt, "max_tokens": 16}))
    status, body = _curl(server.url + "/v1/completions", body_file)
    context = server.get("/v1/models").json()["data"][0]["max_model_len"]
    error = assert_openai_error(httpx.Response(status, content=body), 400, f"{prompt_tokens} in the prompt",
                                f"{context} tokens")
    assert error["type"] == "invalid_request_error"
    assert server.get("/health").status_code == 200


def test_body_at_the_size_limit_is_served_and_one_byte_more_is_413(server, model_name, tmp_path):
    limit = _max_body_bytes()
    small = {"model": model_name, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "user": ""}
    padding = limit - len(json.dumps(small).encode())
    small["user"] = "x" * padding  # an ignored field: the body is large, the prompt is not
    at_limit = tmp_path / "at_limit.json"
    at_limit.write_text(json.dumps(small))
    assert at_limit.stat().st_size == limit
    status, body = _curl(server.url + "/v1/completions", at_limit)
    assert status == 200, body[:500]
    assert json.loads(body)["usage"]["completion_tokens"] == 2
    over = tmp_path / "over.json"
    over.write_text(json.dumps({**small, "user": small["user"] + "x"}))
    status, body = _curl(server.url + "/v1/completions", over)
    assert_openai_error(httpx.Response(status, content=body), 413, str(limit))
    assert server.get("/health").status_code == 200


def _max_body_bytes() -> int:
    from deltaserve.config import EngineConfig

    return EngineConfig().max_body_bytes


@pytest.fixture(scope="module")
def float32_client(tmp_path_factory):
    """A server on the exact path (--activation-dtype float32): its greedy text does not depend on the batch. The
    int8 default's rounding can move a near-tie with the step a request shares (any float32 difference of two paths
    may flip one rounding, which moves a logit by a quantum), as vLLM's and llama.cpp's batched outputs can."""
    with running_server(tmp_path_factory.mktemp("server_api_f32"), *SMALL_POOL, "--activation-dtype", "float32") as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_eight_concurrent_streams_get_the_text_each_gets_alone(float32_client, model_name):
    client = float32_client
    prompts = [f"Write a short sentence about the number {i}." for i in range(8)]

    def stream_text(prompt: str) -> str:
        chunks = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=8, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = [stream_text(p) for p in prompts]
    together: list[str | None] = [None] * len(prompts)

    def worker(i: int) -> None:
        together[i] = stream_text(prompts[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert len(set(alone)) > 1  # the prompts really differ


def _wait_until_free(server) -> None:
    give_up = time.monotonic() + FREE_WAIT_S
    while time.monotonic() < give_up:
        if (server.metric("deltaserve_kv_pages_used") == 0 and server.metric("deltaserve_state_slots_used") == 0
                and server.metric("deltaserve_requests_running") == 0
                and server.metric("deltaserve_requests_waiting") == 0):
            return
        time.sleep(0.2)
    pytest.fail("pages or slots still held after the client left:\n" + server.get("/metrics").text[-3000:])


def test_disconnect_mid_stream_frees_every_page_and_slot(server, model_name):
    aborted = server.metric("deltaserve_requests_finished_total", '{reason="abort"}')
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300, trust_env=False) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: dropping the iterator would close the connection here
        events = 0
        for line in lines:
            events += line.startswith("data: ")
            if events >= 3:
                break
        assert server.metric("deltaserve_kv_pages_used") > 0  # it really holds pages while it runs
        assert server.metric("deltaserve_requests_running") == 1
    _wait_until_free(server)
    assert server.metric("deltaserve_requests_finished_total", '{reason="abort"}') == aborted + 1
    assert server.get("/health").status_code == 200


def test_disconnect_while_waiting_for_a_non_streamed_answer_frees_everything(server, model_name):
    aborted = server.metric("deltaserve_requests_finished_total", '{reason="abort"}')
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=3), trust_env=False)
    _wait_until_free(server)
    assert server.metric("deltaserve_requests_finished_total", '{reason="abort"}') == aborted + 1


def test_metrics_report_tokens_and_latencies(server):
    text = server.get("/metrics").text
    for name in ("deltaserve_requests_waiting", "deltaserve_requests_running", "deltaserve_kv_pages_free",
                 "deltaserve_state_slots_free", "deltaserve_prompt_tokens_total", "deltaserve_generation_tokens_total",
                 "deltaserve_time_to_first_token_seconds_count", "deltaserve_request_duration_seconds_count"):
        assert name in text, name
    assert server.metric("deltaserve_generation_tokens_total") > 0
    assert server.metric("deltaserve_time_to_first_token_seconds_count") > 0
    # a load tester tells a restarted server by its start time
    assert abs(server.metric("process_start_time_seconds") - time.time()) < 3600
