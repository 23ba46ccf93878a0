"""Hundreds of SIGKILLs at random: at a named crash point (random point, random n-th arrival) or at a random
time, in light-weight producer and consumer children (tests/support/crash_child.py: the real protocol code on a fake
plan and backend), with a logged seed (``ARTCACHE_CRASH_SEED=<seed>`` replays a run).

After every kill the test process checks:

- nothing torn or temporary is ever returned: every published artifact verifies (content hash, header,
  shapes, token ids against its fingerprint) and every plan position reads as a whole artifact or a miss;
- every fingerprint can be captured again at once: each fingerprint lock is free (the kernel dropped the
  dead holder's flock), and after a producer kill a fresh producer publishes every position of the live
  windows within ``RECOVER_S``;
- ``artcache fsck --fix`` removes the dead writer's temp files and nothing of a live writer's (a canary
  temp file named with the test process's pid survives every run, also runs made while a child is alive);
- a killed consumer's committed cursor is exactly what its crash point implies, and the next incarnation
  resumes from it: across all incarnations the committed positions are 0, 1, 2, ... with no gap and no
  repeat. (Resume is tested at the registry/cursor level: the child re-registers with the committed cursor,
  as ``artcache consume`` does on restart.)

At the end ``artcache inspect``'s invariants hold over all the journals. The figures go to the lane's
summary (tests/support/reliability_figures.py).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from artcache import journal as J
from artcache import leases, registry, store
from artcache.accounting import account
from artcache.errors import ArtifactMissing
from artcache.fingerprint import PlanFingerprints
from artcache.fsck import fsck
from artcache.layout import CacheLayout, parse_temp_name
from artcache.liveness import this_process
from artcache.locking import Timeout, cache_lock
from artcache.settings import init_settings
from tests.support import crash_child as K
from tests.support.mooncake_store import PAYLOAD_BACKENDS, root_settings
from tests.support.reliability_figures import record

#: kills to reach (the lane's promise is >= 500)
KILLS = int(os.environ.get("ARTCACHE_CRASH_KILLS", "500"))
#: kills of the Mooncake-payload subset (the mooncake lane: the same trials, fewer of them)
MOONCAKE_KILLS = int(os.environ.get("ARTCACHE_CRASH_KILLS_MOONCAKE", "60"))
CHILD_DEADLINE_S = 60.0  # only bounds a hang
RECOVER_S = 30.0  # a fresh producer republishes the live windows within this
MOVER_WINDOW = (1, 6)  # lookbehind, lookahead of the registration the test moves

PRODUCER_POINTS = ["publish.after-write", "publish.after-fsync", "publish.after-rename", "capture.after-forward",
                   "evict.after-rename"]
#: a Mooncake root's publish has one more step: the payload is put, its manifest not yet written
MOONCAKE_POINTS = ["publish.after-payload"]
CONSUMER_POINTS = ["lease.after-create", "cursor.before-commit", "cursor.after-commit"]
MAX_N = {"publish.after-write": 4, "publish.after-fsync": 4, "publish.after-rename": 4,
         "capture.after-forward": 2, "evict.after-rename": 3, "publish.after-payload": 4, "lease.after-create": 8,
         "cursor.before-commit": 4, "cursor.after-commit": 4}


@pytest.fixture(scope="module")
def ctx():
    return K.forkserver_context()


class Trials:
    def __init__(self, tmp: Path, ctx, rng: random.Random, settings=None) -> None:
        self.ctx, self.rng = ctx, rng
        self.layout = CacheLayout(tmp / "root")
        self.layout.create()
        init_settings(self.layout, settings or K.settings())
        self.producer_points = PRODUCER_POINTS + (MOONCAKE_POINTS if (settings and settings.payload) else [])
        self.logs = tmp / "trial-logs"
        self.logs.mkdir()
        self.plan = K.FakePlan()
        self.fp_of = PlanFingerprints(K.CONTRACT, self.plan)
        self.order = self.plan.order()  # position -> sample, as the client and producer map it (epochs)
        mover = registry.register(self.layout, registry.Registration(
            consumer_id=K.MOVER, draft="mover", lookbehind=MOVER_WINDOW[0], lookahead=MOVER_WINDOW[1],
            pid=os.getpid()))
        self.mover = registry.ConsumerHandle(self.layout, mover)
        with J.JournalWriter(self.layout.journal_path("consumer", K.MOVER)) as j:  # its window counts in the bound
            j.emit(J.ConsumerStart(consumer=K.MOVER, pid=os.getpid(), draft="mover", block_size=2, batch_size=1,
                                   lookbehind=MOVER_WINDOW[0], lookahead=MOVER_WINDOW[1], cursor=0))
        # a temp file of a live writer (this process): no fsck run may ever remove it
        self.canary = self.layout.tmp / f"{this_process().token()}.c0ffee.part"
        self.canary.write_bytes(b"a live writer's partial file")
        self.n = 0
        self.stats = {"trials": 0, "kills": 0, "kills_at_point": 0, "kills_random_time": 0,
                      "completed_before_kill": 0, "passed": 0, "producer_recoveries": 0,
                      "orphans_removed": 0, "dead_leases_removed": 0, "consumers_fenced": 0,
                      "fsck_while_child_alive": 0}
        self.per_point: dict[str, int] = {}
        self.commits: list[tuple[int, int]] = []  # (incarnation start, committed cursor) per consumer run
        self.durations = {"producer": [0.05], "consumer": [0.05]}

    # -- children ----------------------------------------------------------------------------------
    def start(self, kind: str, crash_at: str = ""):
        self.n += 1
        log = self.logs / f"{self.n:04d}-{kind}.log"
        target = K.producer_main if kind == "producer" else K.consumer_main
        p = self.ctx.Process(target=target, args=(str(self.layout.root), str(log), crash_at))
        p.start()
        return p, log

    def join(self, p, log: Path, what: str) -> int:
        p.join(CHILD_DEADLINE_S)
        if p.is_alive():
            p.kill()
            p.join()
            pytest.fail(f"{what}: child hung for {CHILD_DEADLINE_S:.0f}s; log:\n{log.read_text()}")
        return p.exitcode

    def lines(self, log: Path) -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    # -- one trial ---------------------------------------------------------------------------------
    def trial(self) -> None:
        rng = self.rng
        kind = "producer" if rng.random() < 0.55 else "consumer"
        at_point = rng.random() < 0.7
        if kind == "producer":
            self.mover.commit_cursor(self.mover.current.cursor + rng.randint(0, 8))  # capture and evict
        else:
            self.prepublish_for_consumer()
        crash_at = ""
        if at_point:
            point = rng.choice(self.producer_points if kind == "producer" else CONSUMER_POINTS)
            crash_at = f"{point}:{rng.randint(1, MAX_N[point])}"
        what = f"trial {self.stats['trials']} ({kind}, {crash_at or 'random time'})"
        t0 = time.monotonic()
        p, log = self.start(kind, crash_at)
        if not at_point:
            typical = sorted(self.durations[kind])[len(self.durations[kind]) // 2]
            deadline = t0 + rng.uniform(0.0, 1.3 * typical)
            if rng.random() < 0.15:  # now and then, fsck --fix while the child is alive
                self.run_fsck()
                self.stats["fsck_while_child_alive"] += 1
            while time.monotonic() < deadline and p.is_alive():
                time.sleep(0.002)
            if p.is_alive():
                p.kill()
        code = self.join(p, log, what)
        self.stats["trials"] += 1
        lines = self.lines(log)
        if code not in (0, -9):
            pytest.fail(f"{what}: child exited {code}; log:\n" + "\n".join(lines))
        if code == 0:
            self.durations[kind].append(time.monotonic() - t0)
            self.stats["completed_before_kill"] += 1
        else:
            self.stats["kills"] += 1
            self.stats["kills_at_point" if at_point else "kills_random_time"] += 1
            label = crash_at.split(":")[0] if at_point else f"random time ({kind})"
            self.per_point[label] = self.per_point.get(label, 0) + 1
        self.check_after(kind, code, crash_at, lines, what)
        self.stats["passed"] += 1

    def prepublish_for_consumer(self) -> None:
        """Publish what the next consumer incarnation reads (no producer runs beside it)."""
        reg = registry.read(self.layout, K.CONSUMER)
        start = reg.cursor if reg else 0
        for pos in range(start, start + 4 * K.BATCH):
            fp = self.fp_of(self.order.sample(pos))
            if not store.exists(self.layout, fp):
                s = self.plan.sample(self.order.sample(pos))
                store.publish(self.layout, fp, K.CONTRACT, K.fake_capture(s), verify_tokens=True)

    # -- checks after a trial ------------------------------------------------------------------------
    def check_after(self, kind: str, code: int, crash_at: str, lines: list[str], what: str) -> None:
        dead_pid = int(lines[0].split()[1]) if lines and lines[0].startswith("pid ") else None
        self.check_published(what)
        self.check_fsck(dead_pid, what)
        self.check_locks_free(what)
        if kind == "consumer":
            self.check_consumer(code, crash_at, lines, what)
        elif code != 0:
            self.recover(what)

    def check_published(self, what: str) -> None:
        for fp in store.list_objects(self.layout):
            try:
                bad = store.verify(self.layout, fp, K.CONTRACT)
            except ArtifactMissing:
                continue
            assert bad is None, f"{what}: a published artifact is bad: {bad}"
        for i in self.rng.sample(range(len(self.plan)), 8):  # a whole artifact or a miss, never an error
            try:
                art = store.read(self.layout, self.fp_of(i), K.CONTRACT, verify_tokens=True)
            except ArtifactMissing:
                continue
            assert art.input_ids.tolist() == self.plan.sample(i).input_ids.tolist(), what
        assert list(self.layout.quarantine.iterdir()) == [], f"{what}: something was quarantined"

    def run_fsck(self):
        """``fsck --fix`` from the test process."""
        return fsck(self.layout.root, fix=True)

    def check_fsck(self, dead_pid: int | None, what: str) -> None:
        tmp_before = {p.name for p in self.layout.tmp.iterdir()}
        rep = self.run_fsck()
        kinds = {p.kind for p in rep.problems} - {"bad-plan"}  # the fake plan has no plan directory
        assert kinds <= {"orphan-temp", "dead-lease", "dead-consumer"}, (what, rep.problems)
        assert all(p.fixed for p in rep.problems if p.kind != "bad-plan"), (what, rep.problems)
        for p in rep.problems:
            if p.kind == "orphan-temp":  # only the dead child's files (or an earlier dead child's)
                pid = parse_temp_name(Path(p.path).name).identity.pid
                assert pid != os.getpid() and (pid == dead_pid or pid not in self.live_pids()), (what, p)
                self.stats["orphans_removed"] += 1
            elif p.kind == "dead-lease":
                self.stats["dead_leases_removed"] += 1
            elif p.kind == "dead-consumer":
                self.stats["consumers_fenced"] += 1
        left = {p.name for p in self.layout.tmp.iterdir()}
        assert left == {self.canary.name}, f"{what}: tmp/ after fsck --fix: {sorted(left)} (before {tmp_before})"
        assert not [n for n in os.listdir(self.layout.leases) if leases.parse(n).pid == dead_pid], what

    def live_pids(self) -> set[int]:
        return {int(d) for d in os.listdir("/proc") if d.isdigit()}

    def check_locks_free(self, what: str) -> None:
        """The locks of every position a producer would capture now (the live windows' readable ranges)."""
        positions = {p for reg in registry.read_all(self.layout) if reg.state == "running"
                     for p in range(reg.readable()[0], reg.readable()[1] + 1)}
        for i in sorted(positions):
            lock = cache_lock(self.layout.fingerprint_lock(self.fp_of(self.order.sample(i))), timeout=0)
            try:
                lock.acquire()
            except Timeout:
                pytest.fail(f"{what}: the capture lock of position {i} is still held after the kill")
            lock.release()

    def recover(self, what: str) -> None:
        """A fresh producer republishes every readable position of the live windows, within RECOVER_S."""
        t0 = time.monotonic()
        p, log = self.start("producer")
        code = self.join(p, log, what + " (recovery)")
        assert code == 0, f"{what}: recovery producer exited {code}:\n{log.read_text()}"
        took = time.monotonic() - t0
        assert took < RECOVER_S, f"{what}: recapture took {took:.1f}s"
        for reg in registry.read_all(self.layout):
            if reg.state != "running":
                continue
            lo, hi = reg.readable()  # [cursor, cursor + lookahead]: what the producer prefetches
            for pos in range(lo, hi + 1):
                fp = self.fp_of(self.order.sample(pos))
                try:
                    bad = store.verify(self.layout, fp, K.CONTRACT)
                except ArtifactMissing:
                    bad = "missing"
                assert bad is None, (f"{what}: position {pos} of {reg.consumer_id} not recaptured ({bad}); "
                                     f"registrations {registry.read_all(self.layout)}; recovery log:\n"
                                     f"{log.read_text()}")
        self.stats["producer_recoveries"] += 1

    def check_consumer(self, code: int, crash_at: str, lines: list[str], what: str) -> None:
        starts = [int(x.split()[1]) for x in lines if x.startswith("start ")]
        commits = [int(x.split()[1]) for x in lines if x.startswith("commit ")]
        reg = registry.read(self.layout, K.CONSUMER)
        if not starts:  # killed before it read its registration: nothing changed
            return
        start = starts[0]
        # resumes exactly where the previous incarnation's committed cursor was: nothing lost or repeated
        previous = self.commits[-1][1] if self.commits else 0
        assert start == previous, f"{what}: resumed at {start}, committed cursor was {previous}"
        # no registration yet: the first incarnation was killed between reading and writing it
        cursor = reg.cursor if reg is not None else start
        if code == 0:
            assert cursor == start + 4 * K.BATCH == commits[-1], (what, cursor, commits)
        elif crash_at:
            point, n = crash_at.split(":")
            n = int(n)
            want = {"cursor.before-commit": start + (n - 1) * K.BATCH, "cursor.after-commit": start + n * K.BATCH,
                    "lease.after-create": start + ((n - 1) // K.BATCH) * K.BATCH}[point]
            assert cursor == want, f"{what}: committed cursor {cursor}, the crash point implies {want}"
        else:  # random time: the last logged commit, or one more if killed between commit and log line
            last = commits[-1] if commits else start
            assert cursor in (last, last + K.BATCH), (what, cursor, commits)
        assert (cursor - start) % K.BATCH == 0
        self.commits.append((start, cursor))


@pytest.mark.parametrize("backend", PAYLOAD_BACKENDS)
def test_random_sigkill_trials(tmp_path, ctx, backend, request):
    """``mooncake``: the same trials on a root whose payloads are in Mooncake Store (fewer kills: the
    mooncake lane's subset), with its extra crash point between the payload put and the manifest."""
    seed = int(os.environ.get("ARTCACHE_CRASH_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"crash trials seed={seed} (replay with ARTCACHE_CRASH_SEED={seed})")
    t = Trials(tmp_path, ctx, random.Random(seed), root_settings(backend, request))
    kills = KILLS if backend == "posix" else MOONCAKE_KILLS
    where = "" if backend == "posix" else ", mooncake payloads"
    t0 = time.monotonic()
    max_trials = 4 * kills
    while t.stats["kills"] < kills and t.stats["trials"] < max_trials:
        try:
            t.trial()
        except BaseException:
            print(f"failed in trial {t.stats['trials']} (seed={seed})")
            raise
    assert t.stats["kills"] >= kills, t.stats
    # the canary (a live writer's temp file) survived every fsck --fix
    assert t.canary.exists()
    t.canary.unlink()
    # the journals of every killed and finished process still add up (inspect's invariants)
    acc = account(t.layout)
    assert acc.violations == [], acc.violations
    assert acc.cache.torn_journal_lines <= t.stats["kills"]
    assert acc.cache.quarantined == 0
    s = t.stats
    print(f"crash trials: {s} in {time.monotonic() - t0:.1f}s; kills per point: {t.per_point}")
    record("crash", f"random SIGKILL trials (seed {seed}{where})", run=s["trials"], kills=s["kills"],
           passed=s["passed"], failed=s["trials"] - s["passed"])
    for label, n in sorted(t.per_point.items()):
        record("crash", f"  killed at {label}", kills=n, passed=n)
    record("crash", "recaptures after producer kills", run=s["producer_recoveries"],
           passed=s["producer_recoveries"])
    record("crash", "orphan temp files removed (writer dead)", run=s["orphans_removed"],
           passed=s["orphans_removed"])
    record("crash", "consumer resumes at committed cursor", run=len(t.commits), passed=len(t.commits))
    record("crash", "fsck --fix beside a live child", run=s["fsck_while_child_alive"],
           passed=s["fsck_while_child_alive"])
