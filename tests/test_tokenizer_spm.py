"""SentencePiece ("llama") GGUF vocabularies against transformers' GGUF tokenizer, on a small
vocabulary trained here and written with gguf.GGUFWriter."""

import gguf
import numpy as np
import pytest
from tokenizers import SentencePieceBPETokenizer

from deltaserve.text.tokenizer import IncrementalDetokenizer
from deltaserve.weights import read_tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there!",
          "naïve café 中文 tests", "  leading spaces and\ttabs\nnewlines"] * 20
TEXTS = ["The quick brown fox", "hello world", " leading", "naïve café 中文 😀", "a  b\n\tc", "<s>x</s>", ""]
TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS, vocab_size=300, min_frequency=2, show_progress=False)
    base = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    learned = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1]) if t not in base]
    tokens = base + learned
    folder = tmp_path_factory.mktemp("spm")
    writer = gguf.GGUFWriter(str(folder / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(base) + [-float(i) for i in range(len(learned))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(learned))  # unknown, control, byte, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(TEMPLATE)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(1)
    writer.add_context_length(16)
    writer.add_feed_forward_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="spm.gguf")
    return read_tokenizer(folder / "spm.gguf"), reference


@pytest.mark.parametrize("text", TEXTS)
def test_spm_ids_and_decode_equal_transformers(spm_pair, text):
    ours, reference = spm_pair
    ids = ours.encode(text)
    assert ids == reference.encode(text) and ids[0] == ours.bos_token_id  # llama adds BOS by default
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_spm_chat_has_one_bos(spm_pair):
    ours, reference = spm_pair
    messages = [{"role": "user", "content": "hello world"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                               add_generation_prompt=True)
    ids = ours.encode_chat(messages)
    assert ids[0] == ours.bos_token_id and ids[1] != ours.bos_token_id


def test_spm_streaming_keeps_spaces(spm_pair):
    ours, _ = spm_pair
    ids = ours.encode("hello world naïve 中文 😀", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(ours)
    pieces = [detokenizer.push(i) for i in ids]
    assert "".join(pieces) + detokenizer.flush() == ours.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert b"".join(ours.token_bytes(i) for i in ids) == " hello world naïve 中文 😀".encode()
