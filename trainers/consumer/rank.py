"""The entry point of one rank of a consumer group that ``artcache consume --nproc N`` started
(:func:`artcache.trainers.consumer.group.launch`): a module of its own, so that the group module, which the
training session imports, never imports the session back."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import msgspec

from artcache.shutdown import die_with_parent
from artcache.trainers.consumer.group import LAUNCHER_PID_ENV, SUMMARY_ENV

__all__ = ["child_main"]


def _write_summary(summary: dict | None) -> None:
    """Rank 0's summary, where the launcher reads it (``SUMMARY_ENV``); nothing on the other ranks."""
    if summary is not None and os.environ.get(SUMMARY_ENV):
        Path(os.environ[SUMMARY_ENV]).write_text(json.dumps(summary))


def child_main() -> None:
    """One rank started by :func:`launch`: its config on stdin; exits as ``artcache consume`` does (0, 1 on a
    failure, 2 on bad input, with one line on stderr). Rank 0 writes its summary to the file ``SUMMARY_ENV`` names."""
    from artcache.errors import ArtcacheError
    from artcache.logs import setup_logging
    from artcache.trainers.consumer.config import ConsumerConfig
    from artcache.trainers.consumer.session import run_consumer

    # the launcher SIGKILLed (an OOM killer, a scheduler): every rank stops as on its SIGTERM, instead of training on
    # with no one watching it
    if die_with_parent(signal.SIGTERM) and os.getppid() != int(os.environ.get(LAUNCHER_PID_ENV, os.getppid())):
        sys.exit(143)  # the launcher died before the request took effect
    setup_logging(False)
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=ConsumerConfig)
    try:
        summary = run_consumer(cfg)
    except ArtcacheError as exc:
        prefix = "" if exc.exit_code == 2 else f"{type(exc).__name__}: "
        print(f"artcache: error: rank {os.environ.get('RANK')}: {prefix}{exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:  # Cancelled: stopped by a signal after the clean shutdown (rank 0 checkpointed)
        _write_summary(getattr(exc, "summary", None))
        sys.exit(getattr(exc, "exit_status", 130))
    _write_summary(summary)
