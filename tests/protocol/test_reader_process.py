"""``artcache consume --reader process``: the reader in a child process (trainers/consumer/reader_process.py).

Unit tests for the pieces (messages, errors across the pipe, the slot layout) and real processes on a real root for
the protocol: the same losses as the reader thread, the accounting balanced, a killed child or a killed trainer
leaving no lease that blocks eviction, a fenced consumer's child stopping."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from artcache import errors as E
from artcache import journal as J
from artcache import leases as leases_mod
from artcache.accounting import account
from artcache.layout import CacheLayout
from artcache.trainers.consumer.config import ConsumerConfig
from artcache.trainers.consumer.reader_process import (
    FIELDS,
    Batch,
    Failed,
    Field,
    Start,
    _enc,
    _into_slot,
    _to_parent,
    _view,
    failure_of,
    rebuild,
    slot_bytes,
)
from artcache.trainers.draft import DraftBatch
from tests.protocol.test_consumer_resume import DATA, Proc, consume_args, file_events, steps_of

# ---- units -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [
    E.CaptureTimeout("position 3 (fingerprint ab) was not published within 5s"),
    E.CaptureFailed("the producer gave up", fingerprint="ab" * 8, attempts=3, retryable=False),
    E.ConsumerFenced("consumer 'x' was fenced"),
    E.ConfigError("--reader process needs Linux"),
    E.PublishError("writing failed: No space left", fingerprint="cd" * 8, errno_=28),
])
def test_an_artcache_error_crosses_the_pipe_with_its_class_message_keywords_and_exit_status(exc):
    got = rebuild(_to_parent.decode(_enc.encode(failure_of(exc))))
    assert type(got) is type(exc) and str(got) == str(exc) and got.exit_code == exc.exit_code
    assert got._keywords() == exc._keywords()


def test_regression_an_os_error_keeps_its_message_and_file_once():
    """A PermissionError from the child read ``[Errno 1] [Errno 1] Operation not permitted`` (its message
    passed as strerror) and lost the file name."""
    exc = PermissionError(1, "Operation not permitted", "/root/journal/reader-x.jsonl")
    got = rebuild(_to_parent.decode(_enc.encode(failure_of(exc))))
    assert type(got) is PermissionError and str(got) == str(exc) and got.filename == exc.filename


def test_regression_two_clients_of_one_consumer_keep_each_others_demand(monkeypatch, tmp_path):
    """With a reader process a consumer has two clients — the trainer's (held-out evaluation) and the
    reader's (training positions) — and each wrote both demand lists from its own sets, so the reader's ``want``
    wiped the evaluation's held-out demand. Each writes only the list it changed."""
    from artcache import registry
    from artcache.client import CacheClient

    layout = CacheLayout(tmp_path / "root")
    for sub in ("consumers", "locks", "tmp"):
        (layout.root / sub).mkdir(parents=True)
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", pid=os.getpid(),
                                                          pinned=[190, 200]))
    monkeypatch.setattr("artcache.client.store.exists", lambda _layout, _fp: False)  # nothing published yet

    def client() -> CacheClient:
        c = CacheClient.__new__(CacheClient)  # the demand bookkeeping only: no plan or journal needed
        c.handle, c._demand, c._held_out = registry.ConsumerHandle(layout, reg), set(), set()
        c._demand_lock, c.fp_of, c.fps, c.layout = __import__("threading").Lock(), str, None, layout
        return c

    trainer, reader = client(), client()
    trainer.fps = type("F", (), {"of_sample": staticmethod(str)})()
    assert trainer.want_samples([190, 191]) == [190, 191]
    assert reader.want([4, 5]) == [4, 5]
    now = registry.read(layout, "c")
    assert (now.demand, now.pinned_demand) == ([4, 5], [190, 191])
    reader.unwant([4])
    trainer.unwant([190], held_out=True)
    now = registry.read(layout, "c")
    assert (now.demand, now.pinned_demand) == ([5], [191])


def test_a_builtin_error_keeps_its_errno_and_anything_else_is_a_worker_failure_naming_it():
    got = rebuild(failure_of(FileNotFoundError(2, "objects/ab is gone")))
    assert isinstance(got, FileNotFoundError) and got.errno == 2
    other = rebuild(failure_of(KeyError("hidden_states")))
    assert isinstance(other, E.WorkerFailed) and "KeyError" in str(other) and "hidden_states" in str(other)
    assert other.exit_code == 1
    made_up = rebuild(Failed("NoSuchError", "boom"))  # a class name from nowhere is never looked up elsewhere
    assert isinstance(made_up, E.WorkerFailed) and "NoSuchError: boom" in str(made_up)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_batch_written_into_a_slot_reads_back_equal_from_its_layout(dtype):
    b, t, m, h = 3, 17, 2, 8
    hidden = torch.randn(b, t, m, h).to(dtype)
    ids = torch.randint(0, 1000, (b, t))
    mask = torch.rand(b, t) > 0.3
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 12:] = False
    batch = DraftBatch(hidden, ids, mask, valid, positions=(4, 5, 6))
    start = Start(root="/r", consumer_id="c", generation=1, start_pos=0, batch=b, lookahead=8, depth=2, end=30,
                  workers=1, demand_timeout_s=5.0, epoch_len=0, layers=None, hidden_dtype=None, slots=2,
                  slot_bytes=slot_bytes(b, t, m, h), group=[], length_bucket=0, log_level=20, beat_s=2.0,
                  progress_timeout_s=30.0)
    mm = mmap.mmap(-1, start.slots * start.slot_bytes)
    fields = _into_slot(mm, start, 1, batch)
    assert [f.name for f in fields] == list(FIELDS)
    assert all(f.offset % 64 == 0 for f in fields)  # aligned, back to back
    msg = _to_parent.decode(_enc.encode(Batch(1, [4, 5, 6], fields)))
    got = {f.name: _view(mm, 1 * start.slot_bytes, f) for f in msg.fields}
    assert torch.equal(got["hidden"], hidden) and got["hidden"].dtype == dtype
    assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"], mask)
    assert torch.equal(got["valid"], valid) and torch.equal(got["supervised_host"], mask & valid)
    # slot 0 is untouched: another batch's slot is never written
    assert not any(mm[: start.slot_bytes])


def test_a_batch_larger_than_its_slot_is_refused_naming_the_sizes():
    batch = DraftBatch(torch.zeros(2, 64, 3, 16), torch.zeros(2, 64, dtype=torch.long),
                       torch.zeros(2, 64, dtype=torch.bool), torch.ones(2, 64, dtype=torch.bool))
    start = Start(root="/r", consumer_id="c", generation=1, start_pos=0, batch=2, lookahead=8, depth=2, end=30,
                  workers=1, demand_timeout_s=5.0, epoch_len=0, layers=None, hidden_dtype=None, slots=1,
                  slot_bytes=slot_bytes(2, 32, 3, 16), group=[], length_bucket=0, log_level=20, beat_s=2.0,
                  progress_timeout_s=30.0)
    with pytest.raises(E.ConfigError, match=r"does not fit the reader process's \d+ B slot"):
        _into_slot(mmap.mmap(-1, start.slot_bytes), start, 0, batch)


def test_reader_setting_is_typed():
    assert ConsumerConfig(cache="c", consumer_id="x", reader="process").reader == "process"
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"cache": "c", "consumer_id": "x", "reader": "fork"}, ConsumerConfig)


def test_a_bad_reader_flag_is_one_line_and_exit_2(tmp_path):
    got = subprocess.run([sys.executable, "-m", "artcache", "consume", "--cache", str(tmp_path / "none"),
                          "--reader", "fork"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "--reader" in got.stderr and "fork" in got.stderr and "thread" in got.stderr
    assert "Traceback" not in got.stderr


def test_a_field_layout_is_a_plain_record():
    f = Field("hidden", 128, "bfloat16", [1, 2, 3, 4])
    assert _to_parent.decode(_enc.encode(Batch(0, [7], [f]))).fields == [f]


# ---- real processes on a real root -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def filled(tmp_path_factory, tiny_target):
    """A root filled by ``artcache producer --fill`` (24 samples): consumers read it with no producer running."""
    cache = tmp_path_factory.mktemp("reader-process") / "cache"
    fill = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                           tiny_target.path, "--data", str(DATA), "--max-samples", "24", "--max-length", "128",
                           "--draft-layers", "3", "--threads", "1", "--fill"], capture_output=True, text=True,
                          timeout=600)
    assert fill.returncode == 0, fill.stderr[-2000:]
    return cache


def _reader_events(cache, cid: str) -> list:
    paths = sorted(CacheLayout(cache).journal.glob(f"reader-{cid}-*.jsonl"))
    return [e for p in paths for e in J.iter_file(p) if e is not None]


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _no_children_of(pid: int) -> bool:
    return not _children(pid)


def test_the_reader_process_trains_as_the_reader_thread_and_keeps_the_accounting(filled, tmp_path):
    """Two consumers of one filled root, started together: one reads with the thread, one with a reader process
    (batch 4, 2 read workers). Their losses are the same step for step; the child's requests and leases are in its
    own ``reader-<id>`` journal, counted as the consumer's; every lease balances; no process is left."""
    procs = {}
    for cid, reader in (("thread", "thread"), ("process", "process")):
        args = consume_args(filled, tmp_path, cid, 5, "--reader", reader, "--read-workers", "2")
        args[args.index("--batch-size") + 1] = "4"
        procs[cid] = Proc(cid, args, tmp_path)
    losses = {}
    try:
        for cid, proc in procs.items():
            proc.expect(0)
            (evs,) = file_events(filled, cid)
            losses[cid] = [(s.step, s.cursor, s.loss) for s in steps_of(evs)]
            assert _no_children_of(proc.popen.pid)
    finally:
        for proc in procs.values():
            proc.kill()
    assert len(losses["thread"]) == 5 and losses["process"] == losses["thread"]
    child = _reader_events(filled, "process")
    assert sum(isinstance(e, J.Request) for e in child) == 20  # 5 steps x 4 positions, all read by the child
    assert sum(isinstance(e, J.LeaseAcquire) for e in child) == sum(isinstance(e, J.LeaseRelease) for e in child)
    assert not _reader_events(filled, "thread")
    acc = account(CacheLayout(filled))
    assert acc.violations == []
    per = {k.consumer: k for k in acc.consumers}
    assert per["process"].logical_requests == per["thread"].logical_requests == 20
    assert per["process"].leases_acquired == per["process"].leases_released == 20
    assert per["process"].state == "completed" and per["process"].cursor == 20
    assert acc.cache.captures == 24  # the fill's, nothing since
    assert leases_mod.scan(CacheLayout(filled)) == {}
    # artcache run / report read a process's requests through its consumer_start (regression: they showed 0)
    from artcache.app.experiments import committed_work, consumer_events

    (path,) = CacheLayout(filled).journal.glob("consumer-process-*.jsonl")
    work = committed_work(consumer_events(path))
    assert (work["requests"], work["steps_run"], work["positions_committed"]) == (20, 5, 20)


def test_a_run_config_sets_the_reader_per_experiment_and_names_a_bad_one(tmp_path):
    """``experiments.X.consumer.reader`` (or ``--reader`` with ``consume --experiment X``) reaches the consumer; a
    value other than thread/process is one ConfigError naming the experiment, the value and both accepted ones."""
    from artcache.app import config as C

    run = tmp_path / "run.toml"
    run.write_text("[cache]\nroot = 'c'\n\n[[experiments]]\nname = 'a'\n\n[[experiments]]\nname = 'b'\n")
    cfg = C.load_run_config(run, ["experiments.a.consumer.reader=process"],
                            C.flag_paths("consume", {"reader": "process"}, "b"))
    assert C.consumer_config(cfg, "a").reader == "process" and C.consumer_config(cfg, "b").reader == "process"
    bad = C.load_run_config(run, ["experiments.a.consumer.reader=fork"])
    named = r"experiments\.a\.consumer\.reader.*fork.*(thread.*process|process.*thread)"
    with pytest.raises(E.ConfigError, match=named):
        C.consumer_config(bad, "a")


def test_a_slot_holds_the_collated_dtype_of_the_stored_one():
    """The ring is sized by the dtype a batch arrives in: bf16 / fp16 stored 2 bytes, fp32 4; fp8 is dequantised into
    fp32 on a CPU, bf16 on CUDA (so a CUDA ring, whose pages the registration pins, is half an fp32 one)."""
    from artcache.trainers.consumer.reader_process import batch_itemsize

    assert [batch_itemsize(d, "cpu") for d in ("bfloat16", "float16", "float32", "float8_e4m3fn")] == [2, 2, 4, 4]
    assert batch_itemsize("float8_e4m3fn", "cuda") == 2 and batch_itemsize("float32", "cuda") == 4
    assert slot_bytes(8, 1024, 5, 576, 2) == 8 * 1024 * 5 * 576 * 2 + 8 * 1024 * 8 + 3 * 8 * 1024
