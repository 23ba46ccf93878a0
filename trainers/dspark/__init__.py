"""DSpark semi-autoregressive parallel draft (DSpark arXiv:2607.05147): config, model, loss, metrics,
calibration, adapter, export. The backbone is the DFlash draft (:mod:`artcache.trainers.dflash`)."""

from .config import DEFAULT_BLOCK_SIZE, DEFAULT_MARKOV_RANK, MARKOV_HEAD_TYPES, DSparkConfig, default_anchors
from .loss import BlockLayout, BlockOutputs, block_layout, dspark_loss, slot_weights
from .model import DSparkDraft

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MARKOV_RANK",
    "MARKOV_HEAD_TYPES",
    "BlockLayout",
    "BlockOutputs",
    "DSparkConfig",
    "DSparkDraft",
    "block_layout",
    "default_anchors",
    "dspark_loss",
    "slot_weights",
]
