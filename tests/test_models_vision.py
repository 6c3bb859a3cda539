"""The Qwen3.5 vision tower and the multimodal model against transformers' Qwen3_5ForConditionalGeneration.

A tiny random multimodal config is built with transformers' config classes and saved with save_pretrained; our
tower and whole model load it through deltaserve's checkpoint reader. Images go through transformers' own image
processor (Qwen2VLImageProcessorPil, what the Qwen3.5 checkpoints name) for the oracle, and through ours
(deltaserve/images.py) for us: the two must agree on the pixels too.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from deltaserve.images import preprocess
from deltaserve.models import build_model, skip_prefixes
from deltaserve.models.batch import allocate_caches, single_sequence_batch
from deltaserve.models.vision import ImageGrid, VisionTower, mrope_positions, vision_tensors
from deltaserve.weights import load_checkpoint
from tolerance import LAMBDA, UNIT_ROUNDOFF, logits_rtol
from vision_support import (IMAGE, LIMITS, MERGE, PATCH, VISION, image_prompt, make_multimodal_checkpoint,
                            oracle_inputs, oracle_processor, picture, png)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_vl")
    ref = make_multimodal_checkpoint(folder)
    return folder, ref


def tower_rtol(vision: dict, patches: int) -> float:
    """tests/tolerance.py's bound for the tower: depth blocks, each reducing over at most the widest of hidden,
    intermediate, the patch's pixels, the merged width and the image's patches."""
    widths = [vision["hidden_size"], vision["intermediate_size"], 3 * 2 * PATCH * PATCH,
              vision["hidden_size"] * MERGE * MERGE, patches]
    return 2 * 3 * (vision["depth"] + 1) * LAMBDA * max(widths) ** 0.5 * UNIT_ROUNDOFF


@pytest.mark.parametrize("size", [(40, 24), (61, 97)])
def test_preprocessing_equals_transformers(size):
    image = picture(*size, seed=size[0])
    ref = oracle_processor()(images=[image], return_tensors="pt")
    ours = preprocess(png(image), LIMITS, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2)
    assert list(ours.grid.__dict__.values()) == ref["image_grid_thw"][0].tolist()
    assert torch.equal(ours.patches, ref["pixel_values"].float())


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_preprocessing_other_modes_equals_transformers(mode):
    image = picture(33, 20, seed=3, mode="RGBA" if mode == "RGBA" else "L")
    if mode == "P":
        image = image.convert("RGB").convert("P")
    ref = oracle_processor()(images=[image], return_tensors="pt")
    ours = preprocess(png(image), LIMITS, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2)
    assert torch.equal(ours.patches, ref["pixel_values"].float())


@pytest.mark.parametrize("sizes", [[(40, 24)], [(61, 97)], [(40, 24), (97, 61)]])
def test_tower_equals_transformers(checkpoint, sizes):
    folder, ref = checkpoint
    ckpt = load_checkpoint(folder)
    tower = VisionTower(ckpt.config["vision_config"])
    from deltaserve.models.layers import load_weights
    load_weights(tower, vision_tensors(ckpt.tensors), dtype=torch.float32, device="cpu", name="vision")
    images = [picture(w, h, seed=w) for w, h in sizes]
    inputs = oracle_processor()(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = ref.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        grids = [ImageGrid(*g) for g in inputs["image_grid_thw"].tolist()]
        got = tower(inputs["pixel_values"], grids)
    assert got.shape == expected.shape
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err <= tower_rtol(VISION, max(g.patches for g in grids))


def model_rtol(ref, context: int) -> float:
    """tests/tolerance.py's bound over the tower's blocks and the language model's layers together."""
    text = ref.config.text_config
    widths = [text.hidden_size, text.intermediate_size, context, 64 * text.linear_key_head_dim,
              VISION["intermediate_size"], VISION["hidden_size"] * MERGE * MERGE, 3 * 2 * PATCH * PATCH]
    return logits_rtol(text.num_hidden_layers + VISION["depth"] + 1, max(widths))


@pytest.fixture(scope="module")
def pair(checkpoint):
    folder, ref = checkpoint
    config = json.loads((folder / "config.json").read_text())
    ckpt = load_checkpoint(folder, skip_prefixes=skip_prefixes(config, vision=True))
    return ref, build_model(ckpt.config, ckpt.tensors, vision=True)


def encoded(ours, images: list[Image.Image]):
    prepared = [preprocess(png(i), LIMITS, patch_size=PATCH, merge_size=MERGE) for i in images]
    grids = [p.grid for p in prepared]
    with torch.inference_mode():
        embeds = ours.encode_images(torch.cat([p.patches for p in prepared]), grids)
    return grids, embeds


IMAGE_SETS = {"one": [(40, 24)], "other_size": [(61, 97)], "two": [(40, 24), (97, 61)]}


@pytest.mark.parametrize("which", list(IMAGE_SETS))
def test_logits_with_images_equal_transformers(pair, which, cpu_kernels):
    ref, ours = pair
    images = [picture(w, h, seed=w) for w, h in IMAGE_SETS[which]]
    grids, embeds = encoded(ours, images)
    ids = image_prompt(grids, seed=len(which))
    with torch.no_grad():
        expected = ref(**oracle_inputs(ids, images)).logits[0]
    rope, _ = mrope_positions(ids, grids, IMAGE, MERGE)
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE])
    caches = allocate_caches(ours.geometry, len(ids), 1, torch.float32)
    with torch.inference_mode():
        got = ours(single_sequence_batch(ids, 0, torch.arange(len(ids)), all_logits=True, image_rows=rows,
                                         image_embeds=embeds, rope_positions=rope), caches)
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err <= model_rtol(ref, len(ids)), err
    # the image and its 2D positions change the answer: a model that ignored either would fail the bound above
    caches = allocate_caches(ours.geometry, len(ids), 1, torch.float32)
    with torch.inference_mode():
        flat = ours(single_sequence_batch(ids, 0, torch.arange(len(ids)), all_logits=True, image_rows=rows,
                                          image_embeds=embeds), caches)
    assert ((flat - expected).abs().max() / expected.abs().max()).item() > 10 * model_rtol(ref, len(ids))
    with torch.no_grad():
        blind = ref(input_ids=torch.tensor([ids])).logits[0]
    assert ((blind - expected).abs().max() / expected.abs().max()).item() > 100 * model_rtol(ref, len(ids))


@pytest.mark.parametrize("which", ["one", "two"])
def test_greedy_with_images_equals_transformers(pair, which):
    ref, ours = pair
    steps = 24
    images = [picture(w, h, seed=w + 1) for w, h in IMAGE_SETS[which]]
    grids, embeds = encoded(ours, images)
    ids = image_prompt(grids, seed=7)
    with torch.no_grad():
        expected = ref.generate(**oracle_inputs(ids, images), max_new_tokens=steps, do_sample=False,
                                min_new_tokens=steps)[0, len(ids):].tolist()
    rope, delta = mrope_positions(ids, grids, IMAGE, MERGE)
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE])
    slots = torch.arange(len(ids) + steps)
    caches = allocate_caches(ours.geometry, len(slots), 1, torch.float32)
    out = []
    with torch.inference_mode():
        logits = ours(single_sequence_batch(ids, 0, slots, image_rows=rows, image_embeds=embeds,
                                            rope_positions=rope), caches)
        for step in range(steps):
            out.append(int(logits[-1].argmax()))
            index = len(ids) + step
            logits = ours(single_sequence_batch([out[-1]], index, slots,
                                                rope_positions=torch.full((3, 1), index + delta)), caches)
    assert out == expected
