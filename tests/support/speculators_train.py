"""Run speculators 0.9.0's own trainer (``speculators.train.cli.main``) on this machine's CPU, with the ``artcache``
hidden-states backend registered; print its per-step training losses.

Used by tests/speculators/test_speculators_backend.py under ``$ARTCACHE_SPECULATORS_PYTHON`` (a Python that imports
speculators==0.9.0 and this checkout's artcache; .ci/speculators-lane makes one). Arguments are speculators'
``train`` arguments. Three changes to speculators, for CPU only: its ``Trainer`` moves the model and each batch
to ``get_local_rank()`` (an int, i.e. a CUDA device), here ``"cpu"``; its checkpointer loads a checkpoint onto
``get_current_device()`` (``"cuda:0"`` without an accelerator), here ``"cpu"``; its step timer's
``torch.accelerator.synchronize()`` (which raises without an accelerator) is a no-op. Everything else
(argument resolution, the draft, the data set, its packing sampler, the collate, the loss, the optimizers,
the scheduler, checkpoints) is speculators' code as installed.

Prints ``SPECULATORS_LOSSES [[global_step, loss], ...]`` (every step: pass ``--log-freq 1``).
"""

from __future__ import annotations

import json
import logging
import sys

from artcache.trainers import speculators_backend


def main(argv: list[str]) -> None:
    speculators_backend.register()
    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer
    import torch
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    losses: list[list[float]] = []

    class Losses(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.msg
            if isinstance(msg, dict) and isinstance(msg.get("train"), dict) and "loss" in msg["train"]:
                losses.append([msg["global_step"], float(msg["train"]["loss"])])

    setup = cli.setup_metric_logger

    def setup_and_listen(*args, **kwargs):
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(Losses())

    cli.setup_metric_logger = setup_and_listen
    cli.main(TrainConfig.resolve(argv))
    print("SPECULATORS_LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
