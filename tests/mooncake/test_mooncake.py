"""Mooncake Store as the payload backend, on loopback (marker ``mooncake``; ``.ci/mooncake-lane`` installs
``mooncake-transfer-engine-non-cuda`` and ``libibverbs1``; without them every test here skips, saying so).

The payload protocol (artcache/payload_mooncake.py): publish puts the payload hard-pinned then renames the
manifest into place; a reader accepts only a payload matching its manifest's hash; eviction removes
manifest and payload ("not found" is success, a read lease is waited out); a killed writer's half-put key
is taken over; the bytes live in a holder process (a producer's exit or kill loses nothing); a master
restart turns the forgotten keys into misses; a full store is back-pressure. Then real processes: a
producer SIGKILLed mid-run and restarted, and an ``artcache run`` with Mooncake payloads whose ``artcache
inspect`` invariants hold with captures per consumed position <= 1.05.

The crash trials and the concurrency races run against this backend too (their ``[mooncake]`` cases in
tests/reliability/test_crash_trials.py and tests/reliability/test_concurrency.py). Deadlines only bound a hang.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from artcache import journal as J
from artcache import payload, store
from artcache.errors import ArtifactMissing, IntegrityError, PayloadUnavailable, PublishError
from artcache.fingerprint import PlanFingerprints
from artcache.hashing import digest_bytes
from artcache.layout import CacheLayout
from artcache.payload import new_spec, remote_for
from artcache.payload_mooncake import OBJECT_NOT_FOUND, Manifest
from artcache.settings import init_settings, load_settings
from tests.support import crash_child as K
from tests.support.mooncake_store import MooncakeService, require_mooncake
from tests.support.procs import REPO, Proc, child_env, inspect_json, wait_until

PLAN = K.FakePlan()
FP_OF = PlanFingerprints(K.CONTRACT, PLAN)


@pytest.fixture(autouse=True)
def _mooncake_installed():
    require_mooncake()


def mooncake_root(tmp_path: Path, url: str, name: str = "root") -> CacheLayout:
    lay = CacheLayout(tmp_path / name)
    lay.create()
    init_settings(lay, msgspec.structs.replace(K.settings(), payload=new_spec(url)))
    return lay


def publish(lay: CacheLayout, i: int) -> int:
    return store.publish(lay, FP_OF(i), K.CONTRACT, K.fake_capture(PLAN.sample(i)), verify_tokens=True)


def payload_of(lay: CacheLayout, fp: str) -> int:
    """Mooncake's get_size of ``fp``'s key: its size, or a negative code (-704: not there)."""
    backend = remote_for(lay)
    return backend.client.get_size(backend.key(fp))


def read_until_settled(lay: CacheLayout, fp: str, timeout_s: float = 30.0):
    """Read as a consumer does: PayloadUnavailable (the store cannot serve it just now, e.g. this client's
    first call after a master restart) is retried; returns the artifact or raises ArtifactMissing."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return store.read(lay, fp, K.CONTRACT)
        except PayloadUnavailable:
            assert time.monotonic() < deadline, f"{fp} stayed unavailable for {timeout_s:.0f}s"
            time.sleep(0.2)


def settle(lay: CacheLayout, timeout_s: float = 20.0) -> float:
    """Run the producer's housekeeping until no ``.pending`` marker is left; the seconds it took."""
    t0 = time.monotonic()
    while list(lay.objects.glob("*/*.pending")):
        assert time.monotonic() - t0 < timeout_s, sorted(p.name for p in lay.objects.glob("*/*.pending"))
        store.maintain(lay)
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.fixture
def service_factory(tmp_path):
    """Own Mooncake services for tests that restart or fill them (closed after the test)."""
    made: list[MooncakeService] = []

    def make(**kw) -> MooncakeService:
        made.append(MooncakeService(tmp_path / f"svc{len(made)}", **kw))
        return made[-1]

    yield make
    payload.close_all()
    for svc in made:
        svc.close()


# ---- publish and read ------------------------------------------------------------------------------------

def test_publish_puts_the_posix_bytes_under_the_fingerprint_and_a_manifest(tmp_path, mooncake_service):
    """The payload is byte for byte the artifact a POSIX root would hold; the root keeps only the manifest."""
    posix = CacheLayout(tmp_path / "posix")
    posix.create()
    init_settings(posix, K.settings())
    lay = mooncake_root(tmp_path, mooncake_service.url)
    fp = FP_OF(5)
    n = publish(lay, 5)
    assert publish(posix, 5) == n
    file_bytes = posix.object_path(fp).read_bytes()
    names = sorted(p.name for p in lay.objects.rglob("*") if p.is_file())
    assert names == [f"{fp}.manifest"], names  # no .safetensors, no intent marker left
    m = msgspec.json.decode((lay.objects / fp[:2] / f"{fp}.manifest").read_bytes(), type=Manifest)
    backend = remote_for(lay)
    assert m.key == f"{load_settings(lay).payload.namespace}/{fp}" and m.nbytes == n == len(file_bytes)
    assert m.payload_hash == digest_bytes(file_bytes) and m.epoch == backend.epoch
    assert m.tensors["hidden_states"].shape == [len(PLAN.sample(5).input_ids), 2, K.HIDDEN]
    assert m.tensors["hidden_states"].dtype == "BF16" and m.tensors["input_ids"].dtype == "I32"
    buf = torch.empty(n, dtype=torch.uint8)
    assert backend.client.get_into(m.key, buf) == n and bytes(buf.numpy()) == file_bytes
    art = store.read(lay, fp, K.CONTRACT, verify_tokens=True)
    want = K.fake_capture(PLAN.sample(5))
    assert torch.equal(art.hidden_states, want["hidden_states"]) and torch.equal(art.input_ids, want["input_ids"])
    assert store.list_objects(lay) == {fp: n} and store.exists(lay, fp)
    assert store.verify(lay, fp, K.CONTRACT) is None


def test_reader_accepts_only_a_payload_matching_its_manifest(tmp_path, mooncake_service):
    """Another artifact's bytes under the key (a stale or foreign payload) fail the manifest's payload hash:
    the read raises IntegrityError, the manifest goes to quarantine/ and the key is removed."""
    lay = mooncake_root(tmp_path, mooncake_service.url)
    fp0, fp1 = FP_OF(0), FP_OF(1)
    publish(lay, 0)
    n1 = publish(lay, 1)
    backend = remote_for(lay)
    other = torch.empty(n1, dtype=torch.uint8)
    assert backend.client.get_into(backend.key(fp1), other) == n1
    stage = backend.client.staging(n1)
    stage[:n1] = other
    assert backend.client.upsert_from(backend.key(fp0), stage, n1) == 0
    with pytest.raises(IntegrityError, match="payload"):
        store.read(lay, fp0, K.CONTRACT)
    assert not store.exists(lay, fp0) and [p.name.split(".")[0] for p in lay.quarantine.iterdir()] == [fp0]
    settle(lay)
    assert payload_of(lay, fp0) == OBJECT_NOT_FOUND
    assert store.read(lay, fp1, K.CONTRACT).nbytes == n1  # the other artifact is untouched


def test_regression_tampered_manifest_hash_is_refused(tmp_path, mooncake_service):
    """A manifest whose payload hash does not match the payload is never accepted (not even once)."""
    lay = mooncake_root(tmp_path, mooncake_service.url)
    fp = FP_OF(2)
    publish(lay, 2)
    path = lay.objects / fp[:2] / f"{fp}.manifest"
    m = msgspec.json.decode(path.read_bytes(), type=Manifest)
    path.write_bytes(msgspec.json.encode(msgspec.structs.replace(m, payload_hash="0" * 32)))
    assert "payload hash" in store.verify(lay, fp, K.CONTRACT)
    with pytest.raises(IntegrityError):
        store.read(lay, fp, K.CONTRACT)
    assert not store.exists(lay, fp)


# ---- eviction --------------------------------------------------------------------------------------------

def test_eviction_removes_payload_and_manifest_and_not_found_is_success(tmp_path, mooncake_service):
    lay = mooncake_root(tmp_path, mooncake_service.url)
    fp = FP_OF(3)
    n = publish(lay, 3)
    assert payload_of(lay, fp) == n
    assert store.remove(lay, fp) == n
    settle(lay)
    assert not store.exists(lay, fp) and payload_of(lay, fp) == OBJECT_NOT_FOUND
    assert store.remove(lay, fp) == 0  # already gone
    n = publish(lay, 3)
    backend = remote_for(lay)
    assert backend.client.remove(backend.key(fp)) == 0  # Mooncake lost it under us
    assert store.remove(lay, fp) == n  # "not found" is success
    assert list(lay.objects.glob("*/*")) == []


def test_read_lease_is_waited_out_not_an_error(service_factory, tmp_path):
    """A read grants Mooncake's read lease (here 3 s; 10 s by default), which blocks the remove (-706):
    eviction withdraws the manifest at once and removes the key once the lease has run out."""
    svc = service_factory(lease_ms=3000)
    lay = mooncake_root(tmp_path, svc.url)
    fp = FP_OF(4)
    n = publish(lay, 4)
    store.read(lay, fp, K.CONTRACT)
    t0 = time.monotonic()
    assert store.remove(lay, fp) == n
    assert not store.exists(lay, fp) and payload_of(lay, fp) == n  # withdrawn; the bytes wait for the lease
    with pytest.raises(ArtifactMissing):
        store.read(lay, fp, K.CONTRACT)
    settle(lay)
    waited = time.monotonic() - t0
    assert payload_of(lay, fp) == OBJECT_NOT_FOUND
    assert 1.5 < waited < 15, f"the key went after {waited:.1f}s; the lease was 3 s"


def test_a_closing_producer_waits_out_its_deferred_removals(service_factory, tmp_path):
    """close() (run at a producer's exit) finishes removals a read lease deferred: nothing it evicted stays."""
    svc = service_factory(lease_ms=2000)
    lay = mooncake_root(tmp_path, svc.url)
    fp = FP_OF(6)
    publish(lay, 6)
    store.read(lay, fp, K.CONTRACT)
    store.remove(lay, fp)
    assert list(lay.objects.glob("*/*.pending"))
    remote_for(lay).close()
    assert list(lay.objects.glob("*/*.pending")) == []
    assert payload_of(lay, fp) == OBJECT_NOT_FOUND


# ---- writers that die ------------------------------------------------------------------------------------

_HALF_PUT = """
import os, sys, torch
from artcache.payload_mooncake import MooncakeClient
c = MooncakeClient(sys.argv[1])
buf = c.staging(int(sys.argv[3]))
print("putting", flush=True)
c.upsert_from(sys.argv[2], buf, int(sys.argv[3]))
print("put done", flush=True)
"""


def test_killed_writers_half_put_key_is_taken_over(service_factory, tmp_path):
    """A writer SIGKILLed mid-put leaves its key unreadable (-703) for ~30 s; the next publish of the
    fingerprint takes it over (upsert) at once and the artifact reads back whole."""
    svc = service_factory(holder_bytes=1 << 30)
    lay = mooncake_root(tmp_path, svc.url)
    fp = FP_OF(7)
    key = remote_for(lay).key(fp)
    size = 384 << 20
    for attempt in range(4):  # the kill must land while the put runs (it takes ~0.3-2 s on loopback here)
        proc = subprocess.Popen([sys.executable, "-c", _HALF_PUT, svc.url, key, str(size)], stdout=subprocess.PIPE,
                                text=True, env=child_env(), cwd=REPO)
        assert proc.stdout.readline().strip() == "putting"
        time.sleep(0.05 * (attempt + 1))
        proc.kill()
        proc.wait()
        state = payload_of(lay, fp)
        if state != size:
            break
        remote_for(lay).client.remove(key)
    assert state < 0, f"the put finished before every kill (get_size {state})"
    t0 = time.monotonic()
    n = publish(lay, 7)
    took = time.monotonic() - t0
    assert payload_of(lay, fp) == n and took < 10, (state, took)
    art = store.read(lay, fp, K.CONTRACT, verify_tokens=True)
    assert torch.equal(art.hidden_states, K.fake_capture(PLAN.sample(7))["hidden_states"])


_PUBLISHER = """
import os, sys
sys.path.insert(0, sys.argv[2])  # the repository root; never tests/, whose mooncake/ would shadow mooncake
from tests.support import crash_child as K
from pathlib import Path
from artcache import store
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout
lay = CacheLayout(Path(sys.argv[1]))
fp_of = PlanFingerprints(K.CONTRACT, K.FakePlan())
for i in range(int(sys.argv[3])):
    store.publish(lay, fp_of(i), K.CONTRACT, K.fake_capture(K.FakePlan().sample(i)), verify_tokens=True)
print("published", flush=True)
if sys.argv[4] == "kill":
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_writers_exit_or_kill_loses_no_payload(tmp_path, mooncake_service, end):
    """The bytes live in the payload holder's memory: after the publishing process is gone (clean exit or
    SIGKILL) every artifact it published still reads back whole, long after the master would have
    dropped that client."""
    lay = mooncake_root(tmp_path, mooncake_service.url)
    proc = subprocess.run([sys.executable, "-c", _PUBLISHER, str(lay.root), str(REPO), "6", end],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120)
    assert "published" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == (0 if end == "exit" else -9)
    time.sleep(mooncake_service.client_ttl_s + 2)  # the writer's client has expired at the master by now
    for i in range(6):
        art = store.read(lay, FP_OF(i), K.CONTRACT, verify_tokens=True)
        assert torch.equal(art.hidden_states, K.fake_capture(PLAN.sample(i))["hidden_states"])


# ---- the store loses keys --------------------------------------------------------------------------------

def test_master_restart_turns_forgotten_keys_into_misses(service_factory, tmp_path):
    svc = service_factory()
    lay = mooncake_root(tmp_path, svc.url)
    for i in range(4):
        publish(lay, i)
    assert store.maintain(lay) == {}
    old_epoch = remote_for(lay).epoch
    svc.restart_master()
    svc.wait_writable()
    # a reader finds its key forgotten: a miss, and the manifest is withdrawn so the producer recaptures
    with pytest.raises(ArtifactMissing, match="no longer holds"):
        read_until_settled(lay, FP_OF(0))
    assert not store.exists(lay, FP_OF(0))
    # the producer's next pass sees the epoch sentinel gone: every other manifest becomes a miss at once
    remote_for(lay)._next_epoch_check = 0.0
    lost = store.maintain(lay)
    assert set(lost) == {FP_OF(i) for i in (1, 2, 3)}, lost
    assert store.list_objects(lay) == {} and remote_for(lay).epoch != old_epoch
    settle(lay)
    n = publish(lay, 2)  # recaptured into the new epoch
    assert store.read(lay, FP_OF(2), K.CONTRACT, verify_tokens=True).nbytes == n
    assert store.maintain(lay) == {}


def test_a_stopped_holder_turns_its_payloads_into_misses(service_factory, tmp_path):
    svc = service_factory(client_ttl_s=2)
    lay = mooncake_root(tmp_path, svc.url)
    publish(lay, 0)
    svc.stop_holder()
    deadline = time.monotonic() + 30
    while True:
        try:
            store.read(lay, FP_OF(0), K.CONTRACT)
        except PayloadUnavailable:  # the holder's bytes are gone; the key not yet
            pass
        except ArtifactMissing:
            break
        else:
            pytest.fail("read a payload whose holder had stopped")
        assert time.monotonic() < deadline, "the key of a stopped holder never went"
        time.sleep(0.2)
    assert not store.exists(lay, FP_OF(0))
    svc.start_holder()
    svc.wait_writable()
    publish(lay, 0)
    assert store.read(lay, FP_OF(0), K.CONTRACT).fingerprint == FP_OF(0)


def test_a_full_store_is_back_pressure_not_eviction(service_factory, tmp_path, monkeypatch):
    """Hard-pinned payloads are never evicted by Mooncake: a full store refuses the put (-200), the publish
    raises a retryable PublishError naming the holders' size, and room made by artcache's own eviction
    lets it through."""
    from artcache import payload_mooncake
    from artcache.contract import CaptureContract

    monkeypatch.setattr(payload_mooncake, "PUT_WAIT_S", 1.0)
    svc = service_factory(holder_bytes=16 << 20)
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    contract = CaptureContract(target_name="fake", target_revision="r1", target_config_hash="cfg",
                               target_weights_digest="w1", layer_ids=(1, 3), max_length=64,
                               tokenizer_digest="tok", template_digest="tpl")
    init_settings(lay, msgspec.structs.replace(K.settings(), contract=contract, payload=new_spec(svc.url)))
    big = {"hidden_states": torch.randn(64, 2, 16384).to(torch.bfloat16),
           "input_ids": torch.arange(64, dtype=torch.int32), "loss_mask": torch.ones(64, dtype=torch.uint8)}
    published = []
    with pytest.raises(PublishError, match="NO_AVAILABLE_HANDLE") as err:
        for i in range(20):
            store.publish(lay, f"{i:040x}", contract, big)
            published.append(f"{i:040x}")
    assert err.value.retryable and "payload-holder --size" in str(err.value)
    refused = f"{len(published):040x}"
    assert 2 <= len(published) < 8, published
    assert all(payload_of(lay, fp) > 0 for fp in published)  # nothing of ours was evicted by Mooncake
    assert not store.exists(lay, refused)
    store.remove(lay, published[0])
    settle(lay)
    store.publish(lay, refused, contract, big)
    assert store.read(lay, refused, contract).nbytes > 4 << 20


# ---- real processes --------------------------------------------------------------------------------------

ROLE = ["--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "48", "--max-length", "32",
        "--draft-layers", "3"]


def _producer(lay: CacheLayout, **cfg):
    from artcache.producer import Producer, ProducerConfig

    conf = ProducerConfig(cache=str(lay.root), heartbeat_timeout_s=1e9, poll_interval_s=0.0, **cfg)
    journal = J.JournalWriter(lay.journal_path("producer", "p"))
    return Producer(lay, load_settings(lay), PLAN, K.FakeBackend(), conf, journal)


def test_regression_remote_root_retention_does_not_budget_the_local_disk(tmp_path, mooncake_service):
    """With Mooncake payloads retention never evicted (no evictions in the producer-kill test, a consumer's demand
    failing in the crash trials): the default budget was the free space of the root's
    filesystem, which holds only ~1 KB manifests, so nothing was ever evicted from the holders' memory. On a
    root with remote payloads and no --disk-budget the producer keeps the windows rule; --fill is refused;
    an explicit --disk-budget retains by need and budgets the payload bytes (list_objects gives them)."""
    from artcache.errors import ConfigError

    lay = mooncake_root(tmp_path, mooncake_service.url)
    nbytes = publish(lay, 0)
    manifest = remote_for(lay).manifest_path(FP_OF(0)).stat().st_size
    # the retained bytes retention counts are the payload's (Mooncake's size of the key), not the manifest's
    assert store.list_objects(lay) == {FP_OF(0): nbytes} and payload_of(lay, FP_OF(0)) == nbytes != manifest
    p = _producer(lay)
    assert p.cfg.retention == "windows" and "windows-only" in p.budget_note
    p.drain()
    with pytest.raises(ConfigError, match="--fill .* --disk-budget"):
        _producer(lay, fill=True)
    p = _producer(lay, disk_budget=10 * nbytes)
    assert p.cfg.retention == "need" and p.budget == 10 * nbytes
    p.drain()
    p = _producer(lay, retention="windows")
    assert p.cfg.retention == "windows"
    p.drain()


class MProc(Proc):
    deadline = 300.0


def test_producer_kill_against_mooncake_loses_no_published_payload(tmp_path, mooncake_service):
    """``artcache producer --payload mooncake://...`` SIGKILLed mid-run, restarted without --payload (the root
    records it): the consumers finish, nothing the killed producer left in the store is captured again before
    the new producer has evicted it (a lagging consumer may read again what the windows rule evicted), and
    ``artcache inspect`` reports no violation but the captures the kill lost."""
    cache = tmp_path / "cache"
    prod = MProc("producer", ["producer", "--cache", str(cache), *ROLE, "--payload", mooncake_service.url,
                              "--threads", "1", "--batch-samples", "2", "--heartbeat-timeout", "60"], tmp_path)
    wait_until(lambda: (cache / "artcache.json").is_file(), "the producer to create the root", [prod])
    cons = [MProc(c, ["consume", "--cache", str(cache), "--id", c, "--block-size", "4", "--window", "2:6",
                      "--anchors", "4", "--steps", "10", "--batch-size", "2", "--threads", "1", "--log-every", "1",
                      "--demand-timeout", "240", "--no-progress", "--out", str(tmp_path / "runs" / c)], tmp_path)
            for c in ("a", "b")]
    layout = CacheLayout(cache)

    def published() -> int:
        return sum(isinstance(e, J.Publish) for e in J.read_events(layout.journal).events)

    wait_until(lambda: published() >= 8, "8 publications", [prod, *cons])
    prod.popen.send_signal(signal.SIGKILL)
    prod.wait()
    killed_at = time.time()  # journal times are wall-clock (Event.t)
    before = {e.fp for e in J.read_events(layout.journal).events if isinstance(e, J.Publish)}
    still = set(store.list_objects(layout))
    prod2 = MProc("producer2", ["producer", "--cache", str(cache), *ROLE, "--threads", "1", "--batch-samples", "2",
                                "--heartbeat-timeout", "60", "--exit-when-done", "--done-grace", "1"], tmp_path)
    for c in cons:
        c.expect(0)
    prod2.expect(0)
    # prod2 must find what the killed producer left in the store: it may capture one of those again only after
    # evicting it itself (the windows rule evicts what falls behind every window, and a lagging consumer then
    # reads it again), never while it is still there
    evicted, lost = set(), []
    for e in J.read_events(layout.journal).events:
        if e.t <= killed_at:
            continue
        if isinstance(e, J.Evict):
            evicted.add(e.fp)
        elif isinstance(e, J.Capture) and e.fp in still and e.fp not in evicted:
            lost.append(e.fp)
    assert not lost, f"artifacts published before the kill and still in the store were captured again: {lost}"
    acc = inspect_json(cache)
    assert [v for v in acc["violations"] if not v.startswith("captures ")] == [], acc["violations"]
    assert acc["cache"]["quarantined"] == 0 and acc["cache"]["evictions"] > 0
    assert before and store.list_objects(layout) == {}  # the last producer evicted everything at exit
    assert list(layout.objects.glob("*/*.pending")) == []  # and waited out the read leases of its removals
    backend = remote_for(layout)
    assert all(backend.client.get_size(backend.key(fp)) == OBJECT_NOT_FOUND for fp in before)


def test_artcache_run_with_mooncake_payloads(tmp_path, mooncake_service):
    """A run whose config sets cache.payload and a disk budget inside the holder's memory (retention by need:
    without a budget a remote root keeps the windows-only rule, which recaptures what a lagging consumer
    reads after the fast one's window passed it; one lane run saw 17 captures for 16 positions): every
    experiment completes, inspect's invariants hold and the producer captured each consumed position about
    once (<= 1.05)."""
    out = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    exps = "".join(f"""
[[experiments]]
name = "{name}"
block_size = {bs}
anchors = 4
batch_size = 2
steps = 8
window = "2:8"
threads = 1
log_every = 1
[experiments.consumer]
progress = false
tensorboard = false
""" for name, bs in (("b4", 4), ("b8", 8)))
    cfg.write_text(f"""
out = "{out}"
[target]
name = "random:tiny-llama"
threads = 1
[data]
dataset = "synthetic"
max_length = 32
max_samples = 64
[capture]
draft_layers = 3
batch_samples = 2
[cache]
done_grace_s = 1.0
payload = "{mooncake_service.url}"
disk_budget = {mooncake_service.holder_bytes // 2}
""" + exps)
    proc = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(cfg)], capture_output=True,
                          text=True, env=child_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert all(report["checks"].values()), report["checks"]
    cache = Path(report["out"]) / "cache"
    assert load_settings(CacheLayout(cache)).payload.url == mooncake_service.url
    acc = inspect_json(cache)
    assert acc["violations"] == []
    c = acc["cache"]
    assert c["retention"] == "need" and c["budget_bytes"] == mooncake_service.holder_bytes // 2, c
    assert c["distinct_positions_consumed"] >= 16 and c["captures_per_consumed_position"] <= 1.05, c
    assert c["publications"] == c["captures"] and c["quarantined"] == 0
    assert not list(CacheLayout(cache).objects.glob("*/*.safetensors"))  # the tensors never touched the root
