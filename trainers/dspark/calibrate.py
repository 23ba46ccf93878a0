"""Post-hoc calibration of DSpark's confidence head: sequential temperature scaling (STS).

The confidence head predicts ``c_k = sigmoid(z_k)``, the probability that slot k is accepted given every
earlier slot was; what a serving engine acts on is the cumulative ``Π_{i≤k} c_i`` (the probability that the
first k+1 proposals are all accepted). STS (DSpark, arXiv:2607.05147) fits one temperature per slot,
``c_k = sigmoid(z_k / T_k)``, slot by slot in order: for k = 0 … B-1, ``T_k`` is the grid value minimising the
expected calibration error (10 equal-width bins) of ``Π_{i≤k} sigmoid(z_i / T_i)`` against the cumulative
acceptance target ``y_k`` over the held-out blocks where ``y_k`` is known, ``T_0 … T_{k-1}`` fixed. The grid is
241 log-spaced values in [0.05, 20] and always includes 1 (no change), so a fitted slot never has a higher ECE
than before on the fitting data. A temperature on the grid's edge (0.05 or 20) means the fit wanted to go
further: the report lists those slots (``at_grid_edge``).

The target ``y_k`` (``against``):

- ``"replay"`` (the default): the **observed** greedy-replay outcome, ``y_k = 1`` when the first k+1 proposals
  of the block were all accepted by greedy verification against the target's argmax, else 0 (DeepSpec's
  ``deepspec/eval/dspark/confidence_head.py`` bins the cumulative prediction against the same prefix-accepted
  indicator of its verification; the paper's Fig. 6 calibrates against observed acceptance). Known for a
  supervised slot unless the replay walk was cut before it by the target's greedy path leaving the data
  (those slots are left out). This is what a serving engine's threshold on ``Π c`` decides about, hence the
  default.
- ``"alpha"``: the teacher-forced ``Π_{i≤k} α_i`` (the probability that speculative *sampling* accepts the
  first k+1 slots given the data prefix), known for every supervised slot; what the head is trained on.

The data: the held-out split's per-block confidence logits, α, supervised prefix and replay outcome (proposals
accepted, walk cut short) with each block's plan sample, which a DSpark consumer records at every held-out
evaluation and saves with its checkpoint (``heldout.*`` in extra.safetensors, tied to the weights by
:func:`~.adapter.weights_check`). The temperatures go into the checkpoint's extra.safetensors
(``calibration.temperatures``, the file and its digest in state.json replaced atomically:
:func:`~artcache.trainers.checkpoint.replace_file`) and the report into ``calibration.json`` beside it;
``artcache export`` writes the temperatures into the exported config (``confidence_temperatures``).

Also reported: a 2-fold cross-validated "after" ECE (blocks split by their plan sample's parity, temperatures
fitted on one half, ECE measured on the other, the two halves' pooled ECEs weighted by their known slots),
which shows what the fit buys on data it did not see.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.fsio import atomic_write
from artcache.trainers.checkpoint import CheckpointState, find_checkpoint, read_state, read_weights, replace_file

from .adapter import CALIBRATION_KEY, HELDOUT_PREFIX, weights_check
from .metrics import ECE_BINS, _bin_sums

#: The report ``artcache calibrate`` writes into the checkpoint directory.
CALIBRATION_FILE = "calibration.json"

__all__ = ["CALIBRATION_TARGETS", "alpha_targets", "calibrate_checkpoint", "cumulative_ece", "fit_temperatures",
           "grid_edge_slots", "replay_targets", "temperature_grid"]


def temperature_grid() -> Tensor:
    """241 log-spaced temperatures in [0.05, 20] (float64), 1.0 among them."""
    return torch.logspace(math.log10(0.05), math.log10(20.0), 241, dtype=torch.float64)


#: ``artcache calibrate --against`` values: what the cumulative confidence is calibrated against (module
#: docstring); the first is the default.
CALIBRATION_TARGETS = ("replay", "alpha")


def _cum_parts(z: Tensor, target: Tensor, mask: Tensor, temps: Tensor, k: int) -> tuple[Tensor, Tensor]:
    rows = mask[:, k]
    c = torch.sigmoid(z[rows, : k + 1].double() / temps[: k + 1].double()).prod(dim=1)
    return c, target[rows, k].double()


def alpha_targets(alpha: Tensor, supervised: Tensor) -> tuple[Tensor, Tensor]:
    """(``Π_{i≤k} α_i`` [n, B] float64, 0 off the supervised prefix; the mask: ``supervised`` [n, B] bool)."""
    sup = supervised.bool()
    return (alpha.double() * sup).cumprod(dim=1), sup


def replay_targets(accepted: Tensor, truncated: Tensor, supervised: Tensor) -> tuple[Tensor, Tensor]:
    """The observed cumulative outcome of each block's greedy replay and where it is known.

    Args:
        accepted: [n] int64, proposals the walk accepted (no bonus; -1: no replay ran for the block).
        truncated: [n] bool, the walk was cut by the target's greedy path leaving the data (the outcome of
            slot ``accepted`` and later ones is unknown). supervised: [n, B] bool, the supervised prefix.

    Returns:
        (``y`` [n, B] float64: 1 where ``k < accepted``, else 0; ``known`` [n, B] bool: supervised, replayed,
        and not at or past a truncation).
    """
    n, B = supervised.shape
    k = torch.arange(B)[None, :]
    acc = accepted.long()[:, None]
    y = (k < acc).double()
    known = supervised.bool() & (acc >= 0) & ~(truncated.bool()[:, None] & (k >= acc))
    return y, known


def cumulative_ece(z: Tensor, alpha: Tensor, mask: Tensor, temps: Tensor, bins: int = ECE_BINS, *,
                   target: Tensor | None = None) -> tuple[list[float], float]:
    """(per-slot ECE of the cumulative product, pooled ECE over every slot's bins) for logits ``z`` ([n, B])
    under ``temps`` [B], against ``Π_{i≤k} α_i`` (``alpha`` [n, B], ``mask`` the supervised prefix) or, when
    ``target`` ([n, B] cumulative, e.g. :func:`replay_targets`) is given, against it over ``mask``; NaN where
    no row."""
    tgt = alpha_targets(alpha, mask)[0] if target is None else target
    per, err, n = [], 0.0, 0.0
    for k in range(z.shape[1]):
        c, a = _cum_parts(z, tgt, mask, temps, k)
        nb, ps, ts = _bin_sums(c, a, bins)
        total = float(nb.sum())
        e = float((ps - ts).abs().sum())
        per.append(e / total if total > 0 else math.nan)
        err, n = err + e, n + total
    return per, (err / n if n > 0 else math.nan)


def fit_temperatures(z: Tensor, alpha: Tensor, mask: Tensor, grid: Tensor | None = None, bins: int = ECE_BINS, *,
                     target: Tensor | None = None) -> list[float]:
    """STS (module docstring): one temperature per slot, fitted in slot order. A slot without rows keeps 1.0.

    Args:
        z: [n, B] confidence logits. alpha: [n, B] α. mask: [n, B] bool, the rows of each slot (the supervised
            prefix for α). target: [n, B] cumulative targets to fit against instead of ``Π_{i≤k} α_i``
            (``alpha`` is then unused), e.g. the observed outcome of :func:`replay_targets` with its mask.
    """
    grid = temperature_grid() if grid is None else grid.double()
    tgt = alpha_targets(alpha, mask)[0] if target is None else target
    B = z.shape[1]
    temps = torch.ones(B, dtype=torch.float64)
    for k in range(B):
        if not bool(mask[:, k].any()):
            continue
        best, best_t = math.inf, 1.0
        for t in grid.tolist():
            temps[k] = t
            c, a = _cum_parts(z, tgt, mask, temps, k)
            nb, ps, ts = _bin_sums(c, a, bins)
            e = float((ps - ts).abs().sum()) / float(nb.sum())
            if e < best - 1e-12 or (abs(e - best) <= 1e-12 and abs(math.log(t)) < abs(math.log(best_t))):
                best, best_t = e, t
        temps[k] = best_t
    return temps.tolist()


def grid_edge_slots(temps: list[float], mask: Tensor, grid: Tensor | None = None) -> list[int]:
    """Slots with rows whose fitted temperature is the grid's smallest or largest value (the fit hit the edge)."""
    grid = temperature_grid() if grid is None else grid.double()
    lo, hi = float(grid.min()), float(grid.max())
    return [k for k, t in enumerate(temps) if bool(mask[:, k].any()) and (math.isclose(t, lo) or math.isclose(t, hi))]


def _load_records(ckpt: Path) -> tuple[dict[str, Tensor], CheckpointState, dict[str, Tensor]]:
    state = read_state(ckpt)  # checked before any tensor is read
    if state.draft != "dspark":
        raise ConfigError(f"--checkpoint {ckpt} holds a {state.draft!r} draft; calibrate fits DSpark's "
                          "confidence head only")
    state, weights, extra = read_weights(ckpt)  # the digests checked first
    rec = {k[len(HELDOUT_PREFIX):]: v for k, v in extra.items() if k.startswith(HELDOUT_PREFIX)}
    if "position" in rec and "sample" not in rec:
        raise ConfigError(f"checkpoint {ckpt}: its held-out records are keyed by run position, which is the same "
                          "(-1) for every held-out sample, so they hold one sample's blocks; evaluate again (a run "
                          "with --eval-samples, or --resume it to a later step) and calibrate that checkpoint")
    evaluated = state.run.get("eval_samples") if isinstance(state.run, dict) else None
    if not {"conf_logit", "alpha", "supervised", "sample", "weights_check"} <= set(rec) and evaluated:
        raise ConfigError(f"checkpoint {ckpt} (step {state.step}) has no held-out confidence records: its run has "
                          f"--eval-samples {evaluated}, but no evaluation ran before this checkpoint (the run was "
                          "stopped before its final evaluation); resume the run to its end (--resume), or train "
                          "with --eval-interval N so evaluations land on checkpoints, and calibrate that checkpoint")
    if not {"conf_logit", "alpha", "supervised", "sample", "weights_check"} <= set(rec):
        raise ConfigError(f"checkpoint {ckpt} has no held-out confidence records: train with --eval-samples N "
                          "(the records come from the held-out evaluation) and calibrate that run's checkpoint")
    check = weights_check(weights)
    if not torch.allclose(check, rec["weights_check"].double(), rtol=1e-7, atol=1e-9):
        raise ConfigError(f"checkpoint {ckpt}: its held-out records come from other weights (an evaluation at "
                          "another step); calibrate the run's final checkpoint, or one written right after an "
                          "evaluation (--eval-interval a multiple of --save-every is not enough: the checkpoint "
                          "comes first)")
    return rec, state, extra


def calibrate_checkpoint(checkpoint: str | Path, *, against: str = CALIBRATION_TARGETS[0], bins: int = ECE_BINS
                         ) -> dict:
    """Fit STS temperatures on a DSpark checkpoint's held-out records; write ``calibration.json`` beside it.

    Args:
        checkpoint: a ``checkpoints/step-N`` directory or a consumer run directory (its latest).
        against: ``"replay"`` (observed greedy-replay acceptance, the default) or ``"alpha"`` (teacher-forced
            α): the cumulative target (module docstring).

    Returns:
        The report written: ``against``, ``temperatures`` [B], ``at_grid_edge`` (slots whose temperature is the
        grid's edge), ``ece_cum_before`` / ``ece_cum_after`` (per slot) and their pooled values
        ``ece_cum_pooled_before`` / ``_after``, ``ece_cum_pooled_after_crossval``, ``blocks``, ``samples``,
        ``known_slots`` (per slot, the blocks where the target is known), ``step``, ``bins``.

    Raises:
        ConfigError: not a DSpark checkpoint, no (or stale, or one-sample) held-out records, records without a
            replay for ``against="replay"``, too few blocks, an unknown ``against``.
        CheckpointCorrupt: a file it reads does not match the digest the checkpoint recorded.
    """
    if against not in CALIBRATION_TARGETS:
        raise ConfigError(f"--against {against!r}: accepted {', '.join(CALIBRATION_TARGETS)}")
    ckpt = find_checkpoint(checkpoint)
    if ckpt is None:
        raise ConfigError(f"--checkpoint {str(checkpoint)!r}: no state.json + model.safetensors there nor in its "
                          "checkpoints/latest; accepted: a DSpark checkpoint directory or its run directory")
    rec, state, extra = _load_records(ckpt)
    z, alpha, sup, sample = rec["conf_logit"].double(), rec["alpha"].double(), rec["supervised"].bool(), rec["sample"]
    if z.dim() != 2 or z.shape != alpha.shape or z.shape != sup.shape or sample.shape != (z.shape[0],):
        raise ConfigError(f"checkpoint {ckpt}: held-out records have inconsistent shapes {tuple(z.shape)}, "
                          f"{tuple(alpha.shape)}, {tuple(sup.shape)}, {tuple(sample.shape)}")
    if against == "replay":
        accepted, truncated = rec.get("accepted"), rec.get("truncated")
        if accepted is None or truncated is None or not bool((accepted >= 0).any()):
            raise ConfigError(f"checkpoint {ckpt}: its held-out records have no greedy-replay outcomes (the "
                              "evaluation had no target argmax); calibrate --against alpha")
        if accepted.shape != (z.shape[0],) or truncated.shape != (z.shape[0],):
            raise ConfigError(f"checkpoint {ckpt}: replay records {tuple(accepted.shape)}, {tuple(truncated.shape)} "
                              f"do not match {z.shape[0]} blocks")
        target, mask = replay_targets(accepted, truncated, sup)
    else:
        target, mask = alpha_targets(alpha, sup)
    if int(mask[:, 0].sum()) < 2:
        raise ConfigError(f"checkpoint {ckpt}: {int(mask[:, 0].sum())} held-out block(s); calibration needs more "
                          "(a larger --eval-samples)")
    B = z.shape[1]
    ones = torch.ones(B, dtype=torch.float64)
    temps = torch.tensor(fit_temperatures(z, alpha, mask, bins=bins, target=target), dtype=torch.float64)
    before, pooled_before = cumulative_ece(z, alpha, mask, ones, bins, target=target)
    after, pooled_after = cumulative_ece(z, alpha, mask, temps, bins, target=target)
    fold = (sample % 2).bool()
    err = n = 0.0
    for fit_on in (fold, ~fold):
        test = ~fit_on
        if not bool(mask[fit_on, 0].any()) or not bool(mask[test, 0].any()):
            continue
        t = torch.tensor(fit_temperatures(z[fit_on], alpha[fit_on], mask[fit_on], bins=bins, target=target[fit_on]),
                         dtype=torch.float64)
        _, e = cumulative_ece(z[test], alpha[test], mask[test], t, bins, target=target[test])
        w = float(mask[test].sum())
        err, n = err + e * w, n + w
    what = ("the observed greedy-replay acceptance of the first k+1 proposals" if against == "replay" else
            "the cumulative teacher-forced alpha")
    report = {
        "method": "STS: one temperature per slot, fitted slot by slot minimising the ECE of the cumulative "
                  f"product against {what} on the held-out split",
        "against": against, "temperatures": temps.tolist(), "at_grid_edge": grid_edge_slots(temps.tolist(), mask),
        "bins": bins, "blocks": int(sup[:, 0].sum()), "samples": int(torch.unique(sample).numel()),
        "known_slots": [int(x) for x in mask.sum(dim=0).tolist()], "step": state.step, "checkpoint": str(ckpt),
        "ece_cum_before": before, "ece_cum_after": after,
        "ece_cum_pooled_before": pooled_before, "ece_cum_pooled_after": pooled_after,
        "ece_cum_pooled_after_crossval": err / n if n > 0 else math.nan, "written_at": time.time(),
    }
    extra = {**extra, CALIBRATION_KEY: temps.clone()}
    replace_file(ckpt, "extra.safetensors", safetensors.torch.save(extra, metadata={"format": "pt"}))
    atomic_write(ckpt / CALIBRATION_FILE, [json.dumps(report, indent=2, allow_nan=True).encode()], ckpt)
    return report
