"""What each draft needs from a capture: layer-id conventions and the layer formulas (no model code).

The algorithm contracts of the drafts, in the library floor so the producer, ``artcache run`` and the
drafts compute the same ids (like SpecForge's algorithm contracts): DFlash's spread of context layers,
EAGLE-3's three auxiliary layers plus the last layer, a draft's ordered *view* of a root's captured
layers, and the one range check for layer ids.

Conventions (docs/export.md, "Layer ids: the one conversion"):

- **output-of-layer i** (SpecForge, z-lab/dflash, DeepSpec): the residual stream leaving decoder
  layer ``i`` (0-based). artcache's native convention.
- **HF index**: the index into Hugging Face ``output_hidden_states``; index 0 is the embedding
  output, so output-of-layer ``i < L - 1`` is HF index ``i + 1``. (transformers 5.x applies the final norm to
  its last entry, so output-of-layer ``L - 1`` is *not* ``output_hidden_states[L]``: capture it with a hook.)
- **vLLM id** (``eagle_aux_hidden_state_layer_ids``, speculators, original EAGLE: input-of-layer):
  the stream entering layer ``k`` = output-of-layer ``k - 1``; vLLM id ``L`` = output of the last layer,
  before the final norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from artcache.errors import ConfigError, ContractMismatch

__all__ = [
    "LAST_LAYER_STATE",
    "check_layer_ids",
    "dflash_layer_ids",
    "dspark_layer_ids",
    "eagle3_capture_ids",
    "eagle3_layer_ids",
    "hf_index_to_output_of_layer",
    "layer_view",
    "output_of_layer_to_hf_index",
    "output_of_layer_to_vllm_id",
    "select_layers",
    "view_slice",
    "vllm_id_to_output_of_layer",
]


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    return value


def dflash_layer_ids(num_target_layers: int, num_draft_layers: int, option: str = "draft layers") -> list[int]:
    """Target layers DFlash captures, in the **output-of-layer** convention (0-based).

    Formula (z-lab/dflash ``build_target_layer_ids``, DFlash arXiv:2602.06036): with ``L`` target
    layers and ``n`` draft layers, ``round(1 + i * (L - 4) / (n - 1))`` for ``i in range(n)``, using
    Python's ``round`` (half to even); the ids are spread over ``[1, L - 3]``. ``n == 1`` gives
    ``[L // 2]``.

    Goldens: ``L=36, n=5 -> [1, 9, 17, 25, 33]`` (Qwen3-8B); ``L=30, n=5 -> [1, 8, 14, 20, 27]``.

    ``option`` names ``n`` in a message as the user set it (``--draft-layers``, ``capture.draft_layers``,
    ``experiments.<name>.draft_layers``).

    Raises:
        ConfigError: ``L < 5`` or ``n`` outside ``[1, L - 3]`` (the message names ``option``, ``n`` and ``L``).
    """
    L = _check_int("the target's layer count", num_target_layers)
    n = _check_int(option, num_draft_layers)
    if L < 5:
        raise ConfigError(f"{option} {n}: the DFlash layer formula needs a target of at least 5 layers, and this "
                          f"target has {L}; give the layer ids explicitly (--layer-ids / layer_ids)")
    if not 1 <= n <= L - 3:
        raise ConfigError(f"{option} {n} is invalid for a target of {L} layers: accepted an integer in [1, {L - 3}] "
                          "(one captured layer per draft layer, spread over [1, L-3])")
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


def output_of_layer_to_hf_index(layer: int) -> int:
    """Output-of-layer ``i`` -> HF ``output_hidden_states`` index ``i + 1`` (index 0 = embeddings)."""
    i = _check_int("layer", layer)
    if i < 0:
        raise ConfigError(f"output-of-layer id must be >= 0, got {i}")
    return i + 1


def hf_index_to_output_of_layer(index: int) -> int:
    """HF ``output_hidden_states`` index ``j >= 1`` -> output-of-layer ``j - 1``.

    Raises:
        ConfigError: ``j < 1`` (index 0 is the embedding output, not the output of any layer).
    """
    j = _check_int("index", index)
    if j < 1:
        raise ConfigError(f"HF hidden_states index {j} is not the output of a decoder layer (need >= 1)")
    return j - 1


def vllm_id_to_output_of_layer(layer_id: int) -> int:
    """vLLM aux-hidden-state id ``k`` (input-of-layer ``k``; ``k = L`` is the last layer's output)
    -> output-of-layer ``k - 1``.

    Raises:
        ConfigError: ``k < 1`` (id 0 is the embedding output).
    """
    k = _check_int("layer_id", layer_id)
    if k < 1:
        raise ConfigError(f"vLLM layer id {k} is the embedding output, not the output of a decoder layer")
    return k - 1


def output_of_layer_to_vllm_id(layer: int) -> int:
    """Output-of-layer ``i`` -> vLLM aux-hidden-state id ``i + 1`` (inverse of
    :func:`vllm_id_to_output_of_layer`)."""
    i = _check_int("layer", layer)
    if i < 0:
        raise ConfigError(f"output-of-layer id must be >= 0, got {i}")
    return i + 1


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """The three auxiliary target layers EAGLE-3 reads, output-of-layer convention (0-based).

    ``[1, L // 2 - 1, L - 4]`` (SpecForge ``_prepare_data``; the same layers as vLLM's default aux ids
    ``(2, L // 2, L - 3)``, which are input-of-layer). Goldens: L=30 -> [1, 14, 26] (SmolLM2-135M),
    L=36 -> [1, 17, 32] (Qwen3-8B). The ids are distinct for L >= 7; tiny targets with L in 5..6 get a
    repeated id (L=6 -> [1, 2, 2]), as the reference formula gives.

    Raises:
        ConfigError: ``L`` not an int or ``L < 5`` (the ids would not be non-decreasing).
    """
    L = _check_int("num_target_layers", num_target_layers)
    if L < 5:
        raise ConfigError(f"num_target_layers={L}: EAGLE-3 needs at least 5 target layers "
                          "(aux ids [1, L//2-1, L-4] must be non-decreasing)")
    return [1, L // 2 - 1, L - 4]


def eagle3_capture_ids(num_target_layers: int) -> list[int]:
    """Everything an EAGLE-3 capture holds, output-of-layer convention: the three aux ids of
    :func:`eagle3_layer_ids` followed by ``L - 1``, the last decoder layer's output **before** the
    target's final norm. The target logits are ``lm_head(final_norm(h_{L-1}))``.

    L=30 -> [1, 14, 26, 29]; L=36 -> [1, 17, 32, 35].

    Raises:
        ConfigError: as :func:`eagle3_layer_ids`.
    """
    ids = eagle3_layer_ids(num_target_layers)
    return [*ids, num_target_layers - 1]


#: What a capture holds for output-of-layer ``L - 1`` (the last decoder layer): the residual stream **before**
#: the target's final norm, like every output-of-layer id (the contract's ``layer_convention``). A draft that
#: needs the target's distribution (EAGLE-3, DSpark) applies ``final_norm`` once, then the frozen lm_head.
#: Recorded in DSpark checkpoints and exports (``target_state``); peers that store the post-norm state
#: (DeepSpec's ``last_hidden_state``) must not be mixed with it.
LAST_LAYER_STATE = "output-of-layer L-1, before the final norm"


def dspark_layer_ids(num_target_layers: int, num_draft_layers: int, option: str = "draft layers") -> list[int]:
    """The captured layers a DSpark draft reads, output-of-layer convention: its context layers
    (:func:`dflash_layer_ids` ``(L, n)``: DSpark's backbone is DFlash's) followed by ``L - 1``, the last
    decoder layer's output before the final norm (:data:`LAST_LAYER_STATE`), which gives the target's
    distribution at every supervised position (DSpark arXiv:2607.05147; DeepSpec
    ``config/dspark/dspark_qwen3_8b.py`` reads context layers [1, 9, 17, 25, 33] on Qwen3-8B).

    Goldens: L=30, n=5 -> [1, 8, 14, 20, 27, 29] (SmolLM2-135M); L=36, n=5 -> [1, 9, 17, 25, 33, 35].

    Raises:
        ConfigError: as :func:`dflash_layer_ids` (``option`` likewise).
    """
    return [*dflash_layer_ids(num_target_layers, num_draft_layers, option), num_target_layers - 1]


def check_layer_ids(ids: Sequence[int], num_layers: int, what: str, *, target: str = "",
                    unique: bool = False) -> list[int]:
    """``ids`` as ints if every one is an output-of-layer id of a ``num_layers``-layer target.

    The one range check for layer ids (the producer, ``artcache run``, the capture backend and the drafts
    call it). ``unique=True`` for a capture set (a root's ``contract.layer_ids``: a repeated id would be
    stored twice); a draft's view may repeat an id (EAGLE-3 on a 6-layer target reads ``[1, 2, 2, 5]``).

    Args:
        ids: output-of-layer ids (0-based).
        num_layers: the target's decoder layers ``L``.
        what: how the ids are named in a message, e.g. ``"--layer-ids 1,40"``.
        target: the target's name, added to the message when given.
        unique: refuse a repeated id.

    Raises:
        ConfigError: an empty list, a non-integer, an id outside ``0..num_layers - 1``, or (``unique``) an id
            given more than once; one line starting with ``what``, naming the bad ids and what is accepted.
    """
    of = f"a {num_layers}-layer target" + (f" ({target!r})" if target else "")
    accepted = f"accepted: output-of-layer ids 0..{num_layers - 1}"
    if not ids:
        raise ConfigError(f"{what}: no layer id given ({accepted})")
    notint = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
    if notint:
        raise ConfigError(f"{what}: {notint!r} are not integers ({accepted})")
    out = list(ids)
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"{what}: {bad} are not output-of-layer ids of {of} (accepted: 0..{num_layers - 1})")
    dup = sorted({i for i in out if out.count(i) > 1})
    if unique and dup:
        raise ConfigError(f"{what} captures layer(s) {dup} more than once; list each captured id once "
                          "(a consumer's --layer-ids view may repeat captured ids)")
    return out


def layer_view(captured: Sequence[int], needed: Sequence[int], *, draft: str, flag_hint: str) -> list[int]:
    """Indices into the root's captured layers (``contract.layer_ids``) giving ``needed`` in order.

    A root may capture a superset (the union of several drafts' layers); each draft reads its own
    ordered view. ``needed`` may repeat an id (each occurrence maps to the same captured layer).

    Raises:
        ContractMismatch: some needed layer is not captured; the message names the missing ids and
            the producer flag that captures them (``--layer-ids`` with the union, on a fresh root).
    """
    captured = [int(i) for i in captured]
    missing = sorted({int(i) for i in needed} - set(captured))
    if missing:
        union = sorted(set(captured) | {int(i) for i in needed})
        raise ContractMismatch(
            f"{draft} needs output-of-layer ids {list(needed)}{flag_hint}; this cache root captures {captured} "
            f"(missing {missing}): start the producer on a fresh --cache root with --layer-ids "
            f"{','.join(map(str, union))} (the union every draft on it needs)")
    return [captured.index(int(i)) for i in needed]


def view_slice(index: Sequence[int]) -> slice | Tensor:
    """A ``slice`` when ``index`` is a contiguous ascending run (so indexing returns a view, no copy),
    else a long tensor for ``index_select``."""
    idx = list(index)
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return torch.tensor(idx, dtype=torch.long)


def select_layers(hidden: Tensor, sel: slice | Tensor) -> Tensor:
    """``hidden[..., m, H]`` restricted to the view along dim -2: a view for a slice, else a copy."""
    if isinstance(sel, slice):
        return hidden[..., sel, :]
    return hidden.index_select(hidden.dim() - 2, sel.to(hidden.device))
