"""The Qwen3.5 vision tower and the multimodal model against transformers' Qwen3_5ForConditionalGeneration.

A tiny random multimodal config is built with transformers' config classes and saved with save_pretrained; our
tower and whole model load it through deltaserve's checkpoint reader. Images go through transformers' own image
processor (Qwen2VLImageProcessorPil, what the Qwen3.5 checkpoints name) for the oracle, and through ours
(deltaserve/images.py) for us: the two must agree on the pixels too.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from deltaserve.images import ImageLimits, preprocess
from deltaserve.models import build_model, skip_prefixes
from deltaserve.models.batch import allocate_caches, single_sequence_batch
from deltaserve.models.vision import ImageGrid, VisionTower, mrope_positions, vision_tensors
from deltaserve.weights import load_checkpoint
from tolerance import LAMBDA, UNIT_ROUNDOFF, logits_rtol

VOCAB = 160
IMAGE, VISION_START, VISION_END, VIDEO = 150, 151, 152, 153
PATCH, MERGE = 4, 2
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, vocab_size=VOCAB,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
              num_position_embeddings=16, spatial_merge_size=MERGE)
# The pixel budget of these tests: images become at most 24 x 24 patches.
LIMITS = ImageLimits(max_pixels=96 * 96, min_pixels=8 * 8)


SPECIAL = {IMAGE: "<|image_pad|>", VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>",
           VIDEO: "<|video_pad|>", 154: "<|im_start|>", 155: "<|im_end|>"}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def save_vl_tokenizer(folder) -> None:
    """Words t0..t149 split on spaces, and the family's special tokens (vision markers, chat turns) as single ids."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({text: i for i, text in SPECIAL.items()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL.values()])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                              "chat_template": CHAT_TEMPLATE}))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": LIMITS.min_pixels, "longest_edge": LIMITS.max_pixels},
        "image_processor_type": "Qwen2VLImageProcessor"}))


def make_multimodal_checkpoint(folder) -> Qwen3_5ForConditionalGeneration:
    torch.manual_seed(5)
    config = Qwen3_5Config(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                           vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, video_token_id=VIDEO)
    config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = "sdpa"
    ref = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if "pos_embed" in name or "patch_embed" in name:
                p.normal_(0, 0.5)  # the init leaves them small: make a wrong position or patch order show
    ref.save_pretrained(folder)
    save_vl_tokenizer(folder)
    return ref


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_vl")
    ref = make_multimodal_checkpoint(folder)
    return folder, ref


def oracle_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                    size={"shortest_edge": LIMITS.min_pixels, "longest_edge": LIMITS.max_pixels})


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


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


def image_prompt(grids: list[ImageGrid], seed: int) -> list[int]:
    """Text, then each image as vision_start, its tokens, vision_end, then text; as the chat template writes it."""
    rng = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(0, 150, (n,), generator=rng).tolist()  # noqa: E731
    ids = words(5)
    for grid in grids:
        ids += [VISION_START] + [IMAGE] * grid.tokens(MERGE) + [VISION_END] + words(3)
    return ids + words(4)


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


def oracle_inputs(ids: list[int], images: list[Image.Image]) -> dict:
    pixels = oracle_processor()(images=images, return_tensors="pt")
    ids_t = torch.tensor([ids])
    return dict(input_ids=ids_t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(ids_t == IMAGE).int())


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
