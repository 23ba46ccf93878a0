"""Fault injection matrix (reliability lane): ENOSPC, EIO and EDQUOT from each system call of a publication
(open, write, fsync of the file, close, rename, fsync of the directory), of a journal append (write, partly
written or not) and of a registration rewrite. Every injection before the rename must give a typed error
that says whether it is retryable, leave no temp file and no partial artifact, keep the journal readable and
the registration intact, and a retry without the fault must succeed. A fault after the rename (the directory
fsync) never withdraws the complete artifact: the publication succeeds. Figures per errno
go to the lane's summary."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from artcache import journal as J
from artcache import registry, store
from artcache.errors import ArtcacheError, ArtifactMissing, JournalError, PublishError
from artcache.fingerprint import fingerprint
from artcache.fsio import RETRYABLE_ERRNOS, SPACE_ERRNOS
from artcache.layout import CacheLayout
from tests.support import crash_child as K
from tests.support.reliability_figures import record

ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EDQUOT": errno.EDQUOT}
#: call -> (os function, which of its calls fails: 1 = first); fsync #1 is the temp file, #2 the directory
PUBLISH_CALLS = {"open": ("open", 1), "write": ("write", 1), "fsync(file)": ("fsync", 1), "close": ("close", 1),
                 "rename": ("replace", 1), "fsync(dir)": ("fsync", 2)}


class Fault:
    """Make the n-th call of ``os.<name>`` (in this thread's calls to artcache) fail with ``code``.
    ``close`` really closes the descriptor before failing (as Linux does); ``write`` may write ``partial``
    bytes first (a short write, then the error)."""

    def __init__(self, monkeypatch, name: str, nth: int, code: int, partial: int = 0, only_fd: int | None = None,
                 under: Path | None = None):
        self.real = getattr(os, name)
        self.name, self.nth, self.code, self.partial, self.only_fd = name, nth, code, partial, only_fd
        self.under = str(under) if under is not None else None
        self.calls = 0
        self.fired = 0
        monkeypatch.setattr(os, name, self)

    def __call__(self, *args, **kwargs):
        if self.only_fd is not None and args[0] != self.only_fd:
            return self.real(*args, **kwargs)
        if self.under is not None and not str(args[0]).startswith(self.under):  # e.g. not a lock file's open
            return self.real(*args, **kwargs)
        self.calls += 1
        if self.calls != self.nth:
            return self.real(*args, **kwargs)
        self.fired += 1
        if self.name == "close":
            self.real(*args, **kwargs)
        elif self.name == "write" and self.partial:
            self.real(args[0], bytes(args[1][: self.partial]))
        raise OSError(self.code, os.strerror(self.code))


def _capture(i: int) -> tuple[str, dict[str, torch.Tensor]]:
    s = K.FakePlan().sample(i)
    return fingerprint(K.CONTRACT, s.input_ids, s.loss_mask), K.fake_capture(s)


def _layout(tmp_path: Path) -> CacheLayout:
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    return layout


def _partial_artifacts(layout: CacheLayout) -> int:
    """Files in objects/ that do not verify (a partial or torn artifact), plus anything left in tmp/."""
    bad = 0
    for shard in layout.objects.iterdir():
        for f in shard.iterdir():
            fp = f.name.split(".")[0]
            try:
                bad += store.verify(layout, fp, K.CONTRACT) is not None
            except ArtifactMissing:
                continue
    return bad + len(list(layout.tmp.iterdir()))


@pytest.mark.parametrize("call", list(PUBLISH_CALLS))
@pytest.mark.parametrize("ename", list(ERRNOS))
def test_publish_fault(tmp_path, monkeypatch, call, ename):
    layout = _layout(tmp_path)
    code = ERRNOS[ename]
    fp, tensors = _capture(3)
    name, nth = PUBLISH_CALLS[call]
    fault = Fault(monkeypatch, name, nth, code)
    if call == "fsync(dir)":  # after the rename: published, whatever the directory fsync says
        monkeypatch.setattr("artcache.fsio.DIR_FSYNC_BACKOFF", ())
        store.publish(layout, fp, K.CONTRACT, tensors, verify_tokens=True)
        monkeypatch.undo()
        assert fault.fired == 1 and store.verify(layout, fp, K.CONTRACT) is None
        assert _partial_artifacts(layout) == 0
        record("faults", f"{ename} (directory fsync after the rename: artifact kept)", injected=1, typed_errors=0,
               retryable=0, partial_artifacts=0, retried_ok=1)
        return
    with pytest.raises(PublishError) as info:
        store.publish(layout, fp, K.CONTRACT, tensors, verify_tokens=True)
    monkeypatch.undo()
    assert fault.fired == 1
    err = info.value
    assert isinstance(err, ArtcacheError) and isinstance(err, OSError)
    assert err.errno == code and err.retryable is (code in RETRYABLE_ERRNOS) and err.fingerprint == fp
    partial = _partial_artifacts(layout)
    assert partial == 0, "a partial artifact or temp file was left"
    assert not store.exists(layout, fp), "nothing may count as published after a failed publication"
    store.publish(layout, fp, K.CONTRACT, tensors, verify_tokens=True)  # the retry succeeds
    assert store.verify(layout, fp, K.CONTRACT) is None
    record("faults", f"{ename} (publish: open/write/fsync/close/rename/dir fsync)", injected=1, typed_errors=1,
           retryable=int(err.retryable), partial_artifacts=partial, retried_ok=1)


@pytest.mark.parametrize("partial", [0, 9], ids=["nothing-written", "half-line"])
@pytest.mark.parametrize("fail_truncate", [False, True], ids=["cut-back", "truncate-fails"])
@pytest.mark.parametrize("ename", list(ERRNOS))
def test_journal_fault(tmp_path, monkeypatch, ename, partial, fail_truncate):
    code = ERRNOS[ename]
    path = tmp_path / "journal" / "producer-p-1.jsonl"
    w = J.JournalWriter(path)
    w.emit(J.Publish(producer="p", fp="a" * 40, nbytes=1))
    Fault(monkeypatch, "write", 1, code, partial=partial, only_fd=w._fd)
    if fail_truncate:
        Fault(monkeypatch, "ftruncate", 1, errno.EIO)
    space = code in SPACE_ERRNOS
    if space:  # a full disk: the event is held in memory, in order, and written once space is back
        w.emit(J.Publish(producer="p", fp="b" * 40, nbytes=2))
        assert w.held == 1
    else:
        with pytest.raises(JournalError) as info:
            w.emit(J.Publish(producer="p", fp="b" * 40, nbytes=2))
        err = info.value
        assert err.errno == code and err.retryable is (code in RETRYABLE_ERRNOS)
    monkeypatch.undo()
    w.emit(J.Publish(producer="p", fp="c" * 40, nbytes=3))  # the journal goes on
    Fault(monkeypatch, "fsync", 1, code)  # and a failing fsync at close loses nothing written
    w.close()
    monkeypatch.undo()
    res = J.read_events(path.parent)
    assert [e.nbytes for e in res.events] == ([1, 2, 3] if space else [1, 3]), "journal no longer readable as written"
    torn = res.torn_lines
    assert torn <= (1 if partial and fail_truncate else 0)
    record("faults", f"{ename} (journal append)", injected=1, typed_errors=int(not space),
           retryable=int(not space and err.retryable), partial_artifacts=0, retried_ok=1, torn_journal_lines=torn)


@pytest.mark.parametrize("call", ["open", "write", "rename"])
@pytest.mark.parametrize("ename", list(ERRNOS))
def test_registration_fault(tmp_path, monkeypatch, call, ename):
    code = ERRNOS[ename]
    layout = _layout(tmp_path)
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="d", pid=os.getpid()))
    # space_wait_s=0: the first failure is raised (a space error is otherwise tried again for up to the
    # heartbeat timeout: see test_regression_registration_rides_out_a_momentary_full_disk below)
    h = registry.ConsumerHandle(layout, reg, space_wait_s=0.0)
    h.commit_cursor(4)
    before = layout.consumer_path("c").read_bytes()
    # the calls of the registration's atomic rewrite (its temp file in tmp/), not those of its lock
    Fault(monkeypatch, {"rename": "replace"}.get(call, call), 1, code, under=layout.tmp if call != "write" else None)
    with pytest.raises(PublishError) as info:
        h.commit_cursor(6)
    monkeypatch.undo()
    assert info.value.errno == code and info.value.retryable is (code in RETRYABLE_ERRNOS)
    assert layout.consumer_path("c").read_bytes() == before, "registration changed by a failed write"
    assert list(layout.tmp.iterdir()) == []
    assert h.commit_cursor(6).cursor == 6  # a retry succeeds
    record("faults", f"{ename} (registration rewrite)", injected=1, typed_errors=1,
           retryable=int(info.value.retryable), partial_artifacts=0, retried_ok=1)


@pytest.mark.parametrize("call", ["open", "write", "rename"])
@pytest.mark.parametrize("ename", [e for e in ERRNOS if ERRNOS[e] in SPACE_ERRNOS])
def test_regression_registration_rides_out_a_momentary_full_disk(tmp_path, monkeypatch, call, ename):
    """A registration rewrite failing once for space is tried again within
    ``space_wait_s`` and succeeds; the matrix above had expected the first failure to be raised."""
    layout = _layout(tmp_path)
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="d", pid=os.getpid()))
    h = registry.ConsumerHandle(layout, reg, space_wait_s=5.0)
    h.commit_cursor(4)
    fault = Fault(monkeypatch, {"rename": "replace"}.get(call, call), 1, ERRNOS[ename],
                  under=layout.tmp if call != "write" else None)
    assert h.commit_cursor(6).cursor == 6
    monkeypatch.undo()
    assert fault.fired == 1
    assert registry.read(layout, "c").cursor == 6
    assert list(layout.tmp.iterdir()) == []
