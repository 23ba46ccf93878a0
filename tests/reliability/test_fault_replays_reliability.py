"""Injected faults replayed against real producer and consumer processes (the fast parts:
tests/protocol/test_fault_replays.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from artcache import journal as J
from artcache import registry, store
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout
from artcache.plan import Plan
from artcache.settings import load_settings
from tests.protocol import test_fault_replays as fast_part
from tests.protocol.test_fault_replays import figure, hold_window
from tests.support.procs import Proc as BaseProc
from tests.support.procs import dead_pid, fault_env, injected, inspect_json, token, wait_until
from tests.support.reliability_figures import record

cache = fast_part.cache  # a fixture of tests/protocol/test_fault_replays.py
template = fast_part.template  # a fixture of tests/protocol/test_fault_replays.py

PLAN = ["--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "64", "--max-length", "32",
        "--draft-layers", "3", "--threads", "1"]


class Proc(BaseProc):
    deadline = 300.0


def producer(tmp_path: Path, cache: Path, *extra: str, faults=None, log: Path | None = None) -> Proc:
    return Proc("producer", ["producer", "--cache", str(cache), *PLAN, "--heartbeat-timeout", "600", *extra],
                tmp_path, env=fault_env(faults, log))


def fps(cache: Path) -> PlanFingerprints:
    layout = CacheLayout(cache)
    settings = load_settings(layout)
    return PlanFingerprints(settings.contract, Plan.load(layout.plan_dir(settings.plan_id)))


def producer_events(cache: Path, kind) -> list:
    return [e for e in J.read_events(CacheLayout(cache).journal).events if isinstance(e, kind)]


# ---- item 3: the publisher thread cannot die silently ------------------------------------------------------

def test_regression_journal_enospc_is_held_and_the_producer_goes_on(tmp_path, cache):
    """One ENOSPC on the 31st ``publish`` journal line killed the publisher thread, which then
    hung the producer (fixed: it stopped at once with exit 1). A producer must
    survive a full disk, so a journal line that cannot be written for space is held in memory, in order, and
    written once space is back: the producer publishes the whole window, journals every publication, and
    ``inspect`` finds no violation."""
    log = tmp_path / "faults.log"
    hold_window(cache, lookahead=63, end=64)
    prod = producer(tmp_path, cache, faults=[{"call": "os.write", "errno": "ENOSPC", "nth": 31,
                                              "data": '"kind":"publish"'}], log=log)
    wait_until(lambda: len(producer_events(cache, J.Publish)) == 64, "every publication journaled", [prod])
    assert [f[:2] for f in injected(log)] == [("os.write", "ENOSPC")]
    prod.terminate_ready_producer()
    text = prod.text()
    assert "holding events in memory" in text and "ProducerFailed" not in text and "Traceback" not in text
    assert len(store.list_objects(CacheLayout(cache))) == 64
    acc = inspect_json(cache)
    assert acc["violations"] == [] and acc["cache"]["captures_lost_in_crash"] == 0
    assert acc["cache"]["publications"] == 64
    figure("ENOSPC", "journal append (publish line 31)", len(injected(log)))


def test_regression_planted_shard_link_stops_the_producer(tmp_path, cache):
    """Any non-PublishError in the publisher (a planted objects/<ab> symlink: UnsafePath)
    hung the producer the same way."""
    fp = fps(cache)(0)
    os.symlink(tmp_path, cache / "objects" / fp[:2])
    hold_window(cache)
    prod = producer(tmp_path, cache)
    prod.expect(1)
    assert "ProducerFailed" in prod.text() and "UnsafePath" in prod.text()
    figure("planted link", "objects/<ab> (publish)", 1)


def test_regression_sigterm_stops_a_producer_retrying_a_failing_disk(tmp_path, cache):
    """Signals always work, also while the publisher backs off from a transient
    error (EIO on every rename): SIGTERM ends the producer at once, long before the retries would, and as
    every capture it attempted failed it exits 1 saying so."""
    hold_window(cache)
    prod = producer(tmp_path, cache,
                    faults=[{"call": "os.replace", "errno": "EIO", "times": -1, "path": "/cache/tmp/"}])
    wait_until(lambda: "retrying in" in prod.text(), "the publisher to back off", [prod])
    t0 = time.monotonic()
    prod.popen.send_signal(signal.SIGTERM)
    prod.expect(1)
    assert time.monotonic() - t0 < 10.0, "SIGTERM waited for the retries"
    assert "ProducerFailed: every capture failed" in prod.text()
    acc = inspect_json(cache)
    assert acc["violations"] == [] and acc["cache"]["publications"] == 0 and acc["cache"]["failures"] >= 1
    figure("EIO + SIGTERM", "rename (publish, every call)", acc["cache"]["failures"])


@pytest.mark.parametrize("how", ["all-terminal", "died-before-first-pass"])
def test_regression_exit_when_done_without_a_live_consumer(tmp_path, cache, how):
    """``--exit-when-done`` never exited when the producer never saw a live consumer (every
    registration already terminal, or the only consumer died before the producer's first pass):
    `timeout 45 artcache producer ... --exit-when-done --done-grace 2` gave 124. A consumer that died before the
    first pass ends it (exit 0); registrations already terminal at its start are an earlier run's and count for
    nothing, so it waits --expect-timeout for a new one and exits 1 (it served nobody)."""
    layout = CacheLayout(cache)
    if how == "all-terminal":
        hold_window(cache).finish("completed")
    else:
        registry.register(layout, registry.Registration(consumer_id="c", draft="fake", lookahead=7, end=8,
                                                        pid=dead_pid()))
    prod = producer(tmp_path, cache, "--exit-when-done", "--done-grace", "2", "--expect-timeout", "4")
    if how == "all-terminal":
        prod.expect(1)
        assert "no consumer registered on" in prod.text() and "nothing was served" in prod.text(), prod.tail()
    else:
        prod.expect(0)
        assert "all consumers finished" in prod.text() or "producer done" in prod.text()
        assert registry.read(layout, "c").state == "failed"
    figure("no live consumer", f"--exit-when-done ({how})", 1)


def test_regression_exit_when_done_with_no_consumer_at_all(tmp_path, cache):
    """A root no consumer ever registers on kept ``--exit-when-done``
    waiting forever. It now waits ``--expect-timeout`` for a first registration, says so, and exits 1."""
    t0 = time.monotonic()
    prod = producer(tmp_path, cache, "--exit-when-done", "--done-grace", "1", "--expect-timeout", "4")
    prod.expect(1)
    assert "no consumer registered on" in prod.text() and "nothing was served" in prod.text(), prod.tail()
    assert "no consumer has registered yet; stopping in" in prod.text(), prod.tail()
    stops = [e.reason for e in producer_events(cache, J.ProducerStop)]
    assert stops and stops[-1].startswith("failed: ProducerFailed"), stops
    figure("no live consumer", "--exit-when-done (no registration; --expect-timeout 4)", 1)
    print(f"--exit-when-done with no consumer: exit 1 after {time.monotonic() - t0:.1f}s (incl. target load)")


# ---- item 5: an error after the rename never withdraws an artifact; transient errors back off ----------

def test_regression_ebusy_after_rename_keeps_the_artifact_published(tmp_path, cache):
    """As in triton #11512: EBUSY from the directory fsync after ``os.replace`` made atomic_write
    unlink the finished artifact, and three quick retries reached the give-up limit from one capture."""
    log = tmp_path / "faults.log"
    hold_window(cache)
    prod = producer(tmp_path, cache, faults=[{"call": "os.fsync", "errno": "EBUSY", "times": 6,
                                              "path": "/objects/"}], log=log)
    layout = CacheLayout(cache)
    wait_until(lambda: len(store.list_objects(layout)) == 8, "all 8 positions published", [prod])
    prod.terminate_ready_producer()
    assert len(injected(log)) == 6
    assert producer_events(cache, J.CaptureFailure) == [] and not os.listdir(cache / "failed")
    assert len(producer_events(cache, J.Publish)) == 8
    assert inspect_json(cache)["violations"] == []
    figure("EBUSY", "directory fsync after rename", len(injected(log)))


def test_regression_transient_rename_errors_back_off_over_seconds(tmp_path, cache):
    """A transient errno (EIO from the rename, three times in a row) is retried with backoff
    over seconds, within one capture: the artifact is published, no failure is recorded, nothing gives up."""
    hold_window(cache, lookahead=0, end=1)
    prod = producer(tmp_path, cache, faults=[{"call": "os.replace", "errno": "EIO", "times": 3, "path": "/cache/tmp/"}])
    layout = CacheLayout(cache)
    wait_until(lambda: store.exists(layout, fps(cache)(0)), "position 0 published", [prod])
    prod.terminate_ready_producer()
    assert [ln for ln in prod.text().splitlines() if "retrying in" in ln][-1].endswith("retrying in 2s")
    assert producer_events(cache, J.CaptureFailure) == [] and len(producer_events(cache, J.Publish)) == 1
    figure("EIO", "rename (publish, 3 in a row)", 3)


# ---- item 7: markers of another producer incarnation are superseded ------------------------------------

def test_regression_stale_give_up_marker_does_not_fail_the_next_run(tmp_path, cache):
    """failed/<fp>.json written by an earlier producer outlived it; after a restart with a
    healthy (slow) producer the first consumer failed at once with the old error. A starting producer
    supersedes earlier incarnations' markers (before it loads the target), and a consumer ignores a marker
    whose producer is gone."""
    from artcache.client import CacheClient

    layout = CacheLayout(cache)
    settings = load_settings(layout)
    plan = Plan.load(layout.plan_dir(settings.plan_id))
    fp_of = PlanFingerprints(settings.contract, plan)
    old = {"fingerprint": fp_of(0), "attempts": 3, "retryable": False, "error": "PublishError: disk full (old)",
           "producer": token(dead_pid())}
    layout.failure_path(fp_of(0)).write_text(json.dumps(old))
    legacy = {"fingerprint": fp_of(1), "attempts": 3, "error": "PublishError: an older artcache's marker"}
    layout.failure_path(fp_of(1)).write_text(json.dumps(legacy))
    handle = hold_window(cache, lookahead=1, end=2)
    journal = J.JournalWriter(layout.journal_path("consumer", "c"))
    client = CacheClient(layout, settings, plan, handle, journal, demand_timeout_s=100)
    prod = producer(tmp_path, cache)
    try:
        item = client.acquire(0)  # a dead producer's marker: waited through, captured by the new producer
        assert item.artifact.fingerprint == fp_of(0)
        client.release(item)
        wait_until(lambda: not layout.failure_path(fp_of(1)).exists(), "the legacy marker superseded", [prod])
        client.release(client.acquire(1))
    finally:
        journal.close()
    prod.terminate_ready_producer()
    assert "superseded 2 give-up marker(s)" in prod.text()
    figure("stale marker", "failed/<fp>.json of an earlier producer", 2)


@pytest.mark.parametrize("code", ["EACCES", "EROFS"])
def test_regression_unwritable_lock_file_is_one_line(tmp_path, cache, code):
    """A read-only lock file or root gave a raw PermissionError / EROFS traceback."""
    hold_window(cache)
    prod = producer(tmp_path, cache, faults=[{"call": "os.open", "errno": code, "path": "/locks/root.lock",
                                              "times": -1}])
    prod.expect(1)
    lines = [ln for ln in prod.text().splitlines() if ln.startswith("artcache: error:")]
    assert len(lines) == 1 and "NotWritable: cannot open lock file" in lines[0] and "root.lock" in lines[0]
    assert "Traceback" not in prod.text()
    figure(code, "lock file open", 1)


def test_regression_expect_consumers_says_what_it_waits_for(tmp_path, cache):
    """`--expect-consumers` waited silently."""
    hold_window(cache)
    prod = producer(tmp_path, cache, "--expect-consumers", "2")
    wait_until(lambda: "--expect-consumers 2: 1 registered (c)" in prod.text(), "the waiting line", [prod])
    prod.terminate_ready_producer()
    assert store.list_objects(CacheLayout(cache)) == {}


def test_regression_inspect_json_under_load_reports_no_false_violation(tmp_path, cache):
    """5 of 30 `inspect` runs during a healthy run exited 3 (`captures 5921 != publications
    5920 + ...`, `leases acquired 5252 != released 5236 + ...`): journals, the crash re-read and the lease
    scan were separate reads, and a live producer's in-flight captures were called lost in a crash. A
    producer and two consumers (leases and evictions churning: windows 0:4 and 1:6) run while `inspect
    --json` runs 12 times and the same accounting 150 times in-process: never a violation."""
    import subprocess
    import sys

    from artcache.accounting import account

    prod = producer(tmp_path, cache, "--batch-samples", "2")
    consumers = []
    for cid, window in (("a", "0:4"), ("b", "1:6")):
        consumers.append(Proc(cid, ["consume", "--cache", str(cache), "--id", cid, "--block-size", "4", "--window",
                                    window, "--anchors", "4", "--steps", "100000", "--batch-size", "2", "--threads",
                                    "1", "--demand-timeout", "120", "--log-every", "50", "--no-progress",
                                    "--no-tensorboard", "--out", str(tmp_path / "runs" / cid)], tmp_path))
    procs = [prod, *consumers]
    layout = CacheLayout(cache)
    runs = in_flight = 0
    try:
        wait_until(lambda: all((r := registry.read(layout, c)) is not None and r.cursor >= 10 for c in "ab"),
                   "both consumers to step", procs)
        for k in range(150):
            acc = account(layout)
            assert acc.violations == [], (k, acc.violations)
            in_flight += acc.cache.captures_in_flight > 0
            if k % 12 == 0:
                res = subprocess.run([sys.executable, "-m", "artcache", "inspect", "--cache", str(cache), "--json"],
                                     capture_output=True, text=True, timeout=120)
                assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
                assert json.loads(res.stdout)["violations"] == []
                runs += 1
        for c in consumers:
            c.popen.send_signal(signal.SIGINT)
        for c in consumers:
            assert c.wait() in (0, 130), c.tail()  # finished, or stopped by the SIGINT
        prod.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()
    acc = inspect_json(cache)
    assert acc["violations"] == [] and acc["cache"]["captures_in_flight"] == 0
    record("replays", "inspect beside a live run (journal/lease snapshot)", injected=0, hangs=0,
           false_violations=0, passed=1, inspect_runs=runs, accounting_runs=150, saw_in_flight=in_flight)


def _consume_args(cache: Path, tmp_path: Path, steps: int, *extra: str) -> list[str]:
    return ["consume", "--cache", str(cache), "--id", "x", "--block-size", "4", "--window", "0:8", "--anchors", "4",
            "--steps", str(steps), "--batch-size", "2", "--threads", "1", "--demand-timeout", "120", "--log-every",
            "10", "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "runs" / "x"), *extra]


def _stop_outside_its_lock(proc: Proc, layout: CacheLayout, consumer_id: str, tries: int = 100) -> None:
    """SIGSTOP ``proc`` at a moment it does not hold its registration lock. A consumer stopped inside its
    lock (a heartbeat or cursor write: on loaded cores a tenth of the time) cannot be fenced until it runs
    again — the producer keeps its window and retries every pass (docs/protocol.md;
    test_regression_fence_of_a_consumer_holding_its_lock_does_not_kill_the_producer) — so a test of the
    fence must stop it outside (the reliability lane of 2026-12-01 waited 300 s for a fence that could
    not come)."""
    from artcache.errors import LockTimeout
    from artcache.locking import cache_lock

    def stopped() -> bool:
        return Path(f"/proc/{proc.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

    for _ in range(tries):
        proc.popen.send_signal(signal.SIGSTOP)
        wait_until(stopped, "the consumer to stop", [proc], timeout=30)
        try:
            with cache_lock(layout.consumer_lock(consumer_id), timeout=0.2, thread_local=False):
                return
        except LockTimeout:
            proc.popen.send_signal(signal.SIGCONT)
            time.sleep(0.05)
    pytest.fail(f"{consumer_id} held its registration lock at each of {tries} stops")


def test_regression_paused_consumer_is_fenced_checkpoints_and_resumes(tmp_path, cache):
    """As in MosaicML #437 / TorchSpec #72: `producer --heartbeat-timeout 5`, a consumer running,
    `kill -STOP` for 12 s, `kill -CONT`: the producer fenced it, the consumer died of ConsumerFenced and wrote
    no checkpoint (47 steps lost; `--resume` said the registry records no checkpoint). Now the fenced consumer
    checkpoints its last step before exiting, and `--resume` continues from exactly there: 0 steps lost."""
    from artcache.trainers.checkpoint import read_state

    layout = CacheLayout(cache)
    prod = Proc("producer", ["producer", "--cache", str(cache), *PLAN, "--heartbeat-timeout", "5"], tmp_path)
    steps = 60
    x = Proc("x", _consume_args(cache, tmp_path, steps), tmp_path)
    procs = [prod, x]
    try:
        wait_until(lambda: (r := registry.read(layout, "x")) is not None and r.cursor >= 20, "x to step", procs)
        _stop_outside_its_lock(x, layout, "x")
        wait_until(lambda: registry.read(layout, "x").state != "running", "the producer to fence x", [prod])
        time.sleep(12 - 5)
        x.popen.send_signal(signal.SIGCONT)
        assert x.wait() == 1 and "ConsumerFenced" in x.text()
        reg = registry.read(layout, "x")
        assert reg.state == "expired" and "no heartbeat progress" in reg.reason
        assert reg.checkpoint_cursor == reg.cursor >= 20, "the fenced consumer recorded no checkpoint"
        latest = (tmp_path / "runs" / "x" / "checkpoints" / "latest").resolve()
        saved = read_state(latest)
        assert saved.cursor == reg.cursor
        # the steps it trained: the fence may land in the middle of a step (its cursor commit is refused);
        # that step was trained and is in the checkpoint too (and committed with it)
        evs = J.read_events(layout.journal).events
        (end,) = [e for e in evs if isinstance(e, J.ConsumerEnd)]
        steps_done = end.steps
        assert saved.step == steps_done >= max(e.step for e in evs if isinstance(e, J.Step))
        assert saved.cursor == 2 * steps_done
        again = Proc("x-resumed", _consume_args(cache, tmp_path, steps, "--resume"), tmp_path)
        procs.append(again)
        again.expect(0)
        starts = [e for e in J.read_events(layout.journal).events if isinstance(e, J.ConsumerStart)]
        assert starts[-1].step == steps_done and starts[-1].cursor == reg.cursor
        assert registry.read(layout, "x").cursor == steps * 2 and registry.read(layout, "x").state == "completed"
        prod.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()
    figure("SIGSTOP 12 s", "consumer (heartbeat timeout 5 s)", 1, lost_steps=steps_done - saved.step)


def test_regression_refused_duplicate_id_leaves_no_empty_journal(tmp_path, cache):
    """A second `artcache consume --id x` while x runs was refused (exit 2) but left an
    empty journal file behind."""
    layout = CacheLayout(cache)
    first = Proc("x", _consume_args(cache, tmp_path, 60), tmp_path)
    try:
        wait_until(lambda: (r := registry.read(layout, "x")) is not None and r.state == "running",
                   "x to register", [first])
        second = Proc("x-again", _consume_args(cache, tmp_path / "other", 60), tmp_path)
        second.expect(2)
        assert "already running" in second.text()
    finally:
        first.kill()
    journals = sorted(p.name for p in layout.journal.glob("consumer-x-*.jsonl"))
    assert len(journals) == 1 and (layout.journal / journals[0]).stat().st_size > 0, journals


def test_regression_checkpoint_enospc_is_one_typed_error(tmp_path):
    """A consumer's checkpoint on a full disk was a raw SafetensorError traceback. On a
    200 kB tmpfs (in a private mount namespace) it is a CheckpointWriteError naming the checkpoint and ENOSPC,
    and no partial checkpoint directory is left."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a small tmpfs in a private mount namespace")
    code = (
        "import sys, torch, errno\n"
        "from pathlib import Path\n"
        "from artcache.errors import CheckpointWriteError\n"
        "from artcache.trainers.checkpoint import save_checkpoint\n"
        "m = torch.nn.Linear(256, 256)\n"
        "opt = torch.optim.AdamW(m.parameters())\n"
        "try:\n"
        "    save_checkpoint(Path(sys.argv[1]), step=1, cursor=2, weights=m.state_dict(), optimizer=opt,\n"
        "                    generators={}, extra_tensors={}, state={})\n"
        "except CheckpointWriteError as exc:\n"
        "    print('ERRNO', exc.errno == errno.ENOSPC, exc)\n"
        "print('LEFT', sorted(p.name for p in (Path(sys.argv[1]) / 'checkpoints').iterdir()))\n")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size=200k tmpfs "$0" && exec "$1" -c "$2" "$0/run"'
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script, str(disk),
                          sys.executable, code], capture_output=True, text=True, timeout=120)
    if "mount" in res.stderr and res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    out = res.stdout
    assert "ERRNO True" in out and "No space left on device" in out and "step-00000001" in out, res
    assert "LEFT []" in out, out
    figure("ENOSPC", "consumer checkpoint (safetensors)", 1)
