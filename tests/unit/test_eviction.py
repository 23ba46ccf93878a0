"""eviction + leases: the artifacts a decision names go unless a live lease holds them; expiry of dead /
fenced / stale holders."""

from __future__ import annotations

import os
import time

import pytest
import torch

from artcache import leases, store
from artcache.contract import CaptureContract
from artcache.eviction import evict_pass
from artcache.layout import CacheLayout, host_id
from artcache.liveness import HeartbeatWatch, from_token
from tests.support.procs import dead_pid, foreign_token, token

C = CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                    layer_ids=(0,), max_length=8, tokenizer_digest="k", template_digest="m")


@pytest.fixture()
def layout(tmp_path) -> CacheLayout:
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    return lay


def fp_of(i: int) -> str:
    return f"{i:040x}"


def publish(layout: CacheLayout, i: int) -> str:
    fp = fp_of(i)
    ts = {"hidden_states": torch.full((1, 1, 2), float(i), dtype=torch.bfloat16),
          "input_ids": torch.tensor([i], dtype=torch.int32), "loss_mask": torch.ones(1, dtype=torch.uint8)}
    store.publish(layout, fp, C, ts, durable=False)
    return fp


def others(layout: CacheLayout, retain: set[str]) -> list[str]:
    """Every published fingerprint outside ``retain`` (what a decision keeping ``retain`` evicts)."""
    return sorted(set(store.list_objects(layout)) - retain)


def fake_lease(layout: CacheLayout, fp: str, consumer: str, holder: str, nonce: str = "00") -> str:
    """A lease file held by ``holder`` (an identity token, see procs.token / procs.foreign_token)."""
    name = f"{fp}~{consumer}~{holder}~{nonce}"
    (layout.leases / name).touch()
    return name


def test_evicts_only_outside_retain(layout):
    fps = [publish(layout, i) for i in range(10)]
    retain = set(fps[3:7])
    res = evict_pass(layout, others(layout, retain), set())
    assert set(res.evicted) == set(fps) - retain
    assert set(store.list_objects(layout)) == retain
    assert set(res.retained) == retain
    assert all(n > 0 for n in res.evicted.values())
    # the evictor leaves nothing behind in tmp/
    assert list(layout.tmp.iterdir()) == []
    # a second pass is a no-op
    res2 = evict_pass(layout, others(layout, retain), set())
    assert res2.evicted == {} and set(res2.retained) == retain


def test_never_evicts_what_the_decision_keeps_and_expires_dead_leases_first(layout):
    fps = [publish(layout, i) for i in range(4)]
    name = fake_lease(layout, fps[0], "gone", token(dead_pid()))
    res = evict_pass(layout, others(layout, set(fps)), set())
    assert res.evicted == {} and set(store.list_objects(layout)) == set(fps)
    # the dead holder's lease is expired before anything is decided (it holds nothing any more)
    assert not (layout.leases / name).exists() and [r for _, r in res.expired_leases] == ["holder-dead"]


def test_keeps_leased(layout):
    fps = [publish(layout, i) for i in range(5)]
    name = leases.acquire(layout, fps[1], "c1")
    res = evict_pass(layout, others(layout, set()), {"c1"})
    assert res.held_by_lease == {fps[1]}
    assert set(store.list_objects(layout)) == {fps[1]}
    assert set(res.evicted) == set(fps) - {fps[1]}
    assert (layout.leases / name).exists()
    assert leases.release(layout, name) is True
    res = evict_pass(layout, others(layout, set()), {"c1"})
    assert set(res.evicted) == {fps[1]} and store.list_objects(layout) == {}
    assert leases.release(layout, name) is False


def test_several_leases_on_one_fp(layout):
    fp = publish(layout, 1)
    a = leases.acquire(layout, fp, "c1")
    b = leases.acquire(layout, fp, "c2")
    assert a != b
    leases.release(layout, a)
    assert evict_pass(layout, others(layout, set()), {"c1", "c2"}).held_by_lease == {fp}
    leases.release(layout, b)
    assert set(evict_pass(layout, others(layout, set()), {"c1", "c2"}).evicted) == {fp}


def test_expires_lease_of_dead_pid(layout):
    fp = publish(layout, 1)
    pid = dead_pid()
    name = fake_lease(layout, fp, "c1", token(pid))
    res = evict_pass(layout, others(layout, set()), {"c1"})
    assert [(lease.name, reason) for lease, reason in res.expired_leases] == [(name, "holder-dead")]
    assert set(res.evicted) == {fp}
    assert not (layout.leases / name).exists()


def test_expires_lease_of_fenced_consumer(layout):
    fp = publish(layout, 1)
    name = leases.acquire(layout, fp, "c1")  # our own (live) pid
    res = evict_pass(layout, others(layout, set()), {"other"})
    assert [(lease.name, reason) for lease, reason in res.expired_leases] == [(name, "consumer-fenced")]
    assert set(res.evicted) == {fp}
    assert leases.release(layout, name) is False


def test_other_host_lease_expires_by_ttl(layout):
    """Another host's lease (its pid cannot be checked) is expired once this reader has seen it for the TTL
    on its own clock; the file's mtime (another host's clock) plays no part."""
    fp = publish(layout, 1)
    name = fake_lease(layout, fp, "c1", foreign_token())
    old = time.time() - 1e6  # an ancient mtime: irrelevant
    os.utime(layout.leases / name, (old, old))
    now = [0.0]
    watch = HeartbeatWatch(600, clock=lambda: now[0])
    res = evict_pass(layout, others(layout, set()), {"c1"}, lease_ttl_s=600, lease_watch=watch)
    assert res.held_by_lease == {fp} and res.expired_leases == []
    now[0] = 599.0
    assert evict_pass(layout, others(layout, set()), {"c1"}, lease_ttl_s=600, lease_watch=watch).expired_leases == []
    now[0] = 601.0
    res = evict_pass(layout, others(layout, set()), {"c1"}, lease_ttl_s=600, lease_watch=watch)
    assert [(lease.name, reason) for lease, reason in res.expired_leases] == [(name, "ttl")]
    assert set(res.evicted) == {fp}


def test_other_host_lease_of_the_live_registration_process_is_kept(layout):
    """A lease whose holder is the live consumer's own registered process (on another host) lives as long as
    that registration does: no TTL, no pid check."""
    fp = publish(layout, 1)
    name = fake_lease(layout, fp, "c1", foreign_token(7))
    now = [0.0]
    watch = HeartbeatWatch(600, clock=lambda: now[0])
    live = {"c1": from_token(foreign_token(7))}
    assert evict_pass(layout, others(layout, set()), live, lease_ttl_s=600, lease_watch=watch).held_by_lease == {fp}
    now[0] = 1e6
    assert evict_pass(layout, others(layout, set()), live, lease_ttl_s=600, lease_watch=watch).held_by_lease == {fp}
    assert (layout.leases / name).exists()
    # a one-shot reader (no watch) never expires another host's lease by age
    assert evict_pass(layout, others(layout, set()), {"c1"}, lease_ttl_s=0).held_by_lease == {fp}


def test_legacy_lease_names_are_read_and_never_pid_checked(layout):
    """Migration rule: a lease named before identity tokens (<fp>~<consumer>~<hostname>~<pid>~<nonce>) is
    parsed; its pid is never checked (the host name cannot tell pid namespaces apart); it expires with its
    consumer, or by the TTL."""
    fp = publish(layout, 1)
    name = f"{fp}~c1~{os.uname().nodename}~{dead_pid()}~00"
    (layout.leases / name).touch()
    info = leases.parse(name)
    assert info.holder is None and info.host == os.uname().nodename
    assert evict_pass(layout, others(layout, set()), {"c1"}).held_by_lease == {fp}
    res = evict_pass(layout, others(layout, set()), set())
    assert [(lease.name, reason) for lease, reason in res.expired_leases] == [(name, "consumer-fenced")]


def test_other_host_lease_of_fenced_consumer_expires(layout):
    fp = publish(layout, 1)
    name = fake_lease(layout, fp, "c1", foreign_token())
    res = evict_pass(layout, others(layout, set()), set(), lease_ttl_s=600)
    assert [(lease.name, reason) for lease, reason in res.expired_leases] == [(name, "consumer-fenced")]


def test_dead_leases_on_unpublished_fps_are_expired(layout):
    live_name = leases.acquire(layout, fp_of(7), "c1")
    dead_name = fake_lease(layout, fp_of(8), "c1", token(dead_pid()))
    res = evict_pass(layout, others(layout, set()), {"c1"})
    assert [lease.name for lease, _ in res.expired_leases] == [dead_name]
    assert (layout.leases / live_name).exists() and not (layout.leases / dead_name).exists()


def test_garbage_in_leases_dir_ignored(layout):
    fp = publish(layout, 1)
    (layout.leases / "not-a-lease").touch()
    (layout.leases / f"{fp}~c1~h~notapid~00").touch()
    res = evict_pass(layout, others(layout, set()), {"c1"})
    assert set(res.evicted) == {fp}
    assert leases.parse("a~b") is None and leases.parse(f"{'Z' * 40}~c~h~1~n") is None
    with pytest.raises(ValueError):
        leases.release(layout, "not-a-lease")


def test_leases_scan_and_parse(layout):
    name = leases.acquire(layout, fp_of(3), "c1")
    info = leases.parse(name)
    assert info.fp == fp_of(3) and info.consumer == "c1" and info.host == host_id() and info.pid == os.getpid()
    assert dict(leases.scan(layout)) == {fp_of(3): [info]}


def test_acquire_validates_inputs(layout):
    from artcache.errors import ConfigError

    with pytest.raises(ConfigError):
        leases.acquire(layout, "../../x", "c1")
    with pytest.raises(ConfigError):
        leases.acquire(layout, fp_of(1), "bad~id")
    assert list(layout.leases.iterdir()) == []


def test_objects_argument_is_used(layout):
    fps = [publish(layout, i) for i in range(3)]
    res = evict_pass(layout, fps, set(), objects={fps[0]: 1})
    assert set(res.evicted) == {fps[0]}
    assert set(store.list_objects(layout)) == set(fps[1:])


def test_evicted_file_gone_meanwhile_is_success(layout):
    fps = [publish(layout, i) for i in range(2)]
    listing = store.list_objects(layout)
    store.remove(layout, fps[0])  # someone else removed it between the listing and the pass
    res = evict_pass(layout, fps, set(), objects=listing)
    assert set(res.evicted) == {fps[1]}
    assert store.list_objects(layout) == {}
