"""The protocol across "hosts" (lane ``-m multihost``): producers and consumers in separate
UTS+PID namespaces over one cache root (tests/support/hosts.py; docs/scale-out.md), where a pid means nothing
outside its namespace and host names may be shared.

- SIGKILL trials across hosts (a subset of tests/reliability/test_crash_trials.py): producer and consumer children
  on two hosts, ``fsck --fix`` from a third (the test process) and from the killed child's host. Another host's
  fsck removes nothing of a live process; the child's own host removes its orphans and dead leases; a
  producer on either host recaptures; a live writer's temp file and a live consumer's lease held by each
  host's agent survive everything.
- Racing producers across hosts: exactly one capture per fingerprint, zero torn reads.
- Fencing across hosts with real ``artcache producer`` / ``artcache consume`` processes: a producer in its own
  pid namespace sharing the host name of a live consumer in another (``unshare -pf``) does not fence it; a
  dead host's consumer is fenced by heartbeat progress; wall-clock steps of +40 s on the producer's host
  and -40 s on the live consumer's fence nobody.

Where ``unshare`` cannot make namespaces (it needs root) every test of the lane *fails* with the reason: the
lane is only selected on purpose (``-m multihost``, ``.ci/run``), and a lane that skips would pass CI having
proven nothing. Deadlines only bound a hang; figures go to the lane's summary (section "multihost").
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from artcache import journal as J
from artcache import leases, registry, store
from artcache.accounting import account
from artcache.fingerprint import PlanFingerprints
from artcache.fsck import fsck
from artcache.layout import CacheLayout, parse_temp_name
from artcache.settings import init_settings
from tests.reliability.test_crash_trials import CHILD_DEADLINE_S, Trials
from tests.support import crash_child as K
from tests.support.hosts import UNSHARE, Host, unshare_unavailable
from tests.support.procs import Proc as BaseProc
from tests.support.procs import fault_env, inspect_json, wait_until
from tests.support.reliability_figures import record

#: kills of the cross-host trials (ARTCACHE_MULTIHOST_KILLS)
KILLS = int(os.environ.get("ARTCACHE_MULTIHOST_KILLS", "60"))


@pytest.fixture(scope="module")
def namespaces():
    """Fails (never skips) where namespaces cannot be made: see the module docstring."""
    reason = unshare_unavailable()
    if reason:
        pytest.fail(f"multihost lane cannot run here: {reason}", pytrace=False)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, namespaces):
    logs = tmp_path_factory.mktemp("hosts")
    made = [Host("hostA", logs), Host("hostB", logs, uts=False)]  # hostB shares this machine's host name
    yield made
    for h in made:
        h.die()


# ---- SIGKILL trials across hosts --------------------------------------------------------------------------

class RemoteChild:
    """A crash_child child on a host, with the part of multiprocessing.Process's interface Trials uses."""

    def __init__(self, host: Host, fn, root: str, log: str, crash_at: str) -> None:
        self.host = host
        self.pid = host.spawn(fn, root, log, crash_at)
        self.exitcode: int | None = None

    def _poll(self, timeout: float) -> None:
        if self.exitcode is None:
            self.exitcode = self.host.wait(self.pid, timeout)

    def is_alive(self) -> bool:
        self._poll(0.0)
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self._poll(CHILD_DEADLINE_S if timeout is None else timeout)

    def kill(self) -> None:
        if self.exitcode is None:
            self.host.kill(self.pid)


class HostTrials(Trials):
    """Trials whose children run on ``hosts``; fsck runs here (another host) and on the killed child's host."""

    def __init__(self, tmp: Path, hosts: list[Host], rng: random.Random) -> None:
        super().__init__(tmp, None, rng)
        self.hosts = hosts
        self.last_host: Host | None = None
        self.stats.update(fsck_other_host=0, fsck_own_host=0, recaptures_on_other_host=0)
        # each agent holds a live temp file and a live consumer's lease on a published artifact
        self.held = []
        for k, h in enumerate(hosts):
            fp = self.fp_of(30 + k)
            store.publish(self.layout, fp, K.CONTRACT, K.fake_capture(self.plan.sample(30 + k)), verify_tokens=True)
            self.held.append((fp, h.hold(self.layout.root, f"hold-{h.name}", fp)))

    def start(self, kind: str, crash_at: str = ""):
        self.n += 1
        log = self.logs / f"{self.n:04d}-{kind}.log"
        host = self.rng.choice(self.hosts)
        if kind == "producer" and self.last_host is not None and host is not self.last_host:
            self.stats["recaptures_on_other_host"] += 1
        self.last_host = host
        fn = "producer_main" if kind == "producer" else "consumer_main"
        return RemoteChild(host, fn, str(self.layout.root), str(log), crash_at), log

    def run_fsck(self):
        """fsck --fix from this process: another host for every child (their heartbeats are not watched)."""
        self.stats["fsck_other_host"] += 1
        return fsck(self.layout.root, fix=True, observe_s=0)

    def left_in_tmp(self) -> set[str]:
        """tmp/ without the agents' passing registration temp files (their heartbeat threads rewrite the
        holders' registrations all the time)."""
        agents = {f"{h.identity['host']}-{h.identity['pid']}-{h.identity['start']}" for h in self.hosts}
        held = {h["temp"] for _, h in self.held}
        return {n for n in os.listdir(self.layout.tmp) if n in held or n.split(".")[0] not in agents}

    def check_fsck(self, dead_pid: int | None, what: str) -> None:
        # 1. from another host: nothing of the dead child can be judged, nothing live is touched
        rep = self.run_fsck()
        for p in rep.problems:
            if p.kind == "bad-plan":  # the fake plan has no plan directory
                continue
            assert p.kind in ("dead-lease", "dead-consumer") and p.fixed, (what, p)
            if p.kind == "dead-lease":  # only leases of consumers that are not live (fenced or finished)
                assert "consumer-fenced" in p.detail, (what, p)
        # 2. on the killed child's host: its orphans and dead leases go
        host = self.last_host
        out = host.call("tests.support.crash_child:fsck_summary", str(self.layout.root), 0)
        self.stats["fsck_own_host"] += 1
        for p in out["problems"]:
            if p["kind"] == "bad-plan":
                continue
            assert p["fixed"] and p["kind"] in ("orphan-temp", "dead-lease", "dead-consumer"), (what, p)
            if p["kind"] == "orphan-temp":
                writer = parse_temp_name(Path(p["path"]).name).identity
                assert writer.host == out["host"] and writer.pid == dead_pid, (what, p)
                self.stats["orphans_removed"] += 1
            elif p["kind"] == "dead-lease":
                self.stats["dead_leases_removed"] += 1
            else:
                self.stats["consumers_fenced"] += 1
        left = self.left_in_tmp()
        want = {self.canary.name, *(h["temp"] for _, h in self.held)}
        assert left == want, f"{what}: tmp/ after both fscks: {sorted(left)}"
        for fp, h in self.held:
            assert (self.layout.leases / h["lease"]).exists() and store.exists(self.layout, fp), what
        assert not [n for n in os.listdir(self.layout.leases)
                    if (i := leases.parse(n)).pid == dead_pid and i.host == out["host"]], what


def test_sigkill_trials_across_hosts(tmp_path, hosts):
    seed = int(os.environ.get("ARTCACHE_CRASH_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"multihost crash trials seed={seed} (replay with ARTCACHE_CRASH_SEED={seed})")
    t = HostTrials(tmp_path, hosts, random.Random(seed))
    t0 = time.monotonic()
    while t.stats["kills"] < KILLS and t.stats["trials"] < 4 * KILLS:
        try:
            t.trial()
        except BaseException:
            print(f"failed in trial {t.stats['trials']} (seed={seed})")
            raise
    assert t.stats["kills"] >= KILLS, t.stats
    assert t.canary.exists()
    t.canary.unlink()
    acc = account(t.layout)  # from a third host: nothing it cannot check is called a violation or a crash
    assert acc.violations == [], acc.violations
    assert acc.cache.quarantined == 0
    for fp, h in t.held:
        assert (t.layout.leases / h["lease"]).exists() and store.exists(t.layout, fp)
    s = t.stats
    print(f"multihost crash trials: {s} in {time.monotonic() - t0:.1f}s; kills per point: {t.per_point}")
    record("multihost", f"SIGKILL trials on 2 hosts (seed {seed})", run=s["trials"], kills=s["kills"],
           passed=s["passed"], failed=s["trials"] - s["passed"])
    record("multihost", "  fsck --fix from another host: live files/leases removed", run=s["fsck_other_host"],
           passed=s["fsck_other_host"], removed_live=0)
    record("multihost", "  fsck --fix on the killed child's host: orphans removed", run=s["fsck_own_host"],
           passed=s["fsck_own_host"], removed=s["orphans_removed"])
    record("multihost", "  recaptures by a producer on the other host", run=s["recaptures_on_other_host"],
           passed=s["recaptures_on_other_host"])
    record("multihost", "  consumer resumes at committed cursor", run=len(t.commits), passed=len(t.commits))


# ---- racing producers across hosts ----------------------------------------------------------------------

@pytest.mark.parametrize("noop_locks", [False, True], ids=["flock", "flock-no-op"])
def test_racing_producers_across_hosts(tmp_path, hosts, noop_locks):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    init_settings(layout, K.settings())
    n_pos = 40
    start, stop = tmp_path / "start", tmp_path / "stop"
    workers, readers = [], []
    for k in range(8):
        host = hosts[k % len(hosts)]
        out = tmp_path / f"w{k}.json"
        workers.append((host, host.spawn("race_worker", str(layout.root), n_pos, str(out), k, noop_locks,
                                         {"file_barrier": str(start)}), out))
    for k in range(2):
        host = hosts[k % len(hosts)]
        out = tmp_path / f"r{k}.json"
        readers.append((host, host.spawn("reader_worker", str(layout.root), n_pos, str(out), 100 + k,
                                         {"file_event": str(stop)}, {"file_barrier": str(start)}), out))
    start.touch()
    for host, pid, _ in workers:
        assert host.wait(pid, 180) == 0
    stop.touch()
    for host, pid, _ in readers:
        assert host.wait(pid, 180) == 0
    res = [json.loads(out.read_text()) for _, _, out in workers + readers]
    captured = [fp for r in res for fp in r.get("captured", [])]
    fp_of = PlanFingerprints(K.CONTRACT, K.FakePlan())
    assert set(captured) == {fp_of(i) for i in range(n_pos)}
    duplicates = len(captured) - len(set(captured))
    torn = sum(r["counts"]["torn"] for r in res)
    assert torn == 0, f"{torn} torn or wrong reads"
    if not noop_locks:
        assert duplicates == 0, f"{duplicates} duplicate captures across hosts while flock works"
    for fp in store.list_objects(layout):
        assert store.verify(layout, fp, K.CONTRACT) is None
    assert list(layout.tmp.iterdir()) == []
    label = "flock no-op (dups allowed)" if noop_locks else "flock working"
    record("multihost", f"8 producers + 2 readers on 2 hosts, {label}", processes=10,
           operations=sum(r["counts"]["ops"] for r in res), torn_reads=torn, duplicate_captures=duplicates)


# ---- fencing across hosts (real processes) --------------------------------------------------------------

class Proc(BaseProc):
    deadline = 300.0


HEARTBEAT_TIMEOUT = 8
PLAN = ["--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "64", "--max-length", "32",
        "--draft-layers", "3", "--threads", "1"]


def on_host(name: str | None) -> list[str]:
    """The prefix that runs a command in new PID namespaces: with its own host name ``name``, or (None) sharing
    this machine's host name (``unshare -pf``: the case that fenced a live consumer at once)."""
    if name is None:
        return list(UNSHARE)
    return [*UNSHARE, "--uts", "bash", "-c", 'hostname "$0" && exec "$@"', name]


def consume(cache: Path, cwd: Path, cid: str, steps: int, host: str | None, clock_step: str = "") -> Proc:
    args = ["consume", "--cache", str(cache), "--id", cid, "--block-size", "4", "--window", "0:8", "--anchors", "4",
            "--steps", str(steps), "--batch-size", "2", "--threads", "1", "--demand-timeout", "120", "--log-every",
            "10", "--no-progress", "--no-tensorboard", "--out", str(cwd / "runs" / cid)]
    return Proc(cid, args, cwd, env=fault_env(clock_step=clock_step), prefix=on_host(host))


def test_fencing_across_hosts(tmp_path, namespaces):
    """No live consumer is fenced across hosts (a pid of another namespace is never checked; heartbeats are
    compared as counters on the producer's monotonic clock, so clock steps on two hosts change nothing), and a
    dead host's consumer is fenced by its heartbeat's silence."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target="random:tiny-llama", dataset="synthetic", max_samples=64,
                                max_length=32, draft_layers=3, heartbeat_timeout_s=HEARTBEAT_TIMEOUT))
    layout = CacheLayout(cache)
    step_file = tmp_path / "clock-step"
    prod = Proc("producer", ["producer", "--cache", str(cache), *PLAN, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                             "--exit-when-done", "--done-grace", "3"], tmp_path,
                env=fault_env(clock_step=f"+40@file:{step_file}"), prefix=on_host(None))
    live = consume(cache, tmp_path, "live", 600, None, clock_step=f"-40@file:{step_file}")
    doomed = consume(cache, tmp_path, "doomed", 100000, "hostD")
    procs = [prod, live, doomed]
    try:
        def stepping(cid: str, n: int):
            return lambda: (r := registry.read(layout, cid)) is not None and r.cursor >= n

        wait_until(stepping("live", 8), "the live consumer to step", procs)
        wait_until(stepping("doomed", 8), "the doomed consumer to step", procs)
        # fsck --fix from this (third) host while both run: it watches their heartbeats, finds both live
        rep = fsck(cache, fix=True)
        assert [p for p in rep.problems if p.kind != "bad-plan"] == [], rep.problems
        cursor_at_step = registry.read(layout, "live").cursor
        step_file.touch()  # +40 s on the producer's host, -40 s on the live consumer's
        time.sleep(1.0)
        doomed.kill()  # the whole host: its namespace dies with the unshare process
        t_dead = time.monotonic()
        wait_until(lambda: registry.read(layout, "doomed").state != "running", "the dead host's consumer fenced",
                   [prod, live], timeout=120)
        fenced_after = time.monotonic() - t_dead
        live.expect(0)
        prod.expect(0)
    finally:
        for p in procs:
            p.kill()
    assert registry.read(layout, "live").state == "completed"
    assert registry.read(layout, "live").cursor > cursor_at_step + 4  # it trained on after the clock steps
    doomed_reg = registry.read(layout, "doomed")
    assert doomed_reg.state == "expired" and "no heartbeat progress" in doomed_reg.reason
    fences = [e for e in J.read_events(layout.journal).events if isinstance(e, J.Fence)]
    assert [(f.consumer, f.state) for f in fences] == [("doomed", "expired")], fences
    assert fenced_after >= HEARTBEAT_TIMEOUT - 1
    acc = inspect_json(cache)
    assert acc["violations"] == []
    record("multihost", "live consumer (pid ns, shared host name) fenced", run=1, passed=1, false_fences=0)
    record("multihost", "clock steps +40 s (producer) / -40 s (consumer)", run=1, passed=1, false_fences=0)
    record("multihost", f"dead host's consumer fenced by heartbeat silence ({fenced_after:.0f}s)", run=1, passed=1)
