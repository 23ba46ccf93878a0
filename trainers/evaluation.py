"""Held-out evaluation of a consumer's draft on the plan's held-out split.

Split (decided here, documented in docs/training.md): with ``--eval-samples E`` the **last E samples of
the plan**, ``[len(plan) - E, len(plan))``, are the held-out split. A consumer that evaluates never trains
on them: its positions walk the plan's first ``len(plan) - E`` samples only, epoch after epoch
(:class:`artcache.plan.EpochOrder` with that ``epoch_len``; ``Registration.epoch_len``), so any number of
steps or ``--epochs`` keeps the split out of training. Held-out samples are read by sample index
(``CacheClient.acquire_sample``: no run position), pinned in the consumer's registration
(``Registration.pinned``): the producer retains those artifacts while the consumer is live, counts them in
the window bound, prefetches them after every window position and captures them on demand, so an
evaluation never breaks the eviction invariants. Consumers that share a root and are compared with each
other should use the same ``--eval-samples`` (the split depends only on E and the plan).

Metrics (sums divided once over the whole split, see :class:`artcache.trainers.draft.MetricSums`): the
draft's loss, per-position accuracy ``acc_k``, DFlash τ (mean accepted length per block **including
the +1 bonus token**) over every eligible anchor, EAGLE-3 ``simulated_acc_len``; and a greedy
acceptance replay against the **target's own argmax** when the root captures the target's last
layer (output-of-layer ``L - 1``): ``argmax(lm_head(final_norm(h_{L-1})))``. Without it the
acceptance figures use the data tokens and the summary says so (``labels``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.target import load_final_norm
from artcache.trainers.draft import MetricSums

log = logging.getLogger("artcache.consumer")


def heldout_samples(plan, eval_samples: int, name: str = "--eval-samples") -> int:
    """The held-out split's size for a consumer of ``plan`` that asked for ``eval_samples``: a plan with an
    evaluation source (``data.eval``; :attr:`artcache.plan.Plan.heldout` > 0) fixes it to that source's samples
    for every consumer (0, or the same number, is accepted); otherwise ``eval_samples`` as given.

    Raises:
        ConfigError: ``eval_samples`` differs from the plan's held-out split (one line naming both).
    """
    held = plan.heldout
    if not held or eval_samples in (0, held):
        return held or eval_samples
    raise ConfigError(f"{name} {eval_samples} differs from the plan's held-out split: its last {held} samples come "
                      f"from its evaluation source (data.eval) and every consumer evaluates on them; accepted: 0 "
                      f"(left out) or {held}")


def eval_split(plan_len: int, eval_samples: int, name: str = "--eval-samples",
               limit: str = "", need_split: bool = False) -> tuple[int, int]:
    """The held-out sample indices ``[lo, hi)`` (``(0, 0)`` when ``eval_samples`` is 0); training walks the
    plan's first ``lo`` samples (``epoch_len``; all of it without a split). ``name`` names the setting and
    ``limit`` where ``plan_len`` comes from (default: the plan's length), in the message (a run's dry run
    checks a config's ``eval_samples`` against the same plan's length, naming ``data.max_samples`` too);
    ``need_split``: the caller refuses 0 itself (a script that exists for the split), so the accepted range
    starts at 1.

    Raises:
        ConfigError: ``eval_samples`` leaves no training sample.
    """
    if eval_samples <= 0:
        return (0, 0)
    if eval_samples >= plan_len:
        raise ConfigError(f"{name} {eval_samples} leaves no training sample: "
                          f"{limit or f'the plan has {plan_len} samples'}; accepted: "
                          f"{'1' if need_split else '0 (no held-out split)'} .. {plan_len - 1}")
    return (plan_len - eval_samples, plan_len)


def epoch_steps(epochs: int, epoch_len: int, batch_size: int) -> int:
    """Optimizer steps of ``epochs`` passes over ``epoch_len`` training samples: ``epochs × epoch_len //
    batch_size`` (a last partial batch is not taken).

    Raises:
        ConfigError: not even one step (the training part is smaller than one batch).
    """
    steps = epochs * epoch_len // batch_size
    if steps < 1:
        raise ConfigError(f"--epochs {epochs} over {epoch_len} training samples is not one batch of {batch_size}; "
                          "raise --epochs or lower --batch-size")
    return steps


def target_argmax_fn(info, lm_head: Tensor, device: torch.device) -> Callable[[Tensor], Tensor]:
    """``h [n, H] (output-of-layer L-1, un-normed) -> argmax(lm_head(RMSNorm(h))) [n] long``.

    RMSNorm as the target's (``y = h / sqrt(mean(h²) + eps) · w``, float32; eps = the target config's
    ``rms_norm_eps``). Rows are processed 256 at a time so ``rows × vocab`` never materialises at once.

    Raises:
        ConfigError: the target's final norm is not an RMSNorm or cannot be read.
    """
    weight = load_final_norm(info).to(device=device, dtype=torch.float32)
    cfg = json.loads((Path(info.path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    head = lm_head.to(device)

    def fn(h: Tensor) -> Tensor:
        out = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        for s in range(0, h.shape[0], 256):
            x = h[s:s + 256].float()
            x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
            out[s:s + 256] = torch.nn.functional.linear(x.to(head.dtype), head).argmax(dim=-1)
        return out

    return fn


class Evaluator:
    """Evaluates a draft on the pinned held-out samples.

    Args:
        draft: a :class:`artcache.trainers.draft.Draft`.
        client: the consumer's :class:`artcache.client.CacheClient` (leases each sample while read).
        positions: the held-out split (plan sample indices).
        batch_size: positions per forward.
        collate: ``(items, with_last_layer) -> DraftBatch`` (the consumer's collate with its layer view).
        target_argmax: see :func:`target_argmax_fn`, or None (data tokens only).
        stop: set to abandon an evaluation (the consumer is stopping).
    """

    def __init__(self, draft, client, positions: range, batch_size: int, collate,
                 target_argmax: Callable[[Tensor], Tensor] | None, stop: threading.Event) -> None:
        self.draft, self.client, self.positions = draft, client, positions
        self.batch_size, self.collate, self.target_argmax, self.stop = batch_size, collate, target_argmax, stop

    @property
    def labels(self) -> str:
        """What the acceptance replay compares against."""
        return "target argmax" if self.target_argmax is not None else "data tokens"

    def run(self) -> dict:
        """One pass over the split; returns the draft's summary plus ``labels`` and ``samples``."""
        model = self.draft.model
        was_training = model.training
        model.eval()
        sums = MetricSums()
        pos = list(self.positions)
        # every missing split position becomes demand at once: the producer captures them together
        # (regression: one producer batch per eval sample when each acquire announced its own demand)
        self.client.want_samples(pos)
        try:
            for s in range(0, len(pos), self.batch_size):
                if self.stop.is_set():  # SIGTERM/Ctrl-C: a full pass can take minutes on a CPU
                    raise InterruptedError("stopped during evaluation")
                items = []
                try:
                    for p in pos[s:s + self.batch_size]:
                        items.append(self.client.acquire_sample(p, self.stop))
                    batch = self.collate(items, self.target_argmax is not None)
                    # a held-out row's run position is -1: the plan sample index is its identity
                    batch.samples = tuple(pos[s:s + self.batch_size])
                    argmax = None
                    if self.target_argmax is not None and batch.last_layer is not None:
                        b, T, H = batch.last_layer.shape
                        argmax = self.target_argmax(batch.last_layer.reshape(b * T, H)).reshape(b, T)
                    with torch.no_grad():
                        sums = sums + self.draft.evaluate(batch, argmax)
                finally:
                    for it in items:
                        self.client.release(it)
        finally:
            self.client.unwant(pos, held_out=True)
            model.train(was_training)
        out = self.draft.summary(sums)
        out["labels"] = self.labels
        out["samples"] = len(self.positions)
        return out
