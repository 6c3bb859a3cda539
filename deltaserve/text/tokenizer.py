"""Text <-> token ids: the tokenizer, chat templates, streaming detokenization, stop strings.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (from an HF `tokenizer.json`, or built from GGUF
metadata by deltaserve.weights.gguf) and renders chat templates the way transformers does. Reading
a checkpoint's files is weights/' job (weights/hf.read_hf_tokenizer hands `from_hf` their contents):
text/ imports nothing of ours but config.
"""

import bisect
import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors

REPLACEMENT_CHAR = "\ufffd"
# Names a message's reasoning may come under; templates read the first (as transformers aliases them).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# How many prompt tokens the detokenizer keeps as context (a SentencePiece space depends on its neighbour).
DETOKENIZE_CONTEXT_TOKENS = 5
# Chat messages whose ends (besides the first's) the prefix cache is told of: the newest, which earlier turns lacked.
BOUNDARY_MESSAGES = 16
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ChatTemplateError(ValueError):
    """A chat that cannot be rendered: no template, or the template refused the messages."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + shifted)
            shifted += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


class Tokenizer:
    """A model's tokenizer: ids, special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: list[int] | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token,
                               "unk_token": unk_token, "pad_token": pad_token}
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.eos_token_ids = _unique(list(eos_token_ids or []) + ([eos_id] if eos_id is not None else []))
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # The post-processor decides about BOS; ask it once instead of re-deriving its rules.
        self.adds_bos = (self.bos_token_id is not None
                         and backend.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id])
        self._compiled_template = None
        self._byte_decoder = _byte_decoder_of(backend)
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}

    @classmethod
    def from_hf(cls, backend: tokenizers.Tokenizer, config: dict, specials: dict, chat_template_jinja: str | None,
                model_configs: list[dict]) -> "Tokenizer":
        """A tokenizer from an HF folder's files as weights/ read them: the backend (tokenizer.json), the JSON objects
        of tokenizer_config.json and special_tokens_map.json ({} when absent), chat_template.jinja (None when absent)
        and generation_config.json, config.json (for the eos ids)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        tokens = {name: _token_content(config.get(name, specials.get(name))) for name in names}
        chat_template = chat_template_jinja if chat_template_jinja is not None else _config_chat_template(config)
        # tokenizer.json's post-processor decides BOS/EOS (as in transformers 5); the flags only fill a gap.
        if backend.post_processor is None:
            backend.post_processor = bos_eos_processor(
                tokens["bos_token"] if config.get("add_bos_token") else None,
                tokens["eos_token"] if config.get("add_eos_token") else None, backend)
        eos_ids = []
        for meta in model_configs:
            eos_ids += _as_id_list(meta.get("eos_token_id"))
            eos_ids += _as_id_list(meta.get("text_config", {}).get("eos_token_id"))
        return cls(backend, **tokens, eos_token_ids=eos_ids, chat_template=chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` a BOS (or EOS) only where the model asks for it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (special tokens dropped unless asked)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the model's chat template, like transformers' `apply_chat_template`."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        if self._compiled_template is None:
            try:
                self._compiled_template = chat_template_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
        context = {**{k: v for k, v in self.special_tokens.items() if v is not None},
                   "tools": None, "documents": None, **kwargs}
        try:
            return self._compiled_template.render(
                messages=_template_messages(messages), add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template refused the messages: {e}") from e

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (--chat-template) instead of the model's own."""
        self.chat_template, self._compiled_template = template, None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Ids of the rendered chat; one BOS when the model wants it, even if the template wrote it."""
        return self.encode_chat_boundaries(messages, add_generation_prompt, with_boundaries=False, **kwargs)[0]

    def encode_chat_boundaries(self, messages: list[dict], add_generation_prompt: bool = True, *,
                               with_boundaries: bool = True, **kwargs) -> tuple[list[int], list[int]]:
        """(ids of the rendered chat, the token positions where its messages end).

        A message ends where the rendering of the messages up to it stops, when that rendering is a prefix of the
        whole chat's (a template that renders a turn differently once later turns follow gives no boundary
        there); the last message's end is the position before the generation prompt. Only the first message and
        the last BOUNDARY_MESSAGES are rendered: earlier boundaries were seen by earlier turns of the chat."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids = encoding.ids
        shift = 0
        if self.adds_bos and ids[:1] != [self.bos_token_id]:
            ids, shift = [self.bos_token_id] + ids, 1
        if not with_boundaries:
            return ids, []
        ends = [end for _, end in encoding.offsets]
        count = len(messages)
        boundaries = []
        for i in sorted({1} | set(range(max(1, count - BOUNDARY_MESSAGES + 1), count + 1))):
            if i > count or (i == count and not add_generation_prompt):
                continue
            try:
                part = self.apply_chat_template(messages[:i], False, **kwargs)
            except Exception:  # a template may refuse a cut chat (one that ends in an assistant turn)
                continue
            if part and text.startswith(part):
                boundaries.append(bisect.bisect_right(ends, len(part)) + shift)  # the tokens that end inside it
        return ids, sorted(set(b for b in boundaries if 0 < b < len(ids)))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (part of a UTF-8 character for some byte-level tokens)."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        if byte := BYTE_TOKEN.fullmatch(piece):
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def token_str(self, token_id: int) -> str:
        """One token as text, for logprobs (an incomplete UTF-8 character shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, holding back incomplete characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids or [])[-DETOKENIZE_CONTEXT_TOKENS:]
        self.prefix_offset = 0  # window start: decoded again each step for context
        self.read_offset = len(self.ids)  # text up to here has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""


class StopStringMatcher:
    """Cuts a text stream at the stop string that completes first; holds back text that may begin one.

    As vLLM and SGLang do, a stop string takes effect when it completes in the stream: of the stops in the text, the
    one that ends first wins (at the same end, the one that starts first, i.e. the longer), and the output is the
    text before it. The result does not depend on how the text was split into pieces."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        self.pending += text
        found = [(i + len(s), i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            _, start, self.matched = min(found)
            out, self.pending, self.stopped = self.pending[:start], "", True
            return out, True
        held = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - held
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text, at the end of the stream (it turned out not to be a stop)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask marker): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_template_env() -> ImmutableSandboxedEnvironment:
    """A sandboxed jinja2 environment configured as transformers configures it for chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as templates expect them: None-valued keys dropped, reasoning under every alias."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be an object, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def bos_eos_processor(bos: str | None, eos: str | None, backend: tokenizers.Tokenizer):
    """A post-processor adding BOS and/or EOS around one sequence (or none)."""
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    specials = [(t, backend.token_to_id(t)) for t in _unique([t for t in (bos, eos) if t])]
    if any(token_id is None for _, token_id in specials):
        return None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _byte_decoder_of(backend: tokenizers.Tokenizer) -> dict[str, int] | None:
    """The char -> byte table when the vocabulary is byte-level, else None."""
    decoder = backend.decoder
    if decoder is None or "ByteLevel" not in decoder.__getstate__().decode(errors="replace"):
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _config_chat_template(config: dict) -> str | None:
    """tokenizer_config.json's `chat_template` (where a folder has no chat_template.jinja, transformers 5's file)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _token_content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _unique(items: list) -> list:
    return list(dict.fromkeys(items))
