"""``artcache fsck``: each kind of problem is found, reported without --fix (exit 1, nothing changed), and
repaired with --fix (exit 0); nothing belonging to a live process is touched; ``artcache inspect`` exits
nonzero when an accounting invariant fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache import journal as J
from artcache import leases, registry, store
from artcache.app.cli import main
from artcache.fingerprint import PlanFingerprints
from artcache.fsck import fsck
from artcache.layout import CacheLayout
from tests.support import crash_child as K
from tests.support.procs import dead_pid, foreign_token, token

PLAN = K.FakePlan()
FP = PlanFingerprints(K.CONTRACT, PLAN)


@pytest.fixture()
def layout(layout) -> CacheLayout:
    """conftest's fake root, plus a plan directory."""
    _plan_dir(layout)
    return layout


def _plan_dir(layout: CacheLayout) -> None:
    """A real (tiny) plan directory for the settings' plan id, so the plan check passes."""
    import torch

    from artcache.plan import Plan, PlanSpec, compute_plan_id

    spec = PlanSpec(dataset="synthetic", max_length=16, max_samples=1)
    plan_id, inputs = compute_plan_id(spec, "synthetic-v1", "none", "none")
    prov = {"format_version": 1, "plan_id": plan_id, "id_inputs": inputs, "counts": {"kept": 1}}
    Plan(plan_id, torch.zeros(16, dtype=torch.int32), torch.ones(16, dtype=torch.uint8),
         torch.tensor([0, 16]), prov).save(layout.plans)
    import msgspec

    from artcache.settings import init_settings

    layout.settings.unlink()
    init_settings(layout, msgspec.structs.replace(K.settings(), plan_id=plan_id))


def publish(layout: CacheLayout, pos: int) -> str:
    fp = FP(pos)
    store.publish(layout, fp, K.CONTRACT, K.fake_capture(PLAN.sample(pos)), durable=False, verify_tokens=True)
    return fp


def kinds(rep) -> list[str]:
    return sorted(p.kind for p in rep.problems)


def test_clean_root_is_clean(layout):
    publish(layout, 0)
    rep = fsck(layout.root)
    assert rep.problems == [] and rep.ok
    assert rep.checked["artifacts"] == 1


def test_orphan_temp_files_only_of_dead_writers(layout):
    dead = token(dead_pid())
    names = {"dead": f"{dead}.aa11.part", "dead_evict": f"{dead}.bb22.evict",
             "live": f"{token(os.getpid())}.cc33.part", "other_host": f"{foreign_token()}.dd44.part",
             "legacy": f"{os.uname().nodename}.{dead_pid()}.ee55.part", "junk": "junk"}
    for n in names.values():
        (layout.tmp / n).write_bytes(b"partial")
    (layout.plans / f".tmp-{'a' * 12}-{dead}.{'b' * 8}").mkdir()
    (layout.plans / f".tmp-{'a' * 12}-{os.uname().nodename}-{dead_pid()}-{'b' * 8}").mkdir()  # legacy: kept
    rep = fsck(layout.root)
    assert kinds(rep) == ["orphan-temp"] * 3 and not rep.ok
    assert len(os.listdir(layout.tmp)) == 6  # report only
    rep = fsck(layout.root, fix=True)
    assert rep.ok and all(p.fixed for p in rep.problems)
    # another host's or a pre-identity name's pid is never checked (migration rule): left alone
    assert sorted(os.listdir(layout.tmp)) == sorted([names[k] for k in ("live", "other_host", "legacy", "junk")])
    assert len([n for n in os.listdir(layout.plans) if n.startswith(".tmp-")]) == 1
    assert any("live writers" in n for n in rep.notes) and any("other hosts" in n for n in rep.notes)


def test_bad_artifact_is_quarantined(layout):
    fp = publish(layout, 1)
    good = publish(layout, 2)
    path = layout.object_path(fp)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    rep = fsck(layout.root)
    assert kinds(rep) == ["bad-artifact"] and "content hash" in rep.problems[0].detail
    assert path.exists()  # not without --fix
    rep = fsck(layout.root, fix=True)
    assert rep.ok and not path.exists() and len(os.listdir(layout.quarantine)) == 1
    assert store.verify(layout, good, K.CONTRACT) is None


def test_artifact_with_another_samples_tokens_is_bad(layout):
    fp = FP(3)
    header, chunks = store._encode(fp, K.CONTRACT, K.fake_capture(PLAN.sample(4)))
    layout.object_path(fp).parent.mkdir(exist_ok=True)
    layout.object_path(fp).write_bytes(header + b"".join(bytes(c) for c in chunks))
    rep = fsck(layout.root)
    assert kinds(rep) == ["bad-artifact"] and "token ids" in rep.problems[0].detail


def test_misplaced_artifact_moved_into_place(layout):
    fp = publish(layout, 5)
    wrong = layout.objects / ("00" if fp[:2] != "00" else "01")
    wrong.mkdir(exist_ok=True)
    os.replace(layout.object_path(fp), wrong / f"{fp}.safetensors")
    assert store.list_objects(layout) == {}
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["misplaced-artifact"] and rep.ok
    assert store.verify(layout, fp, K.CONTRACT) is None and list(wrong.iterdir()) == []


def test_stale_failure_marker_removed(layout):
    fp = publish(layout, 6)
    layout.failure_path(fp).write_text(json.dumps({"fingerprint": fp, "attempts": 3}))
    other = FP(7)
    layout.failure_path(other).write_text("{}")  # not published: a real give-up, kept
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["stale-failure"] and rep.ok
    assert not layout.failure_path(fp).exists() and layout.failure_path(other).exists()


def test_dead_consumer_fenced_and_its_leases_expired_journaled(layout):
    dead = dead_pid()
    registry.register(layout, registry.Registration(consumer_id="gone", draft="d", cursor=6, pid=dead))
    registry.register(layout, registry.Registration(consumer_id="live", draft="d", pid=os.getpid()))
    fp = publish(layout, 8)
    mine = leases.acquire(layout, fp, "live")
    theirs = f"{fp}~gone~{token(dead)}~abcd1234"
    (layout.leases / theirs).touch()
    rep = fsck(layout.root)
    assert kinds(rep) == ["dead-consumer", "dead-lease"]
    assert registry.read(layout, "gone").state == "running"
    rep = fsck(layout.root, fix=True)
    assert rep.ok
    reg = registry.read(layout, "gone")
    assert reg.state == "failed" and reg.cursor == 6  # the committed cursor is kept for a restart
    assert sorted(os.listdir(layout.leases)) == [mine]
    evs = J.read_events(layout.journal).events
    assert [(type(e).__name__, getattr(e, "reason", "")) for e in evs] == [
        ("Fence", f"fsck: process {dead} is gone (this host)"), ("LeaseExpire", "holder-dead")]
    # a restart with the same id resumes from the committed cursor
    again = registry.register(layout, registry.Registration(consumer_id="gone", draft="d", cursor=reg.cursor,
                                                            pid=os.getpid()))
    assert again.state == "running" and again.cursor == 6 and again.generation == reg.generation + 1


def test_other_host_consumer_expired_by_heartbeat_progress(layout):
    """A registration whose pid cannot be checked here (another host) is watched for the
    root's heartbeat timeout on fsck's own clock: a moving counter is live (however old its wall-clock
    heartbeat looks), a still one is dead; a shorter watch judges nobody."""
    import threading

    import msgspec

    from artcache.hashing import sealed
    from artcache.liveness import from_token

    far = registry.register(layout, registry.Registration(consumer_id="far", draft="d",
                                                          identity=from_token(foreign_token())))
    path = layout.consumer_path("far")
    stale = msgspec.structs.replace(registry.read(layout, "far"), heartbeat=1.0)  # "decades ago" by our clock
    path.write_bytes(msgspec.json.encode(stale))
    settings = msgspec.json.decode(layout.settings.read_bytes())
    settings["heartbeat_timeout_s"] = 1.0
    layout.settings.write_bytes(msgspec.json.encode(sealed({k: v for k, v in settings.items() if k != "digests"})))
    handle = registry.ConsumerHandle(layout, far)
    stop = threading.Event()
    beater = threading.Thread(target=lambda: [handle.heartbeat() for _ in iter(lambda: stop.wait(0.2), True)])
    beater.start()
    try:
        assert fsck(layout.root, fix=True).problems == []  # its counter moved while watched: live
    finally:
        stop.set()
        beater.join()
    rep = fsck(layout.root, fix=True, observe_s=0.5)  # shorter than the timeout: proves nothing
    assert rep.problems == [] and any("not judged" in n for n in rep.notes)
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["dead-consumer"] and registry.read(layout, "far").state == "expired"
    assert "no heartbeat progress" in rep.problems[0].detail


def test_regression_fsck_fix_leaves_the_users_own_links_alone(layout, tmp_path):
    """With a pre-existing directory used as --cache, `fsck --fix` unlinked the user's own
    symlinks in it, in foreign subdirectories too. Only artcache's part of the root is looked into."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, layout.root / "my-link")
    (layout.root / "my-project").mkdir()
    os.symlink(victim, layout.root / "my-project" / "data-link")
    os.symlink(victim, layout.tmp / "planted")  # inside artcache's part: still found
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["symlink"] and rep.problems[0].path == os.path.join("tmp", "planted")
    assert os.path.islink(layout.root / "my-link") and os.path.islink(layout.root / "my-project" / "data-link")
    assert any("not artcache's" in n for n in rep.notes)


def test_regression_give_up_marker_of_a_gone_producer_is_superseded(layout):
    """failed/<fp>.json of an earlier producer outlived it and failed the next run's first
    consumer; fsck called the root clean. A marker whose producer is gone (same host id) is reported."""
    fp = FP(7)
    layout.failure_path(fp).write_text(json.dumps({"fingerprint": fp, "attempts": 3, "error": "old",
                                                   "producer": token(dead_pid())}))
    live = FP(8)
    layout.failure_path(live).write_text(json.dumps({"fingerprint": live, "attempts": 3, "error": "now",
                                                     "producer": token(os.getpid())}))
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["stale-failure"] and "superseded" in rep.problems[0].detail
    assert not layout.failure_path(fp).exists() and layout.failure_path(live).exists()


def test_bad_registration_moved_aside(layout):
    (layout.consumers / "x.json").write_text("{not json")
    registry.register(layout, registry.Registration(consumer_id="y", draft="d", pid=os.getpid()))
    os.replace(layout.consumer_path("y"), layout.consumers / "z.json")  # names another id
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["bad-registration", "bad-registration"] and rep.ok
    assert os.listdir(layout.consumers) == []


def test_stale_soft_lock_removed_flock_files_kept(layout):
    dead = dead_pid()
    (layout.locks / "fp-0001.lock").touch()  # a flock lock file: never deleted
    (layout.locks / "consumer-a.lock").write_text(f"{dead}\n{os.uname().nodename}\n")  # a marker lock
    (layout.locks / "consumer-b.lock").write_text(f"{os.getpid()}\n{os.uname().nodename}\n")  # held by us
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["stale-lock"] and rep.ok
    assert sorted(os.listdir(layout.locks)) == ["consumer-b.lock", "fp-0001.lock"]


def test_symlinks_reported_and_unlinked_never_followed(layout, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    fp = FP(9)
    (layout.objects / fp[:2]).mkdir(exist_ok=True)
    os.symlink(victim / "keep.txt", layout.object_path(fp))
    os.symlink(victim, layout.objects / "zz")
    rep = fsck(layout.root)
    assert kinds(rep) == ["symlink", "symlink"]
    rep = fsck(layout.root, fix=True)
    assert rep.ok
    assert (victim / "keep.txt").read_text() == "precious"
    assert not os.path.lexists(layout.object_path(fp)) and not os.path.lexists(layout.objects / "zz")


def test_symlinked_subdir_is_replaced_by_a_real_directory(layout, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{token(dead_pid())}.ee55.part").write_text("not ours")
    os.rename(layout.tmp, tmp_path / "old-tmp")
    os.symlink(elsewhere, layout.tmp)
    rep = fsck(layout.root)
    assert kinds(rep) == ["symlink"]  # and nothing under the link was looked at
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["missing-dir", "symlink"] and rep.ok
    assert layout.tmp.is_dir() and not layout.tmp.is_symlink()
    assert len(os.listdir(elsewhere)) == 1  # the link's target was never touched
    layout.require()


def test_bad_plan_is_reported_not_fixed(layout):
    from artcache.settings import load_settings

    plan_dir = layout.plan_dir(load_settings(layout).plan_id)
    (plan_dir / "plan.json").write_text("{}")
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["bad-plan"] and not rep.problems[0].fixable and not rep.ok


def test_regression_a_damaged_plan_is_found_by_fsck_and_refused_by_every_load(layout):
    """Flipping 16 bytes near the end of plans/<id>/plan.safetensors (its loss masks) went unnoticed: fsck said
    clean and a consumer trained on the damaged tokens (exit 0). plan.json now records the digest of the
    tensors file and of itself; every load checks both, naming the file, and fsck reports the plan."""
    import pytest

    from artcache.errors import DataError
    from artcache.plan import Plan
    from artcache.settings import load_settings

    plan_dir = layout.plan_dir(load_settings(layout).plan_id)
    assert Plan.load(plan_dir).verified and fsck(layout.root).ok
    path = plan_dir / "plan.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-20:-4] = bytes(b ^ 0x01 for b in raw[-20:-4])
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"is damaged \(plan.safetensors does not match its recorded digest"):
        Plan.load(plan_dir)
    rep = fsck(layout.root)
    assert kinds(rep) == ["bad-plan"] and "plan.safetensors does not match" in rep.problems[0].detail
    # plan.json itself: a changed value (the epoch seed decides the order of every later epoch)
    path.write_bytes(bytes(b ^ 0x01 if len(raw) - 20 <= i < len(raw) - 4 else b for i, b in enumerate(raw)))
    assert Plan.load(plan_dir).verified
    doc = json.loads((plan_dir / "plan.json").read_text())
    doc["epoch_order"] = {**doc.get("epoch_order", {}), "seed": 7}
    (plan_dir / "plan.json").write_text(json.dumps(doc, indent=2))
    with pytest.raises(DataError, match=r"plan.json: its content does not match its recorded digest"):
        Plan.load(plan_dir)
    assert kinds(fsck(layout.root)) == ["bad-plan"]


def test_regression_a_damaged_artcache_json_is_refused_and_reported(layout):
    """artcache.json (the capture contract and plan id every process uses) carried no digest: a changed value that
    stayed valid JSON was used as written. It records the digest of its content now: every load refuses a
    mismatch in one line, and fsck reports it (and leaves artifacts unjudged: their contract is in doubt)."""
    import pytest

    from artcache.errors import CacheRootError
    from artcache.settings import load_settings

    publish(layout, 0)
    assert load_settings(layout).digests is not None
    doc = json.loads(layout.settings.read_text())
    doc["contract"]["max_length"] += 1
    layout.settings.write_text(json.dumps(doc))
    with pytest.raises(CacheRootError, match="artcache.json is damaged: its content does not match its recorded"):
        load_settings(layout)
    rep = fsck(layout.root, fix=True)
    assert kinds(rep) == ["bad-settings"] and not rep.ok and store.exists(layout, FP(0))
    r = CliRunner().invoke(main, ["fsck", "--cache", str(layout.root)])
    assert r.exit_code == 1 and "MANUAL  bad-settings" in r.stdout
    # a root initialised before roots recorded a digest still loads, unverified, and fsck says so
    del doc["digests"]
    doc["contract"]["max_length"] -= 1
    layout.settings.write_text(json.dumps(doc))
    assert load_settings(layout).digests is None
    rep = fsck(layout.root)
    assert rep.ok and any("records no digest" in n for n in rep.notes)


def test_not_a_root(tmp_path):
    from artcache.errors import CacheRootError

    with pytest.raises(CacheRootError):
        fsck(tmp_path)


# ---- command line ---------------------------------------------------------------------------------------

def test_cli_exit_codes_and_json(layout):
    (layout.tmp / f"{token(dead_pid())}.ff66.part").write_bytes(b"x")
    r = CliRunner().invoke(main, ["fsck", "--cache", str(layout.root)])
    assert r.exit_code == 1 and "PROBLEM orphan-temp" in r.stdout and "--fix" in r.stdout
    r = CliRunner().invoke(main, ["fsck", "--cache", str(layout.root), "--fix", "--json"])
    assert r.exit_code == 0
    out = json.loads(r.stdout)
    assert [p["kind"] for p in out["problems"]] == ["orphan-temp"] and out["problems"][0]["fixed"]
    r = CliRunner().invoke(main, ["fsck", "--cache", str(layout.root)])
    assert r.exit_code == 0 and "clean" in r.stdout


def test_cli_not_a_root_is_bad_input(tmp_path):
    r = CliRunner().invoke(main, ["fsck", "--cache", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not an initialised cache root" in r.stderr


def test_inspect_exits_nonzero_when_an_invariant_fails(layout):
    with J.JournalWriter(layout.journal_path("producer", "p")) as j:
        j.emit(J.ProducerStart(producer="p", pid=1, contract_id="c", plan_id="p"))
        j.emit(J.Capture(producer="p", fp=FP(0), positions=[0], tokens=6))  # never published nor failed
        j.emit(J.ProducerStop(producer="p", reason="done"))
    r = CliRunner().invoke(main, ["inspect", "--cache", str(layout.root)])
    assert r.exit_code == 3 and "captures 1 != publications 0" in r.stdout
    r = CliRunner().invoke(main, ["inspect", "--cache", str(layout.root), "--json"])
    assert r.exit_code == 3 and json.loads(r.stdout)["violations"]
    with J.JournalWriter(layout.journal_path("producer", "q")) as j:  # now it adds up
        j.emit(J.Publish(producer="q", fp=FP(0), nbytes=1))
    assert CliRunner().invoke(main, ["inspect", "--cache", str(layout.root)]).exit_code == 0


def test_fsck_on_a_root_path_it_is_given_relative(layout, monkeypatch):
    monkeypatch.chdir(layout.root.parent)
    assert fsck(Path(layout.root.name)).ok


def test_regression_an_unparsable_artcache_json_or_plan_json_is_a_finding(layout):
    """An artcache.json truncated so that it was no longer valid JSON stopped fsck with ``error: ... artcache.json
    is invalid: Input data was truncated`` (exit 2, as for bad input), while a valid but tampered one was reported
    as ``MANUAL bad-settings`` (exit 1). A damaged root is a finding: both are bad-settings, exit 1; an unparsable
    plan.json is bad-plan, exit 1."""
    from artcache.settings import load_settings

    plan_dir = layout.plan_dir(load_settings(layout).plan_id)
    raw = layout.settings.read_bytes()
    layout.settings.write_bytes(raw[: len(raw) // 2])
    rep = fsck(layout.root)
    assert kinds(rep) == ["bad-settings"] and not rep.ok and "truncated" in rep.problems[0].detail
    r = CliRunner().invoke(main, ["fsck", "--cache", str(layout.root)])
    assert r.exit_code == 1 and "MANUAL  bad-settings" in r.stdout, r.output
    layout.settings.write_bytes(raw)
    text = (plan_dir / "plan.json").read_text()
    (plan_dir / "plan.json").write_text(text[: len(text) // 2])
    assert kinds(fsck(layout.root)) == ["bad-plan"]
    r = CliRunner().invoke(main, ["fsck", "--cache", str(layout.root)])
    assert r.exit_code == 1 and "MANUAL  bad-plan" in r.stdout, r.output


def test_regression_a_read_only_root_refusal_names_inspect_and_fsck(layout, tmp_path):
    """On a read-only root a consumer's refusal (its journal or a lock cannot be opened for writing) said the root
    "can only be read with `artcache inspect`", though ``artcache fsck`` (without --fix) also works read-only.
    Both refusals name both commands, and fsck does check such a root. The root is bind-mounted read-only in a
    private mount namespace (needs root and unshare)."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    root = str(layout.root)
    ro = f"mount --bind {root} {root} && mount -o remount,bind,ro {root} {root}"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", ro], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.decode()[-200:]}")
    code = ("import sys\nfrom artcache import journal as J\nfrom artcache.layout import CacheLayout\n"
            "from artcache.locking import cache_lock\nfrom artcache.errors import NotWritable\n"
            "from pathlib import Path\nlay = CacheLayout(Path(sys.argv[1]))\n"
            "for opener in (lambda: J.JournalWriter(lay.journal_path('consumer', 'c')),\n"
            "               lambda: cache_lock(lay.locks / 'new.lock', timeout=0).acquire()):\n"
            "    try:\n        opener()\n    except NotWritable as exc:\n        print(exc)\n")
    script = f'{ro} && "$0" -c "$1" {root} && exec "$0" -m artcache fsck --cache {root}'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, code], capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("cannot open")]
    assert len(lines) == 2 and "journal" in lines[0] and "lock file" in lines[1], proc.stdout + proc.stderr
    for line in lines:
        assert "`artcache inspect` or `artcache fsck` (without --fix)" in line, line
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stdout + proc.stderr


def test_regression_a_damaged_middle_journal_line_is_a_problem_not_a_torn_line(layout):
    """A journal whose middle line was garbage was called "clean" by fsck (a note: "a process killed mid-write"),
    while inspect exited 3 with an invariant violation that did not say why. Each process appends only to its
    own file, so a kill tears only a file's last line: a bad line with complete lines after it is damage. fsck
    reports it (file and line; not clean) and inspect's first violation names it."""
    from artcache.accounting import account
    from artcache.fsck import format_report

    path = layout.journal / "producer-p-1.jsonl"
    with J.JournalWriter(path) as w:
        for n in range(3):
            w.emit(J.Evict(producer="p", fp=f"{n:064x}", nbytes=1))
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"garbage that is no event\n" + lines[2])
    rep = fsck(layout.root)
    assert not rep.ok and [(p.kind, p.path) for p in rep.problems] == [("damaged-journal", "journal/" + path.name)]
    assert "line 2 is not a journal event" in rep.problems[0].detail and "clean" not in format_report(rep)
    acc = account(layout)
    assert acc.violations and acc.violations[0].startswith(f"journal {path.name} line 2 is damaged")
    assert acc.cache.torn_journal_lines == 0
    with open(path, "ab") as f:  # a torn last line (a kill) is still only a note
        f.write(b'{"kind":"evict","producer":"p","fp":"')
    rep = fsck(layout.root)
    assert [p.kind for p in rep.problems] == ["damaged-journal"] and any("1 torn journal line" in n for n in rep.notes)
