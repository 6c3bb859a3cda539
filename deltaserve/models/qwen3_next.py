"""Qwen3-Next: the hybrid decoder (hybrid.py) with Gated DeltaNet in-projections packed per key-head group
(in_proj_qkvz, in_proj_ba) and a sparse mixture of experts with a gated shared expert on the sparse layers.

A layer is sparse when num_experts > 0, it is not in mlp_only_layers, and (layer + 1) % decoder_sparse_step == 0;
the others use a dense SwiGLU MLP of intermediate_size. Router weights are renormalised over the top-k when
norm_topk_prob (the default).
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


class Qwen3NextForCausalLM(HybridForCausalLM):
    skip_prefixes = SKIP_PREFIXES  # checkpoint tensors never read (mtp.* unless the head is built)
    mtp_capable = True

    def __init__(self, config: dict, mtp: bool = False):
        mlp_only = set(config.get("mlp_only_layers") or [])
        sparse_step = int(config.get("decoder_sparse_step", 1))
        norm_topk_prob = bool(config.get("norm_topk_prob", True))

        def mlp_of_layer(i: int):
            if config.get("num_experts", 0) > 0 and i not in mlp_only and (i + 1) % sparse_step == 0:
                return SparseMoeBlock(config, norm_topk_prob)
            return SwiGLU(config["hidden_size"], config["intermediate_size"])

        super().__init__(config, mlp_of_layer, fused_projections=True,
                         tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
        mtp = mtp and mtp_head.mtp_layers(config) > 0
        if mtp:
            mtp_head.attach(self, config, norm_topk_prob)
        self.announced_parts = announce_unloaded_parts(config, "qwen3_next", mtp_loaded=mtp)

    def checkpoint_tensors(self, tensors) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under this model's names (mtp.* skipped unless the head is built)."""
        return language_model_tensors(tensors, "qwen3_next", self.announced_parts, mtp=self.mtp is not None)
