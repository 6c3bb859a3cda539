"""Images through a real server on 127.0.0.1 (tiny random Qwen3.5 multimodal checkpoint), driven by the `openai`
and `anthropic` packages: answered as transformers answers, bad images refused with a 400 naming the problem, the
server serving on, and the ledger's tower line equal to the tower's bytes."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest
import torch
from safetensors import safe_open

from deltaserve.images import ImageLimits, PreprocessorSettings, preprocess
from deltaserve.engine.multimodal import expand_prompt
from deltaserve.weights.hf import read_hf_tokenizer
from server_util import assert_openai_error, running_server
from vision_support import (IMAGE, MERGE, SPECIAL, VISION_END, VISION_START, make_multimodal_checkpoint,
                            oracle_inputs, picture, png)

MAX_IMAGE_BYTES = 40_000
STEPS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vl_server")
    ref = make_multimodal_checkpoint(folder)
    with running_server(folder, "--model", str(folder), "--device", "cpu", "--max-total-tokens", "4096",
                        "--kv-dtype", "float32", "--max-image-pixels", "9216", "--max-image-bytes",
                        str(MAX_IMAGE_BYTES), "--max-images-per-request", "2", "--no-prefix-cache", "--served-model-name", "x") as server:
        yield folder, ref, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key="unused", max_retries=0, timeout=300)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_message(text: str, *urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"role": "user", "content": [{"type": "text", "text": text}, *parts]}


def oracle_answer(folder, ref, text: str, images) -> str:
    """transformers' greedy answer to the chat the server renders: template, placeholders widened, full forward."""
    tok = read_hf_tokenizer(folder)
    marker = SPECIAL[VISION_START] + SPECIAL[IMAGE] + SPECIAL[VISION_END]
    ids = tok.encode_chat([{"role": "user", "content": text + marker * len(images)}])
    limits = ImageLimits(max_pixels=9216)
    settings = PreprocessorSettings.from_checkpoint(folder, {})
    prepared = [preprocess(png(i), limits, settings) for i in images]
    ids, _ = expand_prompt(ids, prepared, IMAGE, MERGE)
    out = []
    with torch.no_grad():
        for _ in range(STEPS):
            out.append(int(ref(**oracle_inputs(ids + out, images)).logits[0, -1].argmax()))
    return tok.decode(out)


def test_a_data_url_image_is_answered_as_transformers_answers(served, client):
    folder, ref, _ = served
    images = [picture(61, 97, seed=31), picture(40, 24, seed=32)]
    reply = client.chat.completions.create(
        model="x", messages=[image_message("t5 t9 t14", *(data_url(png(i)) for i in images))],
        max_tokens=STEPS, temperature=0, extra_body={"ignore_eos": True})
    # word-level tokens: the words must agree (the stream's first word carries the separating space)
    assert reply.choices[0].message.content.split() == oracle_answer(folder, ref, "t5 t9 t14", images).split()
    tokens = sum(preprocess(png(i), ImageLimits(max_pixels=9216),
                            PreprocessorSettings.from_checkpoint(folder, {})).tokens(MERGE) for i in images)
    assert reply.usage.prompt_tokens > tokens  # every image token is in the prompt (and the reservation)


@pytest.mark.parametrize("url, fragments", [
    ("https://example.com/cat.png", ["fetches no URLs", "data:"]),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode(), ["not a readable image"]),
    ("data:text/plain;base64," + base64.b64encode(b"hello, I am text").decode(), ["not a readable image"]),
    ("data:image/png,rawbytes", ["must be base64"]),
    ("data:image/png;base64,@@@@", ["not valid base64"]),
    ("file:///etc/hostname", ["--allowed-local-media-path"]),
])
def test_bad_images_get_a_400_naming_the_problem(served, url, fragments):
    server = served[2]
    body = {"messages": [image_message("t1", url)], "max_tokens": 2}
    error = assert_openai_error(server.post("/v1/chat/completions", json=body), 400, *fragments)
    assert error["param"] == "messages[0].content[1].image_url"


def test_limits_are_named(served):
    server = served[2]
    big = png(picture(300, 300, seed=1))  # random pixels do not compress: over MAX_IMAGE_BYTES
    assert len(big) > MAX_IMAGE_BYTES
    too_big = {"messages": [image_message("t1", data_url(big))], "max_tokens": 2}
    assert_openai_error(server.post("/v1/chat/completions", json=too_big), 400, f"{MAX_IMAGE_BYTES:,} bytes")
    small = data_url(png(picture(20, 20, seed=2)))
    three = {"messages": [image_message("t1", small, small, small)], "max_tokens": 2}
    assert_openai_error(server.post("/v1/chat/completions", json=three), 400, "3 images", "limit of 2",
                        "--max-images-per-request")
    smuggled = {"messages": [{"role": "user", "content": "t1 " + SPECIAL[IMAGE]}], "max_tokens": 2}
    assert_openai_error(server.post("/v1/chat/completions", json=smuggled), 400, "image placeholder")


def test_server_keeps_serving_after_bad_images(served, client):
    for _ in range(2):
        served[2].post("/v1/chat/completions", json={"messages": [image_message("t1", "data:image/png;base64,AAAA")],
                                                     "max_tokens": 2})
    reply = client.chat.completions.create(model="x", messages=[image_message("t3", data_url(png(
        picture(24, 24, seed=3))))], max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert served[2].get("/health").status_code == 200


def test_anthropic_image_block_is_answered_like_the_openai_part(served, client):
    folder, ref, server = served
    image = png(picture(33, 50, seed=41))
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    message = claude.messages.create(
        model="x", max_tokens=STEPS, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "t7 t8"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}]}])
    openai_reply = client.chat.completions.create(model="x", messages=[image_message("t7 t8", data_url(image))],
                                                  max_tokens=STEPS, temperature=0)
    assert message.content[0].text == openai_reply.choices[0].message.content
    assert message.usage.input_tokens == openai_reply.usage.prompt_tokens > 10  # the image's tokens counted
    refused = claude.with_options(max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="fetches no URLs"):
        refused.messages.create(model="x", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])


def test_ledger_tower_line_is_the_towers_bytes(served):
    folder, _, server = served
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
        tower = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys() if k.startswith("model.visual."))
    lines = {line["name"]: line for line in server.get("/v1/budget").json()["lines"]}
    assert lines["vision_weights"]["bytes"] == tower * 4  # float32 on CPU (test_engine_vision: measured equals it)
    assert lines["vision_workspace"]["bytes"] > 0
