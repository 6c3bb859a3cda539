"""Qwen3.5 (dense and MoE, text-only or multimodal checkpoints): the hybrid decoder (hybrid.py) with separate
Gated DeltaNet in-projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), and the vision tower (vision.py).

Dense models use a SwiGLU MLP of intermediate_size on every layer; MoE models a sparse mixture of experts with a
gated shared expert on every layer, router weights always renormalised over the top-k. A multimodal checkpoint
(model_type qwen3_5 / qwen3_5_moe) nests the language model's settings under text_config and its tensors under
model.language_model.; its vision tower (model.visual.*) is built and loaded when asked (`vision=True`), else
skipped unread (the language model only).
"""

from __future__ import annotations

import torch

from deltaserve.models import mtp as mtp_head
from deltaserve.models.hybrid import (
    SKIP_PREFIXES,
    HybridForCausalLM,
    SparseMoeBlock,
    SwiGLU,
    announce_unloaded_parts,
    language_model_tensors,
)
from deltaserve.models.vision import ImageGrid, VisionTower, vision_tensors

MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def text_config(config: dict) -> dict:
    """The language model's settings: text_config of a multimodal checkpoint, else the config itself."""
    return config.get("text_config") or config


class Qwen3_5ForCausalLM(HybridForCausalLM):
    skip_prefixes = SKIP_PREFIXES  # checkpoint tensors never read (the vision tower's unless it is built)
    vision_capable = True
    mtp_capable = True  # mtp.* built and loaded when asked (models/mtp.py)

    def __init__(self, config: dict, vision: bool = False, mtp: bool = False):
        text = text_config(config)
        moe = config["model_type"] in MOE_MODEL_TYPES

        def mlp_of_layer(i: int):
            if moe:
                return SparseMoeBlock(text, norm_topk_prob=True)
            return SwiGLU(text["hidden_size"], text["intermediate_size"])

        # A multimodal checkpoint ties (or not) at its top level, as transformers reads it.
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        super().__init__(text, mlp_of_layer, fused_projections=False, tie_word_embeddings=bool(tie))
        self.model_type = config["model_type"]
        vision = vision and "vision_config" in config
        self.visual = VisionTower(config["vision_config"]) if vision else None
        self.image_token_id = config.get("image_token_id") if vision else None
        mtp = mtp and mtp_head.mtp_layers(config) > 0
        if mtp:
            mtp_head.attach(self, text)
        self.announced_parts = announce_unloaded_parts(config, self.model_type, vision_loaded=vision, mtp_loaded=mtp)

    def checkpoint_tensors(self, tensors) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under this model's names (mtp.* and model.visual.* skipped unless built)."""
        own = language_model_tensors(tensors, self.model_type, self.announced_parts, mtp=self.mtp is not None)
        if self.visual is not None:
            own.update({"visual." + name: t for name, t in vision_tensors(tensors).items()})
        return own

    def encode_images(self, patches: torch.Tensor, grids: list[ImageGrid]) -> torch.Tensor:
        """The language-model embeddings [tokens, hidden] of images' patches (deltaserve/images.py), in order."""
        return self.visual(patches.to(self.visual.patch_embed.proj.weight.device), grids)
