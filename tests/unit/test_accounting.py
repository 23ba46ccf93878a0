"""accounting: counts from journals + disk, invariants hold on a consistent root, each violation reported."""

from __future__ import annotations

import os

import pytest
import torch

from artcache import journal as J
from artcache import leases, store
from artcache.accounting import CacheCounts, account, check_invariants
from artcache.contract import CaptureContract
from artcache.layout import CacheLayout
from tests.support.procs import dead_pid, foreign_token, token

C = CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                    layer_ids=(0,), max_length=8, tokenizer_digest="k", template_digest="m")


def fp(i: int) -> str:
    return f"{i:040x}"


@pytest.fixture()
def layout(tmp_path) -> CacheLayout:
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    return lay


def write(layout: CacheLayout, name: str, events) -> None:
    with J.JournalWriter(layout.journal / f"{name}.jsonl") as w:
        for i, ev in enumerate(events):
            if not ev.t:
                ev.t = 1000.0 + i
            w.emit(ev)


def publish_file(layout: CacheLayout, i: int) -> int:
    ts = {"hidden_states": torch.zeros(1, 1, 2, dtype=torch.bfloat16),
          "input_ids": torch.tensor([i], dtype=torch.int32), "loss_mask": torch.ones(1, dtype=torch.uint8)}
    return store.publish(layout, fp(i), C, ts, durable=False)


def consistent(layout: CacheLayout) -> dict:
    """A small but complete consistent run: 2 consumers, 4 captures (1 failed, 1 recapture)."""
    n1 = publish_file(layout, 1)
    held = leases.acquire(layout, fp(1), "a")
    producer = [
        J.ProducerStart(producer="p", pid=1, contract_id="c" * 40, plan_id="d" * 40),
        J.CaptureBatch(producer="p", fps=[fp(0), fp(1)], samples=2, tokens=10, padded_tokens=12, start=5.0,
                       end=7.5),
        J.Capture(producer="p", fp=fp(0), positions=[0], tokens=5),
        J.Publish(producer="p", fp=fp(0), nbytes=100),
        J.Capture(producer="p", fp=fp(1), positions=[1], tokens=5),
        J.Coalesced(producer="p", fp=fp(1), requesters=1),
        J.Publish(producer="p", fp=fp(1), nbytes=n1),
        J.Capture(producer="p", fp=fp(2), positions=[2], tokens=5),
        J.CaptureFailure(producer="p", fp=fp(2), attempts=3, retryable=True, error="PublishError: EIO"),
        J.Evict(producer="p", fp=fp(0), nbytes=100),
        J.Capture(producer="p", fp=fp(0), positions=[0], tokens=5, recapture=True),
        J.Publish(producer="p", fp=fp(0), nbytes=100),
        J.Evict(producer="p", fp=fp(0), nbytes=100),
        J.Retained(producer="p", artifacts=2, nbytes=200, window_bound=5),
        J.LeaseExpire(producer="p", fp=fp(0), lease=f"{fp(0)}~b~h~9~00", reason="holder-dead"),
        J.Fence(producer="p", consumer="b", generation=2, state="failed", reason="process 9 is gone"),
        J.ProducerStop(producer="p", reason="signal"),
    ]
    cons_a = [
        J.ConsumerStart(consumer="a", pid=2, draft="dflash", block_size=4, batch_size=1, lookbehind=0,
                        lookahead=2, cursor=0),
        J.LeaseAcquire(consumer="a", fp=fp(0), lease="l1"),
        J.Request(consumer="a", position=0, fp=fp(0), hit=True),
        J.LeaseRelease(consumer="a", fp=fp(0), lease="l1"),
        J.LeaseAcquire(consumer="a", fp=fp(1), lease=held),
        J.Request(consumer="a", position=1, fp=fp(1), hit=False, wait_s=0.5),
        J.Step(consumer="a", step=1, cursor=2, loss=1.0, tau_sum=1.0, blocks=1, acc_correct=[1],
               acc_total=[1], wait_s=0.5, step_s=1.0, lr=1e-3),
    ]
    cons_b = [
        J.ConsumerStart(consumer="b", pid=9, draft="eagle3", block_size=1, batch_size=1, lookbehind=1,
                        lookahead=0, cursor=0),
        J.LeaseAcquire(consumer="b", fp=fp(0), lease=f"{fp(0)}~b~h~9~00"),
        J.Request(consumer="b", position=0, fp=fp(0), hit=False, wait_s=1.0),
        J.Quarantined(consumer="b", fp=fp(0), reason="hash"),
        J.ConsumerEnd(consumer="b", state="failed", steps=0, cursor=1, error="CaptureTimeout: position 1"),
    ]
    return {"producer-p-1": producer, "consumer-a-2": cons_a, "consumer-b-9": cons_b}


def write_all(layout, journals):
    for name, evs in journals.items():
        write(layout, name, evs)


def test_consistent_root_has_no_violations_and_right_counts(layout):
    write_all(layout, consistent(layout))
    acc = account(layout)
    assert acc.violations == []
    c = acc.cache
    assert (c.captures, c.publications, c.failures, c.recaptures) == (4, 3, 1, 1)
    assert c.distinct_fingerprints_captured == 3
    assert c.evictions == 2 and c.coalesced == 1 and c.fences == 1
    assert (c.logical_requests, c.hits, c.misses) == (3, 1, 2)
    assert (c.leases_acquired, c.leases_released, c.leases_expired, c.leases_held) == (3, 1, 1, 1)
    assert c.retained_artifacts == 1 and c.max_retained_artifacts == 2
    assert c.window_bound_artifacts == 3 + 2
    assert c.producer_busy_s == pytest.approx(2.5)
    assert c.timeouts == 1 and c.quarantined == 1
    assert c.distinct_positions_consumed == 2
    assert c.captures_per_consumed_position == pytest.approx(2.0)
    a, b = acc.consumers
    assert (a.consumer, a.hits, a.misses, a.steps, a.cursor, a.state) == ("a", 1, 1, 1, 2, "running")
    assert (b.consumer, b.state, b.timeouts, b.quarantined) == ("b", "failed", 1, 1)
    # production is counted once, not per consumer: 3 logical requests, 4 captures, 3 distinct fps
    assert c.captures != c.logical_requests


def test_capture_without_outcome_is_reported(layout):
    j = consistent(layout)
    j["producer-p-1"].append(J.Capture(producer="p", fp=fp(5), positions=[5], tokens=5))
    write_all(layout, j)
    v = account(layout).violations
    assert len(v) == 1 and "captures 5 != publications 3 + failures 1" in v[0]


def test_publication_without_capture_is_reported(layout):
    j = consistent(layout)
    j["producer-p-1"].append(J.Publish(producer="p", fp=fp(6), nbytes=1))
    write_all(layout, j)
    v = account(layout).violations
    assert len(v) == 1 and v[0].startswith("captures")


def test_unreleased_lease_is_reported(layout):
    j = consistent(layout)
    j["consumer-a-2"].append(J.LeaseAcquire(consumer="a", fp=fp(1), lease="never-released"))
    write_all(layout, j)
    v = account(layout).violations
    assert len(v) == 1 and "leases acquired 4 != released 1 + expired 1 + held 1" in v[0]


def test_regression_lease_removed_by_killed_holder_is_explained(layout):
    """A consumer SIGKILLed between unlinking a lease and journaling its
    release left 'leases acquired 1337 != released 1303 + expired 33 + held 0'. A lease acquired, never
    released or expired, gone from disk, whose holder on this host is dead is counted apart, not a violation."""
    j = consistent(layout)
    lost = f"{fp(1)}~a~{token(dead_pid())}~0a"
    j["consumer-a-2"].append(J.LeaseAcquire(consumer="a", fp=fp(1), lease=lost))
    write_all(layout, j)
    acc = account(layout)
    assert acc.violations == []
    assert acc.cache.leases_removal_unjournaled == 1 and acc.cache.leases_acquired == 4


def test_lease_gone_without_event_while_holder_lives_is_reported(layout):
    j = consistent(layout)
    j["consumer-a-2"].append(J.LeaseAcquire(consumer="a", fp=fp(1), lease=f"{fp(1)}~a~{token(os.getpid())}~0b"))
    write_all(layout, j)
    acc = account(layout)
    assert acc.cache.leases_removal_unjournaled == 0
    assert len(acc.violations) == 1 and "leases acquired 4 != released 1 + expired 1 + held 1" in acc.violations[0]


def test_regression_live_holder_release_line_after_the_lease_scan_is_no_violation(layout):
    """``inspect`` during a healthy run reported (1 of 150 snapshots) 'leases acquired 2844 != released 2832 + expired
    0 + held 11'. A live consumer unlinks its lease, then journals the release; on loaded cores the line came after
    the snapshot's second journal read. account() now waits (bounded) for a live holder's line: held at the
    snapshot, no violation."""
    import threading

    j = consistent(layout)
    name = f"{fp(1)}~a~{token(os.getpid())}~0d"
    j["consumer-a-2"].append(J.LeaseAcquire(consumer="a", fp=fp(1), lease=name))
    write_all(layout, j)

    def release_late():
        with J.JournalWriter(layout.journal / "consumer-a-2.jsonl") as w:
            w.emit(J.LeaseRelease(consumer="a", fp=fp(1), lease=name, t=2000.0))

    timer = threading.Timer(0.5, release_late)
    timer.start()
    try:
        acc = account(layout)
    finally:
        timer.join()
    assert acc.violations == [] and acc.cache.leases_held == 2 and acc.cache.leases_removal_unjournaled == 0


def test_lease_file_without_acquire_event_is_counted_apart(layout):
    """A lease file whose ``lease_acquire`` is not in the journal is being acquired right now (created, the
    line follows) or was left by a holder killed in between: counted apart, not held, not a violation (it used
    to read "held 2" against 1 acquire: a false alarm beside a live consumer)."""
    write_all(layout, consistent(layout))
    leases.acquire(layout, fp(3), "a")
    acc = account(layout)
    assert acc.violations == [] and acc.cache.leases_held == 1 and acc.cache.leases_held_unjournaled == 1


def test_regression_lease_released_between_the_journal_read_and_the_lease_scan(layout, monkeypatch):
    """Inspect during a healthy run reported 'leases acquired 5252 != released 5236 + ...':
    the journals and leases/ were separate reads. A lease released after the journals were read and before
    leases/ was listed is held at the snapshot: the journal read after the scan settles it."""
    j = consistent(layout)
    name = leases.acquire(layout, fp(4), "a")
    j["consumer-a-2"].append(J.LeaseAcquire(consumer="a", fp=fp(4), lease=name))
    write_all(layout, j)
    real_scan = leases.scan

    def release_then_scan(lay):  # the consumer releases between the two reads
        leases.release(lay, name)
        with J.JournalWriter(layout.journal / "consumer-a-2.jsonl") as w:
            w.emit(J.LeaseRelease(consumer="a", fp=fp(4), lease=name))
        return real_scan(lay)

    monkeypatch.setattr(leases, "scan", release_then_scan)
    acc = account(layout)
    assert acc.violations == [] and acc.cache.leases_held == 2 and acc.cache.leases_released == 1


def test_regression_live_producers_unpublished_captures_are_in_flight_not_lost(layout):
    """A live producer's captures not yet published were labelled "lost in a producer
    crash" (and, read separately, did not add up). A producer journal (identity-named) without
    ``producer_stop`` whose writer lives is in flight; once its writer is dead, the same captures are lost."""
    events = [J.ProducerStart(producer="p", pid=1, contract_id="c" * 40, plan_id="d" * 40),
              J.Capture(producer="p", fp=fp(0), positions=[0], tokens=5)]
    write(layout, f"producer-p-{token(os.getpid())}", events)
    acc = account(layout)
    assert acc.violations == [] and (acc.cache.captures_in_flight, acc.cache.captures_lost_in_crash) == (1, 0)
    dead = layout.journal / f"producer-p-{token(dead_pid())}.jsonl"
    (layout.journal / f"producer-p-{token(os.getpid())}.jsonl").rename(dead)
    acc = account(layout)
    assert acc.violations == [] and (acc.cache.captures_in_flight, acc.cache.captures_lost_in_crash) == (0, 1)
    # another host's producer cannot be checked from here: in flight, never called a crash
    dead.rename(
        layout.journal / f"producer-p-{foreign_token()}.jsonl")
    assert account(layout).cache.captures_in_flight == 1


def test_regression_failed_forward_passes_keep_the_capture_invariant(layout):
    """A backend failing every batch gave 'captures 0 != publications 0 + failures 24':
    a failed forward pass journals a capture_failure with stage "forward" and no capture, so it is counted
    among the failures but outside captures = publications + failures."""
    events = [J.ProducerStart(producer="p", pid=1, contract_id="c" * 40, plan_id="d" * 40)]
    events += [J.CaptureFailure(producer="p", fp=fp(i), attempts=1, retryable=False, error="RuntimeError: x",
                                stage="forward") for i in range(24)]
    events.append(J.ProducerStop(producer="p", reason="signal"))
    write(layout, "producer-p-1", events)
    acc = account(layout)
    assert acc.violations == [] and (acc.cache.failures, acc.cache.forward_failures, acc.cache.captures) == (24, 24, 0)


def test_cross_host_holder_removal_is_explained_unless_its_journal_ended_cleanly(layout):
    """A lease acquired, unsettled and gone, held by another host's process: explained (a kill between
    unlink and journal line) while that consumer's journal has no consumer_end; a cleanly ended one
    leaves it a violation."""
    far = foreign_token(4)
    name = f"{fp(1)}~far~{far}~0c"
    start = J.ConsumerStart(consumer="far", pid=4, draft="d", block_size=2, batch_size=1, lookbehind=0,
                            lookahead=1, cursor=0)
    write(layout, f"consumer-far-{far}", [start, J.LeaseAcquire(consumer="far", fp=fp(1), lease=name)])
    acc = account(layout)
    assert acc.violations == [] and acc.cache.leases_removal_unjournaled == 1
    write(layout, f"consumer-far-{far}", [J.ConsumerEnd(consumer="far", state="completed", steps=1, cursor=1)])
    acc = account(layout)
    assert acc.cache.leases_removal_unjournaled == 0 and len(acc.violations) == 1


def test_lease_released_by_consumer_and_expired_is_reported(layout):
    j = consistent(layout)
    # the same lease counted twice (released and expired) breaks the balance
    j["consumer-a-2"].append(J.LeaseRelease(consumer="a", fp=fp(0), lease="l1"))
    write_all(layout, j)
    v = account(layout).violations
    assert len(v) == 1 and v[0].startswith("leases acquired")


def test_retained_above_window_bound_is_reported(layout):
    j = consistent(layout)
    j["producer-p-1"].append(J.Retained(producer="p", artifacts=6, nbytes=600, window_bound=5))
    write_all(layout, j)
    v = account(layout).violations
    assert len(v) == 1 and "max retained artifacts 6 exceeded the window bound 5" in v[0]


def test_several_violations_reported_together(layout):
    j = consistent(layout)
    j["producer-p-1"] += [J.Capture(producer="p", fp=fp(5), positions=[5], tokens=5),
                          J.Retained(producer="p", artifacts=60, nbytes=600, window_bound=5)]
    j["consumer-a-2"].append(J.LeaseAcquire(consumer="a", fp=fp(1), lease="x"))
    write_all(layout, j)
    assert len(account(layout).violations) == 3


def test_torn_journal_lines_counted(layout):
    write_all(layout, consistent(layout))
    with open(layout.journal / "consumer-a-2.jsonl", "ab") as f:
        f.write(b'{"kind":"request","consumer":"a","posi')
    acc = account(layout)
    assert acc.cache.torn_journal_lines == 1 and acc.violations == []


def test_empty_root(layout):
    acc = account(layout)
    assert acc.violations == [] and acc.consumers == [] and acc.cache.captures == 0


# check_invariants directly: the invariants that a journal cannot violate through account()'s own counting
def _ok() -> CacheCounts:
    return CacheCounts(captures=4, publications=3, failures=1, recaptures=1, distinct_fingerprints_captured=3,
                       leases_acquired=3, leases_released=1, leases_expired=1, leases_held=1,
                       logical_requests=3, hits=1, misses=2, max_retained_artifacts=2, window_bound_artifacts=5)


def test_check_invariants_ok():
    assert check_invariants(_ok(), []) == []


@pytest.mark.parametrize(("change", "needle"), [
    (dict(publications=4), "captures 4 != publications 4 + failures 1"),
    (dict(failures=0), "captures 4 != publications 3 + failures 0"),
    (dict(leases_held=0), "leases acquired 3"),
    (dict(leases_expired=2), "leases acquired 3"),
    (dict(hits=2), "logical requests 3 != hits 2 + misses 2"),
    (dict(max_retained_artifacts=6), "max retained artifacts 6 exceeded the window bound 5"),
    (dict(recaptures=5), "recaptures 5 > captures 4"),
    (dict(distinct_fingerprints_captured=5), "more distinct fingerprints than captures"),
])
def test_check_invariants_each_violation(change, needle):
    c = _ok()
    for k, v in change.items():
        setattr(c, k, v)
    v = check_invariants(c, [])
    assert len(v) == 1 and needle in v[0]


def test_no_window_bound_known_disables_the_bound_check():
    c = _ok()
    c.window_bound_artifacts = 0
    c.max_retained_artifacts = 100
    assert check_invariants(c, []) == []


def test_regression_unjournaled_lease_expiry_is_not_a_violation(layout):
    """A consumer SIGKILLed between creating a lease file and journaling ``lease_acquire`` (crash point
    ``lease.after-create``) left a lease the producer later expired: that used to read as
    "acquired 3 != released 1 + expired 2 + held 1". It is counted apart, and no violation."""
    j = consistent(layout)
    orphan = f"{fp(3)}~a~h~2~ff"
    j["producer-p-1"].append(J.LeaseExpire(producer="p", fp=fp(3), lease=orphan, reason="holder-dead"))
    write_all(layout, j)
    acc = account(layout)
    assert acc.violations == []
    assert (acc.cache.leases_expired, acc.cache.leases_unjournaled) == (1, 1)


def test_regression_capture_lost_in_producer_crash_is_not_a_violation(layout):
    """A producer SIGKILLed between capture and publication left `captures != publications + failures`
    in `inspect` forever. A capture unsettled in a journal without `producer_stop` is counted as lost
    in the crash; the same capture in a journal that did stop is still a violation."""
    j = consistent(layout)
    stopped = [e for e in j["producer-p-1"] if not isinstance(e, J.ProducerStop)]
    j["producer-p-1"] = [*stopped, J.Capture(producer="p", fp=fp(5), positions=[5], tokens=5)]
    write_all(layout, j)
    acc = account(layout)
    assert acc.violations == [] and acc.cache.captures_lost_in_crash == 1
    j["producer-p-1"].append(J.ProducerStop(producer="p", reason="signal"))
    write_all(layout, j)
    acc = account(layout)
    assert acc.cache.captures_lost_in_crash == 0
    assert any("captures" in v for v in acc.violations)


def test_regression_resumed_consumer_is_running_not_failed(layout):
    """After SIGKILL + fence + ``--resume``, inspect showed the resumed consumer as ``failed``: the
    producer's fence of the dead holder was the last state-changing event; a ConsumerStart now resets it."""
    old = [J.ConsumerStart(consumer="e", pid=5, draft="eagle3", block_size=16, batch_size=2, lookbehind=0,
                           lookahead=2, cursor=0, t=10.0),
           J.Step(consumer="e", step=3, cursor=6, loss=1.0, tau_sum=0.0, blocks=0, acc_correct=[0],
                  acc_total=[1], wait_s=0.0, step_s=1.0, lr=1e-3, t=11.0)]
    write(layout, "consumer-e-5", old)
    write(layout, "producer-p-1", [J.Fence(producer="p", consumer="e", generation=2, state="failed",
                                           reason="process 5 is gone", t=12.0)])
    write(layout, "consumer-e-6", [J.ConsumerStart(consumer="e", pid=6, draft="eagle3", block_size=16,
                                                   batch_size=2, lookbehind=0, lookahead=2, cursor=4, step=2,
                                                   t=13.0)])
    (e,) = account(layout).consumers
    assert (e.state, e.error, e.steps, e.cursor) == ("running", "", 3, 6)
    assert account(layout).cache.fences == 1


def test_regression_a_lease_release_held_in_memory_for_a_full_disk_is_no_violation(layout, monkeypatch):
    """A journal line that cannot be written for space is held in memory by its live writer
    (artcache.journal). A consumer that released a lease meanwhile has its lease file gone and its release line
    held: inspect counts it as ``leases_release_held`` (the writer's flock says its lines follow), not as a
    violation; once space is back the line is written and the lease is plainly released."""
    import errno

    from artcache.liveness import this_process

    j = consistent(layout)
    write_all(layout, j)
    name = f"{fp(1)}~a~{this_process().token()}~0e"
    w = J.JournalWriter(layout.journal_path("consumer", "a"))
    w.emit(J.LeaseAcquire(consumer="a", fp=fp(1), lease=name))
    real_write, full = os.write, [True]

    def write(fd, data):
        if fd == w._fd and full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    w.emit(J.LeaseRelease(consumer="a", fp=fp(1), lease=name))  # held: the disk is full
    try:
        acc = account(layout)
        assert acc.violations == [], acc.violations
        assert acc.cache.leases_release_held == 1 and acc.cache.journals_holding == 1
    finally:
        full[0] = False
        w.close()  # space is back: written
    acc = account(layout)
    assert acc.violations == [] and acc.cache.leases_release_held == 0 and acc.cache.journals_holding == 0


def test_regression_inspect_prints_one_budget_in_both_tables(layout):
    """A producer whose (default) budget was 0 B made inspect print 'disk budget (bytes) -'
    and 'budget binding yes' in one table and 'budget (bytes) none' / 'budget binding now no' in the other. A
    recorded budget of 0 is a budget of 0 in both (the retention-now decision is taken under it too)."""
    from artcache.report import format_accounting

    write(layout, "producer-p-1", [J.ProducerStart(producer="p", pid=1, contract_id="c", plan_id="p", budget_bytes=0,
                                                   policy="need")])
    import msgspec

    from artcache.accounting import RetentionNow

    acc = account(layout)
    assert acc.cache.budget_recorded and acc.cache.budget_bytes == 0
    now = RetentionNow(policy="need", budget_bytes=0, retained_bytes=0, retained_artifacts=0, live_consumers=0,
                       kept={}, would_evict={}, binding=False, windows_exceed_budget=False, rates={})
    text = format_accounting(msgspec.structs.replace(acc, retention_now=now))
    budget_lines = [line for line in text.splitlines() if "disk budget (bytes)" in line]
    assert len(budget_lines) == 2 and all(line.split()[-1] == "0" for line in budget_lines), budget_lines
    assert "none" not in text and "budget binding (some producer pass so far)" in text


def test_one_fold_serves_the_root_and_one_process():
    """``artcache run``'s report of one producer process and of one consumer process are views of the same
    fold (artcache.accounting.fold) the root's accounting uses: the same counts from the same events."""
    from artcache.accounting import fold
    from artcache.app.experiments import committed_work, production

    fp, fp2 = "ab" * 20, "cd" * 20
    prod = [J.ProducerStart(producer="p", pid=1, contract_id="c", plan_id="q"),
            J.CaptureBatch(producer="p", fps=[fp, fp2], samples=2, tokens=8, padded_tokens=8, start=1.0, end=3.5),
            J.Capture(producer="p", fp=fp, positions=[0], tokens=4),
            J.Capture(producer="p", fp=fp2, positions=[1], tokens=4, recapture=True),
            J.Publish(producer="p", fp=fp, nbytes=100), J.Evict(producer="p", fp=fp, nbytes=100, reason="unneeded"),
            J.Retained(producer="p", artifacts=2, nbytes=300, window_bound=2),
            J.ProducerStop(producer="p", reason="done")]
    got = production(prod)
    assert got == {"captures": 2, "recaptures": 1, "publications": 1, "published_bytes": 100, "failures": 0,
                   "evictions": 1, "evicted_bytes": 100, "batches": 1, "busy_s": 2.5, "max_retained_artifacts": 2,
                   "max_retained_bytes": 300, "distinct_fingerprints": 2, "stop_reason": "done"}
    c = fold(prod).cache
    assert (c.captures, c.evicted_bytes, c.capture_batches, c.producer_busy_s) == (2, 100, 1, 2.5)
    cons = [J.ConsumerStart(consumer="a", pid=2, draft="dflash", block_size=4, batch_size=1, lookbehind=0,
                            lookahead=2, cursor=3),
            J.Request(consumer="a", position=3, fp=fp, hit=True, wait_s=0.0),
            J.Request(consumer="a", position=4, fp=fp2, hit=False, wait_s=0.5),
            *(J.Step(consumer="a", step=i, cursor=3 + i, loss=3.0 - i, tau_sum=2.0, blocks=1, acc_correct=[1],
                     acc_total=[1], wait_s=0.0, step_s=0.1, lr=1e-3) for i in (1, 2)),
            J.ConsumerEnd(consumer="a", state="completed", steps=2, cursor=5)]
    work = committed_work(cons)
    assert (work["requests"], work["hits"], work["misses"], work["wait_s"]) == (2, 1, 1, 0.5)
    assert (work["cursor_start"], work["cursor_end"], work["positions_committed"], work["state"]) == (3, 5, 2,
                                                                                                       "completed")
    assert fold(cons).consumers["a"].logical_requests == 2
