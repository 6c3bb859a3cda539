"""A GGUF's vocabulary (tokenizer.ggml.*) rebuilt as a `tokenizers.Tokenizer`.

"gpt2" files are byte-level BPE: tokens + merges, split first by the regex llama.cpp uses for the
file's `tokenizer.ggml.pre`. "llama" files are SentencePiece BPE: merges derived from the scores,
with byte fallback. Both follow transformers' GGUF tokenizer converter.
"""

from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deltaserve.text.tokenizer import Tokenizer, bos_eos_processor, bytes_to_unicode
from deltaserve.weights.errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
SUPPORTED_MODELS = ("gpt2", "llama")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex llama.cpp applies before byte-level BPE.
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "dbrx", "smaug-bpe"), LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "kormo"), QWEN2_SPLIT),
    "qwen35": QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), GPT4O_SPLIT),
}
# Vocabularies trained with every digit on its own, then GPT-2's regex (llama.cpp's STARCODER group).
ISOLATED_DIGIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")


def gguf_tokenizer(reader: GGUFReader, path: Path) -> Tokenizer:
    """The Tokenizer a GGUF file describes: vocabulary, special ids, BOS flag and chat template."""

    def meta(key, default=None):
        entry = reader.fields.get(f"tokenizer.{key}")
        return entry.contents() if entry is not None and entry.types else default

    kind = meta("ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise CheckpointError(path, f"unsupported GGUF tokenizer model {kind!r}; "
                                    f"supported: {', '.join(SUPPORTED_MODELS)}")
    tokens = meta("ggml.tokens")
    if not tokens:
        raise CheckpointError(path, "GGUF metadata has no tokenizer.ggml.tokens")
    types = meta("ggml.token_type") or [1] * len(tokens)
    added = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)}
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, added, meta("ggml.merges") or [], meta("ggml.pre", "default"))
        add_bos_default = False
    else:
        backend = _sentencepiece_bpe(tokens, added, meta("ggml.scores"), meta("ggml.unknown_token_id"),
                                     meta("ggml.add_space_prefix", True), path)
        add_bos_default = True
    backend.add_tokens([AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False) for i in sorted(added)])

    def token(key):
        token_id = meta(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos, eos = token("ggml.bos_token_id"), token("ggml.eos_token_id")
    backend.post_processor = bos_eos_processor(
        bos if meta("ggml.add_bos_token", add_bos_default) else None,
        eos if meta("ggml.add_eos_token", False) else None, backend)
    stop_ids = [meta(k) for k in ("ggml.eos_token_id", "ggml.eot_token_id", "ggml.eom_token_id")]
    return Tokenizer(backend, bos_token=bos, eos_token=eos, unk_token=token("ggml.unknown_token_id"),
                     pad_token=token("ggml.padding_token_id"), eos_token_ids=[i for i in stop_ids if i is not None],
                     chat_template=meta("chat_template"))


def _byte_level_bpe(tokens: list[str], added: set[int], merges: list[str], pre: str) -> Backend:
    """Byte-level BPE; a plain token written outside the byte alphabet is respelled into it."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, token in enumerate(tokens):
        if i not in added and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = i  # a repeated spelling maps to its last id, as in llama.cpp
    backend = Backend(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False))
    if pre in PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in ISOLATED_DIGIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:  # "gpt2", "default" and the rest: GPT-2's own regex, as transformers falls back to
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], added: set[int], scores: list[float] | None, unk_id: int | None,
                       add_space_prefix: bool, path: Path) -> Backend:
    """SentencePiece BPE with byte fallback; merges rebuilt from the token scores (best merge first)."""
    if scores is None or len(scores) != len(tokens):
        raise CheckpointError(path, "a SentencePiece GGUF vocabulary needs one tokenizer.ggml.scores entry per token")
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        ranked += [(score, left, right) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Backend(models.BPE(vocab, [(left, right) for _, left, right in ranked], unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return backend
