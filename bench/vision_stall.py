"""How long an image stalls the step loop: the vision tower encodes one image between two steps, so the decode of
the other requests waits for one image's encode. Compared here, in one run, with what a prefill chunk of the
language model costs, on the field's 27B (tests/data/qwen3_5_27b_w4a16/config.json).

The tower (real widths, random weights, float32) is timed on this machine for each image size; the language model's
chunk is priced from the same machine's measured matmul rate (the 27B does not fit a CPU run of the chunk itself):
2 x active parameters x chunk tokens, the attention over the chunk left out (it only adds to the chunk's side).

    OMP_NUM_THREADS=2 .venv/bin/python bench/vision_stall.py --pixels 65536,262144 --chunk 512
"""

import argparse
import json
import time
from pathlib import Path

import torch

import results

from deltaserve.budget import spec_from_config
from deltaserve.models.vision import ImageGrid, VisionTower

CONFIG = Path(__file__).parent.parent / "tests" / "data" / "qwen3_5_27b_w4a16" / "config.json"


def random_tower(vision: dict) -> VisionTower:
    tower = VisionTower(vision)
    for module in tower.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.randn(p.shape) * 0.02, requires_grad=False))
    return tower.eval()


def tower_flops(vision: dict, patches: int) -> float:
    h, i, depth, m = vision["hidden_size"], vision["intermediate_size"], vision["depth"], vision["spatial_merge_size"]
    pixels = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    per_patch = 2 * (pixels * h + depth * (4 * h * h + 2 * h * i) + (h * m * m) ** 2 / (m * m))
    return patches * per_patch + depth * 4 * patches * patches * h  # + attention within the image


def matmul_rate() -> float:
    """FLOP/s of a float32 [512, 5120] x [5120, 5120] product on this machine, best of 3."""
    a, b = torch.randn(512, 5120), torch.randn(5120, 5120)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 512 * 5120 * 5120 / best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pixels", default="65536,262144", help="image areas to time (the resize budget)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (512 CPU, 2048 GPU)")
    args = parser.parse_args()
    run = results.Run("vision_stall", "How long one image's vision tower stalls the other requests (the 27B's tower)")
    rows = []
    config = json.loads(CONFIG.read_text())
    vision = config["vision_config"]
    spec = spec_from_config(config, embed_quant="int8", lm_head_quant="int4")
    lm_params = sum(g.params for g in spec.weight_groups if not g.excluded and g.name != "embedding")
    tower = random_tower(vision)
    rate = matmul_rate()
    chunk_s = 2 * lm_params * args.chunk / rate
    side = vision["patch_size"] * vision["spatial_merge_size"]
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s; a {args.chunk}-token chunk of the 27B "
          f"({lm_params / 1e9:.1f}B parameters past the embedding): {chunk_s:.1f} s at that rate")
    print(f"{'pixels':>10} {'tokens':>7} {'encode s':>9} {'tower GFLOP':>12} {'chunk GFLOP':>12} {'stall / chunk':>14}")
    for pixels in (int(p) for p in args.pixels.split(",")):
        grid_side = int((pixels // (side * side)) ** 0.5) * vision["spatial_merge_size"]
        grid = ImageGrid(1, grid_side, grid_side)
        patches = torch.randn(grid.patches, 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2)
        with torch.inference_mode():
            start = time.perf_counter()
            tower(patches, [grid])
            encode_s = time.perf_counter() - start
        tflops = tower_flops(vision, grid.patches)
        print(f"{grid.patches * vision['patch_size'] ** 2:>10,} {grid.tokens(vision['spatial_merge_size']):>7,} "
              f"{encode_s:>9.2f} {tflops / 1e9:>12,.0f} {2 * lm_params * args.chunk / 1e9:>12,.0f} "
              f"{encode_s / chunk_s:>14.2f}")
        rows.append([grid.patches * vision["patch_size"] ** 2, grid.tokens(vision["spatial_merge_size"]),
                     round(encode_s, 2), round(tflops / 1e9), round(2 * lm_params * args.chunk / 1e9),
                     round(encode_s / chunk_s, 2)])
    run.table(f"matmul rate {rate / 1e9:.1f} GFLOP/s; a {args.chunk}-token chunk of the 27B: {chunk_s:.1f} s",
              ["pixels", "image tokens", "encode s", "tower GFLOP", "chunk GFLOP", "stall / chunk"], rows)
    run.save()


if __name__ == "__main__":
    main()
