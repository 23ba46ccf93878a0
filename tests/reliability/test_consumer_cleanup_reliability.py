"""A consumer's cleanup when it is killed or its writes fail, with real processes (the fast parts:
tests/protocol/test_consumer_cleanup.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from artcache import registry
from artcache.layout import CacheLayout
from tests.protocol.test_consumer_resume import BATCH, DATA, Proc, consume_args
from tests.support.procs import fault_env


@pytest.fixture(scope="module")
def filled(tmp_path_factory, tiny_target):
    """A root filled by ``artcache producer --fill`` (12 samples): consumers read it with no producer running."""
    cache = tmp_path_factory.mktemp("consumer-cleanup") / "cache"
    fill = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                           tiny_target.path, "--data", str(DATA), "--max-samples", "12", "--max-length", "128",
                           "--draft-layers", "3", "--threads", "1", "--fill"], capture_output=True, text=True,
                          timeout=600)
    assert fill.returncode == 0, fill.stderr[-2000:]
    return cache


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("artcache: error:")]


def _left_in_root(cache, cid: str) -> list[str]:
    """What consumer ``cid`` wrote into the root: its registration and journal files."""
    layout = CacheLayout(cache)
    return sorted([p.name for p in layout.consumers.glob(f"{cid}.json")] +
                  [p.name for p in layout.journal.glob(f"consumer-{cid}-*.jsonl")] +
                  [p.name for p in layout.journal.glob(f"reader-{cid}-*.jsonl")])


def test_regression_enospc_on_the_latest_link_is_one_line_and_leaves_no_temp_link(filled, tmp_path):
    """A consumer whose ``checkpoints/latest`` link could not be replaced (ENOSPC) after a complete, recorded
    checkpoint stopped with a raw traceback and left a ``.latest-*`` link. Now: one line (CheckpointWriteError
    naming the checkpoint), exit 1, no temp link; the checkpoint is recorded, so --resume finds it."""
    faults = [{"call": "os.replace", "errno": "ENOSPC", "path": "/checkpoints/.latest-", "times": -1}]
    proc = Proc("latest", consume_args(filled, tmp_path, "latest", 4, "--save-every", "2"), tmp_path,
                env=fault_env(faults))
    proc.expect(1)
    text = proc.text()
    lines = _error_lines(text)
    assert len(lines) == 1 and "CheckpointWriteError" in lines[0] and "checkpoints/latest could not be" in lines[0], \
        text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    ckpts = tmp_path / "runs" / "latest" / "checkpoints"
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".")] == []
    reg = registry.read(CacheLayout(filled), "latest")
    assert reg.state == "failed" and reg.checkpoint_cursor == 2 * BATCH
    assert (ckpts / "step-00000002" / "state.json").is_file()


def test_regression_a_ring_that_cannot_be_allocated_is_one_line_and_leaves_nothing(filled, tmp_path):
    """``--reader process`` whose shared-memory ring could not be allocated (ENOMEM) gave a raw traceback and left
    its registration and ``--out`` behind. The ring is allocated before anything is written: one line naming its
    size and --reader thread, exit 2, no registration, journal or run directory."""
    faults = [{"call": "os.ftruncate", "errno": "ENOMEM", "path": "artcache-reader-slots"}]
    proc = Proc("ring", consume_args(filled, tmp_path, "ring", 4, "--reader", "process"), tmp_path,
                env=fault_env(faults))
    proc.expect(2)
    text = proc.text()
    lines = _error_lines(text)
    assert len(lines) == 1 and "shared-memory ring of" in lines[0] and "--reader thread" in lines[0], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert _left_in_root(filled, "ring") == []
    assert not (tmp_path / "runs" / "ring").exists()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_regression_a_consumer_on_a_read_only_root_is_one_line(filled, tmp_path):
    """A consumer on a read-only root (a read-only mount) printed an OSError traceback (EROFS opening its
    journal). Now: one line naming the journal and what a read-only root allows, exit 1, nothing left (no run
    directory). The root is bind-mounted read-only in a private mount namespace (needs root)."""
    root = str(filled)
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {root} {root} && "
                            f"mount -o remount,bind,ro {root} {root}"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.decode()[-200:]}")
    script = f'mount --bind {root} {root} && mount -o remount,bind,ro {root} {root} && exec "$0" "$@"'
    proc = Proc("ro", consume_args(filled, tmp_path, "ro", 2), tmp_path, prefix=["unshare", "-m", "sh", "-c", script])
    proc.expect(1)
    text = proc.text()
    lines = _error_lines(text)
    assert len(lines) == 1 and "NotWritable: cannot open journal" in lines[0] and "read-only" in lines[0], \
        text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert _left_in_root(filled, "ro") == [] and not (tmp_path / "runs" / "ro").exists()


def test_regression_a_damaged_plan_stops_the_consumer_and_fsck_reports_it(filled, tmp_path):
    """16 bytes flipped near the end of plans/<id>/plan.safetensors: fsck said clean and a consumer trained on
    the damaged tokens, exit 0. Now fsck reports bad-plan (exit 1) and the consumer refuses in one line naming
    the file and its recorded digest (exit 2), before it registers or writes anything."""
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache, symlinks=True)
    settings = json.loads((cache / "artcache.json").read_text())
    path = cache / "plans" / settings["plan_id"] / "plan.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-20:-4] = bytes(b ^ 0xFF for b in raw[-20:-4])
    path.write_bytes(bytes(raw))
    fsck = subprocess.run([sys.executable, "-m", "artcache", "fsck", "--cache", str(cache)], capture_output=True,
                          text=True, timeout=300)
    assert fsck.returncode == 1 and "bad-plan" in fsck.stdout and "plan.safetensors does not match" in fsck.stdout, \
        fsck.stdout + fsck.stderr
    proc = Proc("damaged", consume_args(cache, tmp_path, "damaged", 2), tmp_path)
    proc.expect(2)
    text = proc.text()
    lines = _error_lines(text)
    assert len(lines) == 1 and "plan.safetensors does not match its recorded digest" in lines[0], text[-3000:]
    assert "Traceback" not in text and "step 1/" not in text, text[-3000:]
    assert _left_in_root(cache, "damaged") == [] and not (tmp_path / "runs" / "damaged").exists()
