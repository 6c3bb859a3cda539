"""Image inputs: decode (Pillow), resize to the pixel budget, normalise and cut into the vision tower's patches.

The arithmetic is transformers' Qwen2VLImageProcessor (what the Qwen3.5 checkpoints name in their
preprocessor_config.json), done on Pillow and NumPy so serving does not need transformers: composite any alpha onto
white, resize with Pillow's bicubic filter so both sides are multiples of patch * merge and the area lies within
the checkpoint's [min_pixels, max_pixels] (aspect ratio kept; --max-image-pixels may lower the top), scale to [0, 1]
and normalise by the checkpoint's mean and std, and lay the patches out merge block by merge block.
tests/test_images_oracle.py holds file -> server -> logits to transformers' processor -> transformers' model.

Nothing here fetches: the server passes bytes it was given. Every refusal is an ImageError whose message names the
limit or the problem.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from deltaserve.budget.spec import IMAGE_MAX_ASPECT_RATIO as MAX_ASPECT_RATIO
from deltaserve.models.vision import ImageGrid


class ImageError(ValueError):
    """An image that cannot be used: not an image, corrupt, or over a limit. The server answers 400."""


@dataclass(frozen=True)
class ImageLimits:
    """Per-request image limits (server settings)."""

    max_images: int = 8  # per request
    max_bytes: int = 20 * 1024 * 1024  # of one encoded image
    max_source_pixels: int = 64 * 1024 * 1024  # width x height of one decoded image, before resizing
    max_pixels: int = 1024 * 1024  # the resize budget: larger images are scaled down to this area
    min_pixels: int = 64 * 64  # smaller images are scaled up to this area

    def max_grid(self, patch_size: int, merge_size: int) -> int:
        """The most patches one image can become: the largest area the resize can produce, in patches."""
        factor = patch_size * merge_size
        return max(self.max_pixels // (factor * factor), 1) * merge_size * merge_size


@dataclass(frozen=True)
class PreprocessorSettings:
    """The checkpoint's preprocessor_config.json, as far as stills need it."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    # The resize's pixel range. transformers' class defaults (56 x 56, 28 x 28 x 1280) where the file names none;
    # the answer to an image depends on them, so they are the checkpoint's, not the server's.
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_checkpoint(cls, folder: Path | None, vision_config: dict) -> PreprocessorSettings:
        """Read preprocessor_config.json beside the checkpoint; the vision config fills what it lacks."""
        raw = {}
        path = Path(folder) / "preprocessor_config.json" if folder is not None else None
        if path is not None and path.is_file():
            raw = json.loads(path.read_text())
        # transformers reads size's shortest/longest edge (pixel areas, despite the names); a top-level
        # min_pixels / max_pixels (the older spelling) overrides them
        size = raw.get("size") or {}
        return cls(patch_size=int(raw.get("patch_size", vision_config.get("patch_size", 16))),
                   merge_size=int(raw.get("merge_size", vision_config.get("spatial_merge_size", 2))),
                   temporal_patch_size=int(raw.get("temporal_patch_size",
                                                   vision_config.get("temporal_patch_size", 2))),
                   image_mean=tuple(raw.get("image_mean", cls.image_mean)),
                   image_std=tuple(raw.get("image_std", cls.image_std)),
                   min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
                   max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels))

    def limits(self, max_images: int, max_bytes: int, max_image_pixels: int) -> ImageLimits:
        """The server's image limits with this checkpoint's resize range, its top lowered to --max-image-pixels
        where that is smaller (a memory limit: larger images then get fewer tokens than transformers gives them)."""
        max_pixels = min(self.max_pixels, max_image_pixels)
        return ImageLimits(max_images=max_images, max_bytes=max_bytes, max_pixels=max_pixels,
                           min_pixels=min(self.min_pixels, max_pixels))


@dataclass(frozen=True)
class PreparedImage:
    """An image ready for the tower: its patches [N, C*T*P*P] float32, their grid, and a digest of the pixels."""

    patches: torch.Tensor
    grid: ImageGrid
    digest: bytes  # hashes the normalised patches: equal digests, equal tower inputs (the prefix cache's key)

    def tokens(self, merge: int) -> int:
        return self.grid.tokens(merge)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width), multiples of `factor`, area within [min_pixels, max_pixels], aspect ratio kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image is {width}x{height} pixels: its aspect ratio must be at most {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode(data: bytes, limits: ImageLimits) -> Image.Image:
    """Pillow's decoding of `data` as RGB (alpha composited onto white), or ImageError."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data):,} bytes, over the limit of {limits.max_bytes:,} bytes per image")
    if not data:
        raise ImageError("image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limits.max_source_pixels:
                raise ImageError(f"image is {width}x{height} = {width * height:,} pixels, over the limit of "
                                 f"{limits.max_source_pixels:,} pixels per image")
            image.load()
    except ImageError:
        raise
    except Image.DecompressionBombWarning:
        raise ImageError(f"image is over the limit of {limits.max_source_pixels:,} pixels per image") from None
    except Exception as e:  # Pillow raises many types for bad data; the message says which part failed
        raise ImageError(f"the data is not a readable image ({type(e).__name__}: {e})") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(data: bytes, limits: ImageLimits, settings: PreprocessorSettings | None = None,
               **overrides) -> PreparedImage:
    """Decode, resize, normalise and patchify one image (settings: the checkpoint's; overrides: test sizes)."""
    s = settings or PreprocessorSettings()
    if overrides:
        s = PreprocessorSettings(**{**s.__dict__, **overrides})
    image = decode(data, limits)
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    height, width = smart_resize(image.height, image.width, p * m, limits.min_pixels, limits.max_pixels)
    image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = (np.asarray(image).astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
    mean, std = np.array(s.image_mean, dtype=np.float32), np.array(s.image_std, dtype=np.float32)
    pixels = ((pixels.T - mean) / std).T
    gh, gw = height // p, width // p
    blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, p, p)
    # a still is its own temporal_patch_size frames
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    patches = np.ascontiguousarray(frames).reshape(gh * gw, 3 * t * p * p)
    digest = hashlib.blake2b(patches.tobytes(), digest_size=16, person=b"deltaserve-img").digest()
    return PreparedImage(torch.from_numpy(patches), ImageGrid(1, gh, gw), digest)


@dataclass(frozen=True)
class ImageSource:
    """Where a request names an image (`where`: the JSON path, for error messages) and its URL as sent."""

    where: str
    url: str


def data_url(media_type: str, base64_data: str) -> str:
    """An Anthropic base64 image source as the data: URL OpenAI's image_url carries."""
    return f"data:{media_type};base64,{base64_data}"


def read_source(source: ImageSource, limits: ImageLimits, local_root: str | None = None) -> bytes:
    """The encoded image bytes of a data: URL (or, with `local_root`, a file:// path under it); never fetches."""
    url = source.url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise ImageError("a data: URL must be base64: data:image/png;base64,<data>")
        if len(payload) > limits.max_bytes * 4 // 3 + 4:
            raise ImageError(f"image is over the limit of {limits.max_bytes:,} bytes per image")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data: URL's payload is not valid base64") from None
    if scheme in ("http", "https"):
        raise ImageError("the server fetches no URLs: send the image inline as a data: URL "
                         "(data:image/png;base64,<data>)")
    if scheme == "file":
        if local_root is None:
            raise ImageError("file:// images are off: start the server with --allowed-local-media-path to allow "
                             "a folder, or send the image as a data: URL")
        root = Path(local_root).resolve()
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
        if not path.is_relative_to(root):
            raise ImageError(f"file:// images must lie under --allowed-local-media-path {root}")
        try:
            size = path.stat().st_size
            if size > limits.max_bytes:
                raise ImageError(f"image is {size:,} bytes, over the limit of {limits.max_bytes:,} bytes per image")
            return path.read_bytes()
        except OSError as e:
            raise ImageError(f"cannot read {path}: {e.strerror or e}") from None
    raise ImageError(f"unsupported image URL scheme {scheme or url[:16]!r}: send a data: URL")
