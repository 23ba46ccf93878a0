"""One logging setup for every artcache process (the CLI's verbs and the bench's role processes), and the one
progress bar they show on a terminal (:func:`progress_bar`).

Records go to stderr as ``HH:MM:SS <logger> <LEVEL> <message>``; the libraries that log chattily at
INFO (filelock, urllib3, matplotlib, PIL) are held at WARNING.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["progress_bar", "setup_logging"]

#: Loggers held at WARNING whatever the verbosity.
_NOISY = ("filelock", "urllib3", "matplotlib", "PIL")


def setup_logging(verbose: bool) -> None:
    """Configure the root logger: DEBUG when ``verbose``, else INFO (a no-op for the root handler when
    logging is already configured, as :func:`logging.basicConfig` is)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


#: the bar's size on a terminal that reports none (0 x 0: ``script`` without a terminal, ``docker exec -t``, some CI
#: and IDE terminals), where tqdm would size it from the terminal and hide it
FALLBACK_COLUMNS, FALLBACK_ROWS = 80, 24


def progress_bar(total: int, *, enabled: bool, desc: str, unit: str, initial: int = 0, **kwargs):
    """A tqdm bar on stderr, shown when ``enabled`` and stderr is a terminal (disabled otherwise: every method a
    no-op). A terminal that reports no size gets an 80-column bar: tqdm sizes its bar from the terminal and shows
    nothing at 0 x 0 (regression: ``artcache regenerate`` and the consumer showed no bar there). ``kwargs`` go to
    tqdm."""
    from tqdm import tqdm

    shown = enabled and sys.stderr.isatty()
    if shown:
        try:
            size = os.get_terminal_size(sys.stderr.fileno())
        except (OSError, ValueError):
            size = os.terminal_size((0, 0))
        if size.columns <= 0 or size.lines <= 0:
            kwargs.update(ncols=FALLBACK_COLUMNS, nrows=FALLBACK_ROWS, dynamic_ncols=False)
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=not shown, **kwargs)
