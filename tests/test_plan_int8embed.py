"""`deltaserve plan` on the field's 27B W4A16 config whose own quantization_config names an INT8 embedding and an
INT4 lm_head (tests/data/qwen3_5_27b_w4a16_int8embed): no --embed-quant / --lm-head-quant flags needed."""

import json
import subprocess
import sys
from pathlib import Path

from deltaserve.budget import spec_from_config

DATA = Path(__file__).parent / "data"
FIELD = DATA / "qwen3_5_27b_w4a16_int8embed" / "config.json"
FLAGS = DATA / "qwen3_5_27b_w4a16" / "config.json"


def test_config_groups_price_the_embedding_int8_and_lm_head_int4():
    config = json.loads(FIELD.read_text())
    text = config["text_config"]
    spec = spec_from_config(config)
    groups = {g.name: g for g in spec.weight_groups}
    vocab, hidden = text["vocab_size"], text["hidden_size"]
    # On disk: int8 per channel, one byte a weight, one fp16 scale a row, the int64[2] weight_shape; held int8 with
    # a float32 scale a row and no offset (symmetric: models/layers.Int8Embedding), with --dequantize-weights too.
    assert groups["embedding"].stored_bytes == vocab * hidden + vocab * 2 + 16
    assert groups["embedding"].quantized_bytes == groups["embedding"].held_dequantized_bytes == vocab * hidden + vocab * 4
    # On disk: int4 group 128, half a byte a weight, one fp16 scale per 128; held packed with a float32 scale and
    # offset per 128 (kernels/int4.held_bytes): 6 bytes a group more than on disk.
    assert groups["lm_head"].stored_bytes == vocab * hidden // 2 + vocab * hidden // 128 * 2 + 16
    # held packed at the checkpoint's size less weight_shape: symmetric, the bf16 scale kept, no offset
    assert groups["lm_head"].quantized_bytes == vocab * hidden // 2 + vocab * hidden // 128 * 2
    # The same bytes as the flags give on the config without those groups.
    flagged = spec_from_config(json.loads(FLAGS.read_text()), embed_quant="int8", lm_head_quant="int4")
    assert [(g.name, g.stored_bytes) for g in spec.weight_groups] == \
           [(g.name, g.stored_bytes) for g in flagged.weight_groups]
    # Field notes: 15.81 GB on disk, vision tower and MTP head included.
    assert abs(sum(g.stored_bytes for g in spec.weight_groups) / 1e9 - 15.81) < 0.8


def test_plan_cli_shows_the_schemes_and_the_context():
    done = subprocess.run([sys.executable, "-m", "deltaserve.cli", "plan", "--model", str(FIELD), "--device", "24GiB",
                           "--mem-fraction", "0.92", "--kv-dtype", "fp8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "embedding w8a16-channel; lm_head w4a16-g128" in done.stdout
    weights = next(line for line in done.stdout.splitlines() if line.startswith("weights "))
    expected = sum(g.stored_bytes for g in spec_from_config(json.loads(FIELD.read_text())).weight_groups
                   if not g.excluded)
    assert f"{round(expected / 2**20):,} MiB in the checkpoint" in weights
    assert "largest context of one request:" in done.stdout
