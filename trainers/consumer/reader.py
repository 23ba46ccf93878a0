"""The consumer's reader thread and batch collation.

:class:`Reader` leases and reads batches of consecutive positions ahead of the trainer, inside the
window ``[cursor, cursor + lookahead]``; it cannot move the window (the trainer commits the cursor and
then calls :meth:`Reader.authorize`). It also collates each batch it read, so the trainer thread only
steps: on a CPU :func:`collate` pads the batch into a :class:`~artcache.trainers.draft.DraftBatch`
holding the draft's view of the captured layers; on a GPU :class:`DeviceCollator` copies each
artifact's page-locked read buffer to the device without blocking on a side stream and pads, selects
the view and casts there, behind a CUDA event the trainer's stream waits on (no host copy, no host
synchronisation). What the reader hands over is a :class:`Fetched`.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from artcache import registry
from artcache.client import CacheClient, Leased
from artcache.fp8 import dequantize_rows
from artcache.layer_ids import select_layers
from artcache.layout import CacheLayout
from artcache.trainers.draft import DraftBatch

__all__ = ["DeviceCollator", "Fetched", "Reader", "collate", "group_cursor", "queued"]


@dataclass
class Fetched:
    """One batch the reader read and collated.

    Attributes:
        items: the leased artifacts, in position order (the trainer releases their leases).
        batch: the collated :class:`DraftBatch` (None when the reader was built without ``collate``).
        ready: a CUDA event recorded after the batch's host-to-device copies (None on a CPU): the
            trainer's stream waits on it; the artifacts' host buffers must stay referenced until it
            has completed (:meth:`Retired.retire`).
    """

    items: list[Leased]
    batch: DraftBatch | None = None
    ready: object | None = None

    @property
    def positions(self) -> tuple[int, ...]:
        """The batch's run positions, in order (a reader process hands over no leases: its batch's)."""
        return tuple(it.position for it in self.items) if self.items else self.batch.positions

    def wait(self) -> DraftBatch:
        """The batch, usable on the current CUDA stream (which waits on ``ready``; no host wait)."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(self.batch.hidden.device)
            stream.wait_event(self.ready)
            for t in (self.batch.hidden, self.batch.input_ids, self.batch.loss_mask, self.batch.valid):
                t.record_stream(stream)  # allocated on the copy stream: not reused before this stream is done
        return self.batch


class Retired:
    """Batches the trainer is done with whose host buffers may still feed a copy in flight.

    :meth:`retire` keeps each :class:`Fetched` until its ``ready`` event has completed (checked
    without blocking); :meth:`clear` waits for the rest. The read buffers are page-locked host memory
    that a later read may reuse once unreferenced, so they outlive their copy.
    """

    def __init__(self) -> None:
        self._q: collections.deque[Fetched] = collections.deque()

    def retire(self, fetched: Fetched) -> None:
        if fetched.ready is not None:
            self._q.append(fetched)
        while self._q and self._q[0].ready.query():
            self._q.popleft()

    def clear(self) -> None:
        while self._q:
            self._q.popleft().ready.synchronize()


class _BatchStop:
    """The ``stop`` of one pooled batch's acquires (:meth:`CacheClient.acquire` polls ``wait``): set once the
    reader is stopped or any position of the batch failed (:meth:`note`, a future's done callback)."""

    def __init__(self, reader_stop: threading.Event) -> None:
        self.reader_stop, self.failed = reader_stop, threading.Event()

    def note(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.failed.set()

    def is_set(self) -> bool:
        return self.failed.is_set() or self.reader_stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Like ``Event.wait``; the reader's stop is seen at the end of ``timeout`` (acquire polls <= 0.05 s)."""
        return self.failed.wait(timeout) or self.reader_stop.is_set()


class Reader(threading.Thread):
    """Leases and reads batches of consecutive positions, never beyond ``cursor + lookahead``.

    It cannot move the window: the trainer commits the cursor and calls :meth:`authorize`. ``stride`` (default
    ``batch``): positions from one batch's first to the next one's (a rank of a consumer group reads ``batch``
    positions of each global batch of ``stride``, starting at ``start_pos``). ``workers``
    (>= 1) positions of a batch are leased and read at once (``--read-workers``; 1: one after another).
    Results (a :class:`Fetched` per batch, collated by ``collate`` when given, or the exception that
    stopped it) go to ``out``, at most ``depth`` waiting. ``step_positions`` (packing,
    :class:`~artcache.trainers.packing.Packer`): the positions of the batch that starts at a position (at most
    ``lookahead``); None: always ``batch``.
    """

    def __init__(self, client: CacheClient, start_pos: int, batch: int, lookahead: int, depth: int,
                 end: int, group_cursor: Callable[[], int] | None = None,
                 collate: Callable[[list[Leased]], Fetched] | None = None, workers: int = 1,
                 stride: int | None = None, step_positions: Callable[[int], int] | None = None) -> None:
        super().__init__(daemon=True, name="artcache-reader")
        self.collate = collate
        self.client, self.next_pos, self.batch, self.lookahead = client, start_pos, batch, lookahead
        # positions from one batch's start to the next one's (> batch: a rank of a group reads its own slice of
        # each global batch, starting at its offset)
        self.stride = batch if stride is None else stride
        self.end = end  # exclusive: the consumer never reads at or past its announced end
        self.group_cursor = group_cursor  # lockstep: the group's min committed cursor (registry poll)
        self.workers = max(1, int(workers))  # positions of one batch leased and read at once
        self.packed = step_positions is not None  # packing: a batch's positions vary, it moves by what it read
        self.step_positions = step_positions or (lambda _p: batch)
        self.out: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.retired = Retired()
        self._cond = threading.Condition()
        self._cursor = start_pos

    def done(self, fetched: Fetched) -> None:
        """The trainer stepped on ``fetched``: release its leases (its positions are still inside the window) and keep
        its host buffers until its copies completed (:class:`Retired`)."""
        for it in fetched.items:
            self.client.release(it)
        self.retired.retire(fetched)

    def drain(self) -> None:
        """After :meth:`join`: release the leases of batches read but never stepped on, and wait for every copy."""
        for got in queued(self.out):
            _settle(got)
            for it in got.items:
                self.client.release(it)
        self.retired.clear()

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

    def _wait_authorized(self, p: int, stop: threading.Event | _BatchStop | None = None) -> bool:
        """Block until ``p`` is authorized; False when ``stop`` (default: the reader's) is set first."""
        stop = stop or self.stop
        with self._cond:
            while not self._authorized(p) and not stop.is_set():
                self._cond.wait(0.05 if self.group_cursor else 0.1)
        return not stop.is_set()

    def _lease_batch(self, pool: ThreadPoolExecutor | None) -> list[Leased] | None:
        """Lease and read positions ``next_pos .. next_pos + batch - 1`` in position order; None when stopped.

        Each position is requested as soon as it is authorized (so demand reaches the producer in cursor
        order); with a pool, up to ``workers`` of them are read at once (read + verify of one artifact
        is mostly system calls and xxh3, both outside the GIL). On any failure every lease the batch
        holds is released and the first failure (in position order) is raised; with a pool a failure also
        ends the batch's other acquires (demand waits interrupted, queued positions never started), so the
        batch fails within one ``--demand-timeout``, and what they raise for it is not what is handed on.
        """
        n = self.step_positions(self.next_pos)
        positions = range(self.next_pos, self.next_pos + n)
        if pool is None:
            items: list[Leased] = []
            try:
                for p in positions:
                    if not self._wait_authorized(p):
                        break
                    items.append(self.client.acquire(p, self.stop))
            except BaseException:  # the partial batch's leases (regression: leaked on CaptureTimeout)
                for it in items:
                    self.client.release(it)
                raise
            got: list = items
        else:
            # a failed position ends the batch: the positions still waiting on demand give up at once and the
            # queued ones never start (regression: each round of ``workers`` waited out its own demand timeout)
            stop = _BatchStop(self.stop)
            futures: list[Future] = []
            for p in positions:
                if not self._wait_authorized(p, stop):
                    break
                futures.append(f := pool.submit(self._acquire_pooled, p, stop))
                f.add_done_callback(stop.note)
            got, failures = [], []
            for f in futures:  # every future is awaited, so no lease is taken after this returns
                if stop.failed.is_set():
                    f.cancel()  # not started yet: never leases
                if f.cancelled():
                    continue
                try:
                    got.append(f.result())
                except BaseException as exc:
                    failures.append(exc)
            if failures:
                for it in got:
                    self.client.release(it)
                # the cause, not a wait it interrupted (an InterruptedError would read as the reader's stop)
                raise next((e for e in failures if not isinstance(e, InterruptedError)), failures[0])
        if self.stop.is_set() or len(got) < n:
            for it in got:
                self.client.release(it)
            return None
        return got

    def _acquire_pooled(self, p: int, stop: _BatchStop) -> Leased:
        """A pool worker's acquire; none once the batch failed (a worker freed by a failure takes the next queued
        position before the reader can cancel it)."""
        if stop.is_set():
            raise InterruptedError(f"position {p}: the batch failed or the reader stopped before its read began")
        return self.client.acquire(p, stop)

    def run(self) -> None:
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="artcache-read") if self.workers > 1 else None
        try:
            while not self.stop.is_set() and self.next_pos + self.step_positions(self.next_pos) <= self.end:
                items = self._lease_batch(pool)
                if items is None:
                    return
                self.next_pos += len(items) if self.packed else self.stride
                try:
                    fetched = self.collate(items) if self.collate is not None else Fetched(items)
                except BaseException:
                    for it in items:
                        self.client.release(it)
                    raise
                while not self.stop.is_set():
                    try:
                        self.out.put(fetched, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                else:
                    _settle(fetched)
                    for it in items:
                        self.client.release(it)
        except InterruptedError:
            return
        except BaseException as exc:  # handed to the trainer, which re-raises it
            self.out.put(exc)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)


def collate(items: list[Leased], device: torch.device, layers: slice | torch.Tensor | None = None,
            last_layer: int | None = None, hidden_dtype: torch.dtype | None = None) -> DraftBatch:
    """Pad a batch into a :class:`~artcache.trainers.draft.DraftBatch` on ``device``.

    ``hidden`` [b, T, m, H] (zeros past each length) holds the draft's *view* of the captured layers:
    ``layers`` indexes the artifact's layer axis (a ``slice`` for a contiguous run, so a batch of one
    stays a view of the read buffer with no host copy; an index tensor otherwise, which copies only
    the m layers read; None = all). ``input_ids`` [b, T] long, ``loss_mask`` and ``valid`` [b, T]
    bool. ``last_layer``: index of output-of-layer L-1 in the artifact, copied to ``last_layer``
    [b, T, H] (held-out replay against the target's argmax), or None.

    fp8 artifacts (``hidden_scales`` present, :mod:`artcache.fp8`): the e4m3fn codes and their scales go to
    ``device`` as stored (half the bytes of bf16) and are dequantised there into ``hidden_dtype``
    (default: bfloat16 on CUDA, float32 on a CPU: the drafts' compute dtypes). Other artifacts arrive in
    their stored dtype, ``hidden_dtype`` ignored.
    """
    lengths = [it.artifact.input_ids.shape[0] for it in items]
    t = max(lengths)
    full = items[0].artifact.hidden_states
    fp8 = items[0].artifact.hidden_scales is not None

    def view(hs: torch.Tensor) -> torch.Tensor:
        return hs if layers is None else select_layers(hs, layers)

    def scale_view(sc: torch.Tensor) -> torch.Tensor:  # [T, m]: the same layer view as the hidden states
        return view(sc[..., None])[..., 0]

    first = view(full)
    b, m, h = len(items), first.shape[1], first.shape[2]
    gpu = device.type == "cuda"
    scales = None
    if b == 1:
        hidden = first[None]
        if fp8:
            scales = scale_view(items[0].artifact.hidden_scales)[None]
    else:
        hidden = torch.zeros(b, t, m, h, dtype=first.dtype, pin_memory=gpu)
        if fp8:
            scales = torch.zeros(b, t, m, dtype=torch.float32, pin_memory=gpu)
        for i, it in enumerate(items):
            hidden[i, : lengths[i]] = view(it.artifact.hidden_states)
            if scales is not None:
                scales[i, : lengths[i]] = scale_view(it.artifact.hidden_scales)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    valid = torch.zeros(b, t, dtype=torch.bool)
    last_dtype = torch.float32 if fp8 else full.dtype
    last = torch.zeros(b, t, h, dtype=last_dtype) if last_layer is not None else None
    for i, it in enumerate(items):
        n = lengths[i]
        ids[i, :n] = it.artifact.input_ids.long()
        mask[i, :n] = it.artifact.loss_mask.bool()
        valid[i, :n] = True
        if last is not None:
            art = it.artifact
            last[i, :n] = (dequantize_rows(art.hidden_states[:, last_layer], art.hidden_scales[:, last_layer])
                           if fp8 else art.hidden_states[:, last_layer])
    hidden = hidden.to(device, non_blocking=gpu)
    if scales is not None:
        dtype = hidden_dtype or (torch.bfloat16 if gpu else torch.float32)
        hidden = dequantize_rows(hidden, scales.to(device, non_blocking=gpu), dtype)
    return DraftBatch(hidden, ids.to(device), mask.to(device), valid.to(device),
                      positions=tuple(it.position for it in items),
                      last_layer=last.to(device) if last is not None else None)


class DeviceCollator:
    """Collates a batch on a CUDA device without a host copy or a host synchronisation.

    Each artifact's ``hidden_states`` (a view of its page-locked read buffer) is copied without
    blocking into a device batch [b, T, M, H] on a side stream, rows past each length zeroed there;
    the draft's view of the layers (``layers``) is selected on the device. ``input_ids``,
    ``loss_mask`` and ``valid`` are padded on the host (small), pinned and copied the same way; the
    host copy of ``loss_mask & valid`` rides along as ``supervised_host`` (host-side anchor draws
    without reading device memory back). The copies end with an event (:attr:`Fetched.ready`).

    Args:
        device: a CUDA device. layers: the view (as :func:`collate`). length_bucket: pad T up to a
            multiple of this (0: the batch's longest sample), so ``torch.compile`` / CUDA graphs see
            few distinct shapes; padded positions are ``valid=False`` and never supervised.

    The same batch as :func:`collate` on the same items, element for element (apart from the
    bucket padding): tests pin it.
    """

    def __init__(self, device: torch.device, layers: slice | torch.Tensor | None = None,
                 length_bucket: int = 0) -> None:
        self.device, self.layers, self.length_bucket = device, layers, int(length_bucket)
        self.stream = torch.cuda.Stream(device)
        self._index = layers.to(device) if isinstance(layers, torch.Tensor) else layers

    def __call__(self, items: list[Leased]) -> Fetched:
        arts = [it.artifact for it in items]
        if getattr(arts[0], "hidden_scales", None) is not None:  # fp8 codes: the generic path dequantises
            return Fetched(items, collate(items, self.device, self.layers))
        lengths = [a.input_ids.shape[0] for a in arts]
        t = max(lengths)
        if self.length_bucket > 1:
            t = -(-t // self.length_bucket) * self.length_bucket
        b, (m, h), dtype = len(items), arts[0].hidden_states.shape[1:], arts[0].hidden_states.dtype
        ids = torch.zeros(b, t, dtype=torch.long, pin_memory=True)
        mask = torch.zeros(b, t, dtype=torch.bool, pin_memory=True)
        valid = torch.zeros(b, t, dtype=torch.bool, pin_memory=True)
        for i, a in enumerate(arts):
            n = lengths[i]
            ids[i, :n] = a.input_ids
            mask[i, :n] = a.loss_mask.bool()
            valid[i, :n] = True
        dev = self.device
        with torch.cuda.stream(self.stream):
            raw = torch.empty(b, t, m, h, dtype=dtype, device=dev)
            for i, a in enumerate(arts):
                raw[i, :lengths[i]].copy_(a.hidden_states, non_blocking=True)
                if lengths[i] < t:
                    raw[i, lengths[i]:].zero_()
            hidden = raw if self._index is None else select_layers(raw, self._index)
            batch = DraftBatch(hidden, ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True),
                               valid.to(dev, non_blocking=True), positions=tuple(it.position for it in items),
                               supervised_host=mask & valid)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return Fetched(items, batch, ready)


def group_cursor(layout: CacheLayout, members: list[str]) -> int:
    """Min committed cursor over a lockstep group's members: one not registered yet counts as 0,
    one in a terminal state (completed, failed, ...) no longer counts."""
    cursors = []
    for member in members:
        reg = registry.read(layout, member)
        if reg is None or reg.state == "running":
            cursors.append(reg.cursor if reg else 0)
    return min(cursors, default=0)


def queued(out: queue.Queue) -> Iterator[Fetched]:
    """The batches left in a reader's ``out`` queue, taken without waiting (an exception there is dropped: the
    reader is stopping)."""
    while True:
        try:
            got = out.get_nowait()
        except queue.Empty:
            return
        if isinstance(got, Fetched):
            yield got


def _settle(fetched: Fetched) -> None:
    """Wait for a discarded batch's copies (its host buffers may be reused once unreferenced)."""
    if fetched.ready is not None:
        fetched.ready.synchronize()
