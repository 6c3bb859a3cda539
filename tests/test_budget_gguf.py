"""The built-in SmolLM2 GGUF: exact bytes from its tensor infos, and the CPU ledger's weights vs transformers."""

import gguf
import pytest
import torch

from deltaserve.budget import default_model_path, measure_vs_predicted, plan_budget, spec_from_checkpoint
from deltaserve.config import EngineConfig, GiB


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    return path, spec_from_checkpoint(path), gguf.GGUFReader(str(path))


def test_weight_bytes_are_the_files_tensor_bytes(smollm2):
    _, spec, reader = smollm2
    assert spec.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(g.params for g in spec.weight_groups) == sum(int(t.n_elements) for t in reader.tensors)
    assert spec.weight_source == "checkpoint headers"


def test_config_synthesized_from_metadata(smollm2):
    _, spec, reader = smollm2

    def meta(key):
        return reader.fields[key].contents()

    assert spec.model_type == "llama" and spec.gdn_layers == 0
    assert (spec.num_layers, spec.hidden_size) == (meta("llama.block_count"), meta("llama.embedding_length"))
    assert (spec.num_attention_heads, spec.num_kv_heads) == (meta("llama.attention.head_count"),
                                                             meta("llama.attention.head_count_kv"))
    assert spec.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    assert spec.max_position_embeddings == meta("llama.context_length")
    assert spec.tie_word_embeddings and "lm_head" not in [g.name for g in spec.weight_groups]


def test_cpu_weights_line_matches_transformers_fp32_load(smollm2):
    """--dequantize-weights holds the GGUF dequantized in float32: the ledger must predict that."""
    from transformers import AutoModelForCausalLM

    path, spec, _ = smollm2
    budget = plan_budget(spec, EngineConfig(max_total_tokens=4096, dequantize_weights=True),
                         device_total_bytes=8 * GiB, device_kind="cpu")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    loaded = sum(p.nbytes for p in model.parameters())  # tied: the embedding is counted once
    (check,) = measure_vs_predicted(budget, {"weights": loaded})
    assert abs(check.ratio - 1) <= 0.02, str(check)
    assert budget.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2  # the CPU default cache is float16


def test_cpu_weights_line_with_packed_int4_matches_what_the_model_holds(smollm2):
    """The CPU default: Q4_1 matrices held packed (4-bit codes + the block's float16 scale and offset per 32), the
    Q8_0 vocabulary 8-bit (a byte per weight + a float32 scale and offset per 32, shared by the tied lm_head), the
    rest as float32."""
    from deltaserve.engine.loader import load_model

    path, spec, _ = smollm2
    config = EngineConfig(max_total_tokens=4096, dequantize_weights=False)
    assert EngineConfig(max_total_tokens=4096).for_device("cpu").dequantize_weights is False
    budget = plan_budget(spec, config, device_total_bytes=8 * GiB, device_kind="cpu")
    model = load_model(path, dequantize=False).model
    held = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}  # rotary frequencies are not persistent
    (check,) = measure_vs_predicted(budget, {"weights": sum(held.values())})
    assert abs(check.ratio - 1) <= 0.02, str(check)
    assert budget.line("weights").bytes < 0.4 * plan_budget(spec, EngineConfig(max_total_tokens=4096,
                                                                           dequantize_weights=True),
                                                             device_total_bytes=8 * GiB,
                                                             device_kind="cpu").line("weights").bytes


def test_hybrid_gguf_metadata(tmp_path):
    """A qwen35 GGUF written with gguf's own writer: llama.cpp's ssm.* keys map to the GDN dimensions."""
    import numpy as np

    path = tmp_path / "tiny-qwen35.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_block_count(4)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_context_length(512)
    writer.add_vocab_size(320)
    writer.add_ssm_conv_kernel(4)
    writer.add_ssm_state_size(8)  # key head dim
    writer.add_ssm_group_count(2)  # key heads
    writer.add_ssm_time_step_rank(4)  # value heads
    writer.add_ssm_inner_size(48)  # value heads x value head dim
    writer.add_full_attention_interval(4)
    writer.add_tensor("token_embd.weight", np.zeros((320, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ssm_out.weight", np.zeros((64, 48), dtype=np.float16))
    writer.add_tensor("output.weight", np.zeros((320, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    spec = spec_from_checkpoint(path)
    assert (spec.model_type, spec.attention_layers, spec.gdn_layers) == ("qwen3_5_text", 1, 3)
    assert (spec.gdn_num_v_heads, spec.gdn_key_head_dim, spec.gdn_value_head_dim) == (4, 8, 12)
    assert spec.gdn_conv_dim == 2 * 2 * 8 + 48 and spec.gdn_conv_kernel == 4
    assert spec.weight_bytes == 320 * 64 * 4 + 64 * 48 * 2 + 320 * 64 * 2 and not spec.tie_word_embeddings
