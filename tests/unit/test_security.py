"""Security of a cache root: private by default (0700; group sharing opt-in, 2770 + setgid), files created
O_EXCL|O_NOFOLLOW, symbolic links planted inside a root refused (never followed), filelock >= 4.2.1 with the
flock backend and no silent fallback to marker-file locks, no pickle."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import warnings
from pathlib import Path

import pytest

from artcache import fsio, leases, locking, store
from artcache import journal as J
from artcache.errors import LockUnavailable, PublishError, UnsafePath
from artcache.eviction import evict_pass
from artcache.fingerprint import PlanFingerprints
from artcache.layout import SUBDIRS, CacheLayout
from artcache.settings import load_settings
from tests.support import REPO
from tests.support import crash_child as K

FP = PlanFingerprints(K.CONTRACT, K.FakePlan())


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def publish(layout: CacheLayout, pos: int) -> str:
    fp = FP(pos)
    store.publish(layout, fp, K.CONTRACT, K.fake_capture(K.FakePlan().sample(pos)), durable=False)
    return fp


# ---- modes ------------------------------------------------------------------------------------------------

def test_root_is_private_by_default(tmp_path, umask_022):
    layout = CacheLayout(tmp_path / "a" / "root")
    layout.create()
    assert mode(layout.root) == 0o700
    assert all(mode(layout.root / d) == 0o700 for d in SUBDIRS)


def test_group_shared_root_is_2770_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        layout = CacheLayout(tmp_path / "root")
        layout.create(group_shared=True)
    finally:
        os.umask(old)
    assert mode(layout.root) == 0o2770
    assert all(mode(layout.root / d) == 0o2770 for d in SUBDIRS)


def test_existing_directory_keeps_its_mode_subdirs_private(tmp_path, umask_022):
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    CacheLayout(root).create()
    assert mode(root) == 0o755  # the operator's directory: not changed
    assert all(mode(root / d) == 0o700 for d in SUBDIRS)  # what is inside is private


def test_producer_group_shared_flag(tmp_path):
    from artcache.producer import ProducerConfig, prepare_root

    layout, *_ = prepare_root(ProducerConfig(cache=str(tmp_path / "g"), target="random:tiny-llama",
                                             dataset="synthetic", max_samples=2, max_length=16, draft_layers=1,
                                             group_shared=True))
    assert mode(layout.root) == 0o2770 and mode(layout.objects) == 0o2770


@pytest.mark.parametrize("group_shared,want", [(False, 0o700), (True, 0o2770)])
def test_regression_directories_under_the_root_take_its_mode(tmp_path, umask_022, group_shared, want):
    """Object shard directories (objects/<ab>/) and published directories under the root (plans/<id>/) were
    made with the umask's mode (755 with umask 022, 2755 in a group-shared root), so another group member's
    producer could not publish into or evict from a shard the first user created. Every directory under a
    cache root is 0700, or 2770 when group-shared, whatever the umask."""
    layout = CacheLayout(tmp_path / "root")
    layout.create(group_shared=group_shared)
    fp = publish(layout, 0)
    assert mode(layout.object_path(fp).parent) == want
    with fsio.publish_dir(layout.plans / ("ab" * 16), in_root=True) as tmp:
        assert mode(tmp) == want
        (tmp / "plan.json").write_text("{}")
    assert mode(layout.plans / ("ab" * 16)) == want
    # a directory of the user's own (a checkpoint, an export), even inside a private (0700) directory: the umask's
    # default, so an export stays readable by others (test_regression_exported_files_are_readable_by_others)
    for parent_mode in (0o755, 0o700):
        user_dir = tmp_path / f"mine-{parent_mode:o}"
        user_dir.mkdir()
        os.chmod(user_dir, parent_mode)
        with fsio.publish_dir(user_dir / "ckpt"):
            pass
        assert mode(user_dir / "ckpt") == 0o755


# ---- O_EXCL | O_NOFOLLOW where files are created ------------------------------------------------------------

def _spy_open(monkeypatch):
    calls = []
    real = os.open

    def spy(path, flags, *a, **kw):
        calls.append((str(path), flags))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    return calls


def test_temp_files_leases_and_locks_are_created_excl_nofollow(layout, monkeypatch):
    calls = _spy_open(monkeypatch)
    fp = publish(layout, 0)
    name = leases.acquire(layout, fp, "c")
    locking.cache_lock(layout.fingerprint_lock(fp), timeout=0).acquire()
    monkeypatch.undo()
    created = [(p, f) for p, f in calls if f & os.O_CREAT]
    where = {"tmp": layout.tmp, "leases": layout.leases, "locks": layout.locks}
    for label, d in where.items():
        mine = [f for p, f in created if Path(p).parent == d]
        assert mine, f"nothing created in {label}/"
        assert all(f & os.O_EXCL and f & os.O_NOFOLLOW for f in mine), (label, [oct(f) for f in mine])
    leases.release(layout, name)


def test_planted_link_at_a_temp_name_is_not_written_through(layout, monkeypatch, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    monkeypatch.setattr(fsio, "unique_suffix", lambda: "fixed")
    os.symlink(victim, layout.tmp / "fixed.part")
    with pytest.raises(PublishError):
        fsio.atomic_write(layout.root / "x.json", [b"data"], layout.tmp)
    assert victim.read_text() == "precious"


def test_planted_link_at_a_lock_name_is_refused(layout, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, layout.lock_path("root"))
    with pytest.raises(UnsafePath, match="symbolic link"):
        locking.cache_lock(layout.lock_path("root"), timeout=0).acquire()
    assert victim.read_text() == "precious"


def test_planted_link_at_a_journal_name_is_refused(layout, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = layout.journal_path("producer", "p")
    os.symlink(victim, path)
    with pytest.raises(UnsafePath):
        J.JournalWriter(path)
    assert victim.read_text() == "precious"


# ---- links planted inside the root ---------------------------------------------------------------------------

@pytest.mark.parametrize("sub", ["objects", "tmp", "leases", "consumers", "journal"])
def test_linked_subdirectory_refused_on_open(layout, tmp_path, sub):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rename(layout.root / sub, tmp_path / "moved")
    os.symlink(elsewhere, layout.root / sub)
    with pytest.raises(UnsafePath, match=f"{sub} is a symbolic link"):
        layout.require()
    with pytest.raises(UnsafePath):
        load_settings(layout)
    with pytest.raises(UnsafePath):
        layout.create()
    assert list(elsewhere.iterdir()) == []


def test_linked_subdirectory_is_a_clear_cli_error(layout, tmp_path):
    from click.testing import CliRunner

    from artcache.app.cli import main

    os.rename(layout.leases, tmp_path / "moved")
    os.symlink(tmp_path, layout.leases)
    r = CliRunner().invoke(main, ["inspect", "--cache", str(layout.root)])
    assert r.exit_code != 0 and "UnsafePath" in r.stderr and "symbolic link" in r.stderr


def test_linked_artifact_is_refused_not_followed(layout, tmp_path):
    fp = FP(1)
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"\x08" + b"\0" * 100)
    layout.object_path(fp).parent.mkdir(exist_ok=True)
    os.symlink(secret, layout.object_path(fp))
    with pytest.raises(UnsafePath):
        store.read(layout, fp, K.CONTRACT)
    assert os.path.islink(layout.object_path(fp)) and secret.exists()  # not moved, not followed
    assert store.list_objects(layout) == {}


def test_regression_linked_shard_is_not_listed_evicted_through_or_published_into(layout, tmp_path):
    """list_objects used ``is_dir()``/``stat()`` (which follow links): a link planted as objects/<ab> made
    eviction rename and unlink files in the link's target directory, and publication wrote through it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    fp = FP(2)
    name = f"{fp}.safetensors"
    (victim / name).write_bytes(b"someone else's file")
    os.symlink(victim, layout.objects / fp[:2])
    assert store.list_objects(layout) == {}
    res = evict_pass(layout, [fp], set())  # asked to evict it: the planted link is still not followed
    assert res.evicted == {} and (victim / name).read_bytes() == b"someone else's file"
    with pytest.raises(UnsafePath):
        store.read(layout, fp, K.CONTRACT)
    with pytest.raises(UnsafePath):
        store.publish(layout, fp, K.CONTRACT, K.fake_capture(K.FakePlan().sample(2)))
    assert os.listdir(victim) == [name] and os.listdir(layout.tmp) == []


# ---- filelock -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("version", "ok"), [("4.2.1", True), ("4.3.1", True), ("5.0", True), ("4.3.0rc1", True),
                                             ("4.2.0", False), ("4.1.9", False), ("3.20.3", False), ("4", False)])
def test_filelock_version_floor(version, ok):
    if ok:
        locking.check_filelock_version(version)
    else:
        with pytest.raises(ImportError, match=r"filelock >= 4\.2\.1"):
            locking.check_filelock_version(version)


def test_installed_filelock_and_pyproject_pin():
    import filelock

    locking.check_filelock_version(filelock.__version__)
    assert '"filelock>=4.2.1"' in (REPO / "pyproject.toml").read_text()


def test_regression_no_silent_soft_lock_fallback(tmp_path, monkeypatch):
    """filelock.FileLock (filelock 4) falls back to a marker-file lock with only a warning when flock fails
    with ENOSYS; a SIGKILLed holder's marker is never released by the kernel. artcache's lock refuses."""

    def nosys(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", nosys)
    with pytest.raises(LockUnavailable, match="verify-fs") as info:
        locking.cache_lock(tmp_path / "a.lock", timeout=0).acquire()
    assert info.value.errno == errno.ENOSYS and not info.value.retryable
    import filelock

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        soft = filelock.FileLock(str(tmp_path / "b.lock"), timeout=0)
        soft.acquire()  # what artcache used before: "works", on a marker file
        soft.release()
    assert any("SoftFileLock" in str(w.message) for w in seen)


def test_artcache_takes_every_lock_through_locking():
    offenders = []
    for path in sorted((REPO / "artcache").rglob("*.py")) + sorted((REPO / "trainers").rglob("*.py")):
        if path.name == "locking.py":
            continue
        text = path.read_text()
        if re.search(r"\bFileLock\(|SoftFileLock|from filelock import", text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == [], f"take locks with artcache.locking.cache_lock: {offenders}"


def test_no_pickle_or_torch_load_of_cache_contents():
    offenders = []
    for path in sorted((REPO / "artcache").rglob("*.py")):
        text = path.read_text()
        if re.search(r"^\s*import pickle|\bpickle\.loads?\(|\btorch\.load\(", text, re.M):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_linked_registration_is_refused_by_read_and_skipped_by_scans(layout, tmp_path):
    from artcache import registry

    victim = tmp_path / "victim.json"
    victim.write_text('{"consumer_id": "x", "draft": "d"}')
    os.symlink(victim, layout.consumer_path("x"))
    with pytest.raises(UnsafePath):
        registry.read(layout, "x")
    assert registry.read_all(layout) == []


def test_regression_failed_create_removes_what_it_made(tmp_path):
    """create() stopped at a subdirectory name held by a file (UnsafePath) and left the directories it had
    made before it (`plans/` was left behind); it now removes them before raising."""
    root = tmp_path / "dir"
    root.mkdir()
    (root / "objects").write_text("a file, not a directory")  # SUBDIRS: plans comes first, objects second
    with pytest.raises(UnsafePath, match="objects"):
        CacheLayout(root).create()
    assert sorted(p.name for p in root.iterdir()) == ["objects"]


# ---- a group-shared root serves a second member of the group ---------------------------------------------------

ALICE, TEAM = 52001, 52000  # the producer's user and the group sharing the root (no passwd entry needed)


def _teammate_available() -> bool:
    import shutil as sh

    return hasattr(os, "geteuid") and os.geteuid() == 0 and sh.which("setpriv") is not None


needs_root = pytest.mark.skipif(not _teammate_available(),
                                reason="needs root and setpriv (a teammate is root without CAP_DAC_*)")


def _as_teammate(args: list[str], env: dict, timeout: float = 300):
    """Run ``python args`` as a teammate: a member of group TEAM only, without the capabilities that let root read
    what its mode bits refuse (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so another user's 0700 directory and 0600
    file are as closed to it as to any other member of the group."""
    import subprocess
    import sys

    return subprocess.run(["setpriv", "--groups", str(TEAM), "--bounding-set", "-dac_override,-dac_read_search",
                           sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    """``path`` and everything under it owned by ``uid:gid``, modes kept (the files alice's producer made)."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, gid)
    os.lchown(path, uid, gid)


def _alice_root(tmp_path: Path, target: str, home: Path, monkeypatch) -> Path:
    """A group-shared root made as alice's producer makes it (umask 007, her ARTCACHE_HOME ``home``), then owned by
    alice and the group, as her files would be."""
    from artcache.producer import ProducerConfig, prepare_root

    monkeypatch.setenv("ARTCACHE_HOME", str(home))
    shared = tmp_path / "shared"
    shared.mkdir()
    old = os.umask(0o007)
    try:
        prepare_root(ProducerConfig(cache=str(shared / "cache"), target=target, dataset="synthetic", max_samples=8,
                                    max_length=32, draft_layers=3, group_shared=True))
    finally:
        os.umask(old)
    monkeypatch.delenv("ARTCACHE_HOME")
    _chown_tree(shared, ALICE, TEAM)
    return shared / "cache"


# what a consumer does with the root's target at start: resolve it, then read its embedding and lm_head
_CHECK = ("import sys; from pathlib import Path; from artcache.layout import CacheLayout; "
          "from artcache.settings import load_settings; from artcache.target import load_embedding_and_lm_head; "
          "from artcache.trainers.draft import check_target; "
          "info = check_target(load_settings(CacheLayout(Path(sys.argv[1])))); load_embedding_and_lm_head(info); "
          "print('TARGET', info.path)")


@needs_root
@pytest.mark.parametrize("shared_home", [False, True])
def test_regression_group_shared_root_serves_a_teammates_consumer(tmp_path, monkeypatch, shared_home):
    """With ``--group-shared``, umask 007 and each user's default cache, a teammate's consumer died at start: it read
    the target's weights from the path the producer recorded, under alice's private ARTCACHE_HOME (a raw
    PermissionError); with one shared ARTCACHE_HOME, ``random:`` targets' weights were written 0600 (safetensors)
    and the teammate could not read them. Now a built-in target is resolved from the teammate's own cache by its
    weights digest when the recorded path is closed, and its weights are written group-readable."""
    alice_home = tmp_path / "alice" / ".cache" / "artcache"
    if shared_home:
        alice_home = tmp_path / "team-cache"
        alice_home.mkdir()
        os.chmod(alice_home, 0o2770)
    cache = _alice_root(tmp_path, "random:tiny-llama", alice_home, monkeypatch)
    _chown_tree(tmp_path / ("team-cache" if shared_home else "alice"), ALICE, TEAM if shared_home else ALICE)
    if not shared_home:
        os.chmod(tmp_path / "alice", 0o700)
    bob_home = alice_home if shared_home else tmp_path / "bob-home"
    env = dict(os.environ, ARTCACHE_HOME=str(bob_home))
    res = _as_teammate(["-c", _CHECK, str(cache)], env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    got = Path(res.stdout.split("TARGET ")[1].strip())
    assert got == bob_home / "targets" / "random-tiny-llama-s0", got  # bob's own cache, or the shared one
    weights = alice_home / "targets" / "random-tiny-llama-s0" / "model.safetensors"
    assert os.stat(weights).st_mode & 0o040, oct(os.stat(weights).st_mode)  # the group may read it
    if shared_home:
        return
    # the teammate's whole consumer start: it registers on alice's root and waits for a producer (none runs here)
    res = _as_teammate(["-m", "artcache", "consume", "--cache", str(cache), "--id", "bob", "--block-size", "4",
                        "--anchors", "4", "--steps", "1", "--out", str(tmp_path / "bob-run"), "--no-progress",
                        "--demand-timeout", "2"], env)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("artcache: error:")]
    assert res.returncode == 1 and len(errors) == 1 and "CaptureTimeout: position 0" in errors[0], res.stderr[-3000:]
    assert "from this user's cache (same weights digest" in res.stderr
    assert json.loads((cache / "consumers" / "bob.json").read_text())["state"] == "failed"


@needs_root
def test_regression_unreadable_target_directory_is_one_line_naming_path_and_permission(tmp_path, monkeypatch,
                                                                                       tiny_target):
    """A root captured from a target directory in alice's private home: the teammate's consumer got a raw
    PermissionError traceback at start. Now one line names the path, its mode and owner, the teammate's ids and the
    permission missing, exit 1, nothing registered."""
    import shutil as sh

    private = tmp_path / "alice"
    target = private / "models" / "tiny"
    sh.copytree(tiny_target.path, target)
    cache = _alice_root(tmp_path, str(target), tmp_path / "alice-home", monkeypatch)
    _chown_tree(private, ALICE, ALICE)
    os.chmod(private, 0o700)
    env = dict(os.environ, ARTCACHE_HOME=str(tmp_path / "bob-home"))
    res = _as_teammate(["-m", "artcache", "consume", "--cache", str(cache), "--id", "bob", "--block-size", "4",
                        "--anchors", "4", "--steps", "1", "--out", str(tmp_path / "bob-run"), "--no-progress"], env)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("artcache: error:")]
    assert res.returncode == 1 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert (f"NotReadable: the cache root's target {target} cannot be read by this user: {private} (drwx------ uid "
            f"{ALICE} gid {ALICE}) gives uid 0 (groups [{TEAM}]) no search permission") in errors[0], errors
    assert "chmod -R g+rX" in errors[0]
    assert not list((cache / "consumers").glob("*.json")) and not (tmp_path / "bob-run").exists()


def test_group_shared_producer_warns_of_a_target_its_group_cannot_read(tmp_path, tiny_target, caplog):
    """A group-shared root captured from a target directory its group cannot read is said at the producer's start
    (a teammate's consumer would be refused); a built-in target (resolved by each user by name) is not."""
    import logging
    import shutil as sh
    import tempfile

    from artcache.producer import ProducerConfig, prepare_root

    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="artcache-test-"))  # parents the group may search (not tmp_path's)
    try:
        os.chmod(base, 0o755)
        private = base / "private"
        sh.copytree(tiny_target.path, private / "tiny")
        os.chmod(private, 0o700)
        with caplog.at_level(logging.WARNING, logger="artcache.producer"):
            prepare_root(ProducerConfig(cache=str(tmp_path / "cache"), target=str(private / "tiny"),
                                        dataset="synthetic", max_samples=4, max_length=32, draft_layers=3,
                                        group_shared=True))
        warned = [r.getMessage() for r in caplog.records if "--group-shared: the target" in r.getMessage()]
        assert len(warned) == 1 and f"{private} (drwx------" in warned[0] and "no search" in warned[0], warned
        os.chmod(private, 0o750)
        for f in (private / "tiny").iterdir():
            os.chmod(f, 0o640)
        os.chmod(private / "tiny", 0o750)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="artcache.producer"):
            prepare_root(ProducerConfig(cache=str(tmp_path / "cache"), target=str(private / "tiny"),
                                        dataset="synthetic", max_samples=4, max_length=32, draft_layers=3,
                                        group_shared=True))
        assert not [r.getMessage() for r in caplog.records if "--group-shared: the target" in r.getMessage()]
    finally:
        sh.rmtree(base, ignore_errors=True)
