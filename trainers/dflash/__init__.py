"""DFlash block-diffusion draft (DFlash arXiv:2602.06036): config, layer ids, model, anchors, loss."""

from .anchors import eligible_anchors, sample_anchors
from .config import DFlashConfig, default_gamma
from .layers import (
    dflash_layer_ids,
    hf_index_to_output_of_layer,
    output_of_layer_to_hf_index,
    output_of_layer_to_vllm_id,
    vllm_id_to_output_of_layer,
)
from .loss import LossStats, dflash_loss, slot_weights
from .model import ATTN_IMPLS, DFlashDraft, build_attention_mask, dflash_mask_mod

__all__ = [
    "ATTN_IMPLS",
    "DFlashConfig",
    "DFlashDraft",
    "LossStats",
    "build_attention_mask",
    "default_gamma",
    "dflash_layer_ids",
    "dflash_loss",
    "dflash_mask_mod",
    "eligible_anchors",
    "hf_index_to_output_of_layer",
    "output_of_layer_to_hf_index",
    "output_of_layer_to_vllm_id",
    "sample_anchors",
    "slot_weights",
    "vllm_id_to_output_of_layer",
]
