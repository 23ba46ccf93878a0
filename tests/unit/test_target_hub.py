"""``--target ORG/NAME``: a Hugging Face hub id resolved through huggingface_hub's cache, offline.

Every test builds its own hub cache (``models--ORG--NAME/{blobs,refs,snapshots}``, the layout huggingface_hub
writes) under tmp_path holding the tiny target, and points ``HF_HUB_CACHE`` at it; nothing reaches the network.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.errors import ConfigError
from artcache.target import resolve_target
from tests.support import TINY_SHAREGPT

DATA = TINY_SHAREGPT
REPO = "artcache-test/tiny-llama"
REV = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, target_dir: Path, repo: str = REPO, rev: str = REV) -> Path:
    """Write ``root/models--ORG--NAME`` as huggingface_hub does: each file once under ``blobs/<sha256>``, the
    snapshot ``snapshots/<rev>/`` of relative symlinks to them, ``refs/main`` naming the revision."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    blobs, snap = repo_dir / "blobs", repo_dir / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(target_dir.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture
def cached(tmp_path, tiny_target, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    snap = hub_cache(cache, Path(tiny_target.path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, snap


def test_hub_id_resolves_to_the_cached_snapshot_offline(cached, tiny_target):
    cache, snap = cached
    info = resolve_target(REPO)
    assert Path(info.path) == snap and info.name == REPO and info.revision == REV
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (tiny_target.num_layers, tiny_target.hidden_size,
                                                                    tiny_target.vocab_size)
    assert info.weights_digest == tiny_target.weights_digest and info.config_hash == tiny_target.config_hash
    pinned = resolve_target(f"{REPO}@{REV}")
    assert pinned.path == info.path and pinned.name == REPO and pinned.revision == REV


def test_hub_id_absent_from_the_cache_offline_is_one_line_naming_it(cached):
    cache, _ = cached
    with pytest.raises(ConfigError) as err:
        resolve_target("artcache-test/not-there")
    msg = str(err.value)
    assert "'artcache-test/not-there'" in msg and str(cache) in msg and "HF_HUB_OFFLINE" in msg
    assert "\n" not in msg


def test_hub_id_absent_and_hub_unreachable_is_one_line_naming_it(tmp_path, monkeypatch):
    """Online mode, but the hub endpoint refuses connections: the cache miss is reported, not a traceback."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    with pytest.raises(ConfigError) as err:
        resolve_target("artcache-test/not-there")
    msg = str(err.value)
    assert "'artcache-test/not-there'" in msg and "could not provide it" in msg and "\n" not in msg


def test_a_directory_of_that_name_wins_over_the_hub(tmp_path, tiny_target, monkeypatch):
    """A relative path ``ORG/NAME`` that exists is the directory, never a hub lookup."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_target.path, tmp_path / "org" / "tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = resolve_target("org/tiny")
    assert info.revision == "local" and Path(info.path) == (tmp_path / "org" / "tiny").resolve()


def test_run_dry_run_plans_a_hub_target(cached, tmp_path):
    """``artcache run --dry-run`` with ``target.name`` a hub id: planned against the cached snapshot."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
out = "{tmp_path / 'runs'}"
[target]
name = "{REPO}"
[data]
dataset = "{DATA}"
max_length = 128
max_samples = 20
[capture]
draft_layers = 3
[[experiments]]
name = "a"
block_size = 4
anchors = 4
""")
    result = CliRunner().invoke(main, ["run", "--config", str(cfg), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert REPO in result.output


def test_producer_with_an_absent_hub_id_exits_2_in_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(tmp_path / "root"),
                           "--target", "Qwen/Qwen3-8B", "--data", str(DATA)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "'Qwen/Qwen3-8B'" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "root").exists()
