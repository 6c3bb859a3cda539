"""A request's images inside the engine: where their tokens sit in the prompt, their rotary positions, their
embeddings once the tower has run (one image per step, in the step loop), and the prefix cache's key for them.

The client's prompt holds one image token per image (the chat template's placeholder); `expand_prompt` widens each
into the image's `grid_h * grid_w / merge^2` tokens, so admission reserves KV for every image token before the
request runs. A prefill chunk reads only up to the first image not yet encoded (`ready_until`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.images import PreparedImage
from deltaserve.models.vision import mrope_positions


@dataclass
class PromptImages:
    """The images of one request's prompt, in order."""

    prepared: list[PreparedImage]
    starts: list[int]  # prompt index of each image's first token
    lengths: list[int]  # tokens of each image
    rope: torch.Tensor  # [3, prompt_len] multimodal rotary positions of the prompt
    delta: int  # a token at index i past the prompt sits at rotary position i + delta
    embeds: list[torch.Tensor | None] = field(default_factory=list)  # per image, set when encoded

    def __post_init__(self) -> None:
        self.embeds = [None] * len(self.prepared)

    def pending(self, num_cached: int) -> int | None:
        """The first image not encoded yet that the prompt still has to read (a cached image needs none)."""
        for k, (start, n) in enumerate(zip(self.starts, self.lengths)):
            if self.embeds[k] is None and start + n > num_cached:
                return k
        return None

    def next_to_encode(self, num_cached: int) -> int | None:
        """The image to encode now: the pending one, once the prefill has reached it (so a request holds the
        embeddings of at most one image at a time)."""
        k = self.pending(num_cached)
        return k if k is not None and self.starts[k] <= num_cached else None

    def ready_until(self, num_cached: int) -> int:
        """How far the prompt can be read now: to the first token of the next image not encoded yet."""
        k = self.pending(num_cached)
        return self.starts[k] if k is not None else self.rope.shape[1]

    def chunk(self, start: int, n: int) -> tuple[list[int], list[torch.Tensor]]:
        """For prompt tokens [start, start + n): the offsets (from start) of image tokens and their embeddings."""
        rows, embeds = [], []
        for k, (s, length) in enumerate(zip(self.starts, self.lengths)):
            lo, hi = max(start, s), min(start + n, s + length)
            if lo < hi:
                rows.extend(range(lo - start, hi - start))
                embeds.append(self.embeds[k][lo - s: hi - s])
        return rows, embeds

    def positions(self, start: int, n: int) -> torch.Tensor:
        """[3, n] rotary positions of the tokens [start, start + n) of this request (prompt or generated)."""
        prompt_len = self.rope.shape[1]
        if start + n <= prompt_len:
            return self.rope[:, start: start + n]
        after = torch.arange(max(start, prompt_len), start + n) + self.delta
        head = self.rope[:, start: prompt_len] if start < prompt_len else self.rope[:, :0]
        return torch.cat([head, after.expand(3, -1)], dim=1)

    def cache_ids(self, prompt_ids: list[int]) -> list[int]:
        """The prompt as the prefix cache keys it: each image token replaced by a negative id drawn from the image's
        pixel digest, so equal images (and only they) match."""
        ids = list(prompt_ids)
        for image, start, n in zip(self.prepared, self.starts, self.lengths):
            key = -1 - int.from_bytes(image.digest[:8], "little")
            ids[start: start + n] = [key] * n
        return ids

    def release_read(self, num_cached: int) -> None:
        """Drop the embeddings of the images the prompt has read past: they are not needed again."""
        for k, (start, n) in enumerate(zip(self.starts, self.lengths)):
            if self.embeds[k] is not None and start + n <= num_cached:
                self.embeds[k] = self.embeds[k].new_empty(0)  # a fresh tensor: a view would keep the storage


class ImagePromptError(ValueError):
    """The prompt's image placeholders do not match the images sent."""


def expand_prompt(prompt_ids: list[int], images: list[PreparedImage], image_token_id: int,
                  merge: int) -> tuple[list[int], PromptImages]:
    """Widen each image placeholder token into the image's tokens; the images' layout in the new prompt."""
    placeholders = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(placeholders) != len(images):
        raise ImagePromptError(f"the prompt holds {len(placeholders)} image placeholder tokens for {len(images)} "
                               f"images: the text may not contain the image token itself")
    ids, starts, lengths, last = [], [], [], 0
    for i, image in zip(placeholders, images):
        ids += prompt_ids[last:i]
        starts.append(len(ids))
        lengths.append(image.tokens(merge))
        ids += [image_token_id] * lengths[-1]
        last = i + 1
    ids += prompt_ids[last:]
    rope, delta = mrope_positions(ids, [p.grid for p in images], image_token_id, merge)
    return ids, PromptImages(images, starts, lengths, rope, delta)
