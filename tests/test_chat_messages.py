"""System and developer messages as each chat template can render them (server/chat.py template_messages): in place
where the template renders a system message after the first (Qwen3's), folded where it cannot (Qwen3.5's raises),
so that Claude Code's mid-conversation system messages and Codex's developer messages reach the prompt."""

from pathlib import Path

import tokenizers

from deltaserve.server.chat import template_messages
from deltaserve.text.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def tokenizer(name: str) -> Tokenizer:
    """A tokenizer that only renders: the chat template file, no vocabulary to speak of."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return Tokenizer(backend, chat_template=(TEMPLATES / name).read_text())


CLAUDE_CODE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list"},
               {"role": "system", "content": "# Environment"}]


def test_a_template_that_renders_later_system_messages_gets_them_in_place():
    qwen3 = tokenizer("qwen3.jinja")
    assert template_messages(qwen3, CLAUDE_CODE) == CLAUDE_CODE
    prompt = qwen3.apply_chat_template(template_messages(qwen3, CLAUDE_CODE))
    assert prompt.index("<|im_start|>user\nlist") < prompt.index("<|im_start|>system\n# Environment")


def test_a_template_that_refuses_them_gets_them_folded():
    qwen35 = tokenizer("qwen3_5.jinja")
    folded = template_messages(qwen35, CLAUDE_CODE)
    assert folded == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list\n\n# Environment"}]
    assert "list\n\n# Environment" in qwen35.apply_chat_template(folded)
    # The next turn keeps the first turn's rendering as its prefix: the prefix cache still hits.
    grown = CLAUDE_CODE + [{"role": "assistant", "content": "a.py"}, {"role": "system", "content": "Tools changed."},
                           {"role": "user", "content": "and?"}]
    assert template_messages(qwen35, grown) == folded + [
        {"role": "assistant", "content": "a.py"}, {"role": "user", "content": "Tools changed."},
        {"role": "user", "content": "and?"}]
    assert qwen35.apply_chat_template(template_messages(qwen35, grown), add_generation_prompt=False).startswith(
        qwen35.apply_chat_template(folded, add_generation_prompt=False))
    leading = [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
               {"role": "user", "content": "hi"}]
    assert template_messages(qwen35, leading) == [{"role": "system", "content": "A\n\nB"},
                                                  {"role": "user", "content": "hi"}]


def test_developer_messages_are_system_messages_where_the_template_knows_no_developer_role():
    qwen3 = tokenizer("qwen3.jinja")
    codex = [{"role": "developer", "content": "You are a coding agent."}, {"role": "user", "content": "hi"}]
    assert "developer" not in qwen3.apply_chat_template(codex) and "coding agent" not in qwen3.apply_chat_template(
        codex)  # what the template alone does with it: drops it
    assert "<|im_start|>system\nYou are a coding agent." in qwen3.apply_chat_template(template_messages(qwen3, codex))
