"""DFlash block-diffusion draft (DFlash arXiv:2602.06036): config, layer ids, model, anchors, loss."""


from .anchors import eligible_anchors, sample_anchors
from .config import DFlashConfig, default_gamma
from .loss import LossStats, dflash_loss, slot_weights
from .model import ATTN_IMPLS, DFlashDraft, build_attention_mask, dflash_mask_mod

__all__ = [
    "ATTN_IMPLS",
    "DFlashConfig",
    "DFlashDraft",
    "LossStats",
    "build_attention_mask",
    "default_gamma",
    "dflash_loss",
    "dflash_mask_mod",
    "eligible_anchors",
    "sample_anchors",
    "slot_weights",
]
