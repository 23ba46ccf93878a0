"""Post-hoc calibration of DSpark's confidence head: sequential temperature scaling (STS).

The confidence head predicts ``c_k = sigmoid(z_k)``, the probability that slot k is accepted given every
earlier slot was; what a serving engine acts on is the cumulative ``Π_{i≤k} c_i`` (the probability that the
first k+1 proposals are all accepted). STS fits one temperature per slot, ``c_k = sigmoid(z_k / T_k)``,
slot by slot in order: for k = 0 … B-1, ``T_k`` is the grid value minimising the expected calibration error
(10 equal-width bins) of ``Π_{i≤k} sigmoid(z_i / T_i)`` against ``Π_{i≤k} α_i`` over the held-out blocks whose
slot k is supervised, ``T_0 … T_{k-1}`` fixed. The grid is 241 log-spaced values in [0.05, 20] and always
includes 1 (no change), so a fitted slot never has a higher ECE than before on the fitting data.

The data: the held-out split's per-block confidence logits, α and supervised prefix, which a DSpark
consumer records at every held-out evaluation and saves with its checkpoint (``heldout.*`` in
extra.safetensors, tied to the weights by :func:`~.adapter.weights_check`). The temperatures go into the
checkpoint's extra.safetensors (``calibration.temperatures``, the file and its digest in state.json replaced
atomically: :func:`~artcache.trainers.checkpoint.replace_file`) and the report
into ``calibration.json`` beside it; ``artcache export`` writes the temperatures into the exported config
(``confidence_temperatures``).

Also reported: a 2-fold cross-validated "after" ECE (blocks split by their sample's plan position parity,
temperatures fitted on one half, ECE measured on the other), which shows what the fit buys on data it did
not see.
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

__all__ = ["calibrate_checkpoint", "cumulative_ece", "fit_temperatures", "temperature_grid"]


def temperature_grid() -> Tensor:
    """241 log-spaced temperatures in [0.05, 20] (float64), 1.0 among them."""
    return torch.logspace(math.log10(0.05), math.log10(20.0), 241, dtype=torch.float64)


def _cum_parts(z: Tensor, alpha: Tensor, mask: Tensor, temps: Tensor, k: int) -> tuple[Tensor, Tensor]:
    rows = mask[:, k]
    c = torch.sigmoid(z[rows, : k + 1].double() / temps[: k + 1].double()).prod(dim=1)
    a = alpha[rows, : k + 1].double().prod(dim=1)
    return c, a


def cumulative_ece(z: Tensor, alpha: Tensor, mask: Tensor, temps: Tensor,
                   bins: int = ECE_BINS) -> tuple[list[float], float]:
    """(per-slot ECE of the cumulative product, pooled ECE over every slot's bins) for logits ``z``, targets
    ``alpha`` and supervised prefix ``mask`` ([n, B]) under ``temps`` [B]; NaN where no row."""
    per, err, n = [], 0.0, 0.0
    for k in range(z.shape[1]):
        c, a = _cum_parts(z, alpha, mask, temps, k)
        nb, ps, ts = _bin_sums(c, a, bins)
        total = float(nb.sum())
        e = float((ps - ts).abs().sum())
        per.append(e / total if total > 0 else math.nan)
        err, n = err + e, n + total
    return per, (err / n if n > 0 else math.nan)


def fit_temperatures(z: Tensor, alpha: Tensor, mask: Tensor, grid: Tensor | None = None, bins: int = ECE_BINS
                     ) -> list[float]:
    """STS (module docstring): one temperature per slot, fitted in slot order. A slot without rows keeps 1.0.

    Args:
        z: [n, B] confidence logits. alpha: [n, B] α targets. mask: [n, B] bool supervised prefix.
    """
    grid = temperature_grid() if grid is None else grid.double()
    B = z.shape[1]
    temps = torch.ones(B, dtype=torch.float64)
    for k in range(B):
        if not bool(mask[:, k].any()):
            continue
        best, best_t = math.inf, 1.0
        for t in grid.tolist():
            temps[k] = t
            c, a = _cum_parts(z, alpha, mask, temps, k)
            nb, ps, ts = _bin_sums(c, a, bins)
            e = float((ps - ts).abs().sum()) / float(nb.sum())
            if e < best - 1e-12 or (abs(e - best) <= 1e-12 and abs(math.log(t)) < abs(math.log(best_t))):
                best, best_t = e, t
        temps[k] = best_t
    return temps.tolist()


def _load_records(ckpt: Path) -> tuple[dict[str, Tensor], CheckpointState, dict[str, Tensor]]:
    state = read_state(ckpt)  # checked before any tensor is read
    if state.draft != "dspark":
        raise ConfigError(f"--checkpoint {ckpt} holds a {state.draft!r} draft; calibrate fits DSpark's "
                          "confidence head only")
    state, weights, extra = read_weights(ckpt)  # the digests checked first
    rec = {k[len(HELDOUT_PREFIX):]: v for k, v in extra.items() if k.startswith(HELDOUT_PREFIX)}
    if not {"conf_logit", "alpha", "supervised", "position", "weights_check"} <= set(rec):
        raise ConfigError(f"checkpoint {ckpt} has no held-out confidence records: train with --eval-samples N "
                          "(the records come from the held-out evaluation) and calibrate that run's checkpoint")
    check = weights_check(weights)
    if not torch.allclose(check, rec["weights_check"].double(), rtol=1e-7, atol=1e-9):
        raise ConfigError(f"checkpoint {ckpt}: its held-out records come from other weights (an evaluation at "
                          "another step); calibrate the run's final checkpoint, or one written right after an "
                          "evaluation (--eval-interval a multiple of --save-every is not enough: the checkpoint "
                          "comes first)")
    return rec, state, extra


def calibrate_checkpoint(checkpoint: str | Path, *, bins: int = ECE_BINS) -> dict:
    """Fit STS temperatures on a DSpark checkpoint's held-out records; write ``calibration.json`` beside it.

    Args:
        checkpoint: a ``checkpoints/step-N`` directory or a consumer run directory (its latest).

    Returns:
        The report written: ``temperatures`` [B], ``ece_cum_before`` / ``ece_cum_after`` (per slot) and
        their pooled values ``ece_cum_pooled_before`` / ``_after``, ``ece_cum_pooled_after_crossval``,
        ``blocks``, ``samples``, ``step``, ``bins``.

    Raises:
        ConfigError: not a DSpark checkpoint, no (or stale) held-out records, too few blocks.
        CheckpointCorrupt: a file it reads does not match the digest the checkpoint recorded.
    """
    ckpt = find_checkpoint(checkpoint)
    if ckpt is None:
        raise ConfigError(f"--checkpoint {str(checkpoint)!r}: no state.json + model.safetensors there nor in its "
                          "checkpoints/latest; accepted: a DSpark checkpoint directory or its run directory")
    rec, state, extra = _load_records(ckpt)
    z, alpha, mask, pos = rec["conf_logit"].double(), rec["alpha"].double(), rec["supervised"].bool(), rec["position"]
    if z.dim() != 2 or z.shape != alpha.shape or z.shape != mask.shape or pos.shape != (z.shape[0],):
        raise ConfigError(f"checkpoint {ckpt}: held-out records have inconsistent shapes {tuple(z.shape)}, "
                          f"{tuple(alpha.shape)}, {tuple(mask.shape)}, {tuple(pos.shape)}")
    if int(mask[:, 0].sum()) < 2:
        raise ConfigError(f"checkpoint {ckpt}: {int(mask[:, 0].sum())} held-out block(s); calibration needs more "
                          "(a larger --eval-samples)")
    B = z.shape[1]
    ones = torch.ones(B, dtype=torch.float64)
    temps = torch.tensor(fit_temperatures(z, alpha, mask, bins=bins), dtype=torch.float64)
    before, pooled_before = cumulative_ece(z, alpha, mask, ones, bins)
    after, pooled_after = cumulative_ece(z, alpha, mask, temps, bins)
    fold = (pos % 2).bool()
    err = n = 0.0
    for fit_on in (fold, ~fold):
        test = ~fit_on
        if not bool(mask[fit_on, 0].any()) or not bool(mask[test, 0].any()):
            continue
        t = torch.tensor(fit_temperatures(z[fit_on], alpha[fit_on], mask[fit_on], bins=bins), dtype=torch.float64)
        _, e = cumulative_ece(z[test], alpha[test], mask[test], t, bins)
        w = float(mask[test].sum())
        err, n = err + e * w, n + w
    report = {
        "method": "STS: one temperature per slot, fitted slot by slot minimising the ECE of the cumulative "
                  "product against the cumulative alpha on the held-out split",
        "temperatures": temps.tolist(), "bins": bins, "blocks": int(mask[:, 0].sum()),
        "samples": int(torch.unique(pos).numel()), "step": state.step, "checkpoint": str(ckpt),
        "ece_cum_before": before, "ece_cum_after": after,
        "ece_cum_pooled_before": pooled_before, "ece_cum_pooled_after": pooled_after,
        "ece_cum_pooled_after_crossval": err / n if n > 0 else math.nan, "written_at": time.time(),
    }
    extra = {**extra, CALIBRATION_KEY: temps.clone()}
    replace_file(ckpt, "extra.safetensors", safetensors.torch.save(extra, metadata={"format": "pt"}))
    atomic_write(ckpt / CALIBRATION_FILE, [json.dumps(report, indent=2, allow_nan=True).encode()], ckpt)
    return report
