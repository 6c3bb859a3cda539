"""A tiny random Qwen3.5 multimodal checkpoint (transformers' config classes, save_pretrained), its tokenizer and
preprocessor config, and images for the vision tests."""

from __future__ import annotations

import io
import json

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from deltaserve.images import ImageLimits
from deltaserve.models.vision import ImageGrid

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
LIMITS = ImageLimits(max_pixels=96 * 96)  # the engine's own min_pixels: what a server with --max-image-pixels 9216 does


SPECIAL = {IMAGE: "<|image_pad|>", VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>",
           VIDEO: "<|video_pad|>", 154: "<|im_start|>", 155: "<|im_end|>"}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def save_vl_tokenizer(folder) -> None:
    """Words t0..t149 split on spaces, and the family's special tokens (vision markers, chat turns) as single ids."""
    vocab = {f"t{i}": i for i in range(VOCAB) if i not in SPECIAL}
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


def image_prompt(grids: list[ImageGrid], seed: int) -> list[int]:
    """Text, then each image as vision_start, its tokens, vision_end, then text; as the chat template writes it."""
    rng = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(0, 150, (n,), generator=rng).tolist()  # noqa: E731
    ids = words(5)
    for grid in grids:
        ids += [VISION_START] + [IMAGE] * grid.tokens(MERGE) + [VISION_END] + words(3)
    return ids + words(4)


def oracle_inputs(ids: list[int], images: list[Image.Image]) -> dict:
    pixels = oracle_processor()(images=images, return_tensors="pt")
    ids_t = torch.tensor([ids])
    return dict(input_ids=ids_t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(ids_t == IMAGE).int())
