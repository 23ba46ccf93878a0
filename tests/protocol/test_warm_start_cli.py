"""Issue 16 from the command line, on the tiny random target (``--target random:tiny-llama --data
synthetic``), real ``artcache producer`` / ``consume`` processes sharing one root (``artcache export`` through the
CLI in this process: the same command without another interpreter's start):

- an evaluated run keeps ``checkpoints/best`` beside ``latest``;
- every export of DFlash and EAGLE-3 seeds a new run (``--init-from``);
- a layer-id mismatch is refused naming the layers (exit 2, nothing registered);
- ``--lr 1e38`` exits nonzero naming the step, the last finite checkpoint kept, the registration failed.

Deadlines only bound a hung run; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import safetensors.torch
from click.testing import CliRunner

from artcache import registry
from artcache.app.cli import main
from artcache.layer_ids import dflash_layer_ids, eagle3_capture_ids
from artcache.layout import CacheLayout
from artcache.producer import ProducerConfig, prepare_root
from artcache.trainers.checkpoint import read_state
from tests.support.procs import Proc as BaseProc

L = 8  # random:tiny-llama
DFLASH = dflash_layer_ids(L, 2)
EAGLE3 = eagle3_capture_ids(L)


class Proc(BaseProc):
    deadline = 600.0


def consume(root: Path, cwd: Path, cid: str, *extra: str) -> list[str]:
    return ["consume", "--cache", str(root), "--id", cid, "--window", "2:8", "--batch-size", "2", "--threads", "1",
            "--demand-timeout", "300", "--log-every", "1", "--out", str(cwd / "runs" / cid), "--no-progress",
            "--no-tensorboard", *extra]


DF = ("--draft", "dflash", "--draft-layers", "2", "--block-size", "4", "--anchors", "4")
E3 = ("--draft", "eagle3", "--ttt-steps", "2", "--draft-vocab", "256")


def finite(ckpt: Path) -> bool:
    t = safetensors.torch.load_file(ckpt / "model.safetensors")
    return all(bool(v.float().isfinite().all()) for v in t.values() if v.is_floating_point())


def test_warm_starts_best_checkpoints_and_divergence_from_the_cli(tmp_path):
    root = tmp_path / "root"
    union = sorted(set(DFLASH) | set(EAGLE3))
    # the root, as the producer makes it: the first consumers start beside the producer, not after its start
    prepare_root(ProducerConfig(cache=str(root), target="random:tiny-llama", dataset="synthetic", max_samples=24,
                                max_length=32, layer_ids=union))
    prod = Proc("producer", ["producer", "--cache", str(root), "--target", "random:tiny-llama", "--data", "synthetic",
                             "--max-samples", "24", "--max-length", "32", "--layer-ids", ",".join(map(str, union)),
                             "--threads", "1"],
                tmp_path)
    procs: list[Proc] = []
    try:
        # sources: an evaluated DFlash run (checkpoints/best) and an EAGLE-3 run
        d = Proc("d", consume(root, tmp_path, "d", *DF, "--steps", "4", "--save-every", "1", "--keep-checkpoints",
                              "1", "--eval-samples", "4", "--eval-interval", "2", "--eval-anchors", "4", "--json"),
                 tmp_path)
        e = Proc("e", consume(root, tmp_path, "e", *E3, "--steps", "2"), tmp_path)
        procs += [d, e]
        d.expect(0)
        e.expect(0)
        best = tmp_path / "runs" / "d" / "checkpoints" / "best"
        assert best.is_symlink() and (best / "state.json").is_file()
        assert (tmp_path / "runs" / "d" / "checkpoints" / "latest").resolve().name == "step-00000004"
        assert read_state(best).eval["step"] == read_state(best).step  # the evaluation that made it best
        assert json.loads(d.text().strip().splitlines()[-1])["best"]["metric"] == "replay_tau"  # the root has L-1
        # every export of both drafts seeds a new run. The EAGLE-3 seed keeps its own 256-token map, which
        # covers ~40 % of this random-token plan's supervised tokens (below the 0.5 default): it is refused
        # without --keep-vocab-map (tests/unit/test_seed.py) and trains with it, logging the figure.
        runs = (("d", DF), ("e", (*E3, "--keep-vocab-map")))
        for src, _ in runs:
            for fmt in ("hf", "speculators"):
                res = CliRunner().invoke(main, ["export", "--checkpoint", str(tmp_path / "runs" / src), "--format",
                                                fmt, "--out", str(tmp_path / f"{src}-{fmt}"), "--dtype", "float32"])
                assert res.exit_code == 0, res.output
        # the seeded runs, the refused layer mismatch and the divergent run are independent consumers of the
        # root: started together, then checked one by one
        seeds = {(src, fmt): Proc(f"seed-{src}-{fmt}", consume(root, tmp_path, f"{src}-{fmt}", *flags, "--steps", "1",
                                                               "--init-from", str(tmp_path / f"{src}-{fmt}")),
                                  tmp_path)
                 for src, flags in runs for fmt in ("hf", "speculators")}
        # a layer-id mismatch is refused before registering, naming both layer lists
        bad = Proc("bad", consume(root, tmp_path, "bad", *DF, "--layer-ids", f"{DFLASH[1]},{DFLASH[0]}", "--steps", "1",
                                  "--init-from", str(tmp_path / "runs" / "d")), tmp_path)
        # --lr 1e38 diverges: nonzero exit naming the step, no checkpoint after it, registration failed
        div = Proc("div", consume(root, tmp_path, "div", *DF, "--steps", "6", "--save-every", "1", "--lr", "1e38"),
                   tmp_path)
        procs += [*seeds.values(), bad, div]
        for (src, fmt), s in seeds.items():
            s.expect(0)
            assert "weights seeded from" in s.text() and f"artcache export ({fmt})" in s.text()
            if src == "e":
                assert re.search(r"vocab map \(256 tokens\) covers \d+\.\d% of this plan's supervised training "
                                 r"tokens \(below --min-vocab-coverage 0.5, kept by --keep-vocab-map\)", s.text())
        bad.expect(2)
        assert f"trained on layers {DFLASH}, this run reads {[DFLASH[1], DFLASH[0]]}" in bad.text()
        assert registry.read(CacheLayout(root), "bad") is None
        div.expect(1)
        text = div.text()
        assert "TrainingDiverged" in text and "non-finite" in text, text[-3000:]
        step = int(re.search(r"non-finite [a-z ]+ at step (\d+)", text).group(1))
        latest = (tmp_path / "runs" / "div" / "checkpoints" / "latest")
        if step > 1:
            assert latest.resolve().name == f"step-{step - 1:08d}" and finite(latest)
        else:
            assert not latest.exists()
        reg = registry.read(CacheLayout(root), "div")
        assert reg.state == "failed" and "TrainingDiverged" in reg.reason
    finally:
        for p in procs:
            p.kill()
        prod.popen.terminate()
        prod.wait()
