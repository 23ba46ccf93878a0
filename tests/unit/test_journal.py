"""journal: every event type round-trips, torn lines are skipped and counted, threads write whole lines."""

from __future__ import annotations

import math
import os
import threading

import msgspec
import pytest

from artcache import journal as J
from artcache.errors import JournalError

FP = "ab" * 20

SAMPLES: dict[type, dict] = {
    J.ProducerStart: dict(producer="p", pid=12, contract_id="cc" * 20, plan_id="dd" * 20, budget_bytes=1 << 40,
                          policy="windows", fill=True, evict_fill=True, kept_fill=7,
                          spec="ee" * 16),
    J.ProducerStop: dict(producer="p", reason="signal"),
    J.CaptureBatch: dict(producer="p", fps=[FP, "cd" * 20], samples=2, tokens=30, padded_tokens=40, start=1.5,
                         end=2.25, demand=1),
    J.Capture: dict(producer="p", fp=FP, positions=[3, 1003], tokens=17, recapture=True, demand=True),
    J.Publish: dict(producer="p", fp=FP, nbytes=123456),
    J.CaptureFailure: dict(producer="p", fp=FP, attempts=3, retryable=False, error="PublishError: ENOSPC",
                           stage="forward"),
    J.Coalesced: dict(producer="p", fp=FP, requesters=2, reason="lock-held"),
    J.Evict: dict(producer="p", fp=FP, nbytes=99, reason="needed-later"),
    J.Retained: dict(producer="p", artifacts=5, nbytes=500, window_bound=12, budget=1000, binding=True,
                     windows_exceed_budget=True),
    J.LeaseExpire: dict(producer="p", fp=FP, lease=f"{FP}~c~h~1~aa", reason="holder-dead"),
    J.Fence: dict(producer="p", consumer="c", generation=4, state="expired", reason="no heartbeat for 31s"),
    J.ConsumerStart: dict(consumer="c", pid=7, draft="dflash", block_size=16, batch_size=4, lookbehind=64,
                          lookahead=256, cursor=10, step=5, pinned=8, epoch_len=90, reader="0123456789abcdef-42-99",
                          spec="ff" * 16, ranks=2, rank_readers=["0123456789abcdef-43-99"]),
    J.Request: dict(consumer="c", position=5, fp=FP, hit=False, wait_s=0.25, sample=95, epoch=2, held_out=True),
    J.DemandWait: dict(consumer="c", position=5, fp=FP),
    J.LeaseAcquire: dict(consumer="c", fp=FP, lease=f"{FP}~c~h~1~aa"),
    J.LeaseRelease: dict(consumer="c", fp=FP, lease=f"{FP}~c~h~1~aa"),
    J.Quarantined: dict(consumer="c", fp=FP, reason="failed its content hash"),
    J.Step: dict(consumer="c", step=3, cursor=12, loss=1.25, tau_sum=7.5, blocks=4, acc_correct=[4, 3, 2],
                 acc_total=[4, 4, 4], wait_s=0.0, step_s=0.5, lr=3e-4, epoch=1),
    J.ConsumerEnd: dict(consumer="c", state="failed", steps=3, cursor=12, error="CaptureTimeout: x"),
}


def test_samples_cover_every_event_type():
    assert set(SAMPLES) == set(J.EVENT_TYPES)
    for cls, kw in SAMPLES.items():
        # every field but the time is given a non-default value, so a field lost in encoding shows up
        assert set(kw) == set(cls.__struct_fields__) - {"t"}, cls


def test_round_trip_every_event_type(tmp_path):
    path = tmp_path / "journal" / "x-y-1.jsonl"
    events = [cls(t=1000.0 + i, **kw) for i, (cls, kw) in enumerate(SAMPLES.items())]
    with J.JournalWriter(path) as w:
        for ev in events:
            w.emit(ev)
    res = J.read_events(tmp_path / "journal")
    assert res.files == 1 and res.torn_lines == 0
    assert res.events == events
    assert [type(e) for e in res.events] == list(SAMPLES)
    # one line per event, each a JSON object with its tag
    lines = path.read_bytes().splitlines()
    assert len(lines) == len(events)
    assert all(msgspec.json.decode(line)["kind"] for line in lines)


def test_defaults_round_trip_and_time_is_set(tmp_path):
    with J.JournalWriter(tmp_path / "j.jsonl") as w:
        ev = J.Capture(producer="p", fp=FP, positions=[1], tokens=3)
        w.emit(ev)
    assert ev.t > 0
    (got,) = list(J.iter_file(tmp_path / "j.jsonl"))
    assert got == ev and got.recapture is False and got.demand is False


def test_regression_nonfinite_float_round_trips(tmp_path):
    """A diverged step (loss NaN/Inf) is encoded as JSON null; it must be read back, not counted as torn."""
    with J.JournalWriter(tmp_path / "j" / "c-c-1.jsonl") as w:
        w.emit(J.Step(t=1.0, **{**SAMPLES[J.Step], "loss": float("nan")}))
        w.emit(J.Step(t=2.0, **{**SAMPLES[J.Step], "loss": float("inf"), "step": 4}))
    res = J.read_events(tmp_path / "j")
    assert res.torn_lines == 0
    assert [e.step for e in res.events] == [3, 4]
    # JSON null reads back as None (since issue 16 a Step may carry no loss: nothing supervised); what
    # matters is that the line is read, not counted as torn
    assert all(e.loss is None or math.isnan(e.loss) or math.isinf(e.loss) for e in res.events)


def test_torn_last_line_skipped_and_counted(tmp_path):
    jdir = tmp_path / "journal"
    path = jdir / "producer-p-1.jsonl"
    with J.JournalWriter(path) as w:
        for i in range(5):
            w.emit(J.Publish(t=float(i + 1), producer="p", fp=FP, nbytes=i))
    full = path.read_bytes()
    last_start = full.rstrip(b"\n").rfind(b"\n") + 1
    for cut in range(last_start + 1, len(full) - 1):  # every torn prefix of the last line
        path.write_bytes(full[:cut])
        res = J.read_events(jdir)
        assert res.torn_lines == 1, cut
        assert [e.nbytes for e in res.events] == [0, 1, 2, 3]


def test_torn_line_in_one_file_does_not_hide_others(tmp_path):
    jdir = tmp_path / "journal"
    with J.JournalWriter(jdir / "a-a-1.jsonl") as w:
        w.emit(J.Evict(t=2.0, producer="a", fp=FP, nbytes=1))
    with J.JournalWriter(jdir / "b-b-2.jsonl") as w:
        w.emit(J.Evict(t=1.0, producer="b", fp=FP, nbytes=2))
        w.emit(J.Evict(t=3.0, producer="b", fp=FP, nbytes=3))
    with open(jdir / "b-b-2.jsonl", "ab") as f:
        f.write(b'{"kind":"evict","producer":"b","fp":"')
    (jdir / "c-c-3.jsonl").write_bytes(b"\n\n")  # blank lines are not torn
    (jdir / "notes.txt").write_text("ignored")
    res = J.read_events(jdir)
    assert res.files == 3 and res.torn_lines == 1
    assert [e.nbytes for e in res.events] == [2, 1, 3]  # merged and sorted by time


def test_garbage_and_unknown_kind_are_counted(tmp_path):
    jdir = tmp_path / "journal"
    jdir.mkdir()
    (jdir / "x-x-1.jsonl").write_bytes(b'{"kind":"nope","t":1}\n[1,2]\n{"kind":"publish","t":1}\n\xff\xfe\n')
    res = J.read_events(jdir)  # the last line may be torn by a kill; the others, with lines after them, are damage
    assert res.torn_lines == 1 and res.events == [] and res.corrupt == [(jdir / "x-x-1.jsonl", n) for n in (1, 2, 3)]
    (jdir / "x-x-1.jsonl").write_bytes(b'{"kind":"evict","producer":"b","fp":"\n{"kind":"nope","t":1}\n')
    res = J.read_events(jdir)  # a failed write's cut-off event, terminated by the next write: torn, not damage
    assert res.torn_lines == 2 and res.corrupt == []


def test_missing_journal_dir(tmp_path):
    res = J.read_events(tmp_path / "none")
    assert res.files == 0 and res.events == [] and res.torn_lines == 0


def test_concurrent_threads_write_whole_lines(tmp_path):
    path = tmp_path / "journal" / "c-c-1.jsonl"
    w = J.JournalWriter(path)
    n_threads, per = 8, 300
    big = "x" * 5000  # lines larger than a pipe buffer / typical page, to catch interleaving

    def work(k: int):
        for i in range(per):
            w.emit(J.CaptureFailure(producer=f"p{k}", fp=FP, attempts=i, retryable=True, error=big))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    w.close()
    res = J.read_events(path.parent)
    assert res.torn_lines == 0
    assert len(res.events) == n_threads * per
    for k in range(n_threads):
        assert sorted(e.attempts for e in res.events if e.producer == f"p{k}") == list(range(per))
    assert all(e.error == big for e in res.events)


def test_emit_after_close_is_dropped(tmp_path):
    path = tmp_path / "j.jsonl"
    w = J.JournalWriter(path)
    w.emit(J.ProducerStop(producer="p", reason="a"))
    w.close()
    w.close()  # idempotent
    w.emit(J.ProducerStop(producer="p", reason="b"))
    assert [e.reason for e in J.iter_file(path)] == ["a"]


def test_writer_appends_to_existing_file(tmp_path):
    path = tmp_path / "j.jsonl"
    for reason in ("a", "b"):
        with J.JournalWriter(path) as w:
            w.emit(J.ProducerStop(producer="p", reason=reason))
    assert [e.reason for e in J.iter_file(path)] == ["a", "b"]


def test_write_error_propagates(tmp_path, monkeypatch):
    """A write error other than space (EIO) raises JournalError; so does space with ``hold=False``."""
    import errno

    w = J.JournalWriter(tmp_path / "j.jsonl")

    def boom(code):
        def write(fd, data):
            raise OSError(code, os.strerror(code))
        return write

    monkeypatch.setattr(os, "write", boom(errno.EIO))
    with pytest.raises(JournalError) as info:
        w.emit(J.ProducerStop(producer="p", reason="x"))
    assert info.value.errno == errno.EIO and w.held == 0
    monkeypatch.setattr(os, "write", boom(errno.ENOSPC))
    with pytest.raises(JournalError) as info:
        w.emit(J.ProducerStart(producer="p", pid=1, contract_id="c", plan_id="p"), hold=False)
    assert info.value.errno == errno.ENOSPC and w.held == 0
    monkeypatch.undo()
    w.close(remove_if_empty=True)
    assert not (tmp_path / "j.jsonl").exists(), "a start refused on a full disk left an empty journal"


class _FullDisk:
    """os.write raising ENOSPC (or EDQUOT) on the journal's fd while ``full``; a short first write (half a
    line reaches the file) when ``partial``."""

    def __init__(self, monkeypatch, fd, code, partial=False):
        self.full, self.fd, self.code, self.partial, self.real = True, fd, code, partial, os.write
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd, data):
        if fd != self.fd or not self.full:
            return self.real(fd, data)
        if self.partial:
            self.partial = False
            return self.real(fd, bytes(data)[:7])
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT"])
def test_regression_journal_holds_events_in_order_while_the_disk_is_full(tmp_path, monkeypatch, code):
    """A journal append failing for space raised JournalError, which killed the producer
    (and a consumer) on a full disk. Now the events are held in memory in emit order, the file carries an
    exclusive flock meanwhile (a reader tells held lines from lost ones), and the first try after space is
    back writes them all, with their original times, after the lines written before."""
    import errno

    monkeypatch.setattr(J, "HOLD_RETRY_S", 0.0)
    path = tmp_path / "producer-p-1.jsonl"
    w = J.JournalWriter(path)
    w.emit(J.Publish(producer="p", fp="a" * 40, nbytes=1))
    disk = _FullDisk(monkeypatch, w._fd, getattr(errno, code), partial=True)
    for n in (2, 3, 4):
        w.emit(J.Publish(t=float(n), producer="p", fp="b" * 40, nbytes=n))  # no raise: held
    assert w.held == 3 and not w.flush_held()
    assert [e.nbytes for e in J.read_events(tmp_path).events] == [1]
    assert J.holding_events(path), "a writer holding events must say so to readers"
    disk.full = False
    assert w.flush_held() and w.held == 0 and not J.holding_events(path)
    w.emit(J.Publish(producer="p", fp="c" * 40, nbytes=5))
    w.close()
    lines = list(J.iter_file(path))  # file order (read_events sorts by time)
    assert None not in lines, "a torn line"
    assert [e.nbytes for e in lines] == [1, 2, 3, 4, 5]
    assert [e.t for e in lines][1:4] == [2.0, 3.0, 4.0]


def test_regression_journal_hold_is_bounded_and_lost_events_are_logged(tmp_path, monkeypatch, caplog):
    """The held events are bounded (HOLD_MAX_BYTES): past it emit fails clearly (JournalError, ENOSPC) instead
    of growing without bound; events still held at close are lost (as a kill loses them) and logged."""
    import errno

    monkeypatch.setattr(J, "HOLD_MAX_BYTES", 400)
    w = J.JournalWriter(tmp_path / "j.jsonl")
    _FullDisk(monkeypatch, w._fd, errno.ENOSPC)
    with pytest.raises(JournalError) as info:
        for _ in range(10):
            w.emit(J.ProducerStop(producer="p", reason="x" * 60))
    assert info.value.errno == errno.ENOSPC and "held in memory" in str(info.value) and 1 < w.held < 10
    w.close()
    assert "lost" in caplog.text and (tmp_path / "j.jsonl").stat().st_size == 0


def test_regression_short_write_completes_the_line(tmp_path, monkeypatch):
    """os.write may write fewer bytes than asked; emit ignored the count and left half a line, which the
    next event was then glued to (both lost as one torn line)."""
    path = tmp_path / "j.jsonl"
    w = J.JournalWriter(path)
    real_write = os.write

    def short(fd, data):
        return real_write(fd, bytes(data)[:10])

    monkeypatch.setattr(os, "write", short)
    w.emit(J.ProducerStop(t=1.0, producer="p", reason="first"))
    w.emit(J.ProducerStop(t=2.0, producer="p", reason="second"))
    monkeypatch.undo()
    w.close()
    res = J.read_events(tmp_path)
    assert res.torn_lines == 0
    assert [e.reason for e in res.events] == ["first", "second"]
