"""A tiny random Qwen3.5 multimodal checkpoint (transformers' config classes, save_pretrained), its tokenizer and
preprocessor config, and images for the vision tests; and the image oracle (`ImageOracle`): an image file through our
preprocessing and model against transformers' processor and model on the same file, for tests and the fuzzer."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from deltaserve.images import ImageLimits, PreparedImage, preprocess
from deltaserve.models.vision import ImageGrid
from random_parameters import draw_constant_parameters_
from tolerance import logits_rtol

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


def make_multimodal_checkpoint(folder, vision: dict = VISION, text: dict = TEXT) -> Qwen3_5ForConditionalGeneration:
    torch.manual_seed(5)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
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
    draw_constant_parameters_(ref)  # the tower's and merger's biases start at zero
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


def image_prompt(grids: list[ImageGrid], seed: int, merge: int = MERGE) -> list[int]:
    """Text, then each image as vision_start, its tokens (a token per merge x merge patches), vision_end, then text;
    as the chat template writes it."""
    rng = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(0, 150, (n,), generator=rng).tolist()  # noqa: E731
    ids = words(5)
    for grid in grids:
        ids += [VISION_START] + [IMAGE] * grid.tokens(merge) + [VISION_END] + words(3)
    return ids + words(4)


def oracle_inputs(ids: list[int], images: list[Image.Image]) -> dict:
    pixels = oracle_processor()(images=images, return_tensors="pt")
    ids_t = torch.tensor([ids])
    return dict(input_ids=ids_t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(ids_t == IMAGE).int())


# The checkpoint of issue 42: 16-pixel patches, a 16 x 16 position table, and a preprocessor whose pixel range
# (32 x 32 .. 256 x 256) is not the server's: what the checkpoint says must decide the resize.
ORACLE_VISION = dict(VISION, patch_size=16, num_position_embeddings=256)
ORACLE_MIN_PIXELS, ORACLE_MAX_PIXELS = 32 * 32, 256 * 256
IMAGE_FORMATS = ("RGB", "RGBA", "P", "P+transparency", "L", "JPEG")


def make_oracle_checkpoint(folder, vision: dict = ORACLE_VISION, min_pixels: int = ORACLE_MIN_PIXELS,
                           max_pixels: int = ORACLE_MAX_PIXELS, text: dict = TEXT) -> Qwen3_5ForConditionalGeneration:
    """The multimodal checkpoint (`text`: the language model's config, vocabulary VOCAB) with its
    preprocessor_config.json written by transformers' own image processor."""
    ref = make_multimodal_checkpoint(folder, vision, text)
    Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                             temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                             min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(folder)
    return ref


def image_file(width: int, height: int, seed: int, kind: str = "RGB") -> bytes:
    """Random-noise pixels encoded as a file: a PNG of mode `kind` (P+transparency: a palette with a transparent
    index), or a JPEG."""
    if kind == "JPEG":
        out = io.BytesIO()
        picture(width, height, seed).save(out, format="JPEG", quality=90)
        return out.getvalue()
    if kind.startswith("P"):
        image = picture(width, height, seed).convert("P")
        if kind == "P+transparency":
            image.info["transparency"] = int(image.getpixel((0, 0)))
        return png(image)
    return png(picture(width, height, seed, kind))


def draw_image(rng: np.random.Generator, min_pixels: int = ORACLE_MIN_PIXELS,
               max_pixels: int = ORACLE_MAX_PIXELS) -> tuple[int, int, str]:
    """(width, height, kind) of a random image: area log-uniform from a quarter of min_pixels to four times
    max_pixels (up- and down-scaling, and sizes needing none), aspect ratio log-uniform to 16:1 either way, one time
    in eight up to the 200:1 the processor accepts."""
    area = math.exp(rng.uniform(math.log(min_pixels / 4), math.log(4 * max_pixels)))
    widest = 200 if rng.random() < 0.125 else 16
    aspect = math.exp(rng.uniform(-math.log(widest), math.log(widest)))
    width = max(1, round(math.sqrt(area * aspect)))
    height = max(1, round(math.sqrt(area / aspect)))
    if max(width, height) / min(width, height) > 200:  # rounding a tiny side can pass the processor's limit
        width, height = (min(width, 200 * height), height) if width > height else (width, min(height, 200 * width))
    return width, height, str(rng.choice(IMAGE_FORMATS))


class ImageOracle:
    """A tiny multimodal checkpoint loaded twice: by deltaserve (the engine's own preprocessing settings and limits,
    the model it builds) and by transformers (AutoImageProcessor and Qwen3_5ForConditionalGeneration from the folder).

    `compare(data)` runs one image file through both and returns the last prompt row's logits of each and the bound
    on their difference; `pixels(data)` the two preprocessings. The fuzzer draws cases with `random_case`."""

    def __init__(self, folder, max_image_pixels: int = 1024 * 1024):
        from transformers import AutoImageProcessor

        from deltaserve.images import PreprocessorSettings
        from deltaserve.models import build_model, skip_prefixes
        from deltaserve.weights import load_checkpoint

        config = json.loads((Path(folder) / "config.json").read_text())
        self.ref = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = AutoImageProcessor.from_pretrained(folder)
        ckpt = load_checkpoint(folder, skip_prefixes=skip_prefixes(config, vision=True))
        self.ours = build_model(ckpt.config, ckpt.tensors, vision=True)
        self.settings = PreprocessorSettings.from_checkpoint(folder, config["vision_config"])
        self.limits = self.settings.limits(8, 20 * 1024 * 1024, max_image_pixels)  # what the engine holds
        self.vision = config["vision_config"]

    def pixels(self, data: bytes) -> tuple[PreparedImage, dict]:
        """Our preprocessing of the file and transformers' (pixel_values, image_grid_thw) of the same file."""
        ours = preprocess(data, self.limits, self.settings)
        return ours, self.processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")

    def compare(self, data: bytes, seed: int = 0, use_reference_pixels: bool = False):
        """(our logits, transformers' logits, bound): the last prompt row [vocab] of a prompt holding the image, and
        the largest |difference| float32 arithmetic allows. With `use_reference_pixels` our model reads the
        processor's pixel_values (localises a difference to preprocessing or to the model)."""
        from deltaserve.models.batch import allocate_caches, single_sequence_batch
        from deltaserve.models.vision import mrope_positions

        prepared, reference = self.pixels(data)
        patches, grid = prepared.patches, prepared.grid
        if use_reference_pixels:
            patches, grid = reference["pixel_values"].float(), ImageGrid(*reference["image_grid_thw"][0].tolist())
        merge = self.vision["spatial_merge_size"]
        ids = image_prompt([grid], seed, merge)
        rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE])
        rope, _ = mrope_positions(ids, [grid], IMAGE, self.ours.visual.merge)
        caches = allocate_caches(self.ours.geometry, len(ids), 1, torch.float32)
        with torch.inference_mode():
            embeds = self.ours.encode_images(patches, [grid])
            got = self.ours(single_sequence_batch(ids, 0, torch.arange(len(ids)), image_rows=rows,
                                                  image_embeds=embeds, rope_positions=rope), caches)[-1]
        ref_ids = image_prompt([ImageGrid(*reference["image_grid_thw"][0].tolist())], seed, merge)
        with torch.no_grad():
            expected = self.ref(**self._reference_inputs(ref_ids, reference)).logits[0, -1]
        return got, expected, self.rtol(len(ids), grid.patches) * expected.abs().max().item()

    @staticmethod
    def _reference_inputs(ids: list[int], reference: dict) -> dict:
        ids_t = torch.tensor([ids])
        # use_cache=False: transformers' cache asks an attention layer for its length, and a drawn text config may
        # have none (all GDN layers; fuzzer seed 121)
        return dict(input_ids=ids_t, pixel_values=reference["pixel_values"], use_cache=False,
                    image_grid_thw=reference["image_grid_thw"], mm_token_type_ids=(ids_t == IMAGE).int())

    def rtol(self, context: int, patches: int) -> float:
        """tests/tolerance.py's bound over the tower's blocks and the language model's layers, the longest reduction
        being the widest layer, a patch's pixels, the merged width, the image's patches or the context."""
        text, v = self.ref.config.text_config, self.vision
        widths = [text.hidden_size, text.intermediate_size, 64 * text.linear_key_head_dim, context, patches,
                  v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2,
                  3 * v.get("temporal_patch_size", 2) * v["patch_size"] ** 2]
        return logits_rtol(text.num_hidden_layers + v["depth"] + 1, max(widths))

    def random_case(self, rng: np.random.Generator):
        """One random image (size, aspect ratio, mode or JPEG from `draw_image`) through `compare`:
        (our logits, transformers' logits, bound, a description of the image for the failure message)."""
        width, height, kind = draw_image(rng, self.settings.min_pixels, self.settings.max_pixels)
        seed = int(rng.integers(1 << 30))
        got, expected, bound = self.compare(image_file(width, height, seed, kind), seed=seed % 1000)
        return got, expected, bound, f"{width}x{height} {kind} (pixels seed {seed})"
