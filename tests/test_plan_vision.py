"""The vision tower in the ledger: its weights as their own line, its workspace for the largest allowed image, and
what --language-model-only buys in tokens of context (the field's 27B W4A16 config, tests/data)."""

from __future__ import annotations

import json
from pathlib import Path

from deltaserve.budget import option_costs, plan_budget, spec_from_config
from deltaserve.config import EngineConfig, GiB
from deltaserve.plan import main

FIXTURE = Path(__file__).parent / "data" / "qwen3_5_27b_w4a16" / "config.json"
CARD = 24 * GiB


def spec27():
    return spec_from_config(json.loads(FIXTURE.read_text()), embed_quant="int8", lm_head_quant="int4")


def plan(**settings):
    return plan_budget(spec27(), EngineConfig(device="cuda", **settings), device_total_bytes=CARD,
                       device_kind="cuda")


def test_tower_weights_and_workspace_are_lines_of_their_own():
    spec = spec27()
    vision = next(g for g in spec.weight_groups if g.name == "vision")
    budget = plan()
    assert budget.line("vision_weights").bytes == vision.params * 2  # bfloat16 on CUDA
    assert 400e6 < vision.params < 500e6  # the 27B's tower: 27 blocks of width 1152
    # the language model's own line does not count the tower twice
    assert budget.line("weights").bytes == plan(language_model_only=True).line("weights").bytes
    assert sum(line.bytes for line in budget.lines) == budget.device_total_bytes
    small = plan(max_image_pixels=256 * 256).line("vision_workspace").bytes
    assert 0 < small < budget.line("vision_workspace").bytes  # the workspace follows the largest allowed image


def test_language_model_only_gives_the_tower_back_as_context():
    with_images, text_only = plan(), plan(language_model_only=True)
    assert text_only.line("vision_weights").bytes == text_only.line("vision_workspace").bytes == 0
    freed = with_images.line("vision_weights").bytes + with_images.line("vision_workspace").bytes
    gained = text_only.kv_tokens - with_images.kv_tokens
    assert gained == (text_only.kv_pages - with_images.kv_pages) * 16
    assert abs(gained * with_images.kv_bytes_per_token - freed) < 16 * with_images.kv_bytes_per_token
    costs = {c.option: c for c in option_costs(spec27(), EngineConfig(device="cuda"), CARD, device_kind="cuda")}
    assert costs["--language-model-only"].delta_kv_tokens == gained > 10_000


def test_plan_prints_what_language_model_only_buys(capsys):
    assert main(["--model", str(FIXTURE), "--device", "24GiB", "--embed-quant", "int8", "--lm-head-quant",
                 "int4"]) == 0
    out = capsys.readouterr().out
    assert "vision_weights" in out and "vision_workspace" in out
    row = next(line for line in out.splitlines() if line.startswith("--language-model-only"))
    assert int(row.split()[1].replace(",", "").replace("+", "")) > 10_000


def test_a_config_without_a_tower_has_empty_vision_lines():
    config = json.loads(FIXTURE.read_text())
    text = {**config["text_config"], "model_type": "qwen3_5_text"}
    spec = spec_from_config(text)
    budget = plan_budget(spec, EngineConfig(device="cuda"), device_total_bytes=8 * CARD, device_kind="cuda")
    assert spec.vision is None
    assert budget.line("vision_weights").bytes == budget.line("vision_workspace").bytes == 0
