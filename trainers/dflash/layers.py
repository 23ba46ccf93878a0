"""Which target layers DFlash captures, and conversions between layer-id conventions.

Conventions (see ALGORITHMS.md, "Layer-id conventions"):

- **output-of-layer i** (SpecForge, z-lab/dflash, DeepSpec): the residual stream leaving decoder
  layer ``i`` (0-based). This module's native convention.
- **HF index**: the index into Hugging Face ``output_hidden_states``; index 0 is the embedding
  output, so output-of-layer ``i`` is HF index ``i + 1``.
- **vLLM id** (``eagle_aux_hidden_state_layer_ids``, speculators, original EAGLE: input-of-layer):
  the stream entering layer ``k`` = HF ``hidden_states[k]`` = output-of-layer ``k - 1``.

The HF index and the vLLM id therefore coincide numerically; they are kept as separate functions so
every boundary names the convention it converts from.
"""

from __future__ import annotations

from artcache.errors import ConfigError

__all__ = [
    "dflash_layer_ids",
    "hf_index_to_output_of_layer",
    "output_of_layer_to_hf_index",
    "output_of_layer_to_vllm_id",
    "vllm_id_to_output_of_layer",
]


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    return value


def dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers DFlash captures, in the **output-of-layer** convention (0-based).

    Formula (z-lab/dflash ``build_target_layer_ids``, DFlash arXiv:2602.06036): with ``L`` target
    layers and ``n`` draft layers, ``round(1 + i * (L - 4) / (n - 1))`` for ``i in range(n)``, using
    Python's ``round`` (half to even); the ids are spread over ``[1, L - 3]``. ``n == 1`` gives
    ``[L // 2]``.

    Goldens: ``L=36, n=5 -> [1, 9, 17, 25, 33]`` (Qwen3-8B); ``L=30, n=5 -> [1, 8, 14, 20, 27]``.

    Raises:
        ConfigError: ``L < 5`` or ``n`` outside ``[1, L - 3]`` (the message names both values).
    """
    L = _check_int("num_target_layers", num_target_layers)
    n = _check_int("num_draft_layers", num_draft_layers)
    if L < 5:
        raise ConfigError(f"num_target_layers={L} (num_draft_layers={n}): DFlash needs at least 5 target layers")
    if not 1 <= n <= L - 3:
        raise ConfigError(
            f"num_draft_layers={n} must be in [1, {L - 3}] for num_target_layers={L} "
            "(one captured layer per draft layer, spread over [1, L-3])"
        )
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
