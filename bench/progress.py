"""What a bench mode is doing while it runs, read from the cache roots' journals (never from the roles' logs).

:class:`ModeProgress` follows the journals of a mode's roots incrementally (:func:`artcache.journal.read_files`
from the offsets read so far): each consumer's last journaled optimizer step (``Step.step``) against its planned
steps, and the captures the mode's producers journaled (``Capture`` events; recaptures counted among them). On a
terminal it draws one tqdm bar per consumer and one for the captures (stderr); elsewhere (a log file, CI) it
writes one line every ``every_s`` seconds and one at the end, so a long mode is never silent.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from artcache import journal as J
from artcache.layout import CacheLayout


class ModeProgress:
    """Progress of one mode: ``roots`` its cache roots, ``planned`` each consumer's planned steps (warm-up
    included), ``mode`` its name. ``bars``: tqdm bars (None: when ``stream`` is a terminal). ``every_s``: seconds
    between two plain lines when there are no bars."""

    def __init__(self, mode: str, roots: list[Path], planned: dict[str, int], *, stream: TextIO | None = None,
                 bars: bool | None = None, every_s: float = 30.0) -> None:
        self.mode, self.roots, self.planned = mode, [Path(r) for r in roots], dict(planned)
        self.stream = stream if stream is not None else sys.stderr
        self.bars_on = self.stream.isatty() if bars is None else bars
        self.every_s = every_s
        self.since: dict[Path, dict[str, int]] = {r: {} for r in self.roots}
        self.steps = {cid: 0 for cid in self.planned}
        self.captures = self.recaptures = 0
        self.t0 = time.monotonic()
        self.t_line = self.t0
        self.bars: dict[str, object] = {}
        if self.bars_on:
            from tqdm import tqdm

            width = max(len(c) for c in [*self.planned, "captures"])
            for k, (cid, total) in enumerate(self.planned.items()):
                self.bars[cid] = tqdm(total=total, desc=f"{mode} {cid:<{width}}", unit="step", position=k,
                                      file=self.stream, leave=True, dynamic_ncols=True)
            self.bars["captures"] = tqdm(total=None, desc=f"{mode} {'captures':<{width}}", unit="capture",
                                         position=len(self.planned), file=self.stream, leave=True,
                                         dynamic_ncols=True)

    def poll(self) -> None:
        """Read what the journals gained since the last poll and show it."""
        for root in self.roots:
            jdir = CacheLayout(root).journal
            for jf in J.read_files(jdir, self.since[root]):
                self.since[root][jf.path.name] = jf.end
                for ev in jf.events:
                    if isinstance(ev, J.Step) and ev.consumer in self.steps:
                        self.steps[ev.consumer] = max(self.steps[ev.consumer], ev.step)
                    elif isinstance(ev, J.Capture):
                        self.captures += 1
                        self.recaptures += ev.recapture
        if self.bars_on:
            for cid, n in self.steps.items():
                bar = self.bars[cid]
                bar.update(min(n, bar.total) - bar.n)
            bar = self.bars["captures"]
            bar.update(self.captures - bar.n)
            if self.recaptures:
                bar.set_postfix_str(f"{self.recaptures} recaptures", refresh=False)
        elif time.monotonic() - self.t_line >= self.every_s:
            self.t_line = time.monotonic()
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        """One line: the mode, seconds so far, each consumer's steps, the captures."""
        steps = ", ".join(f"{cid} {n}/{self.planned[cid]} steps" for cid, n in self.steps.items())
        rec = f" ({self.recaptures} recaptures)" if self.recaptures else ""
        return f"   mode {self.mode}, {time.monotonic() - self.t0:.0f} s: {steps}; {self.captures} captures{rec}"

    def close(self) -> None:
        """A last poll, then the bars closed (or the last line written)."""
        self.poll()
        if self.bars_on:
            for bar in self.bars.values():
                bar.close()
        else:
            self.stream.write(self.line() + "\n")
            self.stream.flush()


__all__ = ["ModeProgress"]
