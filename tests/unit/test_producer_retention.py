"""The producer's retention loop with the real Producer, registry, store and journal on a fake
backend: the disk budget is never exceeded while windows fit it, evictions are journaled with their
reasons, an evicted position a consumer reads again is recaptured on its demand (counted), the final
pass keeps what fits (the root persists), the default budget comes from the free space, and ``--fill``
captures the whole plan once and exits."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import pytest
import torch

from artcache import journal as J
from artcache import registry, store
from artcache.accounting import account
from artcache.contract import CaptureContract
from artcache.fsio import space_reserve
from artcache.layout import CacheLayout
from artcache.producer import BUDGET_FREE_FRACTION, Producer, ProducerConfig, default_budget
from artcache.report import format_accounting
from artcache.scheduler import SchedulerLimits
from artcache.settings import RootSettings, init_settings

C = CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                    layer_ids=(1,), max_length=64, tokenizer_digest="t", template_digest="t")
HIDDEN = 8
T = 8  # tokens per sample


@dataclass
class Sample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


class Plan:
    """``n`` distinct samples of ``T`` tokens."""

    plan_id = "0" * 40

    def __init__(self, n: int) -> None:
        self.n = n

    def order(self, epoch_len: int = 0):
        from artcache.plan import EpochOrder

        return EpochOrder(self.n, epoch_len or self.n, 0)

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> Sample:
        return Sample(torch.arange(T, dtype=torch.int32) + 1000 * i, torch.ones(T, dtype=torch.uint8))


class Backend:
    def __init__(self) -> None:
        self.captured: list[int] = []

    def capture(self, samples):
        self.captured += [int(s.input_ids[0]) // 1000 for s in samples]
        return [{"hidden_states": torch.full((T, 1, HIDDEN), float(s.input_ids[0]), dtype=torch.bfloat16),
                 "input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples]


@pytest.fixture
def root(tmp_path):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    init_settings(layout, RootSettings(plan_id="0" * 40, contract=C, target_path="/nowhere"))
    return layout


def make(layout, n, **cfg) -> tuple[Producer, Backend, J.JournalWriter]:
    backend = Backend()
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    settings = RootSettings(plan_id="0" * 40, contract=C, target_path="/nowhere")
    cfg = ProducerConfig(cache=str(layout.root), limits=SchedulerLimits(max_batch_samples=4, max_batch_tokens=64),
                         max_length=64, **cfg)
    return Producer(layout, settings, Plan(n), backend, cfg, journal, hidden_size=HIDDEN), backend, journal


def artifact_bytes(layout) -> int:
    return max(store.list_objects(layout).values())


def register(layout, cid, cursor=0, lookahead=4, end=-1, lookbehind=0):
    return registry.ConsumerHandle(layout, registry.register(layout, registry.Registration(
        consumer_id=cid, draft="d", cursor=cursor, lookahead=lookahead, lookbehind=lookbehind, end=end,
        pid=os.getpid(), batch_size=1)))


def settle(producer: Producer, ticks: int = 200) -> None:
    """Tick until a pass finds nothing to capture (waiting for the publisher thread after each batch)."""
    for _ in range(ticks):
        worked = producer.tick()
        deadline = time.monotonic() + 30
        while (producer._inflight or not producer._publish_queue.empty()) and time.monotonic() < deadline:
            time.sleep(0.002)
        if not worked:
            break


def test_budget_is_never_exceeded_and_evictions_say_why(root):
    probe, _, j = make(root, 40)  # learn one artifact's size
    h = register(root, "probe", lookahead=0, end=1)
    settle(probe)
    probe.drain()
    j.close()
    size = artifact_bytes(root)
    h.finish("completed")
    store.remove(root, next(iter(store.list_objects(root))))
    shutil.rmtree(root.journal)
    root.journal.mkdir()

    budget = 12 * size
    producer, backend, journal = make(root, 40, disk_budget=budget)
    fast = register(root, "fast", lookahead=3, end=40)
    slow = register(root, "slow", lookahead=3, end=40)
    try:
        for step in range(40):
            settle(producer)
            on_disk = sum(store.list_objects(root).values())
            assert on_disk <= budget, f"step {step}: {on_disk} > {budget}"
            fast.commit_cursor(min(40, fast.current.cursor + 1))
            if step % 3 == 0:
                slow.commit_cursor(slow.current.cursor + 1)
        # the slow one (at 14 of 40) needs what the fast one passed: with room for 12, some of it went
        assert producer.stats.evictions_by_reason.get("needed-later", 0) > 0
        assert producer.stats.binding_passes > 0
        # the slow consumer now reads on: its evicted positions are recaptured on its demand, and counted
        for _ in range(26):
            settle(producer)
            slow.commit_cursor(slow.current.cursor + 1)
            assert sum(store.list_objects(root).values()) <= budget
    finally:
        producer.drain()
        journal.close()
    assert producer.stats.recaptures > 0
    assert sorted(set(backend.captured)) == list(range(40))
    evs = J.read_events(root.journal).events
    reasons = {e.reason for e in evs if isinstance(e, J.Evict)}
    assert reasons <= {"needed-later", "unneeded"} and "needed-later" in reasons
    acc = account(root)  # (ProducerStart, with the budget, is journaled by Producer.run: not called here)
    assert acc.violations == [] and acc.cache.budget_binding
    assert acc.cache.max_retained_bytes <= budget and acc.cache.recaptures == producer.stats.recaptures
    assert acc.cache.evictions_by_reason == producer.stats.evictions_by_reason


def test_final_pass_keeps_what_fits_and_a_later_run_captures_nothing(root):
    producer, backend, journal = make(root, 10, disk_budget="auto")
    h = register(root, "a", lookahead=9, end=10)
    try:
        settle(producer)
        h.commit_cursor(10)
        h.finish("completed")
        producer.stop_event.set()
        producer.run()  # the stop path: drain, final pass
    finally:
        journal.close()
    assert len(store.list_objects(root)) == 10  # nothing needed any more, all of it fits: kept
    again, backend2, journal2 = make(root, 10)
    h2 = register(root, "b", lookahead=9, end=10)
    try:
        settle(again)
    finally:
        again.drain()
        journal2.close()
    assert backend2.captured == [] and h2.current.cursor == 0


def test_auto_budget_comes_from_the_free_space(root):
    producer, _, journal = make(root, 4, disk_budget="auto")
    journal.close()
    usage = shutil.disk_usage(root.objects)
    expect = int(BUDGET_FREE_FRACTION * max(0, usage.free - space_reserve(usage.total)))
    assert abs(producer.budget - expect) < 64 << 20  # the free space moves a little meanwhile
    assert producer.cfg.retention == "need"
    assert "--disk-budget auto" in producer.budget_note and " free on " in producer.budget_note
    budget, how = default_budget(root, retained=3 << 30)
    assert abs(budget - (3 << 30) - expect) < 64 << 20 and "3.00 GiB retained" in how


def test_regression_default_budget_uses_the_publication_reserve_on_a_small_filesystem(root, monkeypatch):
    """The default (now ``auto``) budget kept a 1 GiB reserve free while publication keeps
    ``space_reserve`` (min(64 MiB, 5 %)), so on a 20 MiB filesystem the default budget was silently 0 and
    ``--retention need`` degraded to windows-only. Now both use the one reserve."""
    usage = shutil._ntuple_diskusage(total=20 << 20, used=1 << 20, free=19 << 20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    budget, how = default_budget(root, retained=0)
    assert budget == int(BUDGET_FREE_FRACTION * ((19 << 20) - space_reserve(20 << 20))) > 16 << 20
    assert "beyond a 1.0 MiB reserve" in how and space_reserve(20 << 20) == 1 << 20


def test_fill_captures_the_plan_once_in_plan_order_and_exits(root):
    producer, backend, journal = make(root, 30, fill=True)
    try:
        producer.run()
    finally:
        journal.close()
    assert producer.stats.fill_complete and sorted(backend.captured) == list(range(30))
    assert backend.captured == list(range(30))  # nobody registered: plan order
    stop = [e for e in J.read_events(root.journal).events if isinstance(e, J.ProducerStop)]
    assert stop[-1].reason == "plan filled"
    again, backend2, journal2 = make(root, 30, fill=True)
    try:
        again.run()
    finally:
        journal2.close()
    assert backend2.captured == [] and again.stats.fill_complete


def test_fill_serves_a_consumer_first_and_stops_at_a_budget_too_small(root):
    probe, _, j = make(root, 30, fill=True, disk_budget=1)
    h = register(root, "a", cursor=20, lookahead=2, end=30)
    try:
        probe.run()
    finally:
        j.close()
    # the budget holds less than one artifact: only the consumer's demand-free window is the guarantee, so
    # nothing fits beside it; fill stops and says so
    assert not probe.stats.fill_complete
    stop = [e for e in J.read_events(root.journal).events if isinstance(e, J.ProducerStop)]
    assert stop[-1].reason == "plan does not fit the budget"
    h.finish("completed")
    size_budget = 31 * 400  # comfortably more than 30 tiny artifacts
    producer, backend, journal = make(root, 30, fill=True, disk_budget=size_budget * 10)
    h = register(root, "b", cursor=20, lookahead=2, end=30)
    try:
        producer.run()
    finally:
        journal.close()
    assert producer.stats.fill_complete
    assert backend.captured[:3] == [20, 21, 22]  # what the live consumer reads first, then the plan
    assert sorted(backend.captured) == list(range(30))


def test_fill_on_a_filled_root_loads_no_target_and_captures_nothing(tmp_path, monkeypatch):
    """``run_producer --fill`` end to end on a tiny random target: the first run captures the whole plan;
    a second on the same root (same contract and plan) finds every sample published and returns before
    loading the target (the loader raises if called), journaling no capture."""
    import artcache.target
    from artcache.producer import run_producer

    cfg = ProducerConfig(cache=str(tmp_path / "root"), target="random:tiny-llama", dataset="synthetic",
                         max_samples=6, max_length=32, draft_layers=3, fill=True, poll_interval_s=0.0)
    assert run_producer(cfg).fill_complete
    layout = CacheLayout(tmp_path / "root")
    first = account(layout).cache
    assert first.captures == 6 and first.retained_artifacts == 6

    def no_target(*a, **k):
        raise AssertionError("a filled root must not load the target")

    monkeypatch.setattr(artcache.target, "load_target_model", no_target)
    assert run_producer(cfg).fill_complete
    assert account(layout).cache.captures == 6


def _live(layout):
    return [r for r in registry.read_all(layout) if r.state == "running"]


def test_regression_no_disk_budget_keeps_only_the_live_windows(root):
    """A producer started with no ``--disk-budget`` retained by future need up to ~90 % of the filesystem's free
    space, so disk use grew with the run instead of being bounded by the live windows. Now no budget means the
    windows-only rule: after every pass the root holds no more than the live windows, and the start line says
    so."""
    from artcache.scheduler import window_bound

    producer, backend, journal = make(root, 40)
    assert producer.cfg.retention == "windows" and producer.budget == 0
    assert "windows-only rule" in producer.budget_note and "--disk-budget" in producer.budget_note
    fast = register(root, "fast", lookahead=3, end=40)
    slow = register(root, "slow", lookahead=3, lookbehind=1, end=40)
    try:
        for step in range(36):
            settle(producer)
            held = len(store.list_objects(root))
            assert held <= window_bound(_live(root), 40), f"step {step}: {held} artifacts > the live windows"
            fast.commit_cursor(min(40, fast.current.cursor + 1))
            if step % 3 == 0:
                slow.commit_cursor(slow.current.cursor + 1)
        fast.finish("completed")
        slow.finish("completed")
        producer.stop_event.set()
        producer.run()  # the final pass: no live window, nothing kept
    finally:
        journal.close()
    assert store.list_objects(root) == {}
    acc = account(root)
    assert acc.cache.retention == "windows" and acc.violations == []


def _fill(layout, n):
    producer, backend, journal = make(layout, n, fill=True)
    try:
        producer.run()
    finally:
        journal.close()
    assert producer.stats.fill_complete and len(store.list_objects(layout)) == n


def _run_after_fill(layout, n, **cfg):
    """A producer after the fill serving one consumer through the plan, then its final pass."""
    producer, backend, journal = make(layout, n, **cfg)
    h = register(layout, "late", lookahead=2, end=n)
    try:
        for _ in range(n):
            settle(producer)
            h.commit_cursor(min(n, h.current.cursor + 1))
        h.finish("completed")
        producer.stop_event.set()
        producer.run()
    finally:
        journal.close()
    return producer, backend


def test_regression_a_filled_root_keeps_its_fill(root):
    """A ``--fill``ed root was emptied silently by a later run with ``--retention windows`` (0 of 60 artifacts
    left) or a smaller ``--disk-budget`` (16 of 60), and a run after it found nothing. Now the fill is recorded
    in the root: later producers keep what it published whatever their rule, say so at start, and evict it
    only when asked (``--evict-fill``, also said at start)."""
    _fill(root, 30)
    size = artifact_bytes(root)
    left, notes = [], []
    for cfg in ({}, {"retention": "windows"}, {"disk_budget": 5 * size}):
        producer, backend = _run_after_fill(root, 30, **cfg)
        assert backend.captured == []
        left.append(len(store.list_objects(root)))
        notes.append(getattr(producer, "fill_note", ""))
        assert account(root).violations == []  # the kept fill counts beside the window bound
    assert left == [30, 30, 30]
    assert all("30 artifacts of a --fill" in n and "kept whatever the retention rule" in n for n in notes)
    assert "beyond the disk budget" in notes[-1]
    acc = account(root)
    assert acc.cache.kept_fill_artifacts == 30 and "kept beside the rule" in format_accounting(acc)
    producer, backend = _run_after_fill(root, 30, evict_fill=True)
    assert producer.evict_fill and "--evict-fill" in producer.fill_note and "may evict" in producer.fill_note
    assert store.list_objects(root) == {}  # the windows rule, released: the final pass keeps no window
    starts = [e for e in J.read_events(root.journal).events if isinstance(e, J.ProducerStart)]
    assert starts[-1].evict_fill and not J.fill_recorded(starts)
    producer, _, journal = make(root, 30)  # no longer filled: nothing kept, nothing said
    journal.close()
    assert producer.fill_note == "" and len(producer.fill_kept) == 0


def test_regression_evict_fill_on_a_root_without_a_fill_is_said(root):
    """``--evict-fill`` on a root that was never filled (or whose fill is gone) was accepted without a word: the
    user, believing the root filled, saw nothing telling them the flag did nothing. The producer now says at start
    that there is no fill to release, and retention is unchanged."""
    producer, _, journal = make(root, 10, evict_fill=True)
    journal.close()
    assert "--evict-fill" in producer.fill_note and "changes nothing" in producer.fill_note
    assert not producer.evict_fill and len(producer.fill_kept) == 0


def test_retention_flags_that_contradict_are_refused(root):
    from artcache.errors import ConfigError

    for cfg, words in (({"retention": "need"}, "--retention need"), ({"retention": "windows", "disk_budget": 100},
                       "--retention windows"), ({"retention": "windows", "fill": True}, "cannot keep a --fill"),
                       ({"fill": True, "evict_fill": True}, "--evict-fill")):
        full = ProducerConfig(cache=str(root.root), **cfg)
        with pytest.raises(ConfigError, match=words):
            full.validate()
    assert make(root, 4, retention="need", disk_budget=100)[0].cfg.retention == "need"
    assert make(root, 4, fill=True)[0].budget_note.startswith("retention by future need")  # a fill's budget: auto


def test_regression_budget_is_printed_in_a_unit_that_reads(root):
    """The start line printed ``disk budget 0.00 GiB (4353638 bytes …)`` for a budget of a few MiB. Sizes now
    come in a binary unit that fits them."""
    producer, _, journal = make(root, 4, disk_budget=4353638)
    journal.close()
    assert "4.2 MiB (4353638 bytes" in producer.budget_note and "0.00 GiB" not in producer.budget_note


def test_regression_fill_that_failed_captures_exits_nonzero(tmp_path, monkeypatch):
    """``artcache producer --fill`` exited 0 when captures failed (a 5 MiB tmpfs: 294 failures logged, exit 0),
    so ``producer --fill && consume ...`` went ahead on a partial fill: captures given up on a full disk did not
    count as missing. Now a fill that did not publish the whole plan exits nonzero, naming how many samples are
    missing and why (ENOSPC injected into publication after the first two artifacts)."""
    import errno

    from click.testing import CliRunner

    from artcache import producer as P
    from artcache.app.cli import main
    from artcache.errors import PublishError

    real, published = store.publish, []

    def publish(*a, **k):
        if len(published) >= 2:
            raise PublishError("No space left on device", retryable=False, errno_=errno.ENOSPC)
        published.append(real(*a, **k))
        return published[-1]

    monkeypatch.setattr(store, "publish", publish)
    monkeypatch.setattr(P, "free_space", lambda path: (0, 1 << 40, path))  # the filesystem stays full
    root = tmp_path / "root"
    result = CliRunner().invoke(main, ["producer", "--cache", str(root), "--target", "random:tiny-llama", "--data",
                                       "synthetic", "--max-samples", "6", "--max-length", "32", "--draft-layers",
                                       "3", "--fill", "--disk-budget", "100M"], catch_exceptions=True)
    assert result.exit_code == 1, (result.exit_code, result.output)
    line = [ln for ln in result.stderr.splitlines() if ln.startswith("artcache: error:")]
    assert len(line) == 1 and "4 of the plan's 6 samples are missing" in line[0], result.stderr
    assert "given up after failed captures" in line[0] and "No space left on device" in line[0]
    assert len(store.list_objects(CacheLayout(root))) == 2  # what was captured stays published
    stop = [e for e in J.read_events(CacheLayout(root).journal).events if isinstance(e, J.ProducerStop)]
    assert stop[-1].reason.startswith("plan incomplete: 4 of the plan's 6 samples are missing")


@pytest.mark.parametrize("flags, needle", [
    (["--retention", "need"], "--retention need keeps what consumers will read again inside a disk budget"),
    (["--retention", "windows", "--disk-budget", "1G"], "--retention windows keeps only the live windows"),
    (["--fill", "--evict-fill"], "--fill and --evict-fill contradict"),
    (["--disk-budget", "lots"], "or auto"),
])
def test_contradicting_retention_flags_are_one_line_and_write_nothing(tmp_path, flags, needle):
    from click.testing import CliRunner

    from artcache.app.cli import main

    root = tmp_path / "new" / "root"
    res = CliRunner().invoke(main, ["producer", "--cache", str(root), "--target", "random:tiny-llama", "--data",
                                    "synthetic", "--max-samples", "4", "--max-length", "32", *flags])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("artcache: error:") and needle in lines[0], lines
    assert not (tmp_path / "new").exists()


def test_regression_a_budget_over_the_filesystem_is_warned_at_start(root, monkeypatch, caplog):
    """Bug: a --disk-budget larger than the root's filesystem (or than what the root holds plus the free space) was
    taken silently; the budget never bound, captures failed for space first while the start line and the
    accounting showed room in the budget. Symptom: a full disk with no word that the budget could not fit. Now the
    producer warns once at start naming the budget and the filesystem's size (or its free space)."""
    import artcache.producer as P

    monkeypatch.setattr(P, "free_space", lambda path: (10 << 20, 100 << 20, root.objects))
    cases = ((1 << 30, "exceeds the filesystem's size, 100.0 MiB (104857600 bytes)"),
             (50 << 20, "exceeds the 0 B the root holds plus the 10.0 MiB free (10485760 bytes"),
             (8 << 20, None), (0, None))
    for budget, needle in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="artcache"):
            _, _, journal = make(root, 4, disk_budget=budget)
        journal.close()
        warned = [r.getMessage() for r in caplog.records if "exceeds" in r.getMessage()]
        if needle is None:
            assert warned == [], warned
        else:
            assert len(warned) == 1 and needle in warned[0] and f"({budget} bytes)" in warned[0], warned
            assert "ENOSPC" in warned[0] and "--disk-budget" in warned[0]


def test_regression_a_full_disk_failure_names_the_free_bytes_and_the_budget(root, caplog, full_temp_writes):
    """Bug: a capture that failed for space (ENOSPC) said only the errno and "given up until the filesystem has room
    again", beside a budget that looked far from full. Symptom: a full disk read as a budget problem, or none. The
    failure (log line and the give-up record consumers read) now says the filesystem is full, with its free bytes,
    the disk budget and what the root retains."""
    producer, _, journal = make(root, 8, disk_budget=1 << 30)
    register(root, "c", lookahead=2, end=8)
    full_temp_writes()
    try:
        with caplog.at_level("ERROR", logger="artcache"):
            settle(producer, ticks=5)
    finally:
        producer.drain()
        journal.close()
    lines = [r.getMessage() for r in caplog.records if "given up until the filesystem has room" in r.getMessage()]
    assert lines, caplog.text
    want = (f"the filesystem of {root.objects} is full (or its quota is): ", " bytes) free of ",
            "disk budget 1.00 GiB (1073741824 bytes), 0 B retained", "free space there or lower --disk-budget")
    for needle in want:
        assert needle in lines[0], lines[0]
    # the journaled failure carries it too (the give-up record consumers read is that error; its own write fails on
    # this full disk)
    failures = [e for e in J.read_events(root.journal).events if isinstance(e, J.CaptureFailure)]
    assert failures and all(want[2] in e.error and want[0] in e.error for e in failures), failures
