"""The payload-backend seam without a Mooncake store: URL and size parsing, what a root records, the POSIX
backend as an object, and the refusals that happen before anything is written (a bad ``--payload``, a
master that does not answer, a ``--payload`` other than the root's, a missing client library).

The protocol against a real Mooncake store is in tests/mooncake/test_mooncake.py (marker ``mooncake``)."""

from __future__ import annotations

import socket
import sys

import msgspec
import pytest

from artcache import store
from artcache.errors import ArtifactMissing, ConfigError, PayloadStoreError
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout
from artcache.payload import new_spec, parse_payload_url, remote_for
from artcache.payload_mooncake import MooncakePayloads, parse_size
from artcache.settings import init_settings, load_settings
from tests.support import crash_child as K
from tests.unit.test_cli import assert_bad_input, invoke, snapshot


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    wd = tmp_path / "wd"
    wd.mkdir()
    monkeypatch.chdir(wd)
    return wd


PLAN = ["--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "8", "--max-length", "32"]


@pytest.mark.parametrize("text,want", [
    ("posix", None), ("mooncake://127.0.0.1:50051", "mooncake://127.0.0.1:50051"),
    ("mooncake://node-7.cluster:8000", "mooncake://node-7.cluster:8000"), (" mooncake://h:0080 ", "mooncake://h:80"),
    ("mooncake://[::1]:50051", "mooncake://[::1]:50051")])
def test_parse_payload_url_accepts(text, want):
    assert parse_payload_url(text) == want


@pytest.mark.parametrize("text", ["", "nfs://h:1", "mooncake://h", "mooncake://h:0", "mooncake://h:70000",
                                  "mooncake://:50051", "mooncake://h:1/path", "mooncake://a b:1", "Posix"])
def test_parse_payload_url_refuses(text):
    with pytest.raises(ConfigError, match="is not accepted: use posix"):
        parse_payload_url(text)


@pytest.mark.parametrize("text,want", [("4GiB", 4 << 30), ("512M", 512 << 20), ("1048576", 1 << 20), ("1.5k", 1536),
                                       ("2TB", 2 << 40), ("64 MiB", 64 << 20)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["0", "-1G", "4GB/s", "lots", "1PiB", ""])
def test_parse_size_refuses(text):
    """Named by the flag (it said "size '0'", naming no flag)."""
    with pytest.raises(ConfigError, match=f"^--size {text!r} is not accepted"):
        parse_size(text)


def test_new_specs_get_distinct_namespaces():
    a, b = new_spec("mooncake://h:1"), new_spec("mooncake://h:1")
    assert a.namespace != b.namespace and a.namespace.startswith("artcache-")


def test_posix_root_records_no_payload_and_takes_the_file_path(layout):
    """A root without a payload record is files in objects/, exactly as before the seam existed."""
    assert load_settings(layout).payload is None and remote_for(layout) is None
    plan = K.FakePlan()
    fp = PlanFingerprints(K.CONTRACT, plan)(3)
    n = store.publish(layout, fp, K.CONTRACT, K.fake_capture(plan.sample(3)), verify_tokens=True)
    assert layout.object_path(fp).stat().st_size == n and store.list_objects(layout) == {fp: n}
    assert store.maintain(layout) == {}


def test_bare_layout_without_settings_is_posix(tmp_path):
    lay = CacheLayout(tmp_path / "bare")
    lay.create()
    assert remote_for(lay) is None


def test_remote_root_is_recognised_without_touching_the_store(tmp_path):
    """A root recording a Mooncake store opens its backend lazily: listing and exists need only the POSIX root
    (``artcache inspect`` on a login node), and a root recreated at the same path is noticed."""
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    spec = new_spec("mooncake://127.0.0.1:9")
    init_settings(lay, msgspec.structs.replace(K.settings(), payload=spec))
    backend = remote_for(lay)
    assert isinstance(backend, MooncakePayloads) and backend.spec == spec
    assert remote_for(lay) is backend  # one per root and process
    fp = PlanFingerprints(K.CONTRACT, K.FakePlan())(0)
    assert store.list_objects(lay) == {} and not store.exists(lay, fp)
    with pytest.raises(ArtifactMissing):
        store.read(lay, fp, K.CONTRACT)
    lay.settings.unlink()  # the root replaced: a POSIX root at the same path
    init_settings(lay, K.settings())
    assert remote_for(lay) is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_producer_refuses_a_bad_payload_and_writes_nothing(tmp_path, workdir):
    cache = tmp_path / "cache"
    assert_bad_input(invoke("producer", "--cache", str(cache), *PLAN, "--payload", "s3://bucket"),
                     "'s3://bucket'", "mooncake://HOST:PORT")
    assert not cache.exists()


def test_producer_with_an_unreachable_master_writes_nothing(tmp_path, workdir):
    """Exit 1 (an operational failure) at once, not after Mooncake's own ~90 s of setup retries."""
    cache = tmp_path / "cache"
    port = _closed_port()
    res = invoke("producer", "--cache", str(cache), *PLAN, "--payload", f"mooncake://127.0.0.1:{port}")
    assert res.exit_code == 1, res.output
    assert "PayloadStoreError" in res.stderr and f"127.0.0.1:{port}" in res.stderr
    assert not cache.exists()


def test_producer_refuses_a_payload_other_than_the_roots(tmp_path, workdir):
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target="random:tiny-llama", dataset="synthetic", max_samples=8,
                                max_length=32))
    before = snapshot(cache)
    assert_bad_input(invoke("producer", "--cache", str(cache), *PLAN, "--payload", "mooncake://127.0.0.1:1"),
                     "keeps its payloads in posix", "--payload posix")
    assert snapshot(cache) == before


def test_missing_mooncake_package_is_a_config_error(tmp_path, monkeypatch):
    """A consumer of a Mooncake root on a machine without the package: one line saying what to install."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import mooncake.store raises ImportError
    try:
        from artcache.payload_mooncake import MooncakeClient

        with pytest.raises(ConfigError, match="pip install mooncake-transfer-engine-non-cuda"):
            MooncakeClient(f"mooncake://127.0.0.1:{listener.getsockname()[1]}")
    finally:
        listener.close()


def test_unreachable_master_is_a_payload_store_error():
    from artcache.payload_mooncake import MooncakeClient

    with pytest.raises(PayloadStoreError, match="no Mooncake master answers"):
        MooncakeClient(f"mooncake://127.0.0.1:{_closed_port()}")


def test_payload_holder_refuses_posix_and_bad_sizes(workdir):
    assert_bad_input(invoke("payload-holder", "--payload", "posix"), "needs no holder")
    assert_bad_input(invoke("payload-holder", "--payload", "mooncake://127.0.0.1:1", "--size", "huge"), "'huge'")
