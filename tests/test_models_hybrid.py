"""Hybrid models (Qwen3.5 dense / MoE, Qwen3-Next) against transformers' own implementation, float32 on CPU.

Each tiny random config is built with transformers' config class, saved with save_pretrained and loaded back
through deltaserve's checkpoint reader; transformers' torch fallbacks (no fla on CPU) are the oracle.
"""

from __future__ import annotations

import json
import zlib
import logging

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from deltaserve.models import build_model, skip_prefixes
from deltaserve.models.batch import ForwardBatch, allocate_caches, single_sequence_batch
from deltaserve.weights import load_checkpoint
from deltaserve.models.decode_stack_path import step_logits
from tolerance import config_rtol

VOCAB = 160
GENERATE_TOKENS = 32

# Four language-model configs that differ in head counts, GQA ratios, layer patterns, rotary and sizes.
CONFIGS = {
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1], mrope_interleaved=True))),
    "qwen3_5_text_tied": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=6,
        head_dim=16, linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=16,
        linear_value_head_dim=32, linear_conv_kernel_dim=3, full_attention_interval=2, tie_word_embeddings=True)),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, dict(
        hidden_size=128, intermediate_size=64, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                     "full_attention", "linear_attention"],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=1.0),
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=40)),
}


def randomize_(model: torch.nn.Module) -> None:
    """Give norms and gates non-trivial values (they are initialised to 0 / 1, hiding x*w vs x*(1+w) bugs)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)


def save_tiny_tokenizer(folder) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))


def make_checkpoint(name: str, folder):
    config_cls, model_cls, kwargs = CONFIGS[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    config = config_cls(vocab_size=VOCAB, initializer_range=0.1, **kwargs)
    config._attn_implementation = "sdpa"
    ref = model_cls(config).eval()
    randomize_(ref)
    ref.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return ref


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, deltaserve model) with the same weights, loaded from a saved checkpoint."""
    folder = tmp_path_factory.mktemp(request.param)
    ref = make_checkpoint(request.param, folder)
    ckpt = load_checkpoint(folder, skip_prefixes=skip_prefixes(json.loads((folder / "config.json").read_text())))
    return ref, build_model(ckpt.config, ckpt.tensors)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_caches(model, kv_tokens: int, state_slots: int = 1):
    return allocate_caches(model.geometry, kv_tokens, state_slots, torch.float32)


def rtol(ref) -> float:
    """The tolerance of a logits comparison on this config, from float32 rounding (tests/tolerance.py): prompts here
    are at most 200 tokens long."""
    return config_rtol(ref.config, context=200)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    caches = fresh_caches(model, len(ids))
    with torch.inference_mode():
        return step_logits(model, single_sequence_batch(ids, 0, torch.arange(len(ids)), all_logits=True), caches)


def greedy(model, ids: list[int], steps: int) -> list[int]:
    """Our generation loop: one prefill, then single-token steps."""
    slots = torch.arange(len(ids) + steps)
    caches = fresh_caches(model, len(slots))
    out = []
    with torch.inference_mode():
        logits = step_logits(model, single_sequence_batch(ids, 0, slots), caches)
        for step in range(steps):
            out.append(int(logits[-1].argmax()))
            if step + 1 < steps:
                logits = step_logits(model, single_sequence_batch([out[-1]], len(ids) + step, slots), caches)
    return out


@pytest.mark.parametrize("length", [37, 101, 200])
def test_prefill_logits_match_transformers(pair, length, cpu_kernels):
    ref, ours = pair
    ids = prompt(length, seed=length)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert rel_error(prefill_logits(ours, ids), expected) <= rtol(ref)


def test_mlp_in_row_blocks_matches_transformers(pair, monkeypatch):
    """A long prompt's MLP runs MLP_ROW_BLOCK rows at a time; shrink the block so a short prompt takes that path."""
    import deltaserve.models.layers as layers

    monkeypatch.setattr(layers, "MLP_ROW_BLOCK", 16)
    ref, ours = pair
    ids = prompt(101, seed=3)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert rel_error(prefill_logits(ours, ids), expected) <= rtol(ref)


def test_greedy_generation_matches_transformers(pair, cpu_kernels):
    ref, ours = pair
    ids = prompt(37, seed=7)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert greedy(ours, ids, GENERATE_TOKENS) == expected


@pytest.mark.parametrize("splits", [(50,), (1, 64), (63, 64, 65)])
def test_chunked_prefill_equals_one_shot(pair, splits, cpu_kernels):
    """Reading a prompt in chunks carries both the GDN states and the KV cache across steps."""
    ref, ours = pair
    ids = prompt(101, seed=3)
    whole = prefill_logits(ours, ids)
    caches = fresh_caches(ours, len(ids))
    slots = torch.arange(len(ids))
    bounds = [0, *splits, len(ids)]
    parts = []
    with torch.inference_mode():
        for lo, hi in zip(bounds, bounds[1:]):
            batch = single_sequence_batch(ids[lo:hi], lo, slots, all_logits=True)
            parts.append(step_logits(ours, batch, caches))
    assert rel_error(torch.cat(parts), whole) <= rtol(ref)


def test_last_row_only_and_no_rows_equal_all_rows(pair):
    """Logits of the last row alone (the last layer runs for it only), or of no row, change nothing."""
    ref, ours = pair
    ids = prompt(90, seed=4)
    whole = prefill_logits(ours, ids)
    slots = torch.arange(len(ids))
    caches = fresh_caches(ours, len(ids))
    with torch.inference_mode():
        first = single_sequence_batch(ids[:60], 0, slots)
        first.logits_indices = torch.tensor([], dtype=torch.long)
        assert step_logits(ours, first, caches).shape == (0, VOCAB)
        last = step_logits(ours, single_sequence_batch(ids[60:], 60, slots), caches)
    assert rel_error(last[0], whole[-1]) <= rtol(ref)


def two_sequence_batch(decode_token: int, decode_pos: int, slots_a: torch.Tensor, prefill_ids: list[int],
                       slots_b: torch.Tensor) -> ForwardBatch:
    """One decode sequence (state slot 0) followed by one fresh prefill (state slot 1), built by hand."""
    n = len(prefill_ids)
    context = torch.zeros(2, max(decode_pos + 1, n), dtype=torch.long)
    context[0, : decode_pos + 1] = slots_a[: decode_pos + 1]
    context[1, :n] = slots_b[:n]
    return ForwardBatch(
        input_ids=torch.tensor([decode_token, *prefill_ids]),
        positions=torch.cat([torch.tensor([decode_pos]), torch.arange(n)]),
        q_lens=[1, n],
        cached_lens=[decode_pos, 0],
        num_decode=1,
        cu_q=torch.tensor([0, 1, 1 + n]),
        slot_mapping=torch.cat([slots_a[decode_pos: decode_pos + 1], slots_b[:n]]),
        context_slots=context,
        state_slots=torch.tensor([0, 1]),
        logits_indices=torch.tensor([0, n]),
    )


def test_decode_and_prefill_in_one_batch_equal_each_alone(pair):
    ref, ours = pair
    a, b = prompt(37, seed=11), prompt(20, seed=12)
    # Scattered KV slots, as pages of a shared pool would give them.
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    slots_a, slots_b = perm[:64], perm[64:]
    with torch.inference_mode():
        alone = fresh_caches(ours, 128, state_slots=2)
        next_a = int(step_logits(ours, single_sequence_batch(a, 0, slots_a), alone)[-1].argmax())
        expected_a = step_logits(ours, single_sequence_batch([next_a], len(a), slots_a), alone)[-1]
        expected_b = step_logits(ours, single_sequence_batch(b, 0, slots_b, state_slot=1), alone)[-1]

        mixed = fresh_caches(ours, 128, state_slots=2)
        step_logits(ours, single_sequence_batch(a, 0, slots_a), mixed)
        logits = ours(two_sequence_batch(next_a, len(a), slots_a, b, slots_b), mixed)
    assert rel_error(logits[0], expected_a) <= rtol(ref)
    assert rel_error(logits[1], expected_b) <= rtol(ref)
    for name in ("k", "v", "conv", "recurrent"):
        for got, want in zip(getattr(mixed, name), getattr(alone, name)):
            if got is not None:
                assert rel_error(got, want) <= rtol(ref), (name, rel_error(got, want))


def test_two_decodes_in_one_batch_equal_each_alone(pair):
    ref, ours = pair
    a, b = prompt(30, seed=21), prompt(45, seed=22)
    slots_a, slots_b = torch.arange(0, 64), torch.arange(64, 128)

    def prefilled():
        caches = fresh_caches(ours, 128, state_slots=2)
        ta = int(step_logits(ours, single_sequence_batch(a, 0, slots_a), caches)[-1].argmax())
        tb = int(step_logits(ours, single_sequence_batch(b, 0, slots_b, state_slot=1), caches)[-1].argmax())
        return caches, ta, tb

    with torch.inference_mode():
        caches, ta, tb = prefilled()
        alone_a = step_logits(ours, single_sequence_batch([ta], len(a), slots_a), caches)[-1]
        alone_b = step_logits(ours, single_sequence_batch([tb], len(b), slots_b, state_slot=1), caches)[-1]

        caches, ta, tb = prefilled()
        context = torch.zeros(2, len(b) + 1, dtype=torch.long)
        context[0, : len(a) + 1], context[1] = slots_a[: len(a) + 1], slots_b[: len(b) + 1]
        batch = ForwardBatch(
            input_ids=torch.tensor([ta, tb]), positions=torch.tensor([len(a), len(b)]), q_lens=[1, 1],
            cached_lens=[len(a), len(b)], num_decode=2, cu_q=torch.tensor([0, 1, 2]),
            slot_mapping=torch.stack([slots_a[len(a)], slots_b[len(b)]]), context_slots=context,
            state_slots=torch.tensor([0, 1]), logits_indices=torch.tensor([0, 1]))
        both = step_logits(ours, batch, caches)
    assert rel_error(both[0], alone_a) <= rtol(ref)
    assert rel_error(both[1], alone_b) <= rtol(ref)


def test_fused_expert_layout_and_mtp_tensors(tmp_path, caplog):
    """transformers' in-memory layout (experts fused as [E, 2I, H] / [E, H, I]) loads too; mtp.* is ignored."""
    ref = make_checkpoint("qwen3_5_moe_text", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = dict(ref.state_dict())
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    tensors["mtp.fc.weight"] = torch.zeros(8, 8)
    with caplog.at_level(logging.INFO, logger="deltaserve.models.hybrid"):
        ours = build_model(config, tensors)
    assert sum("multi-token-prediction" in r.getMessage() for r in caplog.records) == 1
    ids = prompt(37, seed=5)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert rel_error(prefill_logits(ours, ids), expected) <= rtol(ref)

    # A config that names its MTP head says so once at build time, even when the reader skipped mtp.* unread.
    caplog.clear()
    del tensors["mtp.fc.weight"]
    with caplog.at_level(logging.INFO, logger="deltaserve.models.hybrid"):
        build_model({**config, "mtp_num_hidden_layers": 1}, tensors)
    assert sum("multi-token-prediction" in r.getMessage() for r in caplog.records) == 1


class VisionReadGuard(dict):
    """A checkpoint mapping that fails the test if a vision-tower tensor is read."""

    def __getitem__(self, name):
        assert not name.startswith("model.visual."), f"read {name}"
        return super().__getitem__(name)


def test_multimodal_checkpoint_loads_language_model_only(tmp_path, caplog):
    text = dict(CONFIGS["qwen3_5_text"][2], vocab_size=VOCAB, initializer_range=0.1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=text, vision_config=vision)
    config._attn_implementation = "sdpa"
    ref = Qwen3_5ForConditionalGeneration(config).eval()
    randomize_(ref)
    ref.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)

    ckpt = load_checkpoint(tmp_path)  # everything, to prove the model skips the vision tower by itself
    assert any(k.startswith("model.visual.") for k in ckpt.tensors)
    with caplog.at_level(logging.INFO, logger="deltaserve.models.hybrid"):
        ours = build_model(ckpt.config, VisionReadGuard(ckpt.tensors))
    assert sum("vision" in r.getMessage() for r in caplog.records) == 1
    ids = prompt(101, seed=9)
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor([ids])).logits[0]
    assert rel_error(prefill_logits(ours, ids), expected) <= rtol(ref)

    # The engine's path: the reader skips the vision tower unread; the model still says so, once.
    caplog.clear()
    skipped = load_checkpoint(tmp_path, skip_prefixes=skip_prefixes(ckpt.config))
    assert not any(k.startswith("model.visual.") for k in skipped.tensors)
    with caplog.at_level(logging.INFO, logger="deltaserve.models.hybrid"):
        ours = build_model(skipped.config, skipped.tensors)
    assert sum("vision" in r.getMessage() for r in caplog.records) == 1
    assert rel_error(prefill_logits(ours, ids), expected) <= rtol(ref)
