"""The Qwen3.5-family vision tower, in the checkpoint's own names (model.visual.*), and where its tokens go.

An image arrives as patches (deltaserve/images.py): [patches, C * T * P * P] with the patches of each
spatial_merge_size x spatial_merge_size block consecutive. The tower embeds each patch (a Conv3d whose kernel is its
stride: one matmul), adds a learned position table resampled bilinearly to the image's grid, runs `depth`
pre-LayerNorm transformer blocks with full attention within each image and 2D rotary positions over the patch grid
(half the rotary frequencies follow the row, half the column), and merges each block of patches into one token of the
language model's width. The language model then reads an image as `grid_h * grid_w / merge^2` tokens whose
multimodal rotary positions (`mrope_positions`) run over time, row and column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from deltaserve.models.layers import embedding, linear

LAYER_NORM_EPS = 1e-6  # what the checkpoints were trained with (transformers hard-codes it too)
VISION_PREFIX = "model.visual."


@dataclass(frozen=True)
class ImageGrid:
    """One image's patch grid: t frames (1 for a still image) of h x w patches."""

    t: int
    h: int
    w: int

    @property
    def patches(self) -> int:
        return self.t * self.h * self.w

    def tokens(self, merge: int) -> int:
        """How many language-model tokens the image becomes."""
        return self.patches // (merge * merge)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention within one image; q and k rotated by the 2D positions."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.qkv = linear(hidden, 3 * hidden, bias=True)
        self.proj = linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q = (q * cos + rotate_half(q) * sin).to(x.dtype)
        k = (k * cos + rotate_half(k) * sin).to(x.dtype)
        out = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):  # one image at a time
            # 4-D [1, heads, patches, head_dim]: torch's CPU flash kernel takes only 4-D inputs; 3-D ones fall back
            # to the math path, which holds [heads, patches, patches] scores (1 GiB a block at 4096 patches x 16 heads)
            qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi))
            o = F.scaled_dot_product_attention(qi, ki, vi)[0]
            out.append(o.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim))
        return self.proj(torch.cat(out))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.linear_fc1 = linear(hidden, intermediate, bias=True)
        self.linear_fc2 = linear(intermediate, hidden, bias=True)
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


def layer_norm(dim: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS, device="meta")
    norm.requires_grad_(False)
    return norm


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_heads: int, act: str):
        super().__init__()
        self.norm1 = layer_norm(hidden)
        self.norm2 = layer_norm(hidden)
        self.attn = VisionAttention(hidden, num_heads)
        self.mlp = VisionMLP(hidden, intermediate, act)

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (T, P, P) over a patch that is exactly one kernel: a matmul."""

    def __init__(self, channels: int, temporal: int, patch: int, hidden: int):
        super().__init__()
        self.proj = nn.Conv3d(channels, hidden, (temporal, patch, patch), (temporal, patch, patch), bias=True,
                              device="meta")
        self.proj.requires_grad_(False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    """LayerNorm each patch, then each merge x merge block (consecutive rows) -> MLP -> the language model's width."""

    def __init__(self, hidden: int, merge: int, out_hidden: int):
        super().__init__()
        self.merged = hidden * merge * merge
        self.norm = layer_norm(hidden)
        self.linear_fc1 = linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = linear(self.merged, out_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """patches [N, C*T*P*P] of one or more images (their grids in order) -> [sum tokens, out_hidden_size]."""

    def __init__(self, vision_config: dict):
        super().__init__()
        c = vision_config
        hidden, heads = c["hidden_size"], c["num_heads"]
        self.merge = c.get("spatial_merge_size", 2)
        self.patch_size = c.get("patch_size", 16)
        self.temporal_patch_size = c.get("temporal_patch_size", 2)
        self.patch_embed = PatchEmbed(c.get("in_channels", 3), self.temporal_patch_size, self.patch_size, hidden)
        self.pos_embed = embedding(c["num_position_embeddings"], hidden)
        self.grid_side = int(c["num_position_embeddings"] ** 0.5)
        self.blocks = nn.ModuleList(
            VisionBlock(hidden, c["intermediate_size"], heads, c.get("hidden_act", "gelu_pytorch_tanh"))
            for _ in range(c["depth"]))
        self.merger = PatchMerger(hidden, self.merge, c.get("out_hidden_size", hidden))
        theta = float((c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        quarter = hidden // heads // 2  # half the head's frequencies for rows, half for columns
        inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.out_hidden_size = c.get("out_hidden_size", hidden)

    def block_order(self, grid: ImageGrid) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, column) of each patch in the order patches arrive: merge x merge blocks, row-major within."""
        m = self.merge
        rows, cols = torch.meshgrid(torch.arange(grid.h), torch.arange(grid.w), indexing="ij")
        shape = (grid.h // m, m, grid.w // m, m)
        rows = rows.reshape(shape).transpose(1, 2).flatten().repeat(grid.t)
        cols = cols.reshape(shape).transpose(1, 2).flatten().repeat(grid.t)
        return rows, cols

    def position_table(self, grid: ImageGrid, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The learned square position table resampled (bilinear, corners aligned) to the image's grid."""
        side, w = self.grid_side, self.pos_embed.weight
        table = w.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()
        resized = F.interpolate(table, size=(grid.h, grid.w), mode="bilinear", align_corners=True)[0]
        return resized[:, rows, cols].T.to(w.dtype)

    def forward(self, patches: torch.Tensor, grids: list[ImageGrid]) -> torch.Tensor:
        x = self.patch_embed(patches)
        pos, angles = [], []
        for grid in grids:
            rows, cols = self.block_order(grid)
            pos.append(self.position_table(grid, rows, cols))
            angles.append(torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1))
        x = x + torch.cat(pos)
        emb = torch.cat(angles).repeat(1, 2)[:, None, :]  # [N, 1, head_dim]
        cos, sin = emb.cos(), emb.sin()
        lengths = [g.h * g.w for g in grids for _ in range(g.t)]  # attention within each frame
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)


def vision_tensors(tensors, prefix: str = VISION_PREFIX) -> dict[str, torch.Tensor]:
    """The tower's tensors of a checkpoint mapping, under the tower's own names (read only those)."""
    return {key[len(prefix):]: tensors[key] for key in tensors.keys() if key.startswith(prefix)}


def mrope_positions(prompt_ids: list[int], grids: list[ImageGrid], image_token_id: int,
                    merge: int) -> tuple[torch.Tensor, int]:
    """The (time, row, column) rotary position of each prompt token [3, len], and the offset of what follows.

    Text tokens advance all three together. An image's tokens start at the position p after the text before it and
    spread over rows p..p+h'-1 and columns p..p+w'-1 (h', w' its merged grid); the text after it resumes at
    p + max(h', w'). A token generated at index i then sits at i + delta (returned), the same in all three.
    """
    out = torch.empty(3, len(prompt_ids), dtype=torch.long)
    pos = i = 0
    images = iter(grids)
    while i < len(prompt_ids):
        if prompt_ids[i] != image_token_id:
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        grid = next(images)
        t, h, w = grid.t, grid.h // merge, grid.w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        n = t * h * w
        out[:, i:i + n] = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos
        pos += max(h, w)
        i += n
    return out, pos - len(prompt_ids)
