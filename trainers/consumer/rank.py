"""The entry point of one rank of a consumer group that ``artcache consume --nproc N`` started
(:func:`artcache.trainers.consumer.group.launch`): a module of its own, so that the group module, which the
training session imports, never imports the session back."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import msgspec

from artcache.shutdown import die_with_parent
from artcache.trainers.consumer.group import BEAT_S, GROUP_DIR_ENV, LAUNCHER_PID_ENV, SUMMARY_ENV, rank_file

__all__ = ["child_main"]


def _write_summary(summary: dict | None) -> None:
    """Rank 0's summary, where the launcher reads it (``SUMMARY_ENV``); nothing on the other ranks."""
    if summary is not None and os.environ.get(SUMMARY_ENV):
        Path(os.environ[SUMMARY_ENV]).write_text(json.dumps(summary))


def _beat(path: Path) -> None:
    """Touch ``path`` every :data:`~.group.BEAT_S` seconds while this process runs: a thread of its own, so a rank
    waiting in a collective keeps beating and a stopped (``SIGSTOP``) or frozen one does not (the launcher's
    watch, :func:`~.group.launch`)."""
    path.touch()
    while True:
        time.sleep(BEAT_S)
        try:
            os.utime(path)
        except OSError:  # the launcher is gone with its directory: the rank stops on its own (die_with_parent)
            return


def _record(exc: BaseException, rank: str) -> bool:
    """Leave the error that ends this rank for the launcher (``error-<rank>`` in its directory: the launcher
    reports the group's one error, :func:`~.group.launch`); False outside a launcher's group (torchrun)."""
    from artcache.trainers.consumer.reader_process import failure_of

    directory = os.environ.get(GROUP_DIR_ENV)
    if not directory:
        return False
    try:
        rank_file(Path(directory), "error", int(rank)).write_bytes(msgspec.json.encode(failure_of(exc)))
    except OSError:
        return False
    return True


def child_main() -> None:
    """One rank started by :func:`launch`: its config on stdin; exits as ``artcache consume`` does (0, 1 on a
    failure, 2 on bad input). Under the launcher a rank leaves its error in the launcher's directory
    (``GROUP_DIR_ENV``) instead of printing it, so the group prints one line, not one per rank; it touches its
    beat file there (:func:`_beat`). Rank 0 writes its summary to the file ``SUMMARY_ENV`` names."""
    from artcache.errors import ArtcacheError
    from artcache.logs import setup_logging
    from artcache.trainers.consumer.config import ConsumerConfig
    from artcache.trainers.consumer.session import run_consumer

    # the launcher SIGKILLed (an OOM killer, a scheduler): every rank stops as on its SIGTERM, instead of training on
    # with no one watching it
    if die_with_parent(signal.SIGTERM) and os.getppid() != int(os.environ.get(LAUNCHER_PID_ENV, os.getppid())):
        sys.exit(143)  # the launcher died before the request took effect
    rank = os.environ.get("RANK", "0")
    if os.environ.get(GROUP_DIR_ENV):
        beat = rank_file(Path(os.environ[GROUP_DIR_ENV]), "beat", int(rank))
        threading.Thread(target=_beat, args=(beat,), daemon=True, name="artcache-rank-beat").start()
    setup_logging(False)
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=ConsumerConfig)
    try:
        summary = run_consumer(cfg)
    except ArtcacheError as exc:
        if not _record(exc, rank):
            prefix = "" if exc.exit_code == 2 else f"{type(exc).__name__}: "
            print(f"artcache: error: rank {rank}: {prefix}{exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:  # Cancelled: stopped by a signal after the clean shutdown (rank 0 checkpointed)
        _write_summary(getattr(exc, "summary", None))
        sys.exit(getattr(exc, "exit_status", 130))
    except Exception as exc:  # a failed collective, a bug: the launcher prints the traceback of the rank it names
        if not _record(exc, rank):
            raise
        rank_file(Path(os.environ[GROUP_DIR_ENV]), "trace", int(rank)).write_text(traceback.format_exc())
        sys.exit(1)
    _write_summary(summary)
