"""A DFlash and an EAGLE-3 consumer on one root that captures the union of their layers, each evaluating on
the plan's held-out split (real processes, tiny random target).

Checks: each draft reads its own view of the captured layers; the held-out positions are never trained on,
are captured once and shared (pinned in both registrations, so kept between evaluations), and count in
the window bound; metrics.csv / TensorBoard get train and eval scalars; replay uses the target's argmax
(the root captures layer L-1). Deadlines only bound a hung run.
"""

from __future__ import annotations

import json
from collections import Counter

from artcache import journal as J
from artcache.layout import CacheLayout
from artcache.trainers.tracking import read_metrics, tensorboard_available
from tests.protocol.test_consumer_resume import Proc, consume_args
from tests.support import TINY_SHAREGPT
from tests.support.procs import inspect_json, wait_until

DATA = TINY_SHAREGPT
STEPS, BATCH, EVAL, INTERVAL = 6, 2, 4, 3


def summary_of(proc: Proc) -> dict:
    lines = [ln for ln in proc.text().splitlines() if ln.startswith("{")]
    assert lines, proc.text()[-3000:]
    return json.loads(lines[-1])


def test_dflash_and_eagle3_views_with_held_out_evaluation(tmp_path, tiny_target):
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    # DFlash with 3 draft layers reads [1, 2, 3]; EAGLE-3 (L = 6) reads [1, 2, 2] and L-1 = 5: the union
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, layer_ids=[1, 2, 3, 5]))
    common = ("--eval-samples", str(EVAL), "--eval-interval", str(INTERVAL))
    cons = [Proc("d", consume_args(cache, tmp_path, "d", STEPS, "--draft-layers", "3", *common), tmp_path),
            Proc("e", consume_args(cache, tmp_path, "e", STEPS, "--draft", "eagle3", "--draft-vocab", "600",
                                   "--ttt-steps", "3", *common), tmp_path)]
    procs = list(cons)
    try:
        from artcache import registry

        layout = CacheLayout(cache)
        wait_until(lambda: all((r := registry.read(layout, c)) is not None and r.state == "running"
                               for c in ("d", "e")), "both consumers to register", procs)
        prod = Proc("producer", ["producer", "--cache", str(cache), "--target", tiny_target.path, "--data", str(DATA),
                                 "--max-samples", "40", "--max-length", "128", "--layer-ids", "1,2,3,5",
                                 "--threads", "1", "--exit-when-done", "--done-grace", "1", "--disk-budget", "auto"],
                    tmp_path)  # retention by need: what both read stays for a later run
        procs.append(prod)
        for p in cons:
            p.expect(0)
        prod.expect(0)
    finally:
        for p in procs:
            p.kill()

    from artcache.plan import Plan
    from artcache.settings import load_settings

    settings = load_settings(CacheLayout(cache))
    n = len(Plan.load(CacheLayout(cache).plan_dir(settings.plan_id)))
    held_out = set(range(n - EVAL, n))
    res = J.read_events(CacheLayout(cache).journal)
    evs = res.events
    for cid in ("d", "e"):
        requests = [e for e in evs if isinstance(e, J.Request) and e.consumer == cid]
        train = [e for e in requests if not e.held_out]
        assert [e.position for e in train] == list(range(STEPS * BATCH))
        assert not {e.sample for e in train} & held_out  # never a held-out sample in training
        # evaluations at steps 0, 3 and 6, each over the whole split (read by sample index, no position)
        held = [e for e in requests if e.held_out]
        assert all(e.position == -1 for e in held)
        assert Counter(e.sample for e in held) == {p: STEPS // INTERVAL + 1 for p in held_out}
        steps = [e for e in evs if isinstance(e, J.Step) and e.consumer == cid]
        assert [s.cursor for s in steps] == [BATCH * (i + 1) for i in range(STEPS)]
        start = [e for e in evs if isinstance(e, J.ConsumerStart) and e.consumer == cid]
        assert start[0].pinned == EVAL
    # pinned in both registrations: captured once, kept between evaluations and shared by both drafts
    # (held-out samples have no run position since epochs: counted by the fingerprint each read names)
    held_fps = {e.fp for e in evs if isinstance(e, J.Request) and e.held_out}
    assert len(held_fps) == EVAL
    captured = Counter(e.fp for e in evs if isinstance(e, J.Capture))
    assert all(captured[fp] == 1 for fp in held_fps), captured

    d, e = summary_of(cons[0]), summary_of(cons[1])
    assert d["eval"]["labels"] == e["eval"]["labels"] == "target argmax"
    assert d["eval"]["samples"] == EVAL and d["eval"]["step"] == STEPS
    assert 1.0 <= d["eval"]["tau"] <= 4.0 and 1.0 <= d["eval"]["replay_tau"] <= d["eval"]["tau"] + 3.0
    assert e["draft"] == "eagle3" and e["steps"] == STEPS and "sim_acc_len" in e
    assert e["eval"]["replay_tau"] >= 1.0 and e["eval"]["sim_acc_len_includes_bonus"] is False
    for cid in ("d", "e"):
        run = tmp_path / "runs" / cid
        rows = read_metrics(run / "metrics.csv")
        assert [r[0] for r in rows if r[1] == "train/loss"] == list(range(1, STEPS + 1))
        assert [r[0] for r in rows if r[1] == "eval/loss"] == [0, 3, 6]
        tags = {r[1] for r in rows}
        assert {"train/steps_per_s", "train/wait_s", "train/lr", "eval/acc_1", "eval/replay_tau"} <= tags
        assert ("train/tau" if cid == "d" else "train/sim_acc_len") in tags
        assert (run / "tensorboard").is_dir() == tensorboard_available()

    acc = inspect_json(cache)
    assert acc["violations"] == []
    c = acc["cache"]
    # the bound counts each consumer's pinned split: Σ (lookbehind + lookahead + 1 + EVAL)
    assert c["window_bound_artifacts"] == 2 * (2 + 8 + 1 + EVAL)
    assert 0 < c["max_retained_bytes"] <= c["budget_bytes"] and c["budget_exceeded_bytes"] == 0
    # both finished: nothing is needed any more, and the (auto) budget keeps it all for a later run
    assert c["retained_artifacts"] == c["publications"] and c["evictions"] == 0


def test_regression_unknown_best_metric_is_not_silent(caplog):
    """Breakfix report: `consume --best-metric nope --eval-samples 2` trained and evaluated with no word while
    checkpoints/best was never written (`"best": null`), a typo (`replay-tau`) the same. The first evaluation
    that lacks the figure now warns once, naming the figures it has."""
    import logging
    from types import SimpleNamespace

    from artcache.trainers.consumer.session import Session

    s = Session.__new__(Session)
    s.cfg = SimpleNamespace(consumer_id="d")
    s.best_metric, s.best, s.unknown_best_noted = "replay-tau", None, False
    s.last_eval = {"loss": 10.8, "tau": 1.0, "replay_tau": 1.0, "blocks": 110, "samples": 2, "step": 2,
                   "tau_includes_bonus": True, "labels": "target argmax"}
    with caplog.at_level(logging.WARNING, logger="artcache.consumer"):
        s._maybe_best(2)
        s._maybe_best(4)
    notes = [r.getMessage() for r in caplog.records if "--best-metric replay-tau" in r.getMessage()]
    assert len(notes) == 1 and "figures: loss, tau, replay_tau" in notes[0], notes
    assert s.best is None


def test_consumer_without_the_last_layer_warns_once_at_start(tmp_path, caplog):
    """A standalone `artcache consume --eval-samples N` on a root that lacks the target's last layer (here a
    DFlash-only root of the 8-layer random target: [1, 3, 5], no 7) runs (no failure) but says at setup, once,
    that layer 7 is missing and replay_tau will be absent; a root with layer 7, or no held-out split, says
    nothing."""
    import logging

    from artcache.producer import ProducerConfig, prepare_root
    from artcache.trainers.consumer import ConsumerConfig, Session

    def setup_log(layers: list[int], eval_samples: int) -> list[str]:
        cache = tmp_path / f"cache-{'-'.join(map(str, layers))}-{eval_samples}"
        prepare_root(ProducerConfig(cache=str(cache), target="random:tiny-llama", dataset="synthetic", max_length=64,
                                    max_samples=16, layer_ids=layers, threads=1))
        cfg = ConsumerConfig(cache=str(cache), consumer_id="d", draft="dflash", draft_layers=3, block_size=4,
                             num_anchors=4, batch_size=1, lookahead=4, steps=2, threads=1, eval_samples=eval_samples,
                             out_dir=str(cache.parent / f"run-{cache.name}"))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="artcache.consumer"):
            s = Session(cfg)
            s.setup()
        assert (s.last_index is None) == (7 not in layers or not eval_samples)
        return [r.getMessage() for r in caplog.records if "last layer" in r.getMessage()]

    notes = setup_log([1, 3, 5], 2)
    assert len(notes) == 1, notes
    for needle in ("[d] --eval-samples 2", "does not capture the target's last layer 7 (captured: [1, 3, 5])",
                   "no replay_tau", "capture.replay_layer"):
        assert needle in notes[0], (needle, notes[0])
    assert setup_log([1, 3, 5, 7], 2) == []
    assert setup_log([1, 3, 5], 0) == []
