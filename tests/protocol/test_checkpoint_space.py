"""A run whose checkpoints cannot fit fails before step 1 with one line naming the
bytes (nothing written in the root, no run directory); weights-only checkpoints seed runs but are never
resumed; a checkpoint write that fails mid-file keeps the previous checkpoint, and the run's error names it.

The preflight tests need only an initialised root (``prepare_root``, no producer process); the others run a
real ``artcache producer`` process on the tiny random target and the consumers in-process (``CliRunner``),
so a write failure can be injected into safetensors the way tests/protocol/test_faults.py injects errnos.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
from click.testing import CliRunner

from artcache import registry
from artcache.app.cli import main
from artcache.errors import InsufficientSpace
from artcache.layout import CacheLayout
from artcache.producer import ProducerConfig, prepare_root
from artcache.trainers import checkpoint as ck
from artcache.trainers.consumer import ConsumerConfig, Session
from tests.support.procs import Proc as BaseProc

#: what safetensors raised when the disk filled during the issue-14 bench's final checkpoints
ENOSPC_MESSAGE = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                  'device" }) (os error 28)')
TARGET = "random:tiny-llama"


class Proc(BaseProc):
    deadline = 300.0


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def root(tmp_path) -> Path:
    """An initialised cache root (settings and plan; nothing captured) on the tiny random target, with the
    layers of a 3-layer DFlash draft and of EAGLE-3."""
    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target=TARGET, dataset="synthetic", max_length=64, max_samples=16,
                                layer_ids=[1, 3, 4, 5, 7], threads=1))
    return cache


def consume(cache: Path, out: Path, cid: str, *extra: str):
    args = ["consume", "--cache", str(cache), "--id", cid, "--block-size", "4", "--window", "2:4", "--anchors", "4",
            "--batch-size", "2", "--threads", "1", "--demand-timeout", "120", "--log-every", "1", "--no-progress",
            "--no-tensorboard", "--json", "--out", str(out), *extra]
    return CliRunner().invoke(main, args, catch_exceptions=True)


def error_line(result) -> str:
    """The run's one error line: exit status nonzero, no traceback anywhere, the last stderr line."""
    assert "Traceback" not in result.output + result.stderr, result.stderr[-3000:]
    assert not (result.exception and not isinstance(result.exception, SystemExit)), repr(result.exception)
    line = [ln for ln in result.stderr.splitlines() if ln.strip()][-1]
    assert line.startswith("artcache: error: "), line
    return line


def fake_free(monkeypatch, free: int, fs: int = 10**12) -> None:
    monkeypatch.setattr(ck, "free_space", lambda p: (free, fs, Path("/")))


# ---- the preflight: before step 1, nothing written ------------------------------------------------------

def test_a_checkpoint_that_cannot_fit_fails_before_anything_is_written(root, tmp_path, monkeypatch):
    out = tmp_path / "runs" / "d4"
    before = tree(root)
    fake_free(monkeypatch, 1 << 20)  # 1 MiB: less than one full checkpoint of the tiny draft plus the reserve
    result = consume(root, out, "d4", "--steps", "8", "--save-every", "2", "--keep-checkpoints", "2")
    line = error_line(result)
    assert result.exit_code == 2, result.output
    for needle in ("checkpoints of consumer 'd4' need ", " B (", "3 × ", "--keep-checkpoints 2 and 4 written by this "
                   "run", f"under {out}", "has 1,048,576 B (1.0 MiB) free", "a smaller --keep-checkpoints",
                   "--no-checkpoint-optimizer (weights-only", "another --out"):
        assert needle in line, (needle, line)
    assert tree(root) == before  # no registration, no journal, nothing in the root
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_the_preflight_sizes_the_real_draft_and_weights_only_needs_a_third(root, tmp_path, monkeypatch):
    """Session.setup() sizes the checkpoint from the built draft; with --no-checkpoint-optimizer the same
    free space that refuses a full checkpoint is enough. The size is what the checkpoint then takes."""
    import torch

    cfg = ConsumerConfig(cache=str(root), consumer_id="e", draft="eagle3", batch_size=1, lookahead=4, steps=4,
                         draft_vocab=512, ttt_steps=2, threads=1, out_dir=str(tmp_path / "runs" / "e"))
    session = Session(cfg)
    session.setup()
    size = session.checkpoint_bytes
    trained = sum(p.numel() * p.element_size() for p in session.model.parameters() if p.requires_grad)
    assert size.weights > trained and size.rng > 0  # EAGLE-3's weights file also holds its vocab map d2t/t2d
    assert size.optimizer == pytest.approx(2 * trained, rel=0.01)  # AdamW: two moments of every trained weight
    fs = 10**12
    fake_free(monkeypatch, size.weights_only + (64 << 20), fs)
    with pytest.raises(InsufficientSpace, match="--no-checkpoint-optimizer"):
        Session(cfg).setup()
    weights_only = Session(msgspec_replace(cfg, checkpoint_optimizer=False))
    weights_only.setup()
    assert weights_only.checkpoint_bytes.optimizer == 0 == weights_only.checkpoint_bytes.rng
    assert Session(msgspec_replace(cfg, checkpoints=False, checkpoint_optimizer=False)).setup() is None
    # the bound holds for what a checkpoint of this draft takes once AdamW has stepped
    session.resume()
    params = session.params
    loss = sum(p.float().pow(2).sum() for p in params)
    loss.backward()
    session.optimizer.step()
    path = ck.save_checkpoint(tmp_path / "probe", step=1, cursor=1, weights=session.model.trainable_state_dict(),
                              optimizer=session.optimizer, generators=session.generators,
                              extra_tensors=session.draft.extra_tensors(), state={})
    written = sum(p.stat().st_size for p in path.iterdir())
    assert written <= size.total and size.total - written <= ck.STATE_JSON_BOUND + 64 * 1024
    assert not torch.isnan(loss)


def msgspec_replace(cfg: ConsumerConfig, **changes) -> ConsumerConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)


def test_save_every_without_checkpoints_is_refused():
    from artcache.errors import ConfigError

    with pytest.raises(ConfigError, match="--save-every 2 needs checkpoints"):
        ConsumerConfig(cache="-", checkpoints=False, save_every=2).validate()


# ---- with a producer: weights-only runs, and a write that fails ----------------------------------------

def test_weights_only_and_a_failed_write_end_to_end(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    layout = CacheLayout(cache)
    # the root, as the producer makes it: the consumers start beside the producer, not after its start
    prepare_root(ProducerConfig(cache=str(cache), target=TARGET, dataset="synthetic", max_length=64, max_samples=32,
                                draft_layers=3))
    prod = Proc("producer", ["producer", "--cache", str(cache), "--target", TARGET, "--data", "synthetic",
                             "--max-length", "64", "--max-samples", "32", "--draft-layers", "3", "--threads", "1"],
                tmp_path)
    try:
        runs = tmp_path / "runs"

        # a weights-only run: model + state only, resumable false; --resume refuses it, --init-from seeds from it
        res = consume(cache, runs / "w", "w", "--steps", "2", "--no-checkpoint-optimizer")
        assert res.exit_code == 0, res.stderr[-3000:]
        ckpt = ck.find_checkpoint(runs / "w")
        assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "state.json"]
        assert ck.read_state(ckpt).resumable is False
        line = error_line(consume(cache, runs / "w", "w", "--steps", "2", "--resume"))
        assert "is weights-only" in line and f"--init-from {ckpt}" in line, line
        res = consume(cache, runs / "s", "s", "--steps", "2", "--init-from", str(runs / "w"))
        assert res.exit_code == 0, res.stderr[-3000:]
        assert json.loads(res.stdout.strip().splitlines()[-1])["steps"] == 2

        # the final checkpoint fails with ENOSPC half-way through its first file: step 2's stays, named
        real = safetensors.torch.save_file
        first = ck.step_dir(runs / "f", 2)

        def full_disk(tensors, path, *a, **k):
            if first.exists():
                real(tensors, path, *a, **k)
                with open(path, "r+b") as fh:
                    fh.truncate(fh.seek(0, 2) // 2)
                raise safetensors.SafetensorError(ENOSPC_MESSAGE)
            return real(tensors, path, *a, **k)

        monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
        res = consume(cache, runs / "f", "f", "--steps", "4", "--save-every", "2")
        monkeypatch.setattr(safetensors.torch, "save_file", real)
        line = error_line(res)
        assert res.exit_code == 1
        assert line.startswith("artcache: error: CheckpointWriteError: checkpoint ") and "step-00000004" in line
        assert "ENOSPC: No space left on device" in line and "latest is unchanged" in line
        assert f"the last good checkpoint is {first} (step 2, cursor 4)" in line, line
        assert sorted(p.name for p in (runs / "f" / "checkpoints").iterdir()) == ["latest", "step-00000002"]
        assert (runs / "f" / "checkpoints" / "latest").resolve() == first
        reg = registry.read(layout, "f")
        assert reg.state == "failed" and "CheckpointWriteError" in reg.reason and reg.checkpoint_cursor == 4
        # the kept checkpoint is whole: the run resumes from it and completes
        res = consume(cache, runs / "f", "f", "--steps", "4", "--save-every", "2", "--resume")
        assert res.exit_code == 0, res.stderr[-3000:]
        summary = json.loads(res.stdout.strip().splitlines()[-1])
        assert (summary["resumed_from_step"], summary["steps"]) == (2, 4)
    finally:
        prod.kill()


def test_regression_planned_saves_is_constant_time_and_exact():
    """`consume --steps 1000000000000` hung silently before step 1, counting planned
    checkpoints with a Python loop over every step. The count is inclusion-exclusion over the multiples now:
    equal to the loop on small cases, instant on huge ones."""
    from artcache.trainers.checkpoint import planned_saves

    def loop(start, steps, a, b):
        if steps <= start:
            return 0
        every = [e for e in (a, b) if e > 0]
        return sum(1 for s in range(start + 1, steps) if any(s % e == 0 for e in every)) + 1

    for start in (0, 3, 7, 12):
        for steps in (0, 1, 5, 12, 13, 40, 97):
            for a in (0, 1, 4, 6):
                for b in (0, 3, 4, 10):
                    assert planned_saves(start, steps, a, b) == loop(start, steps, a, b), (start, steps, a, b)
    assert planned_saves(0, 10 ** 12, 500, 1000) == (10 ** 12 - 1) // 500 + 1  # the loop: hours
