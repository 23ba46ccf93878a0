"""EAGLE-3 draft (EAGLE-3 arXiv:2503.01840): config, layer ids, vocab map, model, TTT loss, export."""

from artcache.layer_ids import eagle3_capture_ids

from .config import EAGLE3_NUM_AUX, Eagle3Config
from .export import export_config, export_state_dict
from .loss import Eagle3Stats, eagle3_loss, supervision_masks, target_soft_labels
from .model import Eagle3Draft, build_ttt_mask, ttt_input_ids
from .vocab import build_vocab_map, count_plan_tokens, draft_ids_to_target, vocab_map_from_used


def EAGLE3_LAST_LAYER(num_target_layers: int) -> int:  # noqa: N802 - name fixed by the consumer's API
    """Output-of-layer id of the last decoder layer (``L - 1``), whose un-normed output gives the target
    logits through the target's final norm and lm_head."""
    return eagle3_capture_ids(num_target_layers)[-1]


__all__ = [
    "EAGLE3_LAST_LAYER",
    "EAGLE3_NUM_AUX",
    "Eagle3Config",
    "Eagle3Draft",
    "Eagle3Stats",
    "build_ttt_mask",
    "build_vocab_map",
    "count_plan_tokens",
    "draft_ids_to_target",
    "eagle3_loss",
    "export_config",
    "export_state_dict",
    "supervision_masks",
    "target_soft_labels",
    "ttt_input_ids",
    "vocab_map_from_used",
]
