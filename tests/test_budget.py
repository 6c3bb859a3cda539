"""The ledger: whole-device accounting, determinism, exact pools, refusals with fixes that work, option costs."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from deltaserve.budget import BudgetError, measure_vs_predicted, option_costs, plan_budget, spec_from_config
from deltaserve.config import EngineConfig, GiB, MiB

FIXTURE = Path(__file__).parent / "data" / "qwen3_5_27b_w4a16" / "config.json"
CARD = 24 * GiB


@pytest.fixture(scope="module")
def spec27():
    """The field notes' model: W4A16, INT8 embedding, INT4 lm_head."""
    return spec_from_config(json.loads(FIXTURE.read_text()), embed_quant="int8", lm_head_quant="int4")


def tiny_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                             linear_conv_kernel_dim=4, max_position_embeddings=512)


def plan(spec, **settings):
    """The ledger of the language model (the vision tower's lines: test_plan_vision.py)."""
    kind = settings.pop("kind", "cuda")
    free = settings.pop("free", None)
    settings.setdefault("language_model_only", True)
    return plan_budget(spec, EngineConfig(**settings), device_total_bytes=settings.get("device_memory") or CARD,
                       device_kind=kind, device_free_bytes=free)


def test_lines_cover_the_whole_device(spec27):
    cpu = plan(spec27, kind="cpu", device_memory=256 * GiB, context_length=32_768)  # held dequantized: ~100 GiB
    for budget in (plan(spec27), plan(spec27, max_total_tokens=40_000), cpu):
        assert sum(line.bytes for line in budget.lines) == budget.device_total_bytes
        assert all(line.bytes >= 0 and line.reason for line in budget.lines)
        names = [line.name for line in budget.lines]
        for name in ("weights", "kv_pool", "state_pool", "prefill_activations", "gdn_workspace",
                     "attention_workspace", "sampler", "headroom", "free"):
            assert name in names


def test_usable_is_fraction_of_total_minus_headroom(spec27):
    budget = plan(spec27, mem_fraction=0.91, headroom=3 * 2**29)
    assert budget.usable_bytes == int(0.91 * CARD) - 3 * 2**29
    consumers = sum(line.bytes for line in budget.lines if line.name not in ("headroom", "outside_fraction"))
    assert consumers == budget.usable_bytes


def test_ledger_ignores_what_happens_to_be_free(spec27):
    # Incident 2: the pool was 70,045 one boot and 73,898 the next. Here free memory only gates the start.
    first = plan(spec27)
    again = [plan(spec27, free=first.required_bytes + extra).to_json() for extra in (0, 700 * MiB, 3 * GiB)]
    assert all(j == first.to_json() for j in again)


def test_max_total_tokens_is_exact_and_the_rest_is_free(spec27):
    loose = plan(spec27)
    budget = plan(spec27, max_total_tokens=40_000)  # a whole number of 16-token pages: granted exactly
    assert budget.kv_tokens == 40_000 and budget.kv_pages == 40_000 // 16
    assert not any("rounded" in note for note in budget.notes)
    assert budget.line("kv_pool").bytes == budget.kv_tokens * budget.kv_bytes_per_token
    freed = loose.line("kv_pool").bytes - budget.line("kv_pool").bytes
    assert budget.line("free").bytes == loose.line("free").bytes + freed > 0


def test_max_total_tokens_rounds_down_to_whole_pages_and_says_so(spec27):
    # 674 gave a 688-token pool: more than asked. Now 674 // 16 = 42 whole pages, and the ledger says so.
    budget = plan(spec27, max_total_tokens=674)
    assert (budget.kv_pages, budget.kv_tokens) == (674 // 16, 674 // 16 * 16)
    served = budget.to_json()  # what GET /v1/budget answers: requested vs granted
    assert served["settings"]["max_total_tokens"] == 674 and served["kv_tokens"] == 672
    assert any("--max-total-tokens 674 rounded down to 672" in note for note in served["notes"])


def test_free_memory_short_refuses_with_two_fixes_that_work(spec27):
    budget = plan(spec27)
    free = budget.required_bytes - 300 * MiB
    with pytest.raises(BudgetError) as err:
        plan(spec27, free=free)
    message = str(err.value)
    assert "short by 300 MiB" in message and "\n" not in message
    fixes = re.findall(r"(--[a-z-]+)(?: to)? ([0-9]+(?:\.[0-9]+)?)", message.split("Fix:")[1])
    assert len(fixes) == 2
    for flag, value in fixes:  # each fix, applied alone, starts with that much free memory
        setting = flag[2:].replace("-", "_")
        fixed = plan(spec27, free=free, **{setting: type(getattr(EngineConfig(), setting) or 0.0)(value)
                                            if setting == "mem_fraction" else int(value)})
        assert fixed.required_bytes <= free


def test_pool_too_big_refuses_with_fixes_that_work(spec27):
    with pytest.raises(BudgetError) as err:
        plan(spec27, max_total_tokens=400_000)
    message = str(err.value)
    assert re.search(r"--max-total-tokens 400000 needs [\d,]+ MiB of KV", message) and "short by" in message
    tokens = int(re.search(r"--max-total-tokens (\d+)", message.split("Fix:")[1]).group(1))
    assert plan(spec27, max_total_tokens=tokens).kv_tokens >= tokens
    with pytest.raises(BudgetError):
        plan(spec27, max_total_tokens=tokens + 2_000)


def test_context_longer_than_the_pool_is_refused_but_the_models_own_is_capped(spec27):
    assert plan(spec27).max_context_tokens == plan(spec27).kv_tokens < 262_144
    with pytest.raises(BudgetError, match=r"--context-length 200000 is longer than the KV pool"):
        plan(spec27, context_length=200_000)
    with pytest.raises(BudgetError, match="lines before the KV pool"):
        plan(spec27, mem_fraction=0.5)


def test_cpu_pool_stops_at_what_could_ever_be_reserved(spec27):
    budget = plan(spec27, kind="cpu", device_memory=4096 * GiB, context_length=8192, max_running_requests=2)
    assert budget.kv_tokens == 2 * 8192
    assert "never be reserved" in budget.line("free").reason


def test_pool_lines_match_transformers_cache_and_torch_allocations():
    """KV bytes/token and GDN state bytes against transformers' own cache, then pools allocated with torch."""
    from transformers import Qwen3_5ForCausalLM

    cfg = tiny_config()
    spec = spec_from_config(cfg.to_dict())
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).eval()
    seq = 10
    with torch.no_grad():
        cache = model(torch.arange(seq)[None], use_cache=True).past_key_values
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if hasattr(layer, "keys"))
    assert spec.kv_bytes_per_token("float32") == kv // seq
    recurrent = sum(layer.recurrent_states[0].nbytes for layer in cache.layers if hasattr(layer, "recurrent_states"))
    convs = [layer.conv_states[0] for layer in cache.layers if hasattr(layer, "conv_states")]
    assert all(c.shape[1] == spec.gdn_conv_dim and c.shape[2] == spec.gdn_conv_kernel for c in convs)
    conv_kept = sum(c[..., 1:].numel() * c.element_size() for c in convs)  # we keep W - 1 inputs, not W
    assert spec.state_bytes_per_slot("float32") == recurrent + conv_kept

    budget = plan_budget(spec, EngineConfig(max_total_tokens=1000, max_running_requests=3, kv_dtype="float32"),
                         device_total_bytes=4 * GiB, device_kind="cpu")
    k = [torch.zeros(budget.kv_tokens, spec.num_kv_heads, spec.head_dim) for _ in range(2 * spec.attention_layers)]
    conv = [torch.zeros(budget.state_slots, spec.gdn_conv_dim, spec.gdn_conv_kernel - 1)
            for _ in range(spec.gdn_layers)]
    rec = [torch.zeros(budget.state_slots, spec.gdn_num_v_heads, spec.gdn_key_head_dim, spec.gdn_value_head_dim)
           for _ in range(spec.gdn_layers)]
    weights = sum(p.nbytes for p in model.parameters())
    checks = measure_vs_predicted(budget, {"kv_pool": sum(t.nbytes for t in k),
                                           "state_pool": sum(t.nbytes for t in conv + rec), "weights": weights})
    for check in checks:
        assert abs(check.ratio - 1) <= 0.02, str(check)


def test_field_mem_fraction_cost(spec27):
    # Incident 5: "each 0.03 of mem-fraction costs 23,568 tokens" on a 24 GB card at ~32 KB/token (fp8 KV).
    low, high = plan(spec27, mem_fraction=0.89, kv_dtype="fp8"), plan(spec27, mem_fraction=0.92, kv_dtype="fp8")
    assert high.kv_bytes_per_token == 32 * 1024
    assert abs((high.kv_tokens - low.kv_tokens) - 23_568) / 23_568 < 0.005


def test_gdn_state_is_tens_of_megabytes_and_fixed(spec27):
    per_request = plan(spec27).state_bytes_per_slot
    assert 10 * 10**6 < per_request < 100 * 10**6
    assert per_request / plan(spec27).kv_bytes_per_token > 1000  # a byte is worth >1000x more as KV per token


def test_option_costs_agree_with_replanning(spec27):
    config = EngineConfig(language_model_only=True)
    costs = {c.option: c for c in option_costs(spec27, config, CARD, device_kind="cuda")}
    base = plan(spec27).kv_tokens
    assert costs["--mem-fraction 0.91"].delta_kv_tokens == plan(spec27, mem_fraction=0.91).kv_tokens - base
    assert costs["--mem-fraction 0.89"].delta_kv_tokens == plan(spec27, mem_fraction=0.89).kv_tokens - base
    fp32 = costs["--state-dtype float32"]
    assert fp32.delta_kv_tokens == plan(spec27, state_dtype="float32").kv_tokens - base < 0
    assert costs["--max-running-requests 17"].delta_kv_tokens == plan(spec27, max_running_requests=17).kv_tokens - base
    host = next(c for name, c in costs.items() if name.startswith("host prefix tier"))
    assert host.delta_kv_tokens == 0 and "GDN state for only" in host.note
    int8 = next(c for name, c in costs.items() if name.startswith("INT8"))
    assert int8.delta_kv_tokens < 0 and "on top" in int8.note
    slots = config.checkpoint_slots
    more = costs[f"--checkpoint-slots {2 * slots}"]
    assert more.delta_kv_tokens == plan(spec27, checkpoint_slots=2 * slots).kv_tokens - base < 0
    one = plan(spec27).state_bytes_per_slot / plan(spec27).kv_bytes_per_token  # one checkpoint, in KV tokens
    assert -more.delta_kv_tokens == pytest.approx(slots * one, abs=16) and f"{one:,.0f} KV tokens each" in more.note
    assert costs["--no-prefix-cache"].delta_kv_tokens == plan(spec27, prefix_cache=False).kv_tokens - base > 0


def test_table_and_json(spec27):
    budget = plan(spec27)
    table = budget.to_table()
    for line in budget.lines:
        assert line.name in table and line.reason in table
    data = json.loads(json.dumps(budget.to_json()))
    assert data == budget.to_json() and data["kv_tokens"] == budget.kv_tokens
    assert [line["name"] for line in data["lines"]] == [line.name for line in budget.lines]
    assert dataclasses.asdict(budget.line("kv_pool")) in data["lines"]


def test_cpu_attention_workspace_is_one_gathered_context_not_a_chunk_of_scores(spec27):
    """On CPU prefill attention scores a chunk in tiles (kernels/prefill_cpu.py, or torch's flash kernel): the line is
    one sequence's gathered K,V (float16 cache and its float32 copy) and a decode row of scores per head, not the
    [chunk x context] masked score matrix (15,488 MiB at the 27B's 262K context, which refused it on 24 GiB)."""
    context = 262_144
    cpu = plan(spec27, kind="cpu", device_memory=256 * GiB, context_length=context)
    row = spec27.num_kv_heads * spec27.head_dim * 2 * (4 + 2) + spec27.num_attention_heads * 4
    assert cpu.line("attention_workspace").bytes == context * row  # 3,096 MiB for the 27B
    cuda = plan(spec27, device_memory=256 * GiB, context_length=context, attention_backend="portable")
    assert cuda.line("attention_workspace").bytes > 4 * cpu.line("attention_workspace").bytes  # the portable path
