"""The artcache error hierarchy.

Every error derives from :class:`ArtcacheError` and also from the builtin a caller would already
catch (``ValueError``, ``TimeoutError``, ``FileNotFoundError``, ``OSError``), so
``except FileNotFoundError`` keeps working for code that does not know artcache.

Each class carries the CLI's exit status (``exit_code``: 2 = bad input the user can fix by changing a
flag, a file or a path; 1 = an operational failure) and survives pickling with its attributes, so an
error raised in a worker process reaches its parent intact (``tests/unit/test_errors.py`` checks every class).
The pattern follows filelock's ``_error.py``: keyword attributes are rebuilt by ``__reduce__``.
"""

from __future__ import annotations

import functools

import filelock


class ArtcacheError(Exception):
    """Root of all artcache errors."""

    #: Whether retrying the same operation may succeed (transient I/O, a lock held elsewhere).
    retryable: bool = False
    #: The CLI's exit status for this error: 2 = bad input (a flag, file or path to change), 1 = failure.
    exit_code: int = 1

    def _keywords(self) -> dict:
        """The keyword arguments ``__init__`` needs to rebuild this error (none for the plain classes)."""
        return {}

    def __reduce__(self):
        keywords = self._keywords()
        if not keywords:
            return super().__reduce__()
        return functools.partial(type(self), **keywords), (str(self),), None


class _OSErrorMessage(ArtcacheError, OSError):
    """An ``OSError`` whose ``errno`` is the failing call's and whose ``str`` is the message alone."""

    def __init__(self, message: str, *, errno_: int | None = None) -> None:
        super().__init__(errno_ if errno_ is not None else 0, message)

    def __str__(self) -> str:
        return self.strerror or super().__str__()

    def _keywords(self) -> dict:
        return {"errno_": self.errno or None}


class ConfigError(ArtcacheError, ValueError):
    """A setting, flag or input value is invalid. The message names the value and what is accepted."""

    exit_code = 2


class InsufficientSpace(ConfigError):
    """What a run will write cannot fit in the free space of the filesystem it goes to (a consumer's
    checkpoints, the bench's checkpoints and artifacts). Found before anything is written; bad input
    (exit 2): the message names the bytes needed and free there, and the settings that need fewer. Also
    ``artcache verify-fs`` on a full filesystem (its checks could not run): the message names the free bytes."""


class DataError(ArtcacheError, ValueError):
    """Input data (dataset, plan) is unusable: empty, malformed beyond recovery, or inconsistent."""

    exit_code = 2


class CacheRootError(ArtcacheError, FileNotFoundError):
    """The cache root is missing, not initialised, or was made by an incompatible version."""

    exit_code = 2


class ArtifactMissing(ArtcacheError, FileNotFoundError):
    """The artifact for a fingerprint is not published (never captured, or evicted)."""

    retryable = True


class PayloadUnavailable(ArtifactMissing):
    """A remote payload store (Mooncake) could not serve a published artifact's payload just now: its
    master is unreachable, a transfer failed, the object's replica is not ready or its read lease ran
    out mid-transfer. The manifest stays; a reader treats it as a miss and tries again."""


class PayloadStoreError(ArtcacheError, ConnectionError):
    """A cache root's remote payload store cannot be used: its master does not answer or refused the
    client. (A missing client library is a ConfigError: nothing can be done until it is installed.)"""


class IntegrityError(ArtcacheError, ValueError):
    """An artifact failed its content check (hash, shapes, dtype, fingerprint) and was quarantined.

    A ``ValueError`` for callers, but an operational failure for the CLI (exit 1): the input was fine,
    the bytes on disk were not.
    """

    retryable = True


class CheckpointCorrupt(IntegrityError):
    """A consumer checkpoint's file does not match the content digest its ``state.json`` recorded when it
    was written (bytes flipped on disk, a truncated or replaced file), a file the record names is missing,
    or a tensor file is present that the record does not name. Raised before anything is loaded from the
    checkpoint (``--resume``, ``--init-from``, ``artcache export``, ``artcache calibrate``); the message
    names the file and the expected and actual digests. Not retryable (nothing is quarantined: the bytes
    stay wrong until the file is restored); an operational failure (exit 1), as for any IntegrityError."""

    retryable = False


class PublishError(_OSErrorMessage):
    """Writing or renaming an artifact failed; the temp file was removed and nothing was published.

    ``retryable`` is True for transient errors (EIO, EAGAIN, EINTR) and False for ones that need
    an operator (ENOSPC, EDQUOT, EROFS, EACCES).
    """

    def __init__(self, message: str, *, fingerprint: str | None = None, retryable: bool = False,
                 errno_: int | None = None) -> None:
        super().__init__(message, errno_=errno_)
        self.fingerprint = fingerprint
        self.retryable = retryable

    def _keywords(self) -> dict:
        return {**super()._keywords(), "fingerprint": self.fingerprint, "retryable": self.retryable}


class DiskBudgetExceeded(ArtcacheError, OSError):
    """What was asked for does not fit the disk budget (``artcache producer --fill`` with a plan larger than
    ``--disk-budget``). Not retryable with the same budget; an operational failure (exit 1): what fitted
    stays published."""


class LockTimeout(ArtcacheError, filelock.Timeout):
    """A lock could not be taken within its timeout. Also a :class:`filelock.Timeout` (a ``TimeoutError``),
    so ``except filelock.Timeout`` keeps working; ``lock_file`` is the lock's path."""

    retryable = True

    def __init__(self, lock_file: str, holder: str | None = None) -> None:
        filelock.Timeout.__init__(self, lock_file, holder)

    def __reduce__(self):
        return filelock.Timeout.__reduce__(self)


class LockUnavailable(_OSErrorMessage):
    """The filesystem does not support ``flock`` (ENOSYS/EOPNOTSUPP/ENOLCK). Not retryable: artcache never
    falls back to marker-file locks, which a SIGKILLed holder would leave behind (see artcache.locking)."""


class UnsafePath(ArtcacheError, PermissionError):
    """A path inside the cache root is a symbolic link (or not the kind of file artcache made there).
    artcache never follows links planted inside a root; remove the link (``artcache fsck --fix``)."""


class CaptureTimeout(ArtcacheError, TimeoutError):
    """A consumer waited longer than its demand timeout for a position to be published."""

    retryable = True


class CaptureFailed(ArtcacheError, RuntimeError):
    """The producer failed to capture a fingerprint; carries the fingerprint and attempt count."""

    def __init__(self, message: str, *, fingerprint: str, attempts: int, retryable: bool) -> None:
        super().__init__(message)
        self.fingerprint = fingerprint
        self.attempts = attempts
        self.retryable = retryable

    def _keywords(self) -> dict:
        return {"fingerprint": self.fingerprint, "attempts": self.attempts, "retryable": self.retryable}


class CaptureMismatch(ArtcacheError, RuntimeError):
    """A capture backend returned states that do not match the request: fewer or other token ids than
    the sample's, or no states at all. The batch is rejected, never published. Retryable: engine state
    (a prefix-cache hit, a preempted request) can cause it, and the producer retries up to its limit."""

    retryable = True


class ConsumerFenced(ArtcacheError, RuntimeError):
    """This consumer's registration was fenced (generation bumped or state terminal); stop reading."""


class ContractMismatch(ArtcacheError, ValueError):
    """A consumer's needs (layers, target, dtype) do not match the cache root's capture contract."""

    exit_code = 2


class LaunchError(ArtcacheError, RuntimeError):
    """A cluster scheduler refused or failed a job (e.g. ``sbatch`` exited nonzero)."""


class JournalError(_OSErrorMessage):
    """Appending an event to a journal failed (ENOSPC, EIO, ...). Lines already written stay readable;
    a partially written line is cut back or terminated so readers skip it as torn.

    ``retryable`` is True for transient errors (EIO, EAGAIN, EINTR), False for ENOSPC/EDQUOT/EROFS.
    """

    def __init__(self, message: str, *, retryable: bool = False, errno_: int | None = None) -> None:
        super().__init__(message, errno_=errno_)
        self.retryable = retryable

    def _keywords(self) -> dict:
        return {**super()._keywords(), "retryable": self.retryable}


class CheckpointWriteError(_OSErrorMessage):
    """Writing a checkpoint failed (ENOSPC, EDQUOT, EIO, ...). Nothing was published: the temp directory
    was removed and ``checkpoints/latest`` is untouched. ``last_good`` is the checkpoint a ``--resume``
    or ``--init-from`` can still use (None when the run has none); the message names it. ``errno`` is
    the underlying error's (also when it came from safetensors as ``os error N``), or 0 if unknown.
    ``retryable`` is True for transient errors (EIO, EAGAIN, EINTR), False for ENOSPC/EDQUOT/EROFS."""

    def __init__(self, message: str, *, errno_: int | None = None, last_good: str | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message, errno_=errno_)
        self.last_good = last_good
        self.retryable = retryable

    def _keywords(self) -> dict:
        return {**super()._keywords(), "last_good": self.last_good, "retryable": self.retryable}


class TrainingDiverged(ArtcacheError, FloatingPointError):
    """A consumer's loss or gradient norm became non-finite (NaN / inf): training stops at once, no
    checkpoint is written after it (the last finite one stays ``latest``), the registration is marked
    failed. ``step`` is the first optimizer step whose loss or gradient was non-finite."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step

    def _keywords(self) -> dict:
        return {"step": self.step}


class ProducerFailed(ArtcacheError, RuntimeError):
    """The producer stopped because of a failure it cannot work around: its publisher thread failed (a
    journal write, an unsafe path, a lock error), every capture it attempted failed, or (``--exit-when-done``)
    no consumer registered within ``--expect-timeout``. ``artcache producer`` exits 1 with this message."""


class WorkerFailed(ArtcacheError, RuntimeError):
    """A worker process a harness started and waits for (a bench's timed consumer) exited nonzero, exited before
    it was ready, or did not finish in time. The harness has stopped its other workers (SIGTERM, then SIGKILL)
    before raising; the message names the worker, its exit status and its log file (exit 1)."""


class GroupFailed(ArtcacheError, RuntimeError):
    """A rank of a consumer group (``artcache consume --nproc N``) exited nonzero or was killed; the launcher
    stopped the other ranks before raising. ``rank`` is the first rank that failed, ``returncode`` its exit
    status (negative: the signal that killed it, as ``subprocess`` reports it); the message names both (exit 1)."""

    def __init__(self, message: str, *, rank: int, returncode: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode

    def _keywords(self) -> dict:
        return {"rank": self.rank, "returncode": self.returncode}


class NotReadable(_OSErrorMessage, PermissionError):
    """A file or directory another process recorded for this one to read (a cache root's target, recorded by its
    producer) cannot be read by this user (EACCES). The message names the path, its mode and owner, this
    process's ids and how to share it."""


class NotWritable(_OSErrorMessage, PermissionError):
    """A cache root file or directory artcache must write cannot be written (EACCES, EPERM, EROFS: a
    read-only lock file, directory or mount). The message names the path; ``errno`` is the cause's."""
