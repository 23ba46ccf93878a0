"""Graceful shutdown on SIGINT / SIGTERM, one rule for every artcache process (the producer, the consumer,
``artcache run``): the **first** signal asks to stop (sets an event the process's loop checks: the producer
finishes its batch, a consumer its step, ``artcache run`` forwards one SIGTERM to its roles), the **second**
forces (raises :class:`KeyboardInterrupt` in the main thread, where the handler runs, so the process unwinds
through its ``finally`` blocks at once), and the handlers that were installed before are put back when the
process leaves the block (a library caller, a test or an embedding program keeps its own).

    with GracefulShutdown("producer", event=producer.stop_event):
        producer.run()          # returns once stop_event is set; a second signal interrupts it

Python runs signal handlers only in the main thread, so outside it :meth:`GracefulShutdown.install` does
nothing (and says so by returning False); the event can still be set directly.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger("artcache.shutdown")

#: the signals a run stops on by default
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: the first stop signal any :class:`GracefulShutdown` of this process received (0: none)
_received = 0


def stop_exit_status() -> int:
    """The exit status of a process a stop signal cancelled: ``128 + signal`` (the shell's convention: 130 for
    SIGINT, 143 for SIGTERM), from the first signal a :class:`GracefulShutdown` of this process handled; 130 when
    none did (a plain Ctrl-C raises :class:`KeyboardInterrupt` without one)."""
    return 128 + (_received or int(signal.SIGINT))


def cancelled_line(code: int) -> str:
    """The one line (for stderr) of a command a stop signal cancelled with exit status ``code`` (``128 +
    signal``, :func:`stop_exit_status`): ``artcache: cancelled by SIGINT (exit 130)``."""
    return f"artcache: cancelled by {signal.Signals(code - 128).name} (exit {code})"


class GracefulShutdown:
    """First signal: ask (``requested`` set, ``signum`` recorded, ``on_request`` called); second: force.

    Args:
        what: the process, for the log line (``"producer"``, ``"[dflash-b16]"``).
        event: the event to set on the first signal (default: a new one, :attr:`requested`).
        signals: the signals handled (default SIGINT and SIGTERM).
        asked: what the first signal does, for the log (e.g. ``"stopping after the current step"``).
        on_request: called with the signal number on the first signal (in the main thread, inside the
            handler: keep it short and never block).

    Attributes:
        requested: set by the first signal. signum: that signal's number (0: none yet).
        forced: True once a second signal forced the stop.
    """

    def __init__(self, what: str, *, event: threading.Event | None = None,
                 signals: Iterable[int] = STOP_SIGNALS, asked: str = "stopping",
                 on_request: Callable[[int], None] | None = None) -> None:
        self.what, self.asked, self.on_request = what, asked, on_request
        self.requested = event if event is not None else threading.Event()
        self.signals = tuple(signals)
        self.signum = 0
        self.forced = False
        self.previous: dict[int, object] = {}

    def install(self) -> bool:
        """Install the handler for every signal, keeping the ones it replaces. Returns False (nothing
        installed) outside the main thread, where Python cannot install signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            if sig not in self.previous:
                self.previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced (idempotent)."""
        while self.previous:
            sig, handler = self.previous.popitem()
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.requested.is_set() and self.signum:
            self.forced = True
            log.warning("%s: second signal (%s): stopping at once", self.what, name)
            raise KeyboardInterrupt(f"signal {signum} (second)")
        self.signum = signum
        global _received
        _received = _received or signum
        self.requested.set()
        log.warning("%s: %s: %s (send it again to stop at once)", self.what, name, self.asked)
        if self.on_request is not None:
            self.on_request(signum)

    def __enter__(self) -> GracefulShutdown:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


class Forwarding:
    """For a launcher whose children stop themselves (a consumer group's ranks): every stop signal it receives is
    passed to ``forward(signum)`` (which sends it on), the first and every later one alike, so each child applies
    the one rule of :class:`GracefulShutdown` itself; the handlers it replaced come back when the block ends.
    Outside the main thread nothing is installed.

        with Forwarding(lambda signum: [p.send_signal(signum) for p in procs]):
            wait_for(procs)
    """

    def __init__(self, forward: Callable[[int], None], signals: Iterable[int] = STOP_SIGNALS) -> None:
        self.forward, self.signals = forward, tuple(signals)
        self.previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame) -> None:
        global _received
        _received = _received or signum
        log.warning("%s: passed on to the processes this one started", signal.Signals(signum).name)
        self.forward(signum)

    def __enter__(self) -> Forwarding:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        while self.previous:
            sig, handler = self.previous.popitem()
            signal.signal(sig, handler)


class Cancelled(KeyboardInterrupt):
    """A run a stop signal ended, after its clean-up (a consumer: checkpointed, fenced as cancelled): a
    :class:`KeyboardInterrupt`, so every ``except KeyboardInterrupt`` keeps treating it as one, that also carries
    the signal (``signum``; 0 when unknown) and what the run has to say (``summary``, or None).

    :attr:`exit_status` is the shell's convention for a process a signal ended: 128 + the signal's number (SIGINT:
    130, SIGTERM: 143); without ``signum``, :func:`stop_exit_status`'s."""

    def __init__(self, signum: int = 0, summary: dict | None = None) -> None:
        name = signal.Signals(signum).name if signum else "an interrupt"
        super().__init__(f"stopped by {name}")
        self.signum, self.summary = signum, summary

    @property
    def exit_status(self) -> int:
        return 128 + self.signum if self.signum else stop_exit_status()

    def __reduce__(self):
        return type(self), (self.signum, self.summary)


def follow_parent() -> bool:
    """For a helper process its parent stops (a consumer's ``--reader process``): ignore the stop signals (a signal
    to the process group is the parent's to handle: it stops the helper through its own channel), and ask Linux to
    SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``; from the main thread, before any other thread
    starts). Returns False when the request is not available (not Linux): the helper must then also stop at the end
    of its parent's pipe, which it does anyway. The parent may have died before the request took effect: the caller
    compares ``os.getppid()`` with the parent's pid it was given (not with 1: a container's entry point is pid 1)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    return die_with_parent(signal.SIGKILL)


def die_with_parent(signum: int) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent dies (``PR_SET_PDEATHSIG``; call it from the main
    thread). Returns False where the request is not available (not Linux). As :func:`follow_parent` says, the parent
    may have died before the request took effect: the caller compares ``os.getppid()`` with the pid it expects."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(signum), 0, 0, 0) == 0  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return False


__all__ = ["STOP_SIGNALS", "Cancelled", "Forwarding", "GracefulShutdown", "die_with_parent", "follow_parent",
           "stop_exit_status"]
