"""store: publish/read round trip, atomic publication, typed write failures, validation, corruption."""

from __future__ import annotations

import errno
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from artcache import fsio, store
from artcache.contract import CaptureContract
from artcache.errors import ArtifactMissing, IntegrityError, PublishError
from artcache.fingerprint import fingerprint
from artcache.layout import CacheLayout

C = CaptureContract(target_name="tiny-target", target_revision="rev-0001", target_config_hash="cfg01",
                    target_weights_digest="w01", layer_ids=(1, 3), max_length=16,
                    tokenizer_digest="tok01", template_digest="tpl01")
C_OTHER = CaptureContract(target_name="tiny-target", target_revision="rev-0002", target_config_hash="cfg01",
                          target_weights_digest="w01", layer_ids=(1, 3), max_length=16,
                          tokenizer_digest="tok01", template_digest="tpl01")
H = 8


def tensors(t: int = 6, seed: int = 0, contract: CaptureContract = C, **extra) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "hidden_states": torch.randn(t, len(contract.layer_ids), H, generator=g).to(torch.bfloat16),
        "input_ids": torch.randint(0, 50000, (t,), generator=g, dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (t,), generator=g).to(torch.uint8),
    }
    out.update(extra)
    return out


def fp_for(ts: dict[str, torch.Tensor], contract: CaptureContract = C) -> str:
    return fingerprint(contract, ts["input_ids"], ts["loss_mask"])


@pytest.fixture()
def layout(tmp_path) -> CacheLayout:
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    return lay


def objects_files(layout: CacheLayout) -> list[Path]:
    return sorted(p for p in layout.objects.rglob("*") if p.is_file())


def tmp_files(layout: CacheLayout) -> list[Path]:
    return sorted(layout.tmp.iterdir())


def quarantine_files(layout: CacheLayout) -> list[Path]:
    return sorted(layout.quarantine.iterdir())


# ---- round trip ----------------------------------------------------------------------------------
def test_publish_read_round_trip_bytes_equal(layout):
    ts = tensors()
    fp = fp_for(ts)
    n = store.publish(layout, fp, C, ts)
    path = layout.object_path(fp)
    assert path.is_file() and path.stat().st_size == n
    assert store.exists(layout, fp)
    art = store.read(layout, fp, C)
    assert art.fingerprint == fp and art.nbytes == n and art.extras == {}
    for name, got in (("hidden_states", art.hidden_states), ("input_ids", art.input_ids),
                      ("loss_mask", art.loss_mask)):
        assert got.dtype == ts[name].dtype and got.shape == ts[name].shape
        assert got.contiguous().view(torch.uint8).numpy().tobytes() == \
            ts[name].contiguous().view(torch.uint8).numpy().tobytes()
    assert tmp_files(layout) == []


def test_round_trip_with_extras(layout):
    ts = tensors(t=5, seed=3)
    ts["last_hidden"] = torch.randn(5, H).to(torch.bfloat16)
    ts["target_argmax"] = torch.arange(5, dtype=torch.int32)
    fp = fp_for(ts)
    store.publish(layout, fp, C, ts)
    art = store.read(layout, fp, C)
    assert set(art.extras) == {"last_hidden", "target_argmax"}
    assert torch.equal(art.extras["last_hidden"], ts["last_hidden"])
    assert torch.equal(art.extras["target_argmax"], ts["target_argmax"])


def test_noncontiguous_input_is_published(layout):
    ts = tensors(t=4)
    ts["hidden_states"] = ts["hidden_states"].transpose(0, 2).contiguous().transpose(0, 2)
    assert not ts["hidden_states"].is_contiguous()
    fp = fp_for(ts)
    store.publish(layout, fp, C, ts)
    assert torch.equal(store.read(layout, fp, C).hidden_states, ts["hidden_states"])


def test_regression_republish_same_fp_gives_same_bytes(layout):
    """Same fingerprint => same bytes. safetensors writes its metadata map in (random) hash order, so
    before the fix the header differed between publications of the same capture."""
    ts = tensors()
    fp = fp_for(ts)
    seen = set()
    for _ in range(8):
        store.publish(layout, fp, C, ts)
        seen.add(layout.object_path(fp).read_bytes())
    assert len(seen) == 1
    assert len(objects_files(layout)) == 1


def test_object_path_sharded_by_prefix(layout):
    ts = tensors()
    fp = fp_for(ts)
    store.publish(layout, fp, C, ts)
    assert objects_files(layout) == [layout.objects / fp[:2] / f"{fp}.safetensors"]


def test_list_objects(layout):
    fps = {}
    for seed in range(5):
        ts = tensors(t=3 + seed, seed=seed)
        fp = fp_for(ts)
        fps[fp] = store.publish(layout, fp, C, ts)
    assert store.list_objects(layout) == fps


def test_remove(layout):
    ts = tensors()
    fp = fp_for(ts)
    n = store.publish(layout, fp, C, ts)
    assert store.remove(layout, fp) == n
    assert not store.exists(layout, fp)
    assert store.remove(layout, fp) == 0  # already gone is success
    assert tmp_files(layout) == []
    with pytest.raises(ArtifactMissing):
        store.read(layout, fp, C)


def test_remove_never_published_returns_zero(layout):
    assert store.remove(layout, "ab" * 20) == 0


def test_read_missing_is_artifact_missing_and_file_not_found(layout):
    with pytest.raises(ArtifactMissing) as ei:
        store.read(layout, "cd" * 20, C)
    assert isinstance(ei.value, FileNotFoundError) and ei.value.retryable


# ---- atomicity -----------------------------------------------------------------------------------
def test_nothing_in_objects_before_rename(layout, monkeypatch):
    ts = tensors()
    fp = fp_for(ts)
    real_replace = os.replace
    seen = []

    def spy(src, dst, *a, **kw):
        if Path(dst) == layout.object_path(fp):
            # at rename time: the temp file is complete in tmp/, objects/ holds nothing yet
            assert objects_files(layout) == []
            assert Path(src).parent == layout.tmp
            seen.append(Path(src).stat().st_size)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", spy)
    n = store.publish(layout, fp, C, ts)
    monkeypatch.undo()
    assert seen == [n]
    assert tmp_files(layout) == []
    assert len(objects_files(layout)) == 1


def test_publish_fsyncs_file_and_directory(layout, monkeypatch):
    ts = tensors()
    fp = fp_for(ts)
    real_fsync = os.fsync
    calls = []

    def spy(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store.publish(layout, fp, C, ts)
    monkeypatch.undo()
    assert len(calls) == 2
    assert Path(calls[0]).parent == layout.tmp  # the temp file, before the rename
    assert Path(calls[1]) == layout.object_path(fp).parent  # the directory, after it


# ---- failed writes -------------------------------------------------------------------------------
def _raiser(code: int):
    def f(*a, **kw):
        raise OSError(code, os.strerror(code))
    return f


@pytest.mark.parametrize("func", ["write", "fsync", "replace"])
@pytest.mark.parametrize(("code", "retryable"), [(errno.ENOSPC, False), (errno.EIO, True),
                                                 (errno.EDQUOT, False)])
def test_failed_write_is_typed_and_clean(layout, monkeypatch, func, code, retryable):
    ts = tensors()
    fp = fp_for(ts)
    monkeypatch.setattr(os, func, _raiser(code))
    with pytest.raises(PublishError) as ei:
        store.publish(layout, fp, C, ts)
    monkeypatch.undo()
    err = ei.value
    assert err.retryable is retryable
    assert err.errno == code
    assert err.fingerprint == fp
    assert isinstance(err, OSError)
    assert tmp_files(layout) == []
    assert objects_files(layout) == []
    with pytest.raises(ArtifactMissing):
        store.read(layout, fp, C)


def test_partial_write_then_failure_is_clean(layout, monkeypatch):
    """A write that succeeds partially and then fails must not leave a partial file anywhere."""
    ts = tensors(t=16)
    fp = fp_for(ts)
    real_write = os.write
    calls = {"n": 0}

    def flaky(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[:5])  # short write
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "write", flaky)
    with pytest.raises(PublishError) as ei:
        store.publish(layout, fp, C, ts)
    monkeypatch.undo()
    assert ei.value.retryable
    assert tmp_files(layout) == [] and objects_files(layout) == []


def test_short_writes_are_completed(layout, monkeypatch):
    ts = tensors(t=16)
    fp = fp_for(ts)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:7]))
    store.publish(layout, fp, C, ts)
    monkeypatch.undo()
    assert torch.equal(store.read(layout, fp, C).hidden_states, ts["hidden_states"])


@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
def test_regression_error_after_rename_never_withdraws_the_artifact(layout, monkeypatch, caplog, persistent):
    """As in triton #11512: EBUSY from the directory fsync after ``os.replace`` made atomic_write
    unlink the finished artifact (and the consumer then died of CaptureFailed). After the rename the artifact
    is published: the fsync is retried with backoff; if it keeps failing that is logged, never undone."""
    from artcache import fsio

    monkeypatch.setattr(fsio, "DIR_FSYNC_BACKOFF", (0.0, 0.0, 0.0))
    ts = tensors()
    fp = fp_for(ts)
    real_fsync = os.fsync
    calls = {"n": 0}

    def dir_fsync_busy(fd):
        calls["n"] += 1
        if calls["n"] == 2 or (persistent and calls["n"] > 2):  # 1: the temp file; 2...: its directory
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", dir_fsync_busy)
    store.publish(layout, fp, C, ts)  # no error
    monkeypatch.undo()
    assert calls["n"] == (5 if persistent else 3)  # the file, then the directory 1 + retries
    assert tmp_files(layout) == [] and objects_files(layout) != []
    assert store.read(layout, fp, C).fingerprint == fp
    assert ("fsync of its directory failed" in caplog.text) is persistent


def test_check_free_space(tmp_path):
    fsio.check_free_space(tmp_path, 1, reserve=0)
    with pytest.raises(PublishError) as ei:
        fsio.check_free_space(tmp_path, 1 << 62)
    assert ei.value.errno == errno.ENOSPC and ei.value.retryable is False
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(PublishError):
        fsio.check_free_space(tmp_path, free, reserve=1 << 30)


def test_publish_refused_when_disk_nearly_full(layout, monkeypatch):
    ts = tensors()
    fp = fp_for(ts)

    class FakeStat:
        f_bavail = 10
        f_frsize = 4096
        f_blocks = 1 << 20  # a 4 GiB filesystem: the reserve is the full 64 MiB

    monkeypatch.setattr(os, "statvfs", lambda p: FakeStat())
    with pytest.raises(PublishError) as ei:
        store.publish(layout, fp, C, ts)
    monkeypatch.undo()
    assert ei.value.errno == errno.ENOSPC and not ei.value.retryable
    assert tmp_files(layout) == [] and objects_files(layout) == []


@pytest.mark.parametrize(("code", "retryable"), [(errno.EIO, True), (errno.EAGAIN, True), (errno.EINTR, True),
                                                 (errno.ENOSPC, False), (errno.EDQUOT, False),
                                                 (errno.EROFS, False), (errno.EACCES, False)])
def test_retryable_classification(code, retryable):
    assert fsio.is_retryable(OSError(code, "x")) is retryable


# ---- validation ----------------------------------------------------------------------------------
def _bad_cases():
    nan = tensors()
    nan["hidden_states"][2, 1, 3] = float("nan")
    inf = tensors()
    inf["hidden_states"][0, 0, 0] = float("inf")
    ninf = tensors()
    ninf["hidden_states"][5, 1, 7] = float("-inf")
    f32 = tensors()
    f32["hidden_states"] = f32["hidden_states"].float()
    ids64 = tensors()
    ids64["input_ids"] = ids64["input_ids"].long()
    maskbool = tensors()
    maskbool["loss_mask"] = maskbool["loss_mask"].bool()
    layers = tensors()
    layers["hidden_states"] = torch.zeros(6, 3, H, dtype=torch.bfloat16)
    twod = tensors()
    twod["hidden_states"] = torch.zeros(6, 2 * H, dtype=torch.bfloat16)
    long = tensors(t=C.max_length + 1)
    empty = tensors(t=0)
    short_ids = tensors()
    short_ids["input_ids"] = short_ids["input_ids"][:-1]
    short_mask = tensors()
    short_mask["loss_mask"] = short_mask["loss_mask"][:-1]
    missing = tensors()
    del missing["loss_mask"]
    return {"nan": nan, "inf": inf, "-inf": ninf, "float32": f32, "int64 ids": ids64, "bool mask": maskbool,
            "layer count": layers, "2-d": twod, "over-length": long, "empty": empty, "short ids": short_ids,
            "short mask": short_mask, "missing": missing}


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_validation_rejects(layout, case):
    ts = _bad_cases()[case]
    fp = "ef" * 20
    with pytest.raises(IntegrityError):
        store.publish(layout, fp, C, ts)
    assert objects_files(layout) == [] and tmp_files(layout) == []


def test_validation_accepts_max_length(layout):
    ts = tensors(t=C.max_length)
    fp = fp_for(ts)
    store.publish(layout, fp, C, ts)
    assert store.read(layout, fp, C).hidden_states.shape == (C.max_length, 2, H)


def test_regression_fingerprint_with_trailing_newline_rejected(layout):
    """check_fingerprint used re.match with "$", which also matches before a trailing newline."""
    from artcache.errors import ConfigError

    ts = tensors()
    fp = fp_for(ts)
    for bad in (fp + "\n", fp[:-1] + "\n"):
        with pytest.raises(ConfigError):
            layout.object_path(bad)
        with pytest.raises(ConfigError):
            store.publish(layout, bad, C, ts)
    assert objects_files(layout) == [] and tmp_files(layout) == []


def test_publish_rejects_bad_fingerprint(layout):
    from artcache.errors import ConfigError

    for bad in ("../../etc", "ABCDEF0123456789ABCD", "ab" * 5, "zz" * 20):
        with pytest.raises(ConfigError):
            store.publish(layout, bad, C, tensors())
    assert objects_files(layout) == []


# ---- corruption ----------------------------------------------------------------------------------
def _published(layout) -> tuple[str, Path, bytes]:
    ts = tensors()
    fp = fp_for(ts)
    store.publish(layout, fp, C, ts)
    path = layout.object_path(fp)
    return fp, path, path.read_bytes()


def _assert_quarantined(layout, fp, contract=C):
    with pytest.raises(IntegrityError) as ei:
        store.read(layout, fp, contract)
    assert fp in str(ei.value)
    assert not layout.object_path(fp).exists()
    q = quarantine_files(layout)
    assert len(q) == 1 and q[0].name.startswith(fp)
    with pytest.raises(ArtifactMissing):
        store.read(layout, fp, contract)
    return ei.value


def test_corrupt_data_byte(layout):
    fp, path, raw = _published(layout)
    (hlen,) = struct.unpack("<Q", raw[:8])
    b = bytearray(raw)
    b[8 + hlen + 3] ^= 0x40
    path.write_bytes(bytes(b))
    _assert_quarantined(layout, fp)


def test_corrupt_last_data_byte(layout):
    fp, path, raw = _published(layout)
    b = bytearray(raw)
    b[-1] ^= 0x01
    path.write_bytes(bytes(b))
    _assert_quarantined(layout, fp)


def test_corrupt_header_byte(layout):
    fp, path, raw = _published(layout)
    b = bytearray(raw)
    i = raw.index(b'"shape"') + 1
    b[i] ^= 0x01
    path.write_bytes(bytes(b))
    _assert_quarantined(layout, fp)


def test_regression_every_header_bit_flip_is_detected(layout):
    """Flip each bit of every header byte (length prefix included): each read must fail its check.

    Before the fix, flips inside the ``artcache_format`` key or value were read back as valid.
    """
    fp, path, raw = _published(layout)
    (hlen,) = struct.unpack("<Q", raw[:8])
    silent = []
    for i in range(8 + hlen):
        for bit in range(8):
            b = bytearray(raw)
            b[i] ^= 1 << bit
            path.write_bytes(bytes(b))
            try:
                store.read(layout, fp, C)
            except IntegrityError:
                continue
            silent.append((i, bit, raw[i:i + 1]))
        if silent:
            break
    assert silent == []
    assert not path.exists()


def test_regression_other_format_version_rejected(layout):
    """An artifact whose header names another ``artcache_format`` must be quarantined, not read as this format."""
    fp, path, raw = _published(layout)
    path.write_bytes(raw.replace(b'"artcache_format":"1"', b'"artcache_format":"9"'))
    _assert_quarantined(layout, fp)


@pytest.mark.parametrize("keep", [0, 4, 8, 20, -1])
def test_truncated(layout, keep):
    fp, path, raw = _published(layout)
    path.write_bytes(raw[:keep] if keep >= 0 else raw[:-1])
    _assert_quarantined(layout, fp)


def test_appended_bytes(layout):
    fp, path, raw = _published(layout)
    path.write_bytes(raw + b"\0" * 8)
    _assert_quarantined(layout, fp)


def test_wrong_fingerprint_in_metadata(layout):
    fp, path, raw = _published(layout)
    other = "0" * 40
    dest = layout.object_path(other)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, dest)
    err = _assert_quarantined(layout, other)
    assert "fingerprint" in str(err)
    # the original is untouched
    assert store.read(layout, fp, C).fingerprint == fp


def test_other_contract_id(layout):
    ts = tensors()
    fp = fp_for(ts)
    store.publish(layout, fp, C_OTHER, ts)
    err = _assert_quarantined(layout, fp, C)
    assert "contract" in str(err)


def test_quarantine_twice_keeps_both(layout):
    for _ in range(2):
        fp, path, raw = _published(layout)
        b = bytearray(raw)
        b[-2] ^= 0xFF
        path.write_bytes(bytes(b))
        with pytest.raises(IntegrityError):
            store.read(layout, fp, C)
    assert len(quarantine_files(layout)) == 2


def test_quarantine_of_gone_file(layout):
    assert store.quarantine(layout, "ab" * 20) is False


def test_regression_stray_file_in_objects_is_ignored(tmp_path):
    """A file artcache did not write in objects/ used to stop the producer (invalid fingerprint)."""
    layout = CacheLayout(tmp_path)
    layout.create()
    (layout.objects / "ab").mkdir()
    (layout.objects / "ab" / "junk.safetensors").write_bytes(b"\x00" * 100)
    (layout.objects / "README").write_text("hello")
    (layout.objects / "cd").mkdir()
    (layout.objects / "cd" / ("ab" * 20 + ".safetensors")).write_bytes(b"x")  # wrong shard
    assert store.list_objects(layout) == {}
    from artcache.eviction import evict_pass

    # asked to evict the fingerprint of the wrongly sharded file, the pass touches nothing it did not write
    res = evict_pass(layout, evict=["ab" * 20], live_consumers=set())
    assert res.evicted == {} and (layout.objects / "ab" / "junk.safetensors").exists()
    assert (layout.objects / "cd" / ("ab" * 20 + ".safetensors")).exists()


def test_free_space_reserve_scales_down_on_small_filesystems(monkeypatch, tmp_path):
    """An 8 MiB filesystem could never publish with a fixed 64 MiB reserve."""

    class SmallFs:
        f_bavail = 1500  # ~6 MiB free of 8 MiB
        f_frsize = 4096
        f_blocks = 2048

    monkeypatch.setattr(os, "statvfs", lambda p: SmallFs())
    fsio.check_free_space(tmp_path, 3 << 20)  # 3 MiB fits beside a 5 % (410 KiB) reserve
    with pytest.raises(PublishError):
        fsio.check_free_space(tmp_path, 6 << 20)


_KILLED_MID_WRITE = """
import os, signal, sys
from pathlib import Path
import artcache.fsio as fsio
from artcache.bench.run import write_run_report
fsio.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # the report's bytes are in its .part: kill -9
write_run_report(Path(sys.argv[1]), "1p1c", [], [])
"""


def test_regression_kill_mid_report_write_leaves_no_part_litter(tmp_path):
    """``artcache bench``'s run report (``--out``/report.json, written by fsio.atomic_write with its
    temp file beside it) killed -9 mid-write left ``<writer>.<nonce>.part`` in the user's --out for good; nothing
    ever removed it. Now every atomic write whose temp lies beside its destination first removes the ``.part``
    files of dead writers there (the bench report, a run's config.toml, regenerate's --out ...), and only those:
    a live writer's, another host's and a file artcache does not name are kept. A cache root's tmp/ (temp
    directory apart from the destination) is left to the producer's and fsck's sweeps, as before."""
    import json
    import signal
    import subprocess
    import sys

    from artcache.app.config import load_run_config, save_config
    from artcache.bench.run import write_run_report
    from artcache.data.regenerate import write_atomic
    from artcache.layout import unique_suffix
    from tests.support.procs import child_env, foreign_token

    out = tmp_path / "bench-out"
    out.mkdir()

    def killed_mid_write() -> str:
        proc = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, str(out)], env=child_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        (part,) = [p.name for p in out.glob("*.part") if p.name not in kept]
        return part

    kept = {f"{unique_suffix()}.part", f"{foreign_token(4242)}.aaaa.part", "notes.part"}  # live, other host, user's
    for name in kept:
        (out / name).write_bytes(b"x")
    next_runs = [lambda: write_run_report(out, "1p1c", [], []),
                 lambda: save_config(load_run_config(), out / "config.toml"),
                 lambda: write_atomic(out / "regen.jsonl", b"{}\n", force=True)]
    for next_run in next_runs:
        part = killed_mid_write()
        assert not (out / "report.json").exists() or json.loads((out / "report.json").read_text())  # never torn
        next_run()
        assert not (out / part).exists(), part
        assert {p.name for p in out.glob("*.part")} == kept
    assert {p.name for p in out.iterdir()} == kept | {"report.json", "config.toml", "regen.jsonl"}
    # a temp directory apart from the destination (a cache root's tmp/) is not swept by a write
    part = killed_mid_write()
    fsio.atomic_write(tmp_path / "elsewhere" / "f", [b"1"], out)
    assert (out / part).exists()
    assert fsio.remove_orphan_parts(out) == 1 and {p.name for p in out.glob("*.part")} == kept



@pytest.mark.parametrize("hard_links", [True, False])
def test_atomic_write_without_replace_never_clobbers(tmp_path, monkeypatch, hard_links):
    """``replace=False`` (regenerate's --out without --force): an existing destination is refused with EEXIST and
    kept, on a filesystem with or without hard links; no temp file is left either way."""
    if not hard_links:
        def no_link(src, dst, *a, **k):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        monkeypatch.setattr(os, "link", no_link)
    dest = tmp_path / "o.jsonl"
    fsio.atomic_write(dest, [b"one\n"], tmp_path, replace=False)
    with pytest.raises(PublishError) as info:
        fsio.atomic_write(dest, [b"two\n"], tmp_path, replace=False)
    assert info.value.errno == errno.EEXIST and str(dest) in str(info.value)
    assert dest.read_bytes() == b"one\n" and sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]
