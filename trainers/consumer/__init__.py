"""The consumer: one draft trainer reading target hidden states from an artcache root at its own pace.

- :mod:`.config`: :class:`ConsumerConfig` (the ``artcache consume`` flags), :func:`parse_window`, :func:`lr_at`;
- :mod:`.reader`: the reader thread that leases positions inside the window, and :func:`collate`;
- :mod:`.restore`: where a run starts (``--resume``, ``--init-from``) and the checks that refuse a source;
- :mod:`.session`: :func:`run_consumer`, a :class:`Session` whose phases run in order (setup, resume,
  register, then the loop of step / checkpoint / evaluate, and close).
"""

from .config import ConsumerConfig, default_anchors, default_block_size, lr_at, parse_window
from .session import Session, run_consumer

__all__ = ["ConsumerConfig", "Session", "default_anchors", "default_block_size", "lr_at", "parse_window",
           "run_consumer"]
