"""Fast fault tests (default lane): journal writes failing with ENOSPC/EIO, crash-point parsing, orphan
temp-file cleanup, and ``verify_filesystem``."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from artcache import crashpoints
from artcache import journal as J
from artcache.errors import ArtcacheError, JournalError
from artcache.layout import CacheLayout
from artcache.producer import cleanup_orphans
from artcache.verify_fs import verify_filesystem
from tests.support.procs import foreign_token, token


def _ev(i: int) -> J.Event:
    return J.Publish(producer="p", fp=f"{i:040x}", nbytes=i)


class _FailingWrite:
    """Replace os.write for one fd: write ``partial`` bytes of the next call, then raise ``err``."""

    def __init__(self, monkeypatch, fd: int, err: int, partial: int, fail_truncate: bool = False) -> None:
        self.real_write, self.real_truncate = os.write, os.ftruncate
        self.fd, self.err, self.partial, self.armed = fd, err, partial, True
        monkeypatch.setattr(os, "write", self.write)
        if fail_truncate:
            monkeypatch.setattr(os, "ftruncate", self.truncate)

    def write(self, fd, data):
        if fd != self.fd or not self.armed:
            return self.real_write(fd, data)
        self.armed = False
        if self.partial:
            self.real_write(fd, bytes(data[: self.partial]))
        raise OSError(self.err, os.strerror(self.err))

    def truncate(self, fd, size):
        if fd == self.fd:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.real_truncate(fd, size)


def _read(path: Path) -> J.JournalReadResult:
    return J.read_events(path.parent)


def test_journal_enospc_mid_line_is_cut_back_and_typed(tmp_path, monkeypatch):
    path = tmp_path / "j" / "producer-p-1.jsonl"
    w = J.JournalWriter(path)
    w.emit(_ev(1))
    before = path.read_bytes()
    _FailingWrite(monkeypatch, w._fd, errno.ENOSPC, partial=10)
    with pytest.raises(JournalError) as info:  # hold=False: a start line (else a full disk holds it in memory)
        w.emit(_ev(2), hold=False)
    exc = info.value
    assert isinstance(exc, OSError) and isinstance(exc, ArtcacheError)
    assert exc.errno == errno.ENOSPC and exc.retryable is False and "Publish" in str(exc)
    assert path.read_bytes() == before  # the half line was truncated away
    w.emit(_ev(3))
    w.close()
    res = _read(path)
    assert [e.nbytes for e in res.events] == [1, 3] and res.torn_lines == 0


def test_journal_eio_with_failed_truncate_leaves_one_skippable_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "j" / "consumer-c-1.jsonl"
    w = J.JournalWriter(path)
    w.emit(_ev(1))
    _FailingWrite(monkeypatch, w._fd, errno.EIO, partial=15, fail_truncate=True)
    with pytest.raises(JournalError) as info:
        w.emit(_ev(2))
    assert info.value.retryable is True and info.value.errno == errno.EIO
    w.emit(_ev(3))  # must not be glued onto the fragment
    w.emit(_ev(4))
    w.close()
    res = _read(path)
    assert [e.nbytes for e in res.events] == [1, 3, 4]
    assert res.torn_lines == 1


def test_journal_error_before_any_byte_changes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "j" / "producer-p-2.jsonl"
    w = J.JournalWriter(path)
    w.emit(_ev(1))
    _FailingWrite(monkeypatch, w._fd, errno.ENOSPC, partial=0)
    with pytest.raises(JournalError):  # hold=False: a start line (else a full disk holds it in memory)
        w.emit(_ev(2), hold=False)
    w.emit(_ev(3))
    w.close()
    res = _read(path)
    assert [e.nbytes for e in res.events] == [1, 3] and res.torn_lines == 0
    assert path.read_bytes().count(b"\n") == 2


def test_regression_journal_fragment_merged_with_next_event(tmp_path, monkeypatch):
    """Before the fix a failed write left half a line without a newline and the next event was appended
    to it: both were lost as one undecodable line. Now the next event survives."""
    path = tmp_path / "j" / "producer-p-3.jsonl"
    w = J.JournalWriter(path)
    _FailingWrite(monkeypatch, w._fd, errno.EIO, partial=7, fail_truncate=True)
    with pytest.raises(OSError):
        w.emit(_ev(1))
    w.emit(_ev(2))
    w.close()
    assert [e.nbytes for e in _read(path).events] == [2]


# ---- crash points ------------------------------------------------------------------------------------

def test_crash_point_parse():
    assert crashpoints._parse(None) == {} and crashpoints._parse("") == {}
    assert crashpoints._parse("lease.after-create") == {"lease.after-create": 1}
    assert crashpoints._parse("publish.after-fsync:3") == {"publish.after-fsync": 3}
    with pytest.raises(ValueError, match="unknown crash point"):
        crashpoints._parse("nope")
    with pytest.raises(ValueError):
        crashpoints._parse("lease.after-create:0")


def test_crash_point_unset_is_a_no_op():
    crashpoints.reload("")
    for name in crashpoints.POINTS:
        crashpoints.crash_point(name)


@pytest.mark.parametrize("count,killed", [(2, True), (3, False)])
def test_crash_point_kills_on_nth_arrival(count, killed):
    code = ("from artcache.crashpoints import crash_point\n"
            "for i in range(2):\n    print('arrive', i, flush=True)\n    crash_point('evict.after-rename')\n"
            "print('survived', flush=True)\n")
    env = dict(os.environ, ARTCACHE_CRASH_AT=f"evict.after-rename:{count}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    if killed:
        assert proc.returncode == -signal.SIGKILL
        assert proc.stdout.split("\n")[:2] == ["arrive 0", "arrive 1"] and "survived" not in proc.stdout
    else:
        assert proc.returncode == 0 and "survived" in proc.stdout


# ---- orphaned temp files ------------------------------------------------------------------------------

def test_temp_writer_is_the_one_orphan_predicate():
    """A temp name's writer: only a provably dead writer of this host makes an orphan; a live writer's temp
    (this process's, another live process's) never is, nor one whose pid cannot be checked from here."""
    import msgspec

    from artcache.layout import temp_writer, unique_suffix
    from artcache.liveness import this_process

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        cases = {f"{unique_suffix()}.part": "live", f"{token(live.pid)}.aaaa.part": "live",
                 f"{token(dead.pid)}.bbbb.evict": "dead", f"{foreign_token(dead.pid)}.cccc.part": "unknown",
                 f"{os.uname().nodename}.{dead.pid}.dddd.part": "unknown", "not-a-temp-file": "foreign"}
        me = this_process()
        if me.start:  # this process's pid with another start time: the pid was reused, the writer is gone
            cases[f"{msgspec.structs.replace(me, start=me.start + 1).token()}.eeee.part"] = "dead"
        for name, state in cases.items():
            verdict = temp_writer(name)
            assert verdict.state == state, (name, verdict)
            assert verdict.orphan == (state == "dead")
            assert bool(verdict.reason) == (state == "dead") and (verdict.writer is None) == (state == "foreign")
        assert "is gone" in temp_writer(f"{token(dead.pid)}.bbbb.evict").reason
    finally:
        live.kill()
        live.wait()
    assert temp_writer(f"{token(live.pid)}.aaaa.part").orphan  # its writer is gone now


def test_regression_one_home_for_the_orphan_temp_predicate():
    """The producer's tmp/ sweep, fsck and the checkpoint temp sweep each kept their own copy of the test."""
    import artcache.fsck
    import artcache.fsio
    import artcache.layout
    import artcache.trainers.checkpoint

    # the producer's tmp/ sweep is fsio's (test_regression_one_sweep_of_dead_writers_temps); fsck and the checkpoint
    # temp sweep read temp names only through fsio (scan_temps, remove_orphan_parts), which asks layout.temp_writer
    assert artcache.fsio.temp_writer is artcache.layout.temp_writer
    assert artcache.fsck.scan_temps is artcache.fsio.scan_temps
    assert artcache.trainers.checkpoint.remove_orphan_parts is artcache.fsio.remove_orphan_parts
    for mod in (artcache.fsio, artcache.fsck, artcache.trainers.checkpoint):
        assert not hasattr(mod, "parse_temp_name"), mod.__name__
    for mod in (artcache.fsck, artcache.trainers.checkpoint):
        assert not hasattr(mod, "temp_writer"), mod.__name__


def test_cleanup_orphans_spares_live_writers(tmp_path):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        names = {"live": f"{token(live.pid)}.aaaa.part", "dead": f"{token(dead.pid)}.bbbb.part",
                 "dead_evict": f"{token(dead.pid)}.cccc.evict", "other_host": f"{foreign_token(dead.pid)}.dddd.part",
                 "legacy": f"{os.uname().nodename}.{dead.pid}.eeee.part", "junk": "not-a-temp-file"}
        for n in names.values():
            (layout.tmp / n).write_bytes(b"partial")
        assert cleanup_orphans(layout) == 2
        left = sorted(p.name for p in layout.tmp.iterdir())
        # another host's (or a pre-identity name's) pid is never checked: left for the producer's watch
        assert left == sorted([names["live"], names["other_host"], names["legacy"], names["junk"]])
    finally:
        live.kill()
        live.wait()
    assert cleanup_orphans(layout) == 1  # its writer is gone now
    assert not (layout.tmp / names["live"]).exists()



def test_regression_one_sweep_of_dead_writers_temps(tmp_path, monkeypatch):
    """Tidy (one concept, one home): the producer's ``cleanup_orphans`` and ``fsio.remove_orphan_parts`` each
    kept their own sweep of dead writers' temps. The producer's is now fsio's sweep over ``tmp/`` with every temp
    suffix (``.part``, ``.evict``, ...) and the producer's watch; a dead writer's directory there is left alone
    (the old copy's unlink raised IsADirectoryError out of the producer's pass)."""
    import artcache.producer
    from artcache import fsio
    from artcache.liveness import HeartbeatWatch

    calls = []
    real = fsio.remove_orphan_parts
    monkeypatch.setattr(artcache.producer, "remove_orphan_parts", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (layout.tmp / f"{token(dead.pid)}.aaaa.evict").write_bytes(b"x")
    (layout.tmp / f"{token(dead.pid)}.bbbb.part").mkdir()
    watch = HeartbeatWatch(600.0)
    assert cleanup_orphans(layout, watch) == 1
    assert calls == [((layout.tmp,), {"suffix": "", "watch": watch})]
    assert [p.name for p in layout.tmp.iterdir()] == [f"{token(dead.pid)}.bbbb.part"]


# ---- verify-fs ----------------------------------------------------------------------------------------

def test_verify_filesystem_passes_on_local_disk(tmp_path):
    res = verify_filesystem(tmp_path)
    assert res["ok"], res
    assert set(res["checks"]) == {"flock", "o_excl", "atomic_replace", "dir_fsync"}
    assert all(c["ok"] and c["detail"] for c in res["checks"].values())
    assert list(tmp_path.iterdir()) == []  # scratch directory removed


def test_verify_filesystem_reports_a_failing_check(tmp_path, monkeypatch):
    import fcntl

    from artcache import verify_fs

    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)  # flock silently a no-op (some NFS mounts)
    monkeypatch.setitem(verify_fs.CHECKS, "atomic_replace", lambda d: (True, "skipped"))
    res = verify_filesystem(tmp_path)
    assert not res["ok"]
    assert res["checks"]["flock"]["ok"] is False and "no-op" in res["checks"]["flock"]["detail"]
    assert res["checks"]["o_excl"]["ok"] and res["checks"]["dir_fsync"]["ok"]


def test_regression_verify_fs_on_a_full_filesystem_says_so(tmp_path, monkeypatch, capfd):
    """`artcache verify-fs` on a full filesystem printed the writer child's raw ENOSPC traceback, then reported
    `atomic_replace FAILED the writer process failed` and `dir_fsync FAILED OSError: [Errno 28]`, blaming the
    filesystem's semantics. It gives one verdict instead: no free space (ENOSPC), the checks could not run,
    a nonzero exit, and no traceback."""
    import errno

    from click.testing import CliRunner

    from artcache import verify_fs
    from artcache.app.cli import main
    from artcache.errors import InsufficientSpace

    # the writer child's writes fail as on a full disk (its own code runs, with `open` failing)
    monkeypatch.setattr(verify_fs, "_REPLACER", "import errno\n"
                        "def open(*a, **k):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
                        + verify_fs._REPLACER)
    with pytest.raises(InsufficientSpace, match="no free space.*ENOSPC.*could not run"):
        verify_filesystem(tmp_path)
    assert list(tmp_path.iterdir()) == []  # scratch directory removed
    res = CliRunner().invoke(main, ["verify-fs", str(tmp_path)])
    out = res.output + capfd.readouterr().err
    assert res.exit_code != 0 and "no free space" in res.output and "ENOSPC" in res.output, out
    assert "Traceback" not in out and "FAILED" not in out, out

    # a full disk met in this process (the directory fsync check writes a file) is the same verdict
    monkeypatch.setitem(verify_fs.CHECKS, "atomic_replace", lambda d: (True, "skipped"))

    def full(d):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(verify_fs.CHECKS, "dir_fsync", full)
    with pytest.raises(InsufficientSpace, match="no free space"):
        verify_filesystem(tmp_path)


def test_verify_filesystem_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        verify_filesystem(tmp_path / "absent")


def test_cleanup_orphans_of_other_hosts_by_observed_change(tmp_path):
    """Another host's temp file (its writer's pid cannot be checked here) is an orphan only
    once the producer has seen it unchanged (inode, size, mtime) for the watch's timeout on its own clock;
    one that keeps changing (a live writer) stays, however old its mtime looks."""
    from artcache.liveness import HeartbeatWatch

    layout = CacheLayout(tmp_path / "root")
    layout.create()
    still = layout.tmp / f"{foreign_token(5)}.aaaa.part"
    growing = layout.tmp / f"{foreign_token(6)}.bbbb.part"
    still.write_bytes(b"x")
    growing.write_bytes(b"x")
    os.utime(growing, (1.0, 1.0))  # an "ancient" mtime: another host's clock, irrelevant
    now = [0.0]
    watch = HeartbeatWatch(600.0, clock=lambda: now[0])
    assert cleanup_orphans(layout, watch) == 0
    for t in (300.0, 601.0):
        now[0] = t
        with open(growing, "ab") as f:
            f.write(b"more")
        removed = cleanup_orphans(layout, watch)
    assert removed == 1 and not still.exists() and growing.exists()
    assert cleanup_orphans(layout) == 0  # without a watch (a one-shot reader): never
