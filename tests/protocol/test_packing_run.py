"""Packed training runs (``--pack-tokens``) on a ``--fill``-ed root of the tiny random target: a step consumes the
positions its packed rows hold and the cursor moves by them, the settings packing refuses, and a packed run killed
with -9 and resumed trains the losses of an uninterrupted packed run."""

from __future__ import annotations

import math

import pytest

from artcache import journal as J
from artcache import registry
from artcache.errors import ConfigError
from artcache.layout import CacheLayout
from artcache.producer import ProducerConfig, run_producer
from artcache.trainers.consumer import ConsumerConfig
from artcache.trainers.consumer.session import run_consumer

MAX_LEN, SAMPLES = 32, 40


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing") / "root"
    cfg = ProducerConfig(cache=str(root), target="random:tiny-llama", dataset="synthetic", max_samples=SAMPLES,
                         max_length=MAX_LEN, layer_ids=[1, 3, 4, 5, 7], fill=True, poll_interval_s=0.0)
    assert run_producer(cfg).fill_complete
    return root


def _cfg(root, tmp_path, cid, draft="dflash", **kw) -> ConsumerConfig:
    opts = ({"block_size": 4, "num_anchors": 4, "draft_layers": 3} if draft != "eagle3"
            else {"draft_vocab": 100})
    base = dict(cache=str(root), consumer_id=cid, draft=draft, batch_size=2, steps=3, lookbehind=0, lookahead=16,
                threads=1, out_dir=str(tmp_path / cid), progress=False, tensorboard=False, checkpoints=False,
                commit_interval_s=0.0, **opts)
    base.update(kw)
    return ConsumerConfig(**base)


def _steps(root, cid) -> list[J.Step]:
    out = []
    for path in CacheLayout(root).journal.glob(f"consumer-{cid}-*.jsonl"):
        out += [e for e in J.iter_file(path) if isinstance(e, J.Step)]
    return sorted(out, key=lambda e: e.step)


@pytest.mark.parametrize("draft", ["dflash", "eagle3", "dspark"])
def test_a_packed_step_consumes_its_rows_positions(filled, tmp_path, draft):
    """``--pack-tokens 80`` with rows of 32-token samples: two per row, two rows, so each step moves the cursor by
    4 positions (an unpacked step by 2)."""
    layout = CacheLayout(filled)
    seen: list[int] = []
    summary = run_consumer(_cfg(filled, tmp_path, f"p-{draft}", draft, pack_tokens=80),
                           step_hook=lambda i: seen.append(registry.read(layout, f"p-{draft}").cursor))
    assert seen == [4, 8, 12] and summary["cursor"] == 12
    steps = _steps(filled, f"p-{draft}")
    assert [s.cursor for s in steps] == [4, 8, 12]
    assert all(math.isfinite(s.loss) for s in steps)
    assert registry.read(layout, f"p-{draft}").state == "completed"


def test_a_packed_step_never_reads_past_the_lookahead(filled, tmp_path):
    """Rows of four samples (128 tokens) and two rows would be 8 positions; a lookahead of 6 caps the step at 6
    (rows of 4 and 2), and the run ends at the position after its last packed step."""
    seen: list[int] = []
    layout = CacheLayout(filled)
    summary = run_consumer(_cfg(filled, tmp_path, "cap", pack_tokens=128, lookahead=6),
                           step_hook=lambda i: seen.append(registry.read(layout, "cap").cursor))
    assert seen == [6, 12, 18] and summary["cursor"] == 18


def test_packing_refuses_a_row_shorter_than_a_sample(filled, tmp_path):
    with pytest.raises(ConfigError, match=f"--pack-tokens 31 is below the root's max length {MAX_LEN}"):
        run_consumer(_cfg(filled, tmp_path, "short", pack_tokens=31))


@pytest.mark.parametrize(("kw", "match"), [
    ({"reader": "process"}, "--pack-tokens 64 runs with --reader thread only"),
    ({"lockstep_group": "lk,other"}, "--pack-tokens 64 and a lockstep group exclude each other"),
    ({"nproc": 2}, "--pack-tokens 64 runs in one process with --grad-accum 1"),
    ({"grad_accum": 2}, "--pack-tokens 64 runs in one process with --grad-accum 1"),
])
def test_packing_refuses_what_moves_by_whole_batches(tmp_path, kw, match):
    cfg = _cfg(tmp_path / "none", tmp_path, "lk", pack_tokens=64, **kw)
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


# ---- kill -9 and resume ------------------------------------------------------------------------------------


def test_resume_refuses_another_pack_tokens_and_reads_an_older_checkpoint_as_unpacked(tmp_path):
    """``pack_tokens`` decides which positions each step consumes: a resumed run must keep it. A checkpoint whose
    run settings predate packing (no ``pack_tokens`` key) resumes unpacked and refuses a packed resume."""
    import types

    from artcache.trainers.consumer.config import run_settings
    from artcache.trainers.consumer.restore import check_run_settings

    packed = _cfg(tmp_path, tmp_path, "r", pack_tokens=64, steps=10)
    st = types.SimpleNamespace(run=run_settings(packed), schedule=None, step=2)
    check_run_settings(packed, st, tmp_path)
    with pytest.raises(ConfigError, match=r"--pack-tokens 0 \(checkpoint: 64\)"):
        check_run_settings(_cfg(tmp_path, tmp_path, "r", steps=10), st, tmp_path)
    old = {k: v for k, v in run_settings(_cfg(tmp_path, tmp_path, "r", steps=10)).items() if k != "pack_tokens"}
    st_old = types.SimpleNamespace(run=old, schedule=None, step=2)
    check_run_settings(_cfg(tmp_path, tmp_path, "r", steps=10), st_old, tmp_path)
    with pytest.raises(ConfigError, match=r"--pack-tokens 64 \(checkpoint: 0\)"):
        check_run_settings(packed, st_old, tmp_path)
