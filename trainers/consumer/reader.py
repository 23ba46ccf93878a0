"""The consumer's reader thread and batch collation.

:class:`Reader` leases and reads batches of consecutive positions ahead of the trainer, inside the
window ``[cursor, cursor + lookahead]``; it cannot move the window (the trainer commits the cursor and
then calls :meth:`Reader.authorize`). :func:`collate` pads a batch into a
:class:`~artcache.trainers.draft.DraftBatch` holding the draft's view of the captured layers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from artcache import registry
from artcache.client import CacheClient, Leased
from artcache.layer_ids import select_layers
from artcache.layout import CacheLayout
from artcache.trainers.draft import DraftBatch

__all__ = ["Reader", "collate", "drain", "group_cursor"]


class Reader(threading.Thread):
    """Leases and reads batches of consecutive positions, never beyond ``cursor + lookahead``.

    It cannot move the window: the trainer commits the cursor and calls :meth:`authorize`.
    Results (lists of :class:`Leased`, or the exception that stopped it) go to ``out``.
    """

    def __init__(self, client: CacheClient, start_pos: int, batch: int, lookahead: int, depth: int,
                 end: int, group_cursor: Callable[[], int] | None = None) -> None:
        super().__init__(daemon=True, name="artcache-reader")
        self.client, self.next_pos, self.batch, self.lookahead = client, start_pos, batch, lookahead
        self.end = end  # exclusive: the consumer never reads at or past its announced end
        self.group_cursor = group_cursor  # lockstep: the group's min committed cursor (registry poll)
        self.out: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self._cond = threading.Condition()
        self._cursor = start_pos

    def authorize(self, cursor: int) -> None:
        with self._cond:
            self._cursor = cursor
            self._cond.notify_all()

    def _authorized(self, p: int) -> bool:
        """p lies inside ``[cursor, cursor + lookahead]`` and, in a lockstep group, below the group's
        min committed cursor + one batch (every member committed the batches before p's)."""
        if p > self._cursor + self.lookahead:
            return False
        return self.group_cursor is None or p < self.group_cursor() + self.batch

    def run(self) -> None:
        try:
            while not self.stop.is_set() and self.next_pos + self.batch <= self.end:
                items = []
                for p in range(self.next_pos, self.next_pos + self.batch):
                    with self._cond:
                        while not self._authorized(p) and not self.stop.is_set():
                            self._cond.wait(0.05 if self.group_cursor else 0.1)
                    if self.stop.is_set():
                        break
                    try:
                        items.append(self.client.acquire(p, self.stop))
                    except BaseException:  # the partial batch's leases (regression: leaked on CaptureTimeout)
                        for it in items:
                            self.client.release(it)
                        raise
                if self.stop.is_set():
                    for it in items:
                        self.client.release(it)
                    return
                self.next_pos += self.batch
                while not self.stop.is_set():
                    try:
                        self.out.put(items, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                else:
                    for it in items:
                        self.client.release(it)
        except InterruptedError:
            return
        except BaseException as exc:  # handed to the trainer, which re-raises it
            self.out.put(exc)


def collate(items: list[Leased], device: torch.device, layers: slice | torch.Tensor | None = None,
            last_layer: int | None = None) -> DraftBatch:
    """Pad a batch into a :class:`~artcache.trainers.draft.DraftBatch` on ``device``.

    ``hidden`` [b, T, m, H] (zeros past each length) holds the draft's *view* of the captured layers:
    ``layers`` indexes the artifact's layer axis (a ``slice`` for a contiguous run, so a batch of one
    stays a view of the read buffer with no host copy; an index tensor otherwise, which copies only
    the m layers read; None = all). ``input_ids`` [b, T] long, ``loss_mask`` and ``valid`` [b, T]
    bool. ``last_layer``: index of output-of-layer L-1 in the artifact, copied to ``last_layer``
    [b, T, H] (held-out replay against the target's argmax), or None.
    """
    lengths = [it.artifact.input_ids.shape[0] for it in items]
    t = max(lengths)
    full = items[0].artifact.hidden_states
    first = full if layers is None else select_layers(full, layers)
    b, m, h = len(items), first.shape[1], first.shape[2]
    gpu = device.type == "cuda"
    if b == 1:
        hidden = first[None]
    else:
        hidden = torch.zeros(b, t, m, h, dtype=first.dtype, pin_memory=gpu)
        for i, it in enumerate(items):
            hs = it.artifact.hidden_states
            hidden[i, : lengths[i]] = hs if layers is None else select_layers(hs, layers)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    valid = torch.zeros(b, t, dtype=torch.bool)
    last = torch.zeros(b, t, h, dtype=full.dtype) if last_layer is not None else None
    for i, it in enumerate(items):
        n = lengths[i]
        ids[i, :n] = it.artifact.input_ids.long()
        mask[i, :n] = it.artifact.loss_mask.bool()
        valid[i, :n] = True
        if last is not None:
            last[i, :n] = it.artifact.hidden_states[:, last_layer]
    return DraftBatch(hidden.to(device, non_blocking=gpu), ids.to(device), mask.to(device), valid.to(device),
                      positions=tuple(it.position for it in items),
                      last_layer=last.to(device) if last is not None else None)


def group_cursor(layout: CacheLayout, members: list[str]) -> int:
    """Min committed cursor over a lockstep group's members: one not registered yet counts as 0,
    one in a terminal state (completed, failed, ...) no longer counts."""
    cursors = []
    for member in members:
        reg = registry.read(layout, member)
        if reg is None or reg.state == "running":
            cursors.append(reg.cursor if reg else 0)
    return min(cursors, default=0)


def drain(reader: Reader, client: CacheClient) -> None:
    """Release leases of batches the reader fetched but the trainer never used."""
    while True:
        try:
            got = reader.out.get_nowait()
        except queue.Empty:
            return
        if isinstance(got, list):
            for it in got:
                client.release(it)
