"""Tool-call and reasoning parsers on the exact text each family's own chat template writes for an assistant turn.

The oracle is the template: an assistant message with content, reasoning and tool calls is rendered by the
model's chat template (tests/data/chat_templates), the part after the generation prompt is what the model would
have generated, and parsing it must give back the message. Streaming: split at every character boundary (and
one character at a time), the reassembled deltas equal the unsplit parse.
"""

import json
from pathlib import Path

import pytest

from deltaserve.text.reasoning import ReasoningParser, prompt_opens_thinking, template_reasons
from deltaserve.text.tokenizer import _template_messages, chat_template_env
from deltaserve.text.tool_parsers import collect, make_tool_parser, pick_tool_parser, typed_value

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# Verbatim templates: qwen3_5.jinja is Qwen/Qwen3.5-27B's chat_template.jinja (the larger Qwen3.5 models think by
# default: the generation prompt opens <think>), qwen3_coder.jinja Qwen3-Coder's, qwen3.jinja Qwen3's, and
# llama3_1_json.jinja vLLM's JSON tool-calling template for Llama 3.1.

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "required": ["path"], "properties": {
            "path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": ["integer", "null"]},
            "scale": {"type": "number"}, "force": {"type": "boolean"},
            "globs": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "run", "description": "Run a command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}}}},
]
CALLS = [
    ("read_file", {"path": "src/a b.py", "offset": 5, "scale": 1.5, "force": True, "globs": ["*.py", "x"],
                   "opts": {"k": [1, 2]}, "limit": None}),
    ("run", {"command": "echo '<tool_call>' && ls -la\nprintf 'x\\n'", "timeout_s": 30}),
]
# (template file, parser, end-of-turn marker, how many calls one turn may hold, whether it writes content)
FAMILIES = [("qwen3_5.jinja", "qwen3_coder", "<|im_end|>\n", 2, True),
            ("qwen3_coder.jinja", "qwen3_coder", "<|im_end|>\n", 2, True),
            ("qwen3.jinja", "hermes", "<|im_end|>\n", 2, True),
            ("llama3_1_json.jinja", "llama3_json", "<|eot_id|>", 1, False)]


def render(template: str, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    compiled = chat_template_env().from_string(template)
    return compiled.render(messages=_template_messages(messages), add_generation_prompt=add_generation_prompt,
                           bos_token="<|begin_of_text|>", date_string="04 Dec 2026", **kwargs)


def generated_text(template: str, messages: list[dict], end: str, **kwargs) -> tuple[str, str]:
    """(prompt, model output) of the last assistant message, as the template writes them."""
    prompt = render(template, messages[:-1], True, **kwargs)
    whole = render(template, messages, False, **kwargs)
    assert whole.startswith(prompt), "the template renders history differently with a generation prompt"
    output = whole[len(prompt):]
    assert output.endswith(end)
    return prompt, output[:-len(end)]


def counter_ids():
    n = iter(range(1000))
    return lambda: f"call_{next(n)}"


def parse(parser_name: str, pieces: list[str]):
    parser = make_tool_parser(parser_name, TOOLS, counter_ids())
    deltas = [d for piece in pieces for d in parser.push(piece)] + parser.flush()
    return deltas, collect(deltas)


def check_streaming(parser_name: str, text: str):
    _, whole = parse(parser_name, [text])
    for cut in range(len(text) + 1):
        assert parse(parser_name, [text[:cut], text[cut:]])[1] == whole, f"split at {cut}: {text[:cut]!r}"
    deltas, by_char = parse(parser_name, list(text))
    assert by_char == whole
    seen = set()
    for d in deltas:  # OpenAI order: a call's id and name come before any of its arguments
        if d.index is not None:
            assert (d.index in seen) == (d.name is None), d
            seen.add(d.index)
    return whole


@pytest.mark.parametrize("template_file,parser_name,end,max_calls,writes_content", FAMILIES)
def test_template_tool_calls_parse_back(template_file, parser_name, end, max_calls, writes_content):
    template = (TEMPLATES / template_file).read_text()
    assert pick_tool_parser(template) == parser_name
    content = "I will look at the file first." if writes_content else ""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
             for i, (name, args) in enumerate(CALLS[:max_calls])]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix the bug."},
                {"role": "assistant", "content": content, "tool_calls": calls}]
    prompt, output = generated_text(template, messages, end, tools=TOOLS)
    if template_reasons(template):  # Qwen3 writes an (empty) think block before the answer: reasoning goes first
        reasoning, output = check_reasoning_streaming(prompt_opens_thinking(prompt), output)
        assert reasoning == ""
    got_content, got_calls = check_streaming(parser_name, output)
    assert got_content == content
    assert [c.name for c in got_calls] == [name for name, _ in CALLS[:max_calls]]
    assert [json.loads(c.arguments) for c in got_calls] == [args for _, args in CALLS[:max_calls]]
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parser_name", ["qwen3_coder", "hermes", "llama3_json"])
def test_plain_answers_stay_content(parser_name):
    for text in ["The answer is 42.", "  leading and trailing space \n", "a <tool b", "{not json", "<tool_call>"]:
        content, calls = check_streaming(parser_name, text)
        assert calls == []
        assert content.strip() == text.strip()


def test_qwen3_coder_cut_off_call_stays_valid_json():
    """Cut off by max_tokens: a string value keeps what was written, an unfinished typed value is left out."""
    text = "<tool_call>\n<function=run>\n<parameter=timeout_s>\n7\n</parameter>\n<parameter=command>\nls -"
    content, calls = check_streaming("qwen3_coder", text)
    assert content == "" and json.loads(calls[0].arguments) == {"timeout_s": 7, "command": "ls -"}
    text = "<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n<parameter=timeout_s>\n7"
    assert json.loads(check_streaming("qwen3_coder", text)[1][0].arguments) == {"command": "ls"}


def test_qwen3_coder_string_values_stream_before_their_end():
    """A long string argument (a file's content) reaches the client while the model is still writing it."""
    parser = make_tool_parser("qwen3_coder", TOOLS, counter_ids())
    head = "<tool_call>\n<function=run>\n<parameter=command>\ncat <<EOF > a.py\nprint(1)\n"
    fragments = [d.arguments for d in parser.push(head) if d.arguments]
    assert "".join(fragments) == '{"command": "cat <<EOF > a.py\\nprint(1)'
    tail = [d.arguments for d in parser.push("EOF\n</parameter>\n</function>\n</tool_call>") + parser.flush()]
    assert json.loads("".join(fragments + tail)) == {"command": "cat <<EOF > a.py\nprint(1)\nEOF"}


def test_values_typed_by_schema():
    assert typed_value("5", {"type": "integer"}) == 5
    assert typed_value("5", {"type": "string"}) == "5"
    assert typed_value("2.50", {"type": "number"}) == 2.5
    assert typed_value("True", {"type": "boolean"}) is True
    assert typed_value("None", {"type": ["integer", "null"]}) is None
    assert typed_value('["a"]', {"type": "array"}) == ["a"]
    assert typed_value("five", {"type": "integer"}) == "five"  # not a number: kept as written
    assert typed_value("x y", None) == "x y"


def reasoning_parse(in_reasoning: bool, pieces: list[str]) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning)
    parts = [parser.push(p) for p in pieces] + [parser.flush()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def check_reasoning_streaming(in_reasoning: bool, text: str) -> tuple[str, str]:
    whole = reasoning_parse(in_reasoning, [text])
    for cut in range(len(text) + 1):
        assert reasoning_parse(in_reasoning, [text[:cut], text[cut:]]) == whole, f"split at {cut}"
    assert reasoning_parse(in_reasoning, list(text)) == whole
    return whole


def test_qwen3_reasoning_parses_back():
    template = (TEMPLATES / "qwen3.jinja").read_text()
    assert template_reasons(template)
    reasoning, content = "The user wants 2+2.\nThat is 4.", "It is **4**."
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": content, "reasoning_content": reasoning}]
    prompt, output = generated_text(template, messages, "<|im_end|>\n")
    assert check_reasoning_streaming(prompt_opens_thinking(prompt), output) == (reasoning, content)


def test_qwen3_5_prompt_opens_thinking():
    """The Qwen3.5 generation prompt ends in '<think>\\n': the output holds only the closing tag."""
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert prompt_opens_thinking(prompt)
    assert check_reasoning_streaming(True, "Say hello.\n</think>\n\nHello!") == ("Say hello.", "Hello!")
    assert check_reasoning_streaming(True, "cut off while thinking\n") == ("cut off while thinking", "")


def test_thinking_disabled_and_no_think_block():
    template = (TEMPLATES / "qwen3.jinja").read_text()
    prompt = render(template, [{"role": "user", "content": "hi"}], True, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not prompt_opens_thinking(prompt)
    assert check_reasoning_streaming(False, "Hello <think> there") == ("", "Hello <think> there")
    assert check_reasoning_streaming(False, "  <thin") == ("", "  <thin")


def test_earlier_turns_drop_reasoning():
    template = (TEMPLATES / "qwen3.jinja").read_text()
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "A", "reasoning_content": "first thought"},
                {"role": "user", "content": "b"}]
    prompt = render(template, messages, True)
    assert "first thought" not in prompt and "<|im_start|>assistant\nA<|im_end|>" in prompt


def test_reasoning_then_tool_call_with_qwen3():
    template = (TEMPLATES / "qwen3.jinja").read_text()
    calls = [{"id": "c", "type": "function", "function": {"name": "run", "arguments": {"command": "ls"}}}]
    messages = [{"role": "user", "content": "list"},
                {"role": "assistant", "content": "", "reasoning_content": "Use ls.", "tool_calls": calls}]
    prompt, output = generated_text(template, messages, "<|im_end|>\n", tools=TOOLS)
    reasoning, content = check_reasoning_streaming(prompt_opens_thinking(prompt), output)
    assert reasoning == "Use ls."
    got_content, got_calls = check_streaming("hermes", content)
    assert got_content == "" and json.loads(got_calls[0].arguments) == {"command": "ls"}


def test_hermes_arguments_stream_before_the_call_ends():
    parser = make_tool_parser("hermes", TOOLS, counter_ids())
    first = parser.push('Sure.\n<tool_call>\n{"name": "run", "arguments": {"command": "echo }}')
    assert first[0].content == "Sure." and first[1].name == "run"
    streamed = "".join(d.arguments for d in first[2:])
    assert streamed and streamed.startswith('{"command": "echo')
    rest = parser.push(' done"}}\n</tool_call>') + parser.flush()
    assert json.loads(streamed + "".join(d.arguments for d in rest)) == {"command": "echo }} done"}
    content, calls = check_streaming("hermes", '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}')
    assert json.loads(calls[0].arguments) == {"command": "ls"}  # no closing tag (the turn ended): still whole


# -- Qwen3.5: XML calls (qwen3_coder) after a prompt that opens <think> -----------------------------------------

QWEN3_5 = TEMPLATES / "qwen3_5.jinja"


def test_qwen3_5_template_is_read_as_a_thinking_qwen3_coder_family():
    template = QWEN3_5.read_text()
    assert pick_tool_parser(template) == "qwen3_coder" and template_reasons(template)
    prompt = render(template, [{"role": "user", "content": "hi"}], True, tools=TOOLS)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and prompt_opens_thinking(prompt)
    assert "<function=example_function_name>" in prompt and '"name": "read_file"' in prompt
    closed = render(template, [{"role": "user", "content": "hi"}], True, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n") and not prompt_opens_thinking(closed)


def qwen3_5_turn(reasoning: str, content: str, calls: list[tuple[str, dict]]) -> tuple[str, str, list]:
    """(reasoning, content, calls) parsed back from the text Qwen3.5's template writes for such a turn, streamed
    split at every boundary."""
    template = QWEN3_5.read_text()
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                  for i, (name, args) in enumerate(calls)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix the bug."},
                {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}]
    prompt, output = generated_text(template, messages, "<|im_end|>\n", tools=TOOLS)
    assert prompt_opens_thinking(prompt) and output.startswith(reasoning) and "<think>" not in output
    got_reasoning, rest = check_reasoning_streaming(True, output)
    got_content, got_calls = check_streaming("qwen3_coder", rest)
    return got_reasoning, got_content, got_calls


def test_qwen3_5_reasoning_then_calls_parse_back():
    """The output holds the reasoning, the closing tag, the text and the calls: each comes back where it was."""
    reasoning = "The bug is in a b.py.\nRead it, then run the tests."
    got_reasoning, content, calls = qwen3_5_turn(reasoning, "Looking first.", CALLS)
    assert (got_reasoning, content) == (reasoning, "Looking first.")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    got_reasoning, content, calls = qwen3_5_turn("", "", CALLS[1:])  # no thought, no text: the call alone
    assert (got_reasoning, content) == ("", "") and [json.loads(c.arguments) for c in calls] == [CALLS[1][1]]


def test_qwen3_5_multi_turn_keeps_reasoning_until_the_next_query():
    """An agent loop rendered back: calls as XML, results as <tool_response> in one user turn, reasoning kept for
    the assistant turns after the last user query and dropped from them once a new query comes."""
    template = QWEN3_5.read_text()
    call = {"id": "call_0", "type": "function", "function": {"name": "run", "arguments": {"command": "ls"}}}
    loop = [{"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "", "reasoning_content": "Use ls.", "tool_calls": [call, call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "a.py"},
            {"role": "tool", "tool_call_id": "call_0", "content": "b.py"},
            {"role": "assistant", "content": "a.py and b.py.", "reasoning_content": "Two files."}]
    prompt = render(template, loop, True, tools=TOOLS)
    assert "<|im_start|>assistant\n<think>\nUse ls.\n</think>\n\n<tool_call>\n<function=run>\n" \
           "<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>\n<tool_call>" in prompt
    assert "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n</tool_response>" \
           "<|im_end|>\n" in prompt
    assert "<think>\nTwo files.\n</think>\n\na.py and b.py.<|im_end|>" in prompt
    later = render(template, loop + [{"role": "user", "content": "Thanks."}], True, tools=TOOLS)
    assert "Use ls." not in later and "Two files." not in later
    assert "<|im_start|>assistant\na.py and b.py.<|im_end|>" in later
