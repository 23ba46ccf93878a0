"""The consumer's reader in a process of its own (``artcache consume --reader process``).

With ``--reader thread`` (the default) the reader runs beside the trainer in one interpreter: every lease file,
read, content hash, token fingerprint, journal line and collate of the reader holds the trainer's GIL for a
while, and each of the draft's small torch ops that gives the GIL up can lose it to the reader. On a short step
that costs more than the reader's own time (DFlash B4 from a ``--fill``\\ ed root at 0.923
of its in-memory rate on the H200 machine's idle CPU, 5.4 % of it ``train_step`` itself running slower beside the
reader thread). ``--reader process`` moves all of that into a child process:

- the **child** (:data:`CHILD`, ``python -c``) runs the unchanged :class:`.reader.Reader`
  with a :class:`~artcache.client.CacheClient` of its own: it leases, reads, verifies, journals (its own journal
  file ``journal/reader-<consumer id>-<writer>.jsonl``: one writer per file; its events name the consumer, so
  ``inspect`` counts them as the consumer's), announces demand and checks the fence through
  the consumer's registration, exactly as the thread does; it collates each batch (:func:`.reader.collate`) into a
  **slot** of a shared-memory ring (``memfd``), releases the batch's leases once the bytes are in the slot (the
  batch no longer references the artifacts' bytes: the lease rule of docs/protocol.md), and sends the slot's layout;
- the **trainer** process keeps one thin thread (:class:`ProcessReader`) that receives those messages and wraps the
  slot in tensors without a copy (on CUDA: one non-blocking copy per field to the device on a side stream from the
  ring, which is page-locked with ``cudaHostRegister``, behind an event). The trainer hands a slot back
  (:meth:`ProcessReader.done`) after its step (on CUDA once the copies completed) and sends the cursor it committed
  (:meth:`ProcessReader.authorize`).

The window rule is unchanged: the child reads only inside ``[cursor, cursor + lookahead]`` of the cursor the
trainer committed. Leases carry the child's identity: if the child dies, its leases are expired as
``holder-dead``; the child dies with the trainer (``PR_SET_PDEATHSIG``, and at the end of its command pipe).
If the child exits or fails, the trainer's next batch raises the child's error (an artcache error keeps its class
and exit status; anything else is a :class:`~artcache.errors.WorkerFailed` naming it).

**Progress watch.** The trainer's heartbeat keeps its registration live whatever the child does, so the producer
cannot see a child that stopped (``SIGSTOP``, a frozen cgroup, a debugger): the trainer watches it itself. The
child sends a :class:`Beat` every ``Start.beat_s`` (the consumer's heartbeat period, at most
``progress_timeout_s`` / :data:`BEATS_PER_TIMEOUT`); the trainer's pipe thread fails the run with
:class:`~artcache.errors.WorkerFailed` (naming the child's pid, how long it sent nothing and its process state)
when nothing (no batch, no beat) came for ``Start.progress_timeout_s``: the root's heartbeat timeout, the silence
after which the producer fences a consumer, so a stopped child is held to the rule its trainer would be. The
trainer then stops the child (killed after :data:`STOP_GRACE_S`: a stopped process cannot stop itself), its
registration ends ``failed`` and the child's leases are ``holder-dead``. A child waiting on a demand miss still
beats; the wait is bounded by ``--demand-timeout`` in the child itself (``CaptureTimeout``).

Messages are msgspec msgpack frames (a 4-byte little-endian length, then the payload) on two pipes that are
not the child's stdin or stdout; nothing is pickled.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import mmap
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import torch

from artcache import errors as E
from artcache.liveness import local_identity
from artcache.shutdown import follow_parent
from artcache.trainers.draft import DraftBatch

from .reader import Fetched, queued

log = logging.getLogger("artcache.reader")

__all__ = ["ProcessReader", "READERS", "batch_itemsize", "slot_bytes"]

#: ``--reader`` values: the reader thread beside the trainer, or a reader process of its own
READERS = ("thread", "process")
#: byte alignment of every tensor in a slot
ALIGN = 64
#: the batch fields a slot holds, in order
FIELDS = ("hidden", "input_ids", "loss_mask", "valid", "supervised_host")
#: seconds the trainer waits for the child's first message (it imports torch before it reads its settings)
START_TIMEOUT_S = 300.0
#: seconds a stopped child gets to exit before it is killed
STOP_GRACE_S = 5.0
#: the child beats at least this many times per ``progress_timeout_s``, so one or two late beats (a loaded
#: machine) never fail a live child
BEATS_PER_TIMEOUT = 4
_LEN = struct.Struct("<I")
#: the child's program (``python -c``; its arguments: command pipe, reply pipe, ring memfd, the trainer's pid)
CHILD = "import sys; from artcache.trainers.consumer.reader_process import main; sys.exit(main(sys.argv[1:]))"


# ---- messages ----------------------------------------------------------------------------------------------------

class Start(msgspec.Struct, tag="start", forbid_unknown_fields=True):
    """The child's settings (parent to child, first)."""

    root: str
    consumer_id: str
    generation: int
    start_pos: int
    batch: int
    lookahead: int
    depth: int
    end: int
    workers: int
    demand_timeout_s: float
    epoch_len: int
    layers: list[int] | None  # the view's captured-layer indices (None: every layer)
    hidden_dtype: str | None  # fp8 artifacts are dequantised into this dtype (None: collate's default)
    slots: int
    slot_bytes: int
    group: list[str]
    length_bucket: int
    log_level: int
    beat_s: float  # the child's beat period (module docstring, "Progress watch")
    progress_timeout_s: float  # the trainer fails a child silent for this long (the root's heartbeat timeout)


class Authorize(msgspec.Struct, tag="authorize"):
    cursor: int


class Free(msgspec.Struct, tag="free"):
    slot: int


class Stop(msgspec.Struct, tag="stop"):
    pass


class Field(msgspec.Struct, array_like=True):
    name: str
    offset: int
    dtype: str
    shape: list[int]


class Batch(msgspec.Struct, tag="batch"):
    """A collated batch in ``slot`` (child to parent)."""

    slot: int
    positions: list[int]
    fields: list[Field]


class Failed(msgspec.Struct, tag="failed"):
    """What stopped the child's reader: the exception's class, its message and the keywords that rebuild it (an
    ``OSError``: its errno, strerror and file name)."""

    cls: str
    message: str
    keywords: dict = {}
    errno: int | None = None
    strerror: str | None = None
    filename: str | None = None


class Ended(msgspec.Struct, tag="ended"):
    pass


class Beat(msgspec.Struct, tag="beat"):
    """The child runs (child to parent, every ``Start.beat_s``): what the trainer's progress watch waits for."""


ToChild = Start | Authorize | Free | Stop
ToParent = Batch | Failed | Ended | Beat
_enc = msgspec.msgpack.Encoder()
_to_child = msgspec.msgpack.Decoder(ToChild)
_to_parent = msgspec.msgpack.Decoder(ToParent)


def _send(fd: int, msg, lock: threading.Lock | None = None) -> None:
    data = _enc.encode(msg)
    frame = _LEN.pack(len(data)) + data
    if lock is not None:
        with lock:
            _write_all(fd, frame)
    else:
        _write_all(fd, frame)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``, or None at the end of the pipe."""
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _recv(fd: int, decoder):
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    return None if body is None else decoder.decode(body)


# ---- errors across the pipe --------------------------------------------------------------------------------------

def failure_of(exc: BaseException) -> Failed:
    """The message that rebuilds ``exc`` on the other side (:func:`rebuild`)."""
    keywords = exc._keywords() if isinstance(exc, E.ArtcacheError) else {}
    os_error = isinstance(exc, OSError) and not isinstance(exc, E.ArtcacheError)
    return Failed(type(exc).__name__, str(exc), keywords, getattr(exc, "errno", None),
                  exc.strerror if os_error else None,
                  str(exc.filename) if os_error and exc.filename is not None else None)


def rebuild(msg: Failed) -> BaseException:
    """The exception a :class:`Failed` names: an artcache error of that class (same message and keywords, so the
    same exit status), a builtin ``OSError`` subclass with its errno, an ``InterruptedError``; anything else is
    a :class:`~artcache.errors.WorkerFailed` naming the class and message."""
    cls = getattr(E, msg.cls, None)
    if isinstance(cls, type) and issubclass(cls, E.ArtcacheError):
        try:
            return cls(msg.message, **msg.keywords)
        except TypeError:
            pass
    builtin = getattr(builtins, msg.cls, None)
    if isinstance(builtin, type) and issubclass(builtin, OSError) and msg.errno:
        # regression: the message was passed as strerror, so str() said "[Errno 1] [Errno 1] ..." and lost the file
        return builtin(msg.errno, msg.strerror or msg.message, *([msg.filename] if msg.filename else []))
    if builtin is InterruptedError:
        return InterruptedError(msg.message)
    return E.WorkerFailed(f"the consumer's reader process failed: {msg.cls}: {msg.message}")


# ---- the slot ring -----------------------------------------------------------------------------------------------

def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_bytes(batch: int, tokens: int, layers: int, hidden: int, itemsize: int = 4) -> int:
    """Bytes of one slot: the largest batch the child can collate (``batch`` rows of ``tokens`` positions,
    ``layers`` × ``hidden`` values of ``itemsize`` bytes, ``input_ids`` int64, three bool masks), aligned.
    The ring is a sparse ``memfd``: pages a batch never touches cost no memory (except on CUDA, where the
    registration pins them)."""
    rows = batch * tokens
    return _aligned(rows * layers * hidden * itemsize) + _aligned(rows * 8) + 3 * _aligned(rows)


def batch_itemsize(stored: str, device_type: str) -> int:
    """Bytes of one hidden-state value of a collated batch: the stored dtype's (``bfloat16`` 2, ``float32`` 4),
    or for fp8 artifacts the dtype they are dequantised into (float32 on a CPU, bfloat16 on CUDA:
    :func:`.reader.collate`)."""
    if stored == "float8_e4m3fn":
        return 2 if device_type == "cuda" else 4
    return torch.empty((), dtype=_dtype(stored)).element_size()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _view(mm: mmap.mmap, base: int, f: Field) -> torch.Tensor:
    dtype = _dtype(f.dtype)
    numel = 1
    for d in f.shape:
        numel *= d
    if numel == 0:
        return torch.empty(f.shape, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=base + f.offset).view(f.shape)


# ---- the trainer's side ------------------------------------------------------------------------------------------

class ProcessReader:
    """The trainer's end of a reader process: the same surface as :class:`.reader.Reader` for the trainer
    (``out``, ``stop``, ``authorize``, ``start``, ``join``, ``done``, ``drain``).

    Args:
        start: the child's settings (``slots``/``slot_bytes`` size the ring).
        device: where batches are handed over: a CPU batch is a view of its slot; on CUDA each field is copied
            to the device without blocking on a side stream from the page-locked ring (``Fetched.ready``).
        env: the child's environment (default: this process's).
    """

    def __init__(self, start: Start, device: torch.device, env: dict[str, str] | None = None,
                 ring: SlotRing | None = None) -> None:
        """``ring``: the slot ring, allocated beforehand (:class:`SlotRing`, sized ``start.slots`` ×
        ``start.slot_bytes`` for ``device``; the consumer allocates it before it writes anything, so a ring that
        cannot be allocated leaves nothing behind); None allocates it here. Raises as :class:`SlotRing`."""
        self.settings, self.device = start, device
        self.out: queue.Queue = queue.Queue(maxsize=max(1, start.depth))
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: list[Fetched] = []  # CUDA: handed back once their copies completed
        self._slot_of: dict[int, int] = {}  # id(Fetched) -> slot
        self._thread = threading.Thread(target=self._run, daemon=True, name="artcache-reader-pipe")
        self.ring = ring if ring is not None else SlotRing(start.slots, start.slot_bytes, device)
        self.mm = self.ring.mm
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        memfd = self.ring.memfd
        # -c, not -m: the package imports this module first, and runpy would run a second copy of it as __main__
        cmd = [sys.executable, "-c", CHILD, str(to_child_r), str(from_child_w), str(memfd), str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(to_child_r, from_child_w, memfd),
                                     env=env)
        for fd in (to_child_r, from_child_w):  # the child holds its ends
            os.close(fd)
        self.ring.close_fd()  # the mapping stays
        #: the child's identity token: its journal is ``journal/reader-<consumer id>-<token>.jsonl``
        self.token = local_identity(self.proc.pid).token()

    # the Reader surface -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Let the child begin (it waits for its settings, importing meanwhile) and start receiving its batches."""
        _send(self._to_child, self.settings, self._lock)
        self._thread.start()

    def authorize(self, cursor: int) -> None:
        """The trainer committed ``cursor``: the child may read up to ``cursor + lookahead``."""
        self._tell(Authorize(cursor))

    def done(self, fetched: Fetched) -> None:
        """The trainer stepped on ``fetched``: its slot goes back to the child (on CUDA once its copies completed)."""
        if fetched.ready is None:
            self._free(fetched)
            return
        self._pending.append(fetched)
        while self._pending and self._pending[0].ready.query():
            self._free(self._pending.pop(0))

    def drain(self) -> None:
        """Hand back every slot: batches queued but never stepped on, and those whose copies were in flight."""
        self._pending.extend(queued(self.out))
        for fetched in self._pending:
            if fetched.ready is not None:
                fetched.ready.synchronize()
            self._free(fetched)
        self._pending.clear()

    def join(self, timeout: float | None = None) -> None:
        """Stop the child (it releases what it holds and closes its journal), wait for it and the pipe thread."""
        self.stop.set()
        self._thread.join(timeout)
        self._tell(Stop())
        try:
            self.proc.wait(timeout=STOP_GRACE_S if timeout is None else max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            log.warning("the reader process %d did not stop within %.0fs: killed", self.proc.pid, STOP_GRACE_S)
            self.proc.kill()
            self.proc.wait()
        self._close_fds()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the reader process has used so far, from ``/proc`` (0.0 once it is gone):
        what a benchmark adds to the trainer's own CPU time to count the reading."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15

    # internals ---------------------------------------------------------------------------------------------------

    def _tell(self, msg) -> None:
        with contextlib.suppress(OSError):  # the child is gone: the pipe thread reports why
            _send(self._to_child, msg, self._lock)

    def _free(self, fetched: Fetched) -> None:
        slot = self._slot_of.pop(id(fetched), None)
        if slot is not None:
            self._tell(Free(slot))

    def _close_fds(self) -> None:
        for name in ("_to_child", "_from_child"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _silent(self, silent_s: float) -> E.WorkerFailed:
        """The error of a child that sent nothing for ``silent_s`` seconds (its state read from ``/proc``)."""
        try:
            state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        what = {"T": "stopped (SIGSTOP?)", "t": "stopped by a tracer", "D": "in uninterruptible I/O",
                "Z": "exited"}.get(state, f"state {state}")
        return E.WorkerFailed(
            f"the consumer's reader process {self.proc.pid} made no progress for {silent_s:.0f}s (no batch, no beat; "
            f"it is {what}): the deadline is the root's heartbeat timeout {self.settings.progress_timeout_s:g}s; "
            "the run stops and the reader process is killed")

    def _run(self) -> None:
        heard = time.monotonic()
        # until its first beat the child may still be importing torch: START_TIMEOUT_S, then the progress deadline
        deadline = max(START_TIMEOUT_S, self.settings.progress_timeout_s)
        try:
            while not self.stop.is_set():
                ready, _, _ = select.select([self._from_child], [], [], 0.1)
                if not ready:
                    silent = time.monotonic() - heard
                    if silent > deadline:
                        self._put(self._silent(silent))
                        return
                    continue
                msg = _recv(self._from_child, _to_parent)
                heard, deadline = time.monotonic(), self.settings.progress_timeout_s
                if msg is None:
                    code = self.proc.poll()
                    if code is None:
                        try:
                            code = self.proc.wait(timeout=STOP_GRACE_S)
                        except subprocess.TimeoutExpired:
                            code = "running"
                    self._put(E.WorkerFailed(f"the consumer's reader process {self.proc.pid} exited (status {code}) "
                                             "without saying why; its log lines are on this consumer's stderr"))
                    return
                if isinstance(msg, Batch):
                    fetched = self._wrap(msg)
                    if not self._put(fetched):
                        self._free(fetched)
                        return
                elif isinstance(msg, Failed):
                    self._put(rebuild(msg))
                    return
                elif isinstance(msg, Beat):
                    continue
                else:  # Ended: the child read up to its end, or stopped
                    return
        except BaseException as exc:  # handed to the trainer, which re-raises it
            self._put(exc)

    def _wrap(self, msg: Batch) -> Fetched:
        base = msg.slot * self.settings.slot_bytes
        t = {f.name: _view(self.mm, base, f) for f in msg.fields}
        sup = t.get("supervised_host")
        positions = tuple(msg.positions)
        if self.stream is None:
            batch = DraftBatch(t["hidden"], t["input_ids"], t["loss_mask"], t["valid"], positions=positions,
                               supervised_host=sup)
            fetched = Fetched([], batch, None)
        else:
            dev = self.device
            with torch.cuda.stream(self.stream):
                batch = DraftBatch(*(t[k].to(dev, non_blocking=True) for k in FIELDS[:4]), positions=positions,
                                   supervised_host=sup)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            fetched = Fetched([], batch, ready)
        self._slot_of[id(fetched)] = msg.slot
        return fetched


class SlotRing:
    """The shared-memory ring of a reader process: ``slots`` × ``slot_bytes`` bytes of a sparse ``memfd`` mapped
    here (and, on CUDA, page-locked with ``cudaHostRegister``); the child maps the same memfd.

    Raises:
        ConfigError: the ring cannot be allocated (``memfd_create``, ``ftruncate`` or ``mmap`` failed: ENOMEM,
            ENOSPC, EMFILE, ...; or ``cudaHostRegister`` refused it): one line naming its size, how it is sized
            and the cause; nothing is left open.
    """

    def __init__(self, slots: int, slot_bytes: int, device: torch.device) -> None:
        size = slots * slot_bytes
        self.memfd, self.mm, self._registered = -1, None, False
        what = (f"--reader process: its shared-memory ring of {size} B ({slots} slots of {slot_bytes} B: "
                "--prefetch-batches + 3 batches of --batch-size rows at the root's max length)")
        hint = "; use --reader thread, or a smaller --batch-size or --prefetch-batches"
        try:
            self.memfd = os.memfd_create("artcache-reader-slots", os.MFD_CLOEXEC)
            os.ftruncate(self.memfd, size)
            self.mm = mmap.mmap(self.memfd, size)
        except OSError as exc:
            self.close()
            raise E.ConfigError(f"{what} could not be allocated ({exc.strerror or exc}){hint}") from exc
        if device.type == "cuda":
            ptr = torch.frombuffer(self.mm, dtype=torch.uint8, count=1).data_ptr()
            rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            if int(rc) != 0:
                self.close()
                raise E.ConfigError(f"{what} could not be page-locked (cudaHostRegister: {rc}){hint}")
            self._registered = True

    def close_fd(self) -> None:
        """Close the memfd (once the child has its own descriptor); the mapping stays."""
        if self.memfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.memfd)
            self.memfd = -1

    def close(self) -> None:
        """Unregister, unmap and close everything (a ring no reader took). Idempotent."""
        self.close_fd()
        if self._registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(torch.frombuffer(self.mm, dtype=torch.uint8, count=1)
                                                       .data_ptr())
            self._registered = False
        if self.mm is not None:
            with contextlib.suppress(BufferError):  # a tensor still views it: the mapping goes with it
                self.mm.close()
            self.mm = None

    def __del__(self) -> None:  # the registration and descriptor, when the owner never closed it
        try:
            if self._registered:
                torch.cuda.cudart().cudaHostUnregister(torch.frombuffer(self.mm, dtype=torch.uint8, count=1)
                                                       .data_ptr())
                self._registered = False
            self.close_fd()
        except Exception:
            pass


# ---- the child ---------------------------------------------------------------------------------------------------

class _Slots:
    """The child's free slots; :meth:`take` blocks until the trainer hands one back, or the reader stops."""

    def __init__(self, count: int, stop: threading.Event) -> None:
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self.free.put(i)
        self.stop = stop

    def take(self) -> int:
        while True:
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    raise InterruptedError("the reader stopped while waiting for a free slot") from None


def _into_slot(mm: mmap.mmap, start: Start, slot: int, batch: DraftBatch) -> list[Field]:
    """Copy ``batch``'s tensors into ``slot`` back to back (aligned); their layout."""
    base, offset, fields = slot * start.slot_bytes, 0, []
    sup = batch.loss_mask & batch.valid
    for name, src in zip(FIELDS, (batch.hidden, batch.input_ids, batch.loss_mask, batch.valid, sup), strict=True):
        src = src.contiguous()
        nbytes = src.numel() * src.element_size()
        if offset + nbytes > start.slot_bytes:
            raise E.ConfigError(f"a batch of {tuple(batch.hidden.shape)} ({batch.hidden.dtype}) does not fit the "
                                f"reader process's {start.slot_bytes} B slot; use --reader thread")
        field = Field(name, offset, str(src.dtype).removeprefix("torch."), list(src.shape))
        if nbytes:
            _view(mm, base, field).copy_(src)
        fields.append(field)
        offset = _aligned(offset + nbytes)
    return fields


def child_main(fd_in: int, fd_out: int, fd_mem: int, parent: int) -> int:
    """The reader process: read :class:`Start`, then lease/read/collate into slots and send :class:`Batch` messages
    until the plan's end, a :class:`Stop`, the end of the command pipe (the trainer is gone) or a failure (sent as
    :class:`Failed`)."""
    follow_parent()
    if os.getppid() != parent:  # the trainer died before the request took effect (it may itself be pid 1)
        return 1
    start = _recv(fd_in, _to_child)
    if not isinstance(start, Start):
        return 2
    logging.basicConfig(level=start.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    from artcache import journal as J
    from artcache import registry
    from artcache.client import CacheClient, open_root

    from .reader import Reader, collate, group_cursor

    mm = mmap.mmap(fd_mem, start.slots * start.slot_bytes)
    send_lock = threading.Lock()
    journal = client = reader = None
    quiet = threading.Event()  # set once the child sends its last message: no beat after it
    beat_s = min(start.beat_s, start.progress_timeout_s / BEATS_PER_TIMEOUT)

    def beat() -> None:  # the trainer's progress watch (module docstring); the first one at once
        with contextlib.suppress(OSError):
            while True:
                _send(fd_out, Beat(), send_lock)
                if quiet.wait(beat_s):
                    return

    threading.Thread(target=beat, daemon=True, name="artcache-reader-beat").start()
    try:
        layout, settings, plan = open_root(start.root)  # as the trainer opened it
        reg = registry.read(layout, start.consumer_id)
        if reg is None or reg.generation != start.generation or reg.state != "running":
            raise E.ConsumerFenced(f"consumer {start.consumer_id!r} was fenced before its reader process started")
        journal = J.JournalWriter(layout.journal_path("reader", start.consumer_id))
        client = CacheClient.for_consumer(layout, settings, plan, reg, journal, start.demand_timeout_s,
                                          epoch_len=start.epoch_len)  # the trainer's construction
        stop = threading.Event()
        slots = _Slots(start.slots, stop)
        layers = None if start.layers is None else torch.tensor(start.layers, dtype=torch.long)
        if layers is not None and start.layers == list(range(start.layers[0], start.layers[0] + len(start.layers))):
            layers = slice(start.layers[0], start.layers[0] + len(start.layers))
        hidden_dtype = _dtype(start.hidden_dtype) if start.hidden_dtype else None
        cpu = torch.device("cpu")

        def into_slot(items):
            batch = collate(items, cpu, layers, hidden_dtype=hidden_dtype)
            if start.length_bucket > 1 and batch.hidden.shape[1] % start.length_bucket:
                batch = _pad(batch, start.length_bucket)
            slot = slots.take()
            try:
                fields = _into_slot(mm, start, slot, batch)
            except BaseException:
                slots.free.put(slot)
                raise
            for it in items:  # the bytes are in the slot: the artifacts are no longer referenced
                client.release(it)
            return Fetched([], Batch(slot, [it.position for it in items], fields))

        group = list(start.group)
        reader = Reader(client, start.start_pos, start.batch, start.lookahead, start.depth, end=start.end,
                        group_cursor=(lambda: group_cursor(layout, group)) if group else None, collate=into_slot,
                        workers=start.workers)

        def listen() -> None:  # the trainer's messages; the end of the pipe stops everything
            while True:
                msg = _recv(fd_in, _to_child)
                if msg is None or isinstance(msg, Stop):
                    stop.set()
                    reader.stop.set()
                    return
                if isinstance(msg, Authorize):
                    reader.authorize(msg.cursor)
                elif isinstance(msg, Free):
                    slots.free.put(msg.slot)

        threading.Thread(target=listen, daemon=True, name="artcache-reader-commands").start()
        reader.start()
        while True:
            try:
                got = reader.out.get(timeout=0.1)
            except queue.Empty:
                if not reader.is_alive() and reader.out.empty():
                    break
                continue
            if stop.is_set():  # the trainer stops reading the pipe: send nothing more
                break
            if isinstance(got, BaseException):
                if not isinstance(got, InterruptedError) or not stop.is_set():
                    _send(fd_out, failure_of(got), send_lock)
                break
            _send(fd_out, got.batch, send_lock)
        if not stop.is_set():
            _send(fd_out, Ended(), send_lock)
        return 0
    except BrokenPipeError:
        return 0
    except BaseException as exc:
        with contextlib.suppress(OSError):
            _send(fd_out, failure_of(exc), send_lock)
        return 1
    finally:
        quiet.set()
        if reader is not None:
            reader.stop.set()
            reader.join(timeout=5)  # it releases the leases of a batch it had not collated into a slot
        if journal is not None:
            journal.close()


def _pad(batch: DraftBatch, bucket: int) -> DraftBatch:
    """``batch`` with its length padded up to a multiple of ``bucket`` (padded positions invalid, never supervised)."""
    b, t = batch.input_ids.shape
    extra = -(-t // bucket) * bucket - t

    def grow(x: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros((b, extra, *x.shape[2:]), dtype=x.dtype)
        return torch.cat([x, pad], dim=1)

    return DraftBatch(grow(batch.hidden), grow(batch.input_ids), grow(batch.loss_mask), grow(batch.valid),
                      positions=batch.positions)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd_in, fd_out, fd_mem, parent = (int(a) for a in argv)
    return child_main(fd_in, fd_out, fd_mem, parent)


if __name__ == "__main__":
    sys.exit(main())
