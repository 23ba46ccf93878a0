"""Kill consumers mid-run and resume them (real ``artcache producer`` / ``artcache consume`` processes on the
tiny random target), while a sibling that is never stopped keeps training.

- ``a`` SIGKILLs itself after its 6th cursor commit (``ARTCACHE_CRASH_AT=cursor.after-commit:6``); it saved a
  checkpoint at step 3, so three committed steps are lost and retrained.
- ``b`` dies inside its 2nd checkpoint save, after the registry recorded it but before ``latest`` moved
  (``checkpoint.after-record:2``): ``--resume`` must find the recorded checkpoint by its cursor.
- ``sib`` runs on and is finally stopped with SIGTERM: cancelled at a step boundary, with a checkpoint.

Deadlines only bound a hung run; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache import journal as J
from artcache import registry
from artcache.layout import CacheLayout
from artcache.trainers.checkpoint import read_state
from artcache.trainers.tracking import read_metrics
from tests.support import TINY_SHAREGPT
from tests.support.procs import Proc as BaseProc
from tests.support.procs import inspect_json, wait_until

DATA = TINY_SHAREGPT
DEADLINE_S = 300.0
BATCH = 2
STEPS = 8


class Proc(BaseProc):
    deadline = DEADLINE_S


def start_producer(cache: Path, cwd: Path, tiny_target) -> Proc:
    """The producer of this file's runs: the tiny target on the test data, 40 samples of 128 tokens. The root is
    initialised here first, as the producer would (``prepare_root``, with the same settings), so the consumers can
    start beside the producer instead of after its interpreter start and target load."""
    from artcache.producer import ProducerConfig, prepare_root

    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))
    return Proc("producer", ["producer", "--cache", str(cache), "--target", tiny_target.path, "--data", str(DATA),
                             "--max-samples", "40", "--max-length", "128", "--draft-layers", "3", "--threads", "1"],
                cwd)


def consume_args(cache: Path, cwd: Path, cid: str, steps: int, *extra: str) -> list[str]:
    """The consume flags of these tests; the DFlash options only for a DFlash consumer (an EAGLE-3 one refuses
    them)."""
    dflash = [] if "eagle3" in extra else ["--block-size", "4", "--anchors", "4"]
    return ["consume", "--cache", str(cache), "--id", cid, *dflash, "--window", "2:8",
            "--steps", str(steps), "--batch-size", str(BATCH), "--threads", "1", "--demand-timeout", "180",
            "--log-every", "1", "--out", str(cwd / "runs" / cid), "--no-progress", "--json", *extra]


def file_events(cache: Path, cid: str) -> list[list]:
    """Each process's journal of consumer ``cid``, in start order (one list of events per process)."""
    paths = sorted((CacheLayout(cache).journal).glob(f"consumer-{cid}-*.jsonl"), key=lambda p: p.stat().st_mtime)
    out = []
    for path in paths:
        evs = [e for e in J.iter_file(path) if e is not None]
        out.append(evs)
    return sorted(out, key=lambda evs: evs[0].t)


def steps_of(evs: list) -> list[J.Step]:
    return [e for e in evs if isinstance(e, J.Step)]


def check_lineage(cache: Path, cid: str, ckpt_step: int, killed_after: int, steps: int = STEPS) -> None:
    """The killed process committed ``killed_after`` steps; the resumed one continues from ``ckpt_step``:
    the trained lineage is steps 1..STEPS with cursors 2, 4, … exactly once, positions read in order."""
    first, second = file_events(cache, cid)
    s1, s2 = steps_of(first), steps_of(second)
    assert [s.step for s in s1] == list(range(1, killed_after + 1))
    assert not any(isinstance(e, J.ConsumerEnd) for e in first)  # SIGKILLed: no end event
    start = [e for e in second if isinstance(e, J.ConsumerStart)]
    assert len(start) == 1 and (start[0].step, start[0].cursor) == (ckpt_step, ckpt_step * BATCH)
    lineage = [s for s in s1 if s.step <= ckpt_step] + s2
    assert [s.step for s in lineage] == list(range(1, steps + 1))
    assert [s.cursor for s in lineage] == [BATCH * i for i in range(1, steps + 1)]
    requested = [e.position for e in second if isinstance(e, J.Request)]
    assert requested == list(range(ckpt_step * BATCH, steps * BATCH))  # none repeated, none skipped
    ends = [e for e in second if isinstance(e, J.ConsumerEnd)]
    assert len(ends) == 1 and (ends[0].state, ends[0].steps, ends[0].cursor) == ("completed", steps, steps * BATCH)
    # the loss curve continues: the steps the dead process trained after its checkpoint are retrained
    # from the same weights, optimizer and anchor RNG state, so they give the same losses
    again = {s.step: s.loss for s in s2}
    for s in s1:
        if s.step > ckpt_step:
            assert again[s.step] == pytest.approx(s.loss, rel=1e-5, abs=1e-6), (s.step, s.loss, again[s.step])


def test_kill_and_resume_two_consumers_while_a_sibling_keeps_going(tmp_path, tiny_target):
    cache = tmp_path / "cache"
    layout = CacheLayout(cache)
    prod = start_producer(cache, tmp_path, tiny_target)
    procs = [prod]
    try:
        sib = Proc("sib", consume_args(cache, tmp_path, "sib", 100_000), tmp_path)
        # --commit-interval 0: a's n-th cursor commit is its n-th step (the default commits when due)
        a = Proc("a", consume_args(cache, tmp_path, "a", STEPS, "--save-every", "3", "--commit-interval", "0"),
                 tmp_path, crash_at="cursor.after-commit:6")
        b = Proc("b", consume_args(cache, tmp_path, "b", STEPS, "--save-every", "2"), tmp_path,
                 crash_at="checkpoint.after-record:2")
        procs += [sib, a, b]
        wait_until(lambda: (r := registry.read(layout, "sib")) is not None and r.cursor >= 2, "the sibling to step",
                   [prod, sib])
        sib_generation = registry.read(layout, "sib").generation
        assert a.wait() == -signal.SIGKILL, a.text()[-3000:]
        assert b.wait() == -signal.SIGKILL, b.text()[-3000:]
        sib_cursor_at_kill = registry.read(layout, "sib").cursor

        # what the dead consumers left: a's registry cursor is past its checkpoint (two steps lost);
        # b's registry recorded step 4 while `latest` still points at step 2
        ra, rb = registry.read(layout, "a"), registry.read(layout, "b")
        assert (ra.cursor, ra.checkpoint_cursor) == (6 * BATCH, 3 * BATCH)
        assert (rb.cursor, rb.checkpoint_cursor) == (4 * BATCH, 4 * BATCH)
        assert (tmp_path / "runs" / "b" / "checkpoints" / "latest").resolve().name == "step-00000002"

        # a resume past the run's LR horizon (steps is the stop, lr_total_steps the schedule: issue 16), or
        # pointing at another directory, is refused before registering
        runner = CliRunner()
        bad = runner.invoke(__import__("artcache.app.cli", fromlist=["main"]).main,
                            consume_args(cache, tmp_path, "a", STEPS + 1, "--resume"))
        assert bad.exit_code == 2 and f"--steps {STEPS + 1} runs past the LR schedule's horizon --lr-total-steps " \
            f"{STEPS} with min_lr_frac 0" in bad.stderr, bad.output
        bad = runner.invoke(__import__("artcache.app.cli", fromlist=["main"]).main,
                            consume_args(cache, tmp_path, "a", STEPS, "--resume", "--out", str(tmp_path / "elsewhere")))
        assert bad.exit_code == 2 and "cursor 6" in bad.stderr and "no checkpoint" in bad.stderr, bad.output
        bad = runner.invoke(__import__("artcache.app.cli", fromlist=["main"]).main,
                            consume_args(cache, tmp_path, "a", STEPS))
        assert bad.exit_code == 2 and "already holds checkpoints" in bad.stderr, bad.output
        assert registry.read(layout, "a").pid == ra.pid  # nothing registered (the producer may have fenced it)

        a2 = Proc("a-resumed", consume_args(cache, tmp_path, "a", STEPS, "--save-every", "3", "--resume"), tmp_path)
        b2 = Proc("b-resumed", consume_args(cache, tmp_path, "b", STEPS, "--save-every", "2", "--resume"), tmp_path)
        procs += [a2, b2]
        a2.expect(0)
        b2.expect(0)

        # the sibling was never disturbed: same registration generation, still running, and it kept going
        rs = registry.read(layout, "sib")
        assert rs.state == "running" and rs.generation == sib_generation
        wait_until(lambda: registry.read(layout, "sib").cursor > max(sib_cursor_at_kill, rs.cursor),
                   "the sibling to keep stepping", [prod, sib])
        sib.popen.send_signal(signal.SIGTERM)
        assert sib.wait() == 143  # cancelled by SIGTERM: 128 + 15
        prod.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()

    check_lineage(cache, "a", ckpt_step=3, killed_after=5)  # step 6 committed, not journaled
    check_lineage(cache, "b", ckpt_step=4, killed_after=4)
    for cid in ("a", "b"):
        reg = registry.read(layout, cid)
        assert (reg.state, reg.cursor, reg.checkpoint_cursor) == ("completed", STEPS * BATCH, STEPS * BATCH)
        run = tmp_path / "runs" / cid
        latest = (run / "checkpoints" / "latest").resolve()
        assert latest.name == f"step-{STEPS:08d}" and read_state(latest).cursor == STEPS * BATCH
        assert sorted(p.name for p in latest.iterdir()) == ["model.safetensors", "optimizer.safetensors",
                                                           "rng.safetensors", "state.json"]
        # metrics.csv: the dead process's rows after the checkpoint were replaced, each step once
        rows = [r for r in read_metrics(run / "metrics.csv") if r[1] == "train/loss"]
        assert [r[0] for r in rows] == list(range(1, STEPS + 1))

    # the sibling was cancelled at a step boundary and checkpointed there: resumable
    sib_steps = steps_of(file_events(cache, "sib")[0])
    end = [e for e in file_events(cache, "sib")[0] if isinstance(e, J.ConsumerEnd)]
    assert len(end) == 1 and end[0].state == "cancelled" and end[0].steps == sib_steps[-1].step
    rs = registry.read(layout, "sib")
    ck = read_state((tmp_path / "runs" / "sib" / "checkpoints" / "latest").resolve())
    assert rs.state == "cancelled" and ck.step == sib_steps[-1].step
    assert ck.cursor == rs.cursor == rs.checkpoint_cursor == sib_steps[-1].cursor

    acc = inspect_json(cache)
    assert acc["violations"] == [], acc["violations"]
    ks = {k["consumer"]: k for k in acc["consumers"]}
    assert (ks["a"]["state"], ks["a"]["steps"], ks["a"]["cursor"]) == ("completed", STEPS, STEPS * BATCH)


def test_regression_resume_after_kill_before_the_first_checkpoint_is_recorded(tmp_path, tiny_target):
    """Breakfix report: a consumer SIGKILLed after writing its first checkpoint but before the registry
    recorded it (``checkpoint.before-record:1``) could be neither resumed ("the registry records no
    checkpoint ...; start it again without --resume") nor restarted ("already holds checkpoints of an
    earlier run; pass --resume"). The previous checkpoint is none, so ``--resume`` continues from step 0 in the
    same --out, replaces the unrecorded checkpoint, and trains every step once."""
    cache = tmp_path / "cache"
    layout = CacheLayout(cache)
    prod = start_producer(cache, tmp_path, tiny_target)
    procs = [prod]
    steps = 4
    try:
        k = Proc("k", consume_args(cache, tmp_path, "k", steps, "--save-every", "2"), tmp_path,
                 crash_at="checkpoint.before-record:1")
        # another id's run directory, for the refusal below: an independent consumer, run beside k
        other = Proc("other", consume_args(cache, tmp_path, "other", 1), tmp_path)
        procs += [k, other]
        assert k.wait() == -signal.SIGKILL, k.text()[-3000:]
        run = tmp_path / "runs" / "k"
        assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000002"]
        assert registry.read(layout, "k").checkpoint_cursor == -1

        runner = CliRunner()
        main = __import__("artcache.app.cli", fromlist=["main"]).main
        bad = runner.invoke(main, consume_args(cache, tmp_path, "k", steps, "--save-every", "2"))
        assert bad.exit_code == 2 and "pass --resume" in bad.stderr, bad.output
        # a run directory holding another id's checkpoints is still refused, naming another --out
        other.expect(0)
        bad = runner.invoke(main, consume_args(cache, tmp_path, "k", steps, "--resume", "--out",
                                               str(tmp_path / "runs" / "other")))
        assert bad.exit_code == 2 and "another --out" in bad.stderr, bad.output

        k2 = Proc("k-resumed", consume_args(cache, tmp_path, "k", steps, "--save-every", "2", "--resume"), tmp_path)
        procs.append(k2)
        k2.expect(0)
        prod.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()
    check_lineage(cache, "k", ckpt_step=0, killed_after=2, steps=steps)
    reg = registry.read(layout, "k")
    assert (reg.state, reg.cursor, reg.checkpoint_cursor) == ("completed", steps * BATCH, steps * BATCH)
    rows = [r for r in read_metrics(run / "metrics.csv") if r[1] == "train/loss"]
    assert [r[0] for r in rows] == list(range(1, steps + 1))
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004"]


def test_regression_resume_refuses_a_checkpoint_file_that_does_not_match_its_digest(tmp_path, tiny_target):
    """A checkpoint file corrupted on disk (a byte flipped inside a tensor's data, which safetensors
    loads without complaint) was resumed from, and the run trained on from garbage. ``--resume`` now checks every
    file of the checkpoint against the digests recorded when it was written, before registering: one line naming
    the file and the expected and actual digest, exit 1, the registration untouched. A checkpoint that records no
    digests (written before they were) still resumes, with one warning that it is unverified."""
    from artcache.hashing import digest_file
    from tests.support.ckpt_damage import flip_byte, truncate

    cache = tmp_path / "cache"
    layout = CacheLayout(cache)
    prod = start_producer(cache, tmp_path, tiny_target)
    procs = [prod]
    main = __import__("artcache.app.cli", fromlist=["main"]).main
    try:
        c = Proc("c", consume_args(cache, tmp_path, "c", 2, "--lr-total-steps", "4"), tmp_path)
        procs.append(c)
        c.expect(0)
        reg = registry.read(layout, "c")
        step = tmp_path / "runs" / "c" / "checkpoints" / "step-00000002"
        rec = read_state(step).digests
        resume = consume_args(cache, tmp_path, "c", 4, "--lr-total-steps", "4", "--resume")
        for kind, damage in (("model.safetensors", flip_byte), ("optimizer.safetensors", flip_byte),
                             ("rng.safetensors", flip_byte), ("state.json", flip_byte),
                             ("model.safetensors", truncate)):
            good = (step / kind).read_bytes()
            damage(step / kind)
            bad = CliRunner().invoke(main, resume)
            errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("artcache: error:")]
            assert bad.exit_code == 1 and len(errors) == 1, (kind, bad.output)
            assert f"CheckpointCorrupt: checkpoint file {step / kind} does not match" in errors[0], errors
            if kind == "state.json":
                assert f"expected xxh3_128 {rec.state}, actual " in errors[0]
            else:
                want, size = rec.files[kind], (step / kind).stat().st_size
                assert f"expected xxh3_128 {want.digest} ({want.size:,} B), actual {digest_file(step / kind)} " \
                    f"({size:,} B)" in errors[0], errors
            assert registry.read(layout, "c") == reg  # refused before registering
            (step / kind).write_bytes(good)
        # an older checkpoint (no digests recorded) resumes, said once to be unverified
        doc = json.loads((step / "state.json").read_text())
        del doc["digests"]
        (step / "state.json").write_text(json.dumps(doc, indent=1))
        old = Proc("c-resumed", resume, tmp_path)
        procs.append(old)
        old.expect(0)
        assert old.text().count("records no content digests") == 1 and "used unverified" in old.text()
        prod.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()
    reg = registry.read(layout, "c")
    assert (reg.state, reg.cursor, reg.checkpoint_cursor) == ("completed", 4 * BATCH, 4 * BATCH)
    assert read_state(tmp_path / "runs" / "c" / "checkpoints" / "step-00000004").digests is not None


def test_regression_completed_id_reused_with_a_new_out_is_refused(tmp_path, tiny_target):
    """A completed consumer ``--id`` run again without ``--resume`` under a new ``--out`` started over from cursor 0
    without a word (the root forgot the first run's cursor). Now one line names the id, the earlier run directory
    and how to go on; the registration is untouched and nothing is created under the new ``--out``."""
    cache = tmp_path / "cache"
    layout = CacheLayout(cache)
    prod = start_producer(cache, tmp_path, tiny_target)
    procs = [prod]
    main = __import__("artcache.app.cli", fromlist=["main"]).main
    try:
        c = Proc("c", consume_args(cache, tmp_path, "c", 2), tmp_path)
        procs.append(c)
        c.expect(0)
        reg = registry.read(layout, "c")
        assert (reg.state, reg.checkpoint_cursor, reg.out_dir) == ("completed", 4, str(tmp_path / "runs" / "c"))
        new = tmp_path / "runs" / "c-new"
        bad = CliRunner().invoke(main, [*consume_args(cache, tmp_path, "c", 4), "--out", str(new)])
        errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("artcache: error:")]
        assert bad.exit_code == 2 and len(errors) == 1 and "Traceback" not in bad.output, bad.output
        assert (f"consumer id 'c' already ran on this cache root (completed, checkpoint at cursor 4 in "
                f"{tmp_path / 'runs' / 'c'})" in errors[0]), errors
        assert f"pass --resume --out {tmp_path / 'runs' / 'c'} to continue it, or choose another --id" in errors[0]
        assert registry.read(layout, "c") == reg and not new.exists()
        prod.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()


def test_refuse_reused_id_only_when_the_earlier_run_can_be_continued(tmp_path):
    """The reuse check refuses only a fresh run that would forget a recorded checkpoint still on disk elsewhere:
    no registration, none recorded, the same run directory (its own check) or an earlier one that is gone pass."""
    from artcache.errors import ConfigError
    from artcache.trainers.consumer.restore import refuse_reused_id

    earlier = tmp_path / "runs" / "c"
    (earlier / "checkpoints" / "step-00000002").mkdir(parents=True)
    (earlier / "checkpoints" / "step-00000002" / "state.json").write_text("{}")
    reg = registry.Registration(consumer_id="c", draft="dflash", state="completed", checkpoint_cursor=4,
                                out_dir=str(earlier))
    refuse_reused_id("c", None, tmp_path / "new")
    refuse_reused_id("c", registry.Registration(consumer_id="c", draft="dflash", state="failed"), tmp_path / "new")
    refuse_reused_id("c", reg, earlier)
    with pytest.raises(ConfigError, match="already ran on this cache root"):
        refuse_reused_id("c", reg, tmp_path / "new")
    legacy = registry.Registration(consumer_id="c", draft="dflash", state="cancelled", checkpoint_cursor=4)
    with pytest.raises(ConfigError, match="in a run directory its registration does not record"):
        refuse_reused_id("c", legacy, tmp_path / "new")
    import shutil

    shutil.rmtree(earlier)
    refuse_reused_id("c", reg, tmp_path / "new")
