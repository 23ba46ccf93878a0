"""One logging setup for every artcache process (the CLI's verbs and the bench's role processes).

Records go to stderr as ``HH:MM:SS <logger> <LEVEL> <message>``; the libraries that log chattily at
INFO (filelock, urllib3, matplotlib, PIL) are held at WARNING.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]

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
