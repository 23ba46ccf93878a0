"""``artcache run``: layer union and per-experiment views, checks before anything starts, dry-run, and
real runs on the tiny target (a failed experiment leaves its siblings running and the exit status
nonzero; two experiments resume from unequal checkpoints, each at its own frontier).

Deadlines only bound a hung run; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from artcache import journal as J
from artcache import registry, store
from artcache.app.cli import main
from artcache.app.config import load_run_config
from artcache.app.experiments import draft_view, layer_union, plan_run, view_index
from artcache.backends.hf import HFCaptureBackend
from artcache.contract import CaptureContract
from artcache.errors import ConfigError, ContractMismatch
from artcache.layout import CacheLayout
from tests.support import REPO, TINY_SHAREGPT

DATA = TINY_SHAREGPT
DEADLINE_S = 600.0


def base_toml(tiny_target, out: Path, *experiments: str, extra: str = "") -> str:
    """A run config on the tiny target (6 layers: DFlash with 3 draft layers reads [1, 2, 3])."""
    head = f"""
out = "{out}"
[target]
name = "{tiny_target.path}"
threads = 1
[data]
dataset = "{DATA}"
max_length = 128
max_samples = 40
[capture]
draft_layers = 3
[cache]
done_grace_s = 1.0
heartbeat_timeout_s = 30.0
demand_timeout_s = 300.0
{extra}
"""
    return head + "".join(experiments)


def exp(name: str, draft: str = "dflash", steps: int = 6, **consumer) -> str:
    """One ``[[experiments]]`` table: ``consumer`` settings go under ``[experiments.consumer]``, except those the
    experiment holds under a key of its own (``lr``, ``seed`` ...), which go to the experiment's table."""
    from artcache.app.config import Experiment

    own = "".join(f"{k} = {json.dumps(v)}\n" for k, v in consumer.items() if k in Experiment.__struct_fields__)
    table = {"progress": False, "tensorboard": False,
             **{k: v for k, v in consumer.items() if k not in Experiment.__struct_fields__}}
    if draft == "eagle3":
        table.update(ttt_steps=2, draft_vocab=512)
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in table.items())
    # block options for the block drafts (DFlash, DSpark); an EAGLE-3 refuses them
    dflash = "block_size = 4\nanchors = 4\n" if draft in ("dflash", "dspark") else ""
    return f"""
[[experiments]]
name = "{name}"
draft = "{draft}"
{dflash}batch_size = 2
steps = {steps}
window = "2:8"
threads = 1
log_every = 1
{own}[experiments.consumer]
{body}
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- the union and the views return exactly what a solo capture would ---------------------------------

def contract_for(info, layer_ids) -> CaptureContract:
    return CaptureContract(target_name=info.name, target_revision=info.revision, target_config_hash=info.config_hash,
                           target_weights_digest=info.weights_digest, layer_ids=tuple(layer_ids), dtype="bfloat16",
                           max_length=128, tokenizer_digest="t", template_digest="t")


class Sample:
    def __init__(self, ids: torch.Tensor) -> None:
        self.input_ids = ids.to(torch.int32)
        self.loss_mask = torch.ones_like(ids, dtype=torch.uint8)


def test_union_views_equal_solo_captures(tiny_target, tmp_path):
    """Capture a batch once with the union of three views and once per view alone: each view's slice of
    the union (by :func:`view_index`, and by the consumer's own ``artcache.trainers.draft`` selection) equals the
    solo capture bit for bit, in memory and after publish/read through the store."""
    from artcache.layer_ids import dflash_layer_ids, eagle3_capture_ids, layer_view, select_layers, view_slice
    from artcache.target import load_target_model

    L = tiny_target.num_layers
    views = {"dflash": dflash_layer_ids(L, 3), "eagle3": eagle3_capture_ids(L), "reversed": [4, 0, 2]}
    union = layer_union(list(views.values()))
    assert views["dflash"] == [1, 2, 3] and views["eagle3"] == [1, 2, 2, 5] and union == [0, 1, 2, 3, 4, 5]
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(3, 49152, (n,), generator=g)) for n in (17, 9, 30)]  # padded batch
    model = load_target_model(tiny_target, "cpu", torch.float32)
    ub = HFCaptureBackend(model, contract_for(tiny_target, union))
    whole = ub.capture(samples)
    ub.close()
    uc = contract_for(tiny_target, union)
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    for name, view in views.items():
        backend = HFCaptureBackend(model, contract_for(tiny_target, view))
        solo = backend.capture(samples)
        backend.close()
        idx = view_index(union, view)
        assert idx == layer_view(union, view, draft=name, flag_hint="")
        for i, (u, s) in enumerate(zip(whole, solo, strict=True)):
            assert s["hidden_states"].shape == (samples[i].input_ids.shape[0], len(view), tiny_target.hidden_size)
            assert torch.equal(u["hidden_states"][:, idx], s["hidden_states"]), (name, i)
            assert torch.equal(select_layers(u["hidden_states"], view_slice(idx)), s["hidden_states"])
            fp = f"{i:02x}" + "ab" * 15
            store.publish(layout, fp, uc, u)
            art = store.read(layout, fp, uc)
            assert torch.equal(art.hidden_states[:, idx], s["hidden_states"]), (name, i)
            assert torch.equal(art.input_ids, s["input_ids"])


def test_view_index_names_missing_layers():
    assert view_index([1, 8, 14, 20, 26, 27, 29], [1, 14, 26, 29]) == [0, 2, 4, 6]
    assert view_index([1, 2, 5], [2, 2, 5]) == [1, 1, 2]
    with pytest.raises(ContractMismatch, match=r"layers \[9\] of the view \[1, 9\] are not captured"):
        view_index([1, 8], [1, 9])


def test_draft_views_follow_the_published_formulas():
    from artcache.app.config import Experiment

    assert draft_view(Experiment(name="d", draft_layers=5), 30) == [1, 8, 14, 20, 27]
    assert draft_view(Experiment(name="e", draft="eagle3"), 30) == [1, 14, 26, 29]
    assert draft_view(Experiment(name="e", draft="eagle3"), 36) == [1, 17, 32, 35]
    assert draft_view(Experiment(name="x", layer_ids=[3, 1]), 30) == [3, 1]
    assert layer_union([[1, 8, 14, 20, 27], [1, 14, 26, 29]]) == [1, 8, 14, 20, 26, 27, 29]
    with pytest.raises(ConfigError, match="0..29"):
        draft_view(Experiment(name="x", layer_ids=[30]), 30)


# ---- the plan: checks before anything starts ----------------------------------------------------------

def plan_of(tiny_target, tmp_path, *experiments, extra="", overrides=()):
    cfg = load_run_config(write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", *experiments,
                                                                    extra=extra)), overrides)
    return plan_run(cfg)


def test_plan_union_views_and_disk_bound(tiny_target, tmp_path):
    plan, resolved = plan_of(tiny_target, tmp_path, exp("d"), exp("e", "eagle3"))
    assert plan.captured_layer_ids == [1, 2, 3, 5] and resolved.capture.layer_ids == [1, 2, 3, 5]
    d, e = plan.experiments
    assert (d.layer_ids, d.view) == ([1, 2, 3], [0, 1, 2])
    assert (e.layer_ids, e.view) == ([1, 2, 2, 5], [0, 1, 1, 3])
    assert d.positions == 12 and d.window_artifacts == 11 and plan.window_bound_artifacts == 22
    assert plan.bytes_per_artifact_max >= 128 * 4 * 64 * 2
    assert plan.disk_bound_bytes == 22 * plan.bytes_per_artifact_max
    assert d.consumer["draft_layers"] == 3 and d.out_dir == str(tmp_path / "out" / "experiments" / "d")
    assert not (tmp_path / "out").exists()  # planning writes nothing


@pytest.mark.parametrize("overrides", [[], ["data.template_options.enable_thinking=false", "target.dtype=float16"]])
def test_plan_contract_and_plan_id_are_the_producers(tiny_target, tmp_path, overrides):
    """The contract and plan the run checks checkpoints and an existing root against are exactly the ones
    the producer writes (the plan builds them without writing; a drift would reject good roots)."""
    from artcache.app.config import producer_config
    from artcache.producer import prepare_root

    plan, resolved = plan_of(tiny_target, tmp_path, exp("d"), exp("e", "eagle3"), overrides=overrides)
    _layout, settings, *_ = prepare_root(producer_config(resolved))
    assert settings.contract.contract_id == plan.contract_id and settings.plan_id == plan.plan_id
    assert list(settings.contract.layer_ids) == plan.captured_layer_ids == [1, 2, 3, 5]
    again, _ = plan_run(resolved)  # the root now exists: compatible, accepted
    assert again.contract_id == plan.contract_id


def test_producer_started_by_hand_from_a_run_config_captures_the_union(tiny_target, tmp_path):
    from artcache.app.config import producer_config

    cfg = load_run_config(write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d"),
                                                                    exp("e", "eagle3"))))
    assert producer_config(cfg).layer_ids == [1, 2, 3, 5]
    assert producer_config(load_run_config(None, ["capture.draft_layers=2"])).layer_ids is None  # DFlash ids


@pytest.mark.parametrize("experiments, overrides, captured, served", [
    ((exp("d", eval_samples=4),), [], [1, 2, 3, 5], ["d"]),  # DFlash alone, evaluating: + L-1 = 5
    ((exp("d"),), [], [1, 2, 3], []),  # no held-out split: the views only
    ((exp("d", eval_samples=4),), ["capture.replay_layer=false"], [1, 2, 3], []),  # opted out
    ((exp("d", eval_samples=4), exp("e", "eagle3")), [], [1, 2, 3, 5], []),  # EAGLE-3's view already reads 5
    ((exp("d"), exp("d2", eval_samples=4)), [], [1, 2, 3, 5], ["d2"]),
])
def test_plan_adds_the_last_layer_for_a_held_out_replay(tiny_target, tmp_path, experiments, overrides, captured,
                                                        served):
    """With capture.layer_ids left out, an experiment with eval_samples > 0 makes the union hold the target's
    last layer L-1 (the greedy replay's target argmax) unless capture.replay_layer = false; the producer started
    by hand from the same config captures the same layers, and the plan names the layer and its bytes."""
    from artcache.app.config import producer_config
    from artcache.contract import stored_bytes_per_token

    plan, resolved = plan_of(tiny_target, tmp_path, *experiments, overrides=overrides)
    assert plan.captured_layer_ids == captured == resolved.capture.layer_ids
    cfg = load_run_config(tmp_path / "run.toml", overrides)
    assert producer_config(cfg).layer_ids == captured
    assert plan.replay_layer_for == served
    if served:
        h = tiny_target.hidden_size
        assert plan.replay_layer == 5
        assert plan.replay_layer_bytes == 128 * (stored_bytes_per_token("bfloat16", 4, h)
                                                 - stored_bytes_per_token("bfloat16", 3, h)) == 128 * h * 2
    else:
        assert plan.replay_layer is None and plan.replay_layer_bytes == 0


def test_regression_dflash_only_eval_captures_the_last_layer(tiny_target, tmp_path):
    """configs/gpu-smollm2-dflash.toml (one DFlash experiment, eval_samples 64) captured only
    DFlash's view [1, 8, 14, 20, 27], so the held-out evaluation had no target last layer and reported no
    replay_tau (earlier runs had EAGLE-3 beside it, whose view holds L-1). Now the plan, the root it prepares
    and the dry run hold L-1 and say why; a given capture.layer_ids without it is noted, not changed."""
    from artcache.app.config import producer_config
    from artcache.producer import prepare_root

    plan, resolved = plan_of(tiny_target, tmp_path, exp("d", eval_samples=4))
    assert plan.captured_layer_ids == [1, 2, 3, 5] and plan.experiments[0].view == [0, 1, 2]
    _layout, settings, *_ = prepare_root(producer_config(resolved))
    assert list(settings.contract.layer_ids) == [1, 2, 3, 5]
    result = CliRunner().invoke(main, ["run", "--config", str(tmp_path / "run.toml"), "--dry-run", "--out",
                                       str(tmp_path / "o2")])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "capture layers [1, 2, 3, 5] (union of the experiments' views + layer 5)" in text, text
    assert "layer 5, the target's last, is added for the held-out greedy replay (replay_tau) of d: " in text
    assert f"{128 * tiny_target.hidden_size * 2 / 2**10:.1f} KiB per artifact at most" in text  # 16 KiB
    assert "capture.replay_layer = false leaves it out" in text
    (tmp_path / "x").mkdir()
    plan2, _ = plan_of(tiny_target, tmp_path / "x", exp("d", eval_samples=4), overrides=["capture.layer_ids=1,2,3"])
    assert plan2.captured_layer_ids == [1, 2, 3] and plan2.replay_layer is None
    assert any("lacks the target's last layer 5: the held-out evaluation of d reports data-token figures only, no "
               "replay_tau" in n for n in plan2.notes), plan2.notes


def dry_run(path: Path, *args: str):
    return CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run", *args])


def test_regression_run_warns_of_a_disk_budget_over_the_filesystem(tiny_target, tmp_path):
    """Bug: ``cache.disk_budget = "100T"`` (more than the root's filesystem) was said only in the producer's log,
    as "give a --disk-budget", while ``artcache run`` and its dry run printed nothing. Symptom: a budget that never
    binds (captures fail for space first) went unnoticed. The plan (dry run and run) now says it once on the
    terminal, naming ``cache.disk_budget``; a budget that fits says nothing."""
    plan, _ = plan_of(tiny_target, tmp_path, exp("d"), extra='disk_budget = "100T"')
    over = [n for n in plan.notes if "disk_budget" in n]
    assert len(over) == 1 and over[0].startswith(f"cache.disk_budget 100.00 TiB ({100 * 2**40} bytes) exceeds "), over
    assert "give a cache.disk_budget that fits (or auto)" in over[0] and "--disk-budget" not in over[0]
    result = dry_run(tmp_path / "run.toml", "--out", str(tmp_path / "o2"))
    assert result.exit_code == 0, result.output
    assert result.stdout.count("cache.disk_budget 100.00 TiB") == 1, result.stdout
    (tmp_path / "x").mkdir()
    fits, _ = plan_of(tiny_target, tmp_path / "x", exp("d"), extra='disk_budget = "1M"')
    assert not [n for n in fits.notes if "disk_budget" in n], fits.notes


def test_regression_dry_run_labels_explicit_layer_ids_as_such(tiny_target, tmp_path):
    """With an explicit capture.layer_ids the dry run still said "(union of the experiments'
    views)" (the config's own ids, not a union the plan derived); the plan and plan.json say which."""
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d")))
    result = dry_run(path, "capture.layer_ids=1,2,3,4")
    assert result.exit_code == 0, result.output
    assert "capture layers [1, 2, 3, 4] (capture.layer_ids, explicit in the config) into " in result.stdout
    assert "union" not in result.stdout.splitlines()[3], result.stdout
    plan, _ = plan_of(tiny_target, tmp_path, exp("d"), overrides=["capture.layer_ids=1,2,3,4"])
    assert plan.explicit_layer_ids
    plan, _ = plan_of(tiny_target, tmp_path, exp("d"))
    assert not plan.explicit_layer_ids


def test_regression_dry_run_prints_small_replay_bytes_in_a_unit_that_shows_them(tiny_target, tmp_path):
    """On a tiny target the replay layer's bytes printed as "0.0 MiB" (16 KiB per artifact); the
    dry run now prints every size with artcache.report.format_bytes (KiB, or B, under 1 MiB)."""
    from artcache.report import format_bytes

    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d", eval_samples=4)))
    result = dry_run(path)
    assert result.exit_code == 0, result.output
    assert "0.0 MiB" not in result.stdout, result.stdout
    per = 128 * tiny_target.hidden_size * 2
    assert f": {format_bytes(per)} per artifact at most, " in result.stdout and format_bytes(per) == "16.0 KiB"


def test_regression_no_missing_last_layer_note_when_replay_layer_is_off(tiny_target, tmp_path):
    """An explicit capture.layer_ids without the target's last layer noted that the held-out
    evaluation has no replay_tau even under capture.replay_layer = false, the setting that turns it off."""
    explicit = ["capture.layer_ids=1,2,3"]
    plan, _ = plan_of(tiny_target, tmp_path, exp("d", eval_samples=4), overrides=explicit)
    assert any("lacks the target's last layer 5" in n for n in plan.notes), plan.notes  # still noted when on
    plan, _ = plan_of(tiny_target, tmp_path, exp("d", eval_samples=4),
                      overrides=[*explicit, "capture.replay_layer=false"])
    assert not any("last layer" in n for n in plan.notes), plan.notes
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d", eval_samples=4)))
    result = dry_run(path, *explicit, "capture.replay_layer=false")
    assert result.exit_code == 0, result.output
    assert "last layer" not in result.stdout and "replay_tau" not in result.stdout, result.stdout


@pytest.mark.parametrize("dry", [True, False])
def test_regression_negative_capture_layer_id_names_the_id_and_the_range(tiny_target, tmp_path, dry):
    """``capture.layer_ids=[-1,5]`` was refused as "lacks layers the experiments read" (naming the
    experiments' views, not the bad id -1 nor what is accepted). The dry run and the real run now range-check
    the config's own ids first: one line naming -1 and 0..L-1, exit 2, nothing written."""
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d")))
    args = ["run", "--config", str(path), *(["--dry-run"] if dry else []), "capture.layer_ids=[-1,5]"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "capture.layer_ids [-1, 5]: [-1] are not output-of-layer ids of a 6-layer target" in result.output
    assert "(accepted: 0..5)" in result.output and "lacks layers" not in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def _plan_len(tiny_target, tmp_path) -> int:
    """The length of base_toml's plan (tiny_sharegpt.json at max_length 128: fewer than its max_samples 40)."""
    from artcache.plan import PlanSpec, build_plan
    from artcache.target import load_tokenizer

    spec = PlanSpec(dataset=str(DATA), seed=0, max_length=128, max_samples=40)
    return len(build_plan(spec, load_tokenizer(tiny_target), target_vocab_size=tiny_target.vocab_size))


@pytest.mark.parametrize("eval_samples", [40, 41, 1000])
def test_regression_dry_run_refuses_eval_samples_leaving_no_training_sample(tiny_target, tmp_path, eval_samples):
    """eval_samples >= data.max_samples passed the dry run (the consumer refused it only once
    started: the held-out split leaves no sample to train on). One line naming the values and the range."""
    n = _plan_len(tiny_target, tmp_path)
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d", eval_samples=eval_samples)))
    result = dry_run(path)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert (f"experiments.d.consumer.eval_samples {eval_samples} leaves no training sample: the plan has {n} samples "
            "(data.max_samples 40 is the most it holds)" in result.output), result.output
    assert f"accepted: 0 (no held-out split) .. {n - 1}" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    plan, _ = plan_of(tiny_target, tmp_path, exp("d", eval_samples=n - 1))  # the largest accepted
    assert plan.experiments[0].window_artifacts == 11 + n - 1


def test_regression_dry_run_checks_eval_samples_against_the_plan_as_the_consumer_does(tiny_target, tmp_path):
    """The dry run checked eval_samples against data.max_samples, the consumer against the plan's
    length, which can be shorter (tiny_sharegpt.json has fewer usable samples than max_samples 40): an
    eval_samples between the two passed the dry run and the consumer refused it once the run had started.
    Both directions: for every eval_samples around the plan's length and max_samples, the dry run refuses it
    iff the consumer's own setup (on the root the run's producer prepares) refuses it for that reason."""
    import msgspec

    from artcache.app.config import consumer_config, producer_config
    from artcache.producer import prepare_root
    from artcache.trainers.consumer.session import Session

    n = _plan_len(tiny_target, tmp_path)
    assert n < 40  # the case the defect needs: a plan shorter than data.max_samples
    cases = sorted({n - 1, n, n + 1, 39, 40})
    dry: dict[int, bool] = {}  # eval_samples -> the dry run refused it
    for k in cases:  # before any root exists: the dry run builds the plan in memory
        path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d", eval_samples=k)))
        result = dry_run(path)
        assert result.exit_code in (0, 2) and "Traceback" not in result.output, result.output
        dry[k] = result.exit_code == 2
        assert dry[k] == ("leaves no training sample" in result.output), result.output
    assert dry == {k: k >= n for k in cases}  # refused from the plan's length on, not from max_samples
    _, resolved = plan_of(tiny_target, tmp_path, exp("d"))  # no split: planned, so every k below reaches the consumer
    prepare_root(producer_config(resolved))  # the root the real run's producer prepares, with its plan
    e = resolved.experiments[0]
    for k in cases:
        with_k = msgspec.structs.replace(resolved, experiments=[msgspec.structs.replace(
            e, consumer={**e.consumer, "eval_samples": k})])
        try:
            Session(consumer_config(with_k, "d")).setup()  # what the started consumer checks first
            refused = False
        except ConfigError as exc:
            assert "leaves no training sample" in str(exc), exc  # no other refusal
            refused = True
        assert refused == dry[k], (k, n)


def test_root_without_the_replay_layer_names_the_opt_out(tiny_target, tmp_path):
    """A root an earlier DFlash-only run prepared without L-1: the evaluating config is refused (another
    contract), the message naming capture.replay_layer = false, which then plans on that root."""
    from artcache.producer import ProducerConfig, prepare_root

    prepare_root(ProducerConfig(cache=str(tmp_path / "out" / "cache"), target=tiny_target.path, dataset=str(DATA),
                                max_samples=40, max_length=128, layer_ids=[1, 2, 3]))
    with pytest.raises(ContractMismatch, match=re.escape("capture.replay_layer = false captures without it")):
        plan_of(tiny_target, tmp_path, exp("d", eval_samples=4))
    plan, _ = plan_of(tiny_target, tmp_path, exp("d", eval_samples=4), overrides=["capture.replay_layer=false"])
    assert plan.captured_layer_ids == [1, 2, 3]


def test_dry_run_prints_every_experiment_and_starts_nothing(tiny_target, tmp_path):
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("d"), exp("e", "eagle3")))
    result = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run", "experiments.d.lr=1e-3"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "capture layers [1, 2, 3, 5]" in out and "disk bound" in out
    for needle in ("d ", "e ", "1,2,2,5", "0,1,1,3", "0.001", "2:8"):
        assert needle in out, needle
    result = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run", "--json", "--out",
                                       str(tmp_path / "o2")])
    plan = json.loads(result.stdout)
    assert [x["name"] for x in plan["experiments"]] == ["d", "e"]
    assert plan["out"] == str(tmp_path / "o2") and plan["cache_root"] == str(tmp_path / "o2" / "cache")
    assert not (tmp_path / "o2").exists()
    assert not (tmp_path / "out").exists()


def fake_checkpoint(path: Path, **state) -> Path:
    path.mkdir(parents=True)
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    (path / "state.json").write_text(json.dumps({"draft": "dflash", "step": 3, "cursor": 6, **state}))
    return path


def test_init_from_another_target_is_rejected(tiny_target, tmp_path):
    ck = fake_checkpoint(tmp_path / "other", target_weights_digest="0" * 32)
    with pytest.raises(ContractMismatch) as info:
        plan_of(tiny_target, tmp_path, exp("d"), overrides=[f"experiments.d.init_from={ck}"])
    assert "0" * 32 in str(info.value) and tiny_target.weights_digest in str(info.value)


@pytest.mark.parametrize("state, needle", [
    ({"dtype": "float16"}, "hidden-state dtype 'float16'; this run gives 'bfloat16'"),
    ({"layer_convention": "input-of-layer"}, "layer convention"),
    ({"final_norm": "layernorm"}, "target final norm 'layernorm'"),
    ({"draft": "eagle3"}, "holds a 'eagle3' draft"),
])
def test_init_from_other_dtype_normalisation_or_draft_is_rejected(tiny_target, tmp_path, state, needle):
    ck = fake_checkpoint(tmp_path / "ck", target_weights_digest=tiny_target.weights_digest, **state)
    with pytest.raises(ContractMismatch, match=needle):
        plan_of(tiny_target, tmp_path, exp("d"), overrides=[f"experiments.d.init_from={ck}"])


def test_regression_dry_run_checks_the_seed_as_the_consumer_will(tiny_target, tmp_path):
    """A seed that the consumer would refuse passed ``--dry-run`` (and ``artcache run``'s
    checks) and failed only after the run started. The dry run now runs the consumer's own seed checks
    (artcache.trainers.seed): layers in order, sizes, keys."""
    no_layers = fake_checkpoint(tmp_path / "nl", target_weights_digest=tiny_target.weights_digest)
    with pytest.raises(ConfigError, match="records no layer ids"):
        plan_of(tiny_target, tmp_path, exp("d"), overrides=[f"experiments.d.init_from={no_layers}"])
    other = fake_checkpoint(tmp_path / "ol", target_weights_digest=tiny_target.weights_digest,
                            draft_config={"layer_ids": [1, 2, 5]})
    with pytest.raises(ConfigError, match=r"trained on layers \[1, 2, 5\], this run reads \[1, 2, 3\]"):
        plan_of(tiny_target, tmp_path, exp("d"), overrides=[f"experiments.d.init_from={other}"])
    with pytest.raises(ConfigError, match="no model.safetensors there"):
        plan_of(tiny_target, tmp_path, exp("d"), overrides=[f"experiments.d.init_from={tmp_path}"])
    assert not (tmp_path / "out").exists()


def test_dry_run_accepts_steps_past_one_pass_with_a_held_out_split(tiny_target, tmp_path):
    """With epochs (training wraps over the plan's training part and never reads the held-out split), an
    experiment whose ``steps × batch_size`` runs past the plan is planned, held-out split and all (this
    branch's dry-run refusal of such steps predated epochs and was dropped)."""
    plan, _ = plan_of(tiny_target, tmp_path, exp("d", steps=30, eval_samples=8))
    assert plan.experiments[0].consumer["eval_samples"] == 8 and plan.experiments[0].consumer["steps"] == 30
    assert plan.experiments[0].positions == 60
    assert not (tmp_path / "out").exists()


def test_dtype_the_target_cannot_give_is_rejected(tiny_target, tmp_path):
    with pytest.raises(ConfigError, match="target.dtype float32 cannot be given by a target computing in bfloat16"):
        plan_of(tiny_target, tmp_path, exp("d"), overrides=["target.dtype=float32", "target.compute_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="experiment 'd' wants float32 hidden states but this run captures bfloat16"):
        plan_of(tiny_target, tmp_path, exp("d"), overrides=["experiments.d.dtype=float32"])


def test_root_of_another_contract_is_rejected(tiny_target, tmp_path):
    from artcache.producer import ProducerConfig, prepare_root

    root = tmp_path / "out" / "cache"
    prepare_root(ProducerConfig(cache=str(root), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=2))
    with pytest.raises(ContractMismatch,
                       match=re.escape("differs in: capture.layer_ids [1, 3] there, [1, 2, 3, 5] here")):
        plan_of(tiny_target, tmp_path, exp("d"), exp("e", "eagle3"))


@pytest.mark.parametrize("overrides, error, needle", [
    (["capture.layer_ids=1,2"], ConfigError, "d needs [3]"),
    (["experiments.d.resume=true"], ConfigError, "holds no checkpoint"),
    (["experiments.d.device=cuda:7"], ConfigError, "experiments.d.device 'cuda:7'"),
    (["experiments.d.consumer.heartbeat_s=60"], ConfigError, "not below cache.heartbeat_timeout_s"),
    (["experiments.d.window=2:1"], ConfigError, "lookahead 1 is smaller than one batch"),
    (["experiments.d.layer_ids=1,9"], ConfigError, "0..5"),
    # regression: a repeated capture id was recorded twice in the contract (the producer's --layer-ids refused it)
    (["capture.layer_ids=1,2,2,3"], ConfigError,
     "capture.layer_ids [1, 2, 2, 3] captures layer(s) [2] more than once"),
    # issue 19's one range message, named by the config path (the plan's and the capture limits' declared ranges)
    (["data.max_samples=0"], ConfigError, "data.max_samples 0 is invalid: accepted an integer >= 1"),
    (["capture.batch_samples=0"], ConfigError, "capture.batch_samples 0 is invalid: accepted an integer >= 1"),
    (["capture.batch_tokens=64"], ConfigError,
     "capture.batch_tokens 64 is invalid: accepted an integer >= 128, the plan's max length"),
])
def test_bad_experiments_are_rejected_before_start(tiny_target, tmp_path, overrides, error, needle):
    with pytest.raises(error) as info:
        plan_of(tiny_target, tmp_path, exp("d"), overrides=overrides)
    assert needle in str(info.value)
    assert not (tmp_path / "out").exists()


def test_no_experiments_is_rejected(tiny_target, tmp_path):
    with pytest.raises(ConfigError, match="^config: no experiments"):
        plan_of(tiny_target, tmp_path)


@pytest.mark.parametrize("overrides, needle", [
    (["experiments.d.anchors=100000000"], "experiments.d.anchors 100000000 is invalid: accepted an integer >= 1 and "
     "<= 128 (data.max_length"),
    (["experiments.d.consumer.num_anchors=129"], "experiments.d.consumer.num_anchors is the experiment's own "
     "setting: set experiments.d.anchors instead"),
    (["experiments.d.consumer.eval_samples=2", "experiments.d.consumer.best_metric=replay_taux"],
     "experiment 'd': experiments.d.consumer.best_metric 'replay_taux' is not a held-out figure of the dflash "
     "draft"),
])
def test_regression_run_refuses_huge_anchors_and_unknown_best_metric(tiny_target, tmp_path, overrides, needle):
    """`artcache run` checks what the consumer will (anchors against data.max_length, the draft's
    held-out figures) before anything starts."""
    with pytest.raises(ConfigError) as info:
        plan_of(tiny_target, tmp_path, exp("d"), overrides=overrides)
    assert needle in str(info.value)
    assert not (tmp_path / "out").exists()


# ---- real runs -----------------------------------------------------------------------------------------

def artcache_run(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(config), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=DEADLINE_S)


def report_of(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_failed_experiment_leaves_siblings_running_and_exit_nonzero(tiny_target, tmp_path):
    """``bad`` gives up on its first demand miss (a 50 ms demand timeout, while the producer is still
    starting): it fails at run time, fences itself and releases its window; ``good`` runs every step;
    the run exits 1 and says which experiment failed."""
    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", base_toml(tiny_target, out, exp("good"), exp("bad", demand_timeout_s=0.05)))
    proc = artcache_run(cfg)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "experiment bad FAILED" in proc.stdout
    r = report_of(out)
    by = {x["name"]: x for x in r["experiments"]}
    assert by["good"]["exit_code"] == 0 and by["good"]["state"] == "completed"
    assert by["good"]["steps_run"] == 6 and by["good"]["cursor_end"] == 12
    # the consumer's own summary reaches the report (the run asks each consume for its JSON line)
    assert by["good"]["consumer_summary"]["steps"] == 6 and by["good"]["consumer_summary"]["state"] == "completed"
    assert by["good"]["checkpoint"].endswith("step-00000006")
    assert by["bad"]["exit_code"] == 1 and by["bad"]["state"] == "failed" and "CaptureTimeout" in by["bad"]["error"]
    assert by["bad"]["registration"] == "failed"  # fenced: its window no longer counts
    assert r["checks"]["every_experiment_completed"] is False and r["checks"]["failed_experiments_fenced"]
    assert r["checks"]["producer_exit_ok"] and r["checks"]["accounting_invariants"]
    layout = CacheLayout(out / "cache")
    assert registry.read(layout, "bad").state == "failed"
    assert (out / "experiments" / "good" / "checkpoints" / "latest").is_symlink()
    # no lease left; no cache.disk_budget: the windows-only rule, and with no live window nothing stays published
    cache_acc = r["root_accounting"]["cache"]
    assert cache_acc["leases_held"] == 0 and cache_acc["budget_exceeded_bytes"] == 0
    assert cache_acc["retention"] == "windows" and store.list_objects(layout) == {}
    # the resolved config beside the run and each experiment; it reloads to the config the run used
    saved = load_run_config(out / "config.toml")
    assert saved.capture.layer_ids == [1, 2, 3] and [e.name for e in saved.experiments] == ["good", "bad"]
    assert [e.name for e in load_run_config(out / "experiments" / "bad" / "config.toml").experiments] == ["bad"]
    assert json.loads((out / "experiments" / "good" / "report.json").read_text())["experiment"]["steps_run"] == 6
    # reports keep the shared production (counted once) apart from each experiment's committed work
    md = (out / "report.md").read_text()
    assert md.index("Shared production") < md.index("Per experiment")
    shared = r["shared_production"]
    assert shared["distinct_positions_consumed"] == 12 and shared["recaptures"] == 0
    assert shared["captures"] == shared["publications"] == shared["distinct_fingerprints"] == 12
    text = CliRunner().invoke(main, ["inspect", "--cache", str(out / "cache")]).stdout
    assert "Shared production (counted once)" in text and "published bytes" in text
    per = text.split("Per consumer")[1]
    assert "good" in per and "bad" in per and "completed" in per and "failed" in per


def signalled_run(tiny_target, tmp_path, signals: tuple[int, ...], toml=None, started: str = "producer started",
                  roles: int = 3) -> tuple[int, dict, list[int], str]:
    """Start ``artcache run`` with two long experiments (``toml(tiny_target, out, *experiments)``, default
    :func:`base_toml`), wait for the line starting with ``started`` (the last role's) and until both experiments
    have stepped, send ``signals`` back to back; returns (exit status, report, the ``roles`` role pids, stdout)."""
    import re
    import signal  # noqa: F401  (the callers' signal numbers)
    import time

    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", (toml or base_toml)(tiny_target, out, exp("a", steps=100000),
                                                           exp("b", steps=100000)))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "artcache", "run", "--config", str(cfg)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if line.startswith(started):
                break
        pids = [int(m) for m in re.findall(r"\(pid (\d+)", "".join(seen))]
        assert len(pids) == roles, "".join(seen)
        t0 = time.monotonic()
        while not all(any(isinstance(ev, J.Step) and ev.consumer == n for ev in
                          J.read_events(out / "cache" / "journal").events) for n in ("a", "b")):
            assert p.poll() is None and time.monotonic() - t0 < DEADLINE_S, "".join(seen)
            time.sleep(0.2)
        for sig in signals:
            p.send_signal(sig)
        rest = p.communicate(timeout=DEADLINE_S)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, report_of(out), pids, "".join(seen) + rest


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_run_first_signal_cancels_every_experiment(tiny_target, tmp_path):
    """artcache/shutdown.py's rule at the launcher: one SIGINT asks, so every experiment gets one SIGTERM and
    ends cancelled with a checkpoint, the report is written; exit 130 (128 + SIGINT: cancelled by a signal), nothing
    left running."""
    import signal

    code, report, pids, text = signalled_run(tiny_target, tmp_path, (signal.SIGINT,))
    assert code == 130, text[-4000:]
    assert report["problems"] == [], report["problems"]
    assert {x["name"]: x["state"] for x in report["experiments"]} == {"a": "cancelled", "b": "cancelled"}
    assert all((Path(x["out_dir"]) / "checkpoints" / "latest").is_dir() for x in report["experiments"])
    # the producer's own exit is clean: the run does not SIGTERM an --exit-when-done producer that journaled its
    # stop (test_regression_cancel_does_not_signal_an_exiting_producer)
    prod = report["shared_production"]
    assert report["checks"]["producer_exit_ok"], (prod["exit_code"], prod["stop_reason"], text[-2000:])
    assert all(_gone(pid) for pid in pids)


_ROLE = """
import sys, time
from pathlib import Path
from artcache import journal as J
from artcache.layout import CacheLayout
if sys.argv[2] != "-":
    w = J.JournalWriter(CacheLayout(Path(sys.argv[1])).journal_path("producer", sys.argv[3]))
    w.emit(J.ProducerStop(producer=sys.argv[3], reason=sys.argv[2]))
print("ready", flush=True)
time.sleep(120)
"""


def _stand_in(tmp_path, layout, name: str, reason: str):
    """A process that journals as producer ``name``, its role's name (its stop with ``reason``; ``-``: none), then
    sleeps."""
    from artcache.launch import Role

    role = Role(name, [sys.executable, "-c", _ROLE, str(layout.root), reason, name], tmp_path / f"{name}.log")
    t0 = time.monotonic()
    while "ready" not in role.log.read_text():
        assert role.poll() is None and time.monotonic() - t0 < 60, role.tail()
        time.sleep(0.05)
    return role


def test_regression_cancel_does_not_signal_an_exiting_producer(tmp_path):
    """A cancelled `artcache run` SIGTERMed its --exit-when-done producer once the
    experiments ended, though the producer had already left its loop on its own (its grace passed while they
    wrote their final checkpoints). In its teardown the default handlers are back, so it died -15 and the report
    said producer_exit_ok false. Now a producer that journaled its stop is not signalled, only waited for; one
    still in its loop gets the SIGTERM (it stops gracefully there)."""
    import signal

    from artcache.app.experiments import cancel_producer, journaled_stop

    layout = CacheLayout(tmp_path / "root")
    layout.journal.mkdir(parents=True)
    exiting = _stand_in(tmp_path, layout, "exiting", "all consumers finished")
    working = _stand_in(tmp_path, layout, "working", "-")
    try:
        assert journaled_stop(layout, exiting) == "all consumers finished" and journaled_stop(layout, working) is None
        assert cancel_producer(layout, exiting) is False
        assert cancel_producer(layout, working) is True
        assert working.wait(timeout=30) == -signal.SIGTERM
        time.sleep(0.5)
        assert exiting.poll() is None  # not signalled
    finally:
        exiting.kill()
        working.kill()


@pytest.mark.parametrize("code, reason, signalled, ok", [
    (0, "all consumers finished", False, True),
    (0, "signal", True, True),
    (143, "signal", True, True),                    # stopped by the cancel's SIGTERM after its clean shutdown
    (143, "", True, False),                         # no stop line: not the producer's clean shutdown
    (143, "signal", False, False),                  # a SIGTERM this run did not send
    (130, "signal", True, False),
    (-15, "all consumers finished", True, True),    # killed in its teardown, after its stop line: work complete
    (-15, "", True, False),                         # killed before its stop line: cut off mid-work
    (-15, "failed: ProducerFailed: x", True, False),
    (-15, "all consumers finished", False, False),  # a SIGTERM this run's cancel did not send (the hung-exit one)
    (-9, "all consumers finished", True, False),
    (1, "failed: ProducerFailed: x", False, False),
    (None, "", False, False),
])
def test_producer_exit_ok(code, reason, signalled, ok):
    from artcache.app.experiments import producer_exit_ok

    assert producer_exit_ok(code, reason, signalled) is ok


def test_run_second_signal_forces(tiny_target, tmp_path):
    """A second signal forces: the run stops waiting ('interrupted'), terminates every role still running
    and still writes its report; nothing is left running. (Before issue 19 a second signal was ignored:
    this fails on that code with 'interrupted' not in the problems.)"""
    import signal

    code, report, pids, text = signalled_run(tiny_target, tmp_path, (signal.SIGINT, signal.SIGTERM))
    assert code == 130, text[-4000:]  # 128 + the first signal, SIGINT
    assert "interrupted" in report["problems"], report["problems"]
    assert all(_gone(pid) for pid in pids)


# ---- artcache report RUN_DIR on sound and damaged run directories (no process started) -----------------

def _run_dir(tmp_path: Path, steps: dict[str, int], planned: int = 4) -> Path:
    """A run directory as ``artcache run`` leaves it, written with its own writers: the resolved config.toml,
    each experiment's own config.toml, a weights-only checkpoint at ``steps[name]`` (``latest`` and ``best``)
    and a metrics.csv with a held-out evaluation at that step."""
    import msgspec

    from artcache.app.config import save_config
    from artcache.app.experiments import resolve
    from artcache.trainers.checkpoint import point_best, point_latest, save_checkpoint
    from artcache.trainers.tracking import RunTracker

    out = tmp_path / "out"
    body = "".join(f'[[experiments]]\nname = "{n}"\ndraft = "dflash"\nsteps = {planned}\n' for n in steps)
    cfg = resolve(load_run_config(write(tmp_path / "run.toml", f'out = "{out}"\n[target]\nname = "random:tiny-llama"\n'
                                        f'[data]\ndataset = "synthetic"\n{body}')))
    save_config(cfg, out / "config.toml")
    for e in cfg.experiments:
        save_config(msgspec.structs.replace(cfg, experiments=[e]), Path(e.out) / "config.toml")
        step = steps[e.name]
        ckpt = save_checkpoint(Path(e.out), step=step, cursor=2 * step, weights={"w": torch.zeros(2)}, optimizer=None,
                               generators={}, extra_tensors={}, state={"eval": {"replay_tau": 1.25}})
        point_latest(Path(e.out), ckpt)
        point_best(Path(e.out), ckpt)
        t = RunTracker(Path(e.out), tensorboard=False)
        t.scalar(step, "train/loss", 2.0)
        t.scalars(step, "eval", {"replay_tau": 1.25, "loss": 3.0})
        t.close()
    return out


def _row(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(name + " "))


def test_regression_report_uses_the_writers_completed_and_skips_a_torn_metrics_line(tmp_path):
    """Regression: ``artcache report`` called a finished experiment ``complete`` while the consumer, the
    registry and the run report write ``completed``; a torn last metrics.csv line (a consumer killed or
    writing now) is no damage."""
    out = _run_dir(tmp_path, {"a": 4, "b": 2})
    with open(out / "experiments" / "b" / "metrics.csv", "a") as f:
        f.write("3,train/lo")
    res = CliRunner().invoke(main, ["report", str(out), "--json"])
    assert res.exit_code == 0, res.output
    by = {x["name"]: x for x in json.loads(res.output)["experiments"]}
    assert by["a"]["state"] == registry.COMPLETED == "completed" and by["a"]["damage"] == []
    assert by["b"]["state"] == "not started" and by["b"]["last_eval"] == {"step": 2, "replay_tau": 1.25, "loss": 3.0}
    assert by["a"]["best"] == {"checkpoint": "step-00000004", "replay_tau": 1.25}
    assert json.loads(res.output)["damaged"] == []


@pytest.mark.parametrize("damage, needle", [
    ("empty config.toml", "experiments/b/config.toml is empty or damaged: it names no experiment"),
    ("state.json", "state.json is unreadable or not a checkpoint state"),
    ("state.json digest", "state.json does not match the digest it records"),
    ("metrics.csv", "metrics.csv': line 2 '4,train/loss' is not a metrics row"),
    ("registration", "of consumer 'b' is unreadable"),
    ("checkpoints removed", "its registration records a durable checkpoint at cursor 8, but"),
])
def test_regression_report_names_a_damaged_experiment_reports_the_rest_and_exits_1(tmp_path, damage, needle):
    """Regression: an empty experiment config.toml was not noticed (exit 0), and one bad state.json failed the
    whole report. Now the damaged experiment is shown as ``damaged`` with the reason, its sibling as usual,
    and the exit status is 1 (text and --json)."""
    out = _run_dir(tmp_path, {"a": 4, "b": 4})
    b = out / "experiments" / "b"
    if damage == "empty config.toml":
        (b / "config.toml").write_text("")
    elif damage == "state.json":
        (b / "checkpoints" / "step-00000004" / "state.json").write_text('{"step": 4, "cur')
    elif damage == "state.json digest":  # still a valid state, one value changed: its recorded digest catches it
        st = b / "checkpoints" / "step-00000004" / "state.json"
        st.write_text(st.read_text().replace('"cursor": 8', '"cursor": 9').replace('"cursor":8', '"cursor":9'))
    elif damage == "metrics.csv":
        (b / "metrics.csv").write_text("step,tag,value,wall_time\n4,train/loss\n4,eval/replay_tau,1.25,9.0\n")
    elif damage == "checkpoints removed":  # reported 'completed 0/4', exit 0
        layout = CacheLayout(out / "cache")
        layout.create()
        reg = registry.register(layout, registry.Registration(consumer_id="b", draft="dflash", pid=os.getpid()))
        h = registry.ConsumerHandle(layout, reg)
        h.commit_cursor(8)
        h.record_checkpoint(8)
        h.finish(registry.COMPLETED)
        shutil.rmtree(b / "checkpoints")
    else:
        layout = CacheLayout(out / "cache")
        layout.consumer_path("b").parent.mkdir(parents=True)
        layout.consumer_path("b").write_text("{not json")
    text = CliRunner().invoke(main, ["report", str(out)])
    assert text.exit_code == 1, text.output
    assert "completed" in _row(text.output, "a") and "4/4" in _row(text.output, "a")
    assert "damaged" in _row(text.output, "b")
    reasons = text.output[text.output.index("DAMAGED"):]
    assert needle in reasons and "\n  b: " in reasons and "\n  a: " not in reasons, reasons
    assert "experiment(s) b damaged" in text.output  # the one line on stderr (CliRunner mixes the streams)
    as_json = CliRunner().invoke(main, ["report", str(out), "--json"])
    assert as_json.exit_code == 1
    r = json.loads(as_json.output[:as_json.output.rindex("}") + 1])
    by = {x["name"]: x for x in r["experiments"]}
    assert by["a"]["state"] == "completed" and by["b"]["state"] == "damaged" and needle in by["b"]["damage"][0]
    assert len(r["damaged"]) == 1 and r["damaged"][0].startswith("b: ")


def test_regression_report_refuses_an_empty_run_config(tmp_path):
    """Regression: an empty RUN_DIR/config.toml read as the defaults (no experiment, another cache root) and
    the report exited 0 with nothing in it."""
    out = _run_dir(tmp_path, {"a": 4})
    (out / "config.toml").write_text("")
    res = CliRunner().invoke(main, ["report", str(out)])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "config.toml' names no experiment (empty or damaged)" in res.output


@pytest.mark.parametrize("verb", ["report", "inspect"])
def test_regression_a_damaged_saved_config_is_named_by_its_path_not_as_config(tmp_path, verb):
    """Regression: ``artcache report RUN_DIR`` (and ``inspect --cache RUN_DIR``) on a run whose saved
    config.toml is damaged said ``--config '.../config.toml' is not valid TOML``: a flag neither command has."""
    (tmp_path / "config.toml").write_text("x = [")
    args = ["report", str(tmp_path)] if verb == "report" else ["inspect", "--cache", str(tmp_path)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert f"the saved run config '{tmp_path / 'config.toml'}' is not valid TOML" in res.output
    assert "--config" not in res.output


@pytest.mark.parametrize("text", ["", "# nothing\n", "[data]\nseed = 3\n"])
def test_regression_inspect_names_a_saved_config_without_a_cache_root(tmp_path, layout, text):
    """``artcache inspect --cache RUN_DIR`` on an empty RUN_DIR/config.toml read the defaults
    and pointed at a default root (``cache root './runs/run/cache' does not exist; start artcache producer``);
    now one line naming the saved run config and that it names no cache root."""
    (tmp_path / "config.toml").write_text(text)
    res = CliRunner().invoke(main, ["inspect", "--cache", str(tmp_path)])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert f"the saved run config '{tmp_path / 'config.toml'}' names no cache root (empty or damaged" in res.output
    assert "runs/run/cache" not in res.output and "artcache producer" not in res.output, res.output
    (tmp_path / "config.toml").write_text(f"{text}\n[cache]\nroot = {json.dumps(str(layout.root))}\n")
    res = CliRunner().invoke(main, ["inspect", "--cache", str(tmp_path)])  # with its cache root: inspected
    assert res.exit_code == 0, res.output


def test_regression_the_disk_bound_counts_the_held_out_split(tiny_target, tmp_path):
    """Regression: the plan's disk bound was Σ windows, while the producer retains Σ (window + held-out split)
    (``scheduler.window_bound``: a consumer's held-out samples are pinned), so an evaluating run's printed bound
    was E artifacts per evaluating experiment too low."""
    plan, _ = plan_of(tiny_target, tmp_path, exp("d"), exp("e", "eagle3"),
                      overrides=["experiments.d.consumer.eval_samples=4"])
    d, e = plan.experiments
    assert d.window_artifacts == 11 + 4 and e.window_artifacts == 11 and plan.window_bound_artifacts == 26
    assert plan.disk_bound_bytes == 26 * plan.bytes_per_artifact_max


def test_shared_gpus_names_each_cuda_device_given_twice():
    from artcache.app.experiments import shared_gpus

    assert shared_gpus(["cuda", "cuda", "cpu", "cuda:1"]) == ["cuda"]
    assert shared_gpus(["cpu", "cpu", "cuda:0", "cuda:1"]) == []
    assert shared_gpus(["cuda:1", "cuda:0", "cuda:1", "cuda:0"]) == ["cuda:0", "cuda:1"]


def test_each_role_runs_on_exactly_the_spec_the_launcher_built(tiny_target, tmp_path):
    """``artcache run`` builds every role's settings once (the plan's ``producer`` and each experiment's ``spec``),
    writes them as role spec files and starts each child with ``--spec``: the digest each child journals of the
    settings it ran on (``producer_start.spec``, ``consumer_start.spec``) is the digest of the launcher's own struct,
    and the two experiments' specs differ (a child given its sibling's spec would be seen)."""
    from artcache.app.experiments import consumer_spec_path, producer_spec_path
    from artcache.producer import ProducerConfig
    from artcache.rolespec import read_spec, spec_digest
    from artcache.trainers.consumer import ConsumerConfig

    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", base_toml(tiny_target, out, exp("hi", steps=3, lr=1e-3),
                                                 exp("lo", steps=3, lr=1e-4)))
    plan, _ = plan_run(load_run_config(cfg))  # what the launcher builds (nothing written)
    proc = artcache_run(cfg)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    events = J.read_events(out / "cache" / "journal").events
    starts = {ev.consumer: ev for ev in events if isinstance(ev, J.ConsumerStart)}
    for x in plan.experiments:
        spec = read_spec(consumer_spec_path(x), "consumer", ConsumerConfig)
        assert spec == x.spec  # the file holds the struct the plan built, every field
        assert starts[x.name].spec == spec_digest(x.spec)  # and the child ran on it
    assert starts["hi"].spec != starts["lo"].spec
    assert {x.name: x.spec.lr for x in plan.experiments} == {"hi": 1e-3, "lo": 1e-4}
    producer = read_spec(producer_spec_path(plan), "producer", ProducerConfig)
    assert producer == plan.producer and producer.exit_when_done and producer.layer_ids == [1, 2, 3]
    assert [ev.spec for ev in events if isinstance(ev, J.ProducerStart)] == [spec_digest(plan.producer)]


def test_flags_config_and_launcher_build_the_same_consumer_spec(tiny_target, tmp_path):
    """One typed form whichever way a consumer's settings are given: ``artcache run``'s spec for an experiment,
    ``consume --config FILE --experiment NAME`` and the plain flags saying the same settings write the same spec
    file (``--write-spec``), field for field; the producer's likewise from ``producer --config``."""
    import msgspec

    from artcache.producer import ProducerConfig
    from artcache.rolespec import read_spec
    from artcache.trainers.consumer import ConsumerConfig

    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", base_toml(tiny_target, out, exp("hi", steps=3, lr=1e-3)))
    plan, _ = plan_run(load_run_config(cfg))
    (x,) = plan.experiments

    def written(*args: str) -> Path:
        path = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
        res = CliRunner().invoke(main, [*args, "--write-spec", str(path)])
        assert res.exit_code == 0, res.output
        return path

    by_config = read_spec(written("consume", "--config", str(cfg), "--experiment", "hi"), "consumer", ConsumerConfig)
    flags = ["--cache", str(out / "cache"), "--id", "hi", "--draft", "dflash", "--window", "2:8", "--block-size", "4",
             "--anchors", "4", "--draft-layers", "3", "--batch-size", "2", "--steps", "3", "--lr", "1e-3",
             "--threads", "1", "--out", str(out / "experiments" / "hi"), "--demand-timeout", "300",
             "--log-every", "1", "--no-progress", "--no-tensorboard"]
    by_flags = read_spec(written("consume", *flags), "consumer", ConsumerConfig)
    assert by_config == by_flags == x.spec
    by_flags = read_spec(written("consume", *flags[:-1]), "consumer", ConsumerConfig)  # one setting differs
    assert by_flags != x.spec and msgspec.structs.replace(by_flags, tensorboard=False) == x.spec
    producer = read_spec(written("producer", "--config", str(cfg), "--exit-when-done", "--id", "producer"), "producer",
                         ProducerConfig)
    assert producer == plan.producer
    assert not (out / "cache").exists()  # --write-spec starts nothing


# ---- one horizon: consumer.epochs turned into steps by the plan ------------------------------------------

def _epochs_exp(name: str, epochs: int) -> str:
    """An experiment that says how long to train by ``consumer.epochs`` alone (no ``steps``)."""
    return exp(name, epochs=epochs).replace("steps = 6\n", "")


def test_regression_run_config_epochs_is_one_horizon_in_the_plan_and_the_saved_config(tiny_target, tmp_path):
    """``consumer.epochs`` bypassed the plan: with ``steps = 3`` and ``consumer.epochs = 1`` on a 12-sample plan the
    dry run's table said 3 steps, the consumer ran 6 (its epochs replaced the steps it was given) and a rerun of
    the same file was refused ("at step 6, --steps is 3"). Both together are now refused in one line; epochs alone
    are turned into steps by the plan, which the saved config (what every process reads) holds."""
    overrides = ["data.max_samples=12"]
    with pytest.raises(ConfigError) as info:
        plan_of(tiny_target, tmp_path, exp("d", steps=3), overrides=[*overrides, "experiments.0.consumer.epochs=1"])
    assert "experiments.0 ('d') gives steps 3 and consumer.epochs 1" in str(info.value)
    assert "\n" not in str(info.value)
    plan, resolved = plan_of(tiny_target, tmp_path, _epochs_exp("d", 1), overrides=overrides)
    assert plan.experiments[0].steps == 6 and plan.experiments[0].positions == 12  # 1 x 12 samples // batch 2
    assert resolved.experiments[0].steps == 6 and "epochs" not in resolved.experiments[0].consumer
    assert plan.experiments[0].consumer["steps"] == 6 and plan.experiments[0].consumer["epochs"] == 0
    assert any("consumer.epochs 1 = 6 steps" in n for n in plan.notes), plan.notes
    # a held-out split is not trained on: 2 epochs over the 12 - 4 training samples
    plan, _ = plan_of(tiny_target, tmp_path, _epochs_exp("d", 2).replace("[experiments.consumer]\n",
                                                                        "[experiments.consumer]\neval_samples = 4\n"),
                      overrides=overrides)
    assert plan.experiments[0].steps == 8
    # the CLI's consume --config: a flag that gives the other one conflicts with the file
    result = CliRunner().invoke(main, ["consume", "--config", str(tmp_path / "run.toml"), "--experiment", "d",
                                       "--steps", "3", *overrides])
    assert result.exit_code == 2 and "gives steps 3 and consumer.epochs 2" in result.output, result.output
    assert "Traceback" not in result.output


def test_regression_run_epochs_run_and_rerun_walk_the_planned_steps(tiny_target, tmp_path):
    """The consumer of an ``epochs`` experiment ran another number of steps than the plan said and its rerun was
    refused; now the run walks the planned 6 steps and the same file's rerun finds it complete."""
    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", base_toml(tiny_target, out, _epochs_exp("d", 1)))
    proc = artcache_run(cfg, "data.max_samples=12")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    x = report_of(out)["experiments"][0]
    assert (x["steps_planned"], x["steps_run"], x["cursor_end"]) == (6, 6, 12), x
    proc = artcache_run(cfg, "data.max_samples=12")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "experiment d complete: its checkpoint is at its final step 6; not started" in proc.stdout


def test_regression_report_checkpoints_column_counts_and_names_the_steps(tmp_path):
    """``artcache report``'s ``checkpoints`` column held the checkpoints' step numbers alone: one checkpoint at step
    4 showed ``4``, which reads as four checkpoints. It now says how many and at which steps."""
    out = _run_dir(tmp_path, {"a": 4})
    text = CliRunner().invoke(main, ["report", str(out)])
    assert text.exit_code == 0, text.output
    assert "checkpoints (at steps)" in text.output
    cells = [c.strip() for c in re.split(r"\s{2,}", _row(text.output, "a"))]
    assert "1 (4)" in cells, cells


def test_regression_report_says_which_steps_the_experiment_row_counts(tmp_path):
    """``artcache report`` after a consumer was SIGKILLed before its first checkpoint showed the experiment as
    ``failed  0/400`` under a bare ``steps`` header (the step of its latest checkpoint) while its process row said
    ``steps 1-43 (43 run)``: the two read as a contradiction. The row now shows the step trained and the step
    checkpointed, each named in the header."""
    import shutil

    out = _run_dir(tmp_path, {"a": 4, "b": 2})
    _unended_process(out, "b", fence="process 4242 is gone")
    shutil.rmtree(out / "experiments" / "b" / "checkpoints")
    res = CliRunner().invoke(main, ["report", str(out)])
    assert res.exit_code == 0, res.output
    assert "trained (step)" in res.output and "checkpointed (step/planned)" in res.output, res.output
    cells = [c.strip() for c in re.split(r"\s{2,}", _row(res.output, "b"))]
    assert cells[2:5] == ["failed", "2", "0/4"], cells
    assert "b #1: failed, steps 1-2 (2 run)" in res.output
    b = next(x for x in json.loads(CliRunner().invoke(main, ["report", str(out), "--json"]).output)["experiments"]
             if x["name"] == "b")
    assert (b["steps"], b["steps_trained"], b["steps_planned"]) == (0, 2, 4)


def _unended_process(out: Path, name: str, *, fence: str | None, reg_state: str | None = None) -> None:
    """Consumer ``name``'s process as a SIGKILL leaves it: a journal with its start and two steps but no end record,
    its registration (this process's identity); ``fence``: a producer fenced it with that reason (registration and
    journal, as :meth:`artcache.producer.Producer.live_registrations` does); ``reg_state``: the registration was
    set terminal otherwise (fsck)."""
    import time

    layout = CacheLayout(out / "cache")
    layout.create()
    reg = registry.register(layout, registry.Registration(consumer_id=name, draft="dflash", pid=os.getpid()))
    j = J.JournalWriter(layout.journal_path("consumer", name))
    j.emit(J.ConsumerStart(t=time.time(), consumer=name, pid=os.getpid(), draft="dflash", block_size=4, batch_size=2,
                           lookbehind=2, lookahead=8, cursor=0))
    for step in (1, 2):
        j.emit(J.Step(t=time.time(), consumer=name, step=step, cursor=2 * step, loss=2.0, tau_sum=0.0, blocks=0,
                      acc_correct=[], acc_total=[], wait_s=0.0, step_s=0.1, lr=1e-3))
    j.close()
    if fence is not None:
        assert registry.fence(layout, name, "failed", fence, reg.generation)
        p = J.JournalWriter(layout.journal_path("producer", "producer"))
        p.emit(J.Fence(t=time.time(), producer="producer", consumer=name, generation=reg.generation + 1,
                       state="failed", reason=fence))
        p.close()
    elif reg_state is not None:
        assert registry.fence(layout, name, reg_state, "fsck: no heartbeat progress", reg.generation)


@pytest.mark.parametrize("fence, reg_state, want", [
    ("process 4242 is gone", None, "b #1: failed, steps 1-2 (2 run), cursor 0->4, requests 0 (0 hits, 0 misses); no "
     "end record; fenced by the producer: process 4242 is gone"),
    (None, "expired", "b #1: expired, steps 1-2 (2 run)"),
    (None, None, "b #1: running, steps 1-2 (2 run)"),  # alive (this process), never fenced: running it is
])
def test_regression_report_settles_a_process_without_an_end_record(tmp_path, fence, reg_state, want):
    """``artcache report`` took a consumer process's state from its own end record only, so one SIGKILLed and fenced
    by the producer (no end record) stayed ``running`` in the per-process rows. The fence (producer journal) or the
    registration now settle it."""
    out = _run_dir(tmp_path, {"a": 4, "b": 2})
    _unended_process(out, "b", fence=fence, reg_state=reg_state)
    res = CliRunner().invoke(main, ["report", str(out)])
    assert want in res.output, res.output
    as_json = json.loads(CliRunner().invoke(main, ["report", str(out), "--json"]).output)
    b = next(x for x in as_json["experiments"] if x["name"] == "b")
    assert b["processes"][0]["state"] == want.split(": ")[1].split(",")[0] and b["processes"][0]["pid"] == os.getpid()


def test_role_outcome_names_a_cancel_as_the_report_does():
    """``artcache run`` printed a SIGTERM-cancelled experiment as ``FAILED (exit 1)`` while its report said
    ``cancelled``: the consumer exits ``128 + signal`` now and the run names that ``cancelled``."""
    import signal

    from artcache.app.experiments import role_outcome

    assert role_outcome(0) == "completed"
    assert role_outcome(128 + signal.SIGTERM) == "cancelled (SIGTERM, exit 143)"
    assert role_outcome(130) == "cancelled (SIGINT, exit 130)"
    assert role_outcome(-signal.SIGKILL) == "FAILED (killed by SIGKILL)"
    assert role_outcome(1) == "FAILED (exit 1)" and role_outcome(2) == "FAILED (exit 2)"


def test_regression_run_cancelled_by_sigterm_says_cancelled_and_exits_143(tiny_target, tmp_path):
    """A SIGTERM-cancelled run printed each experiment as ``FAILED (exit 1)`` (click's status for the consumer's
    KeyboardInterrupt) while the report said ``cancelled``, and the run exited 1. Now each consumer exits 143, the
    run prints ``cancelled (SIGTERM, exit 143)``, the report agrees and the run exits 143 (128 + SIGTERM)."""
    import signal

    code, report, pids, text = signalled_run(tiny_target, tmp_path, (signal.SIGTERM,))
    assert code == 128 + signal.SIGTERM, text[-4000:]
    assert "experiment a cancelled (SIGTERM, exit 143)" in text and "experiment b cancelled (SIGTERM, exit 143)" in text
    assert not re.search(r"experiment \w+ FAILED", text), text[-4000:]
    assert {x["name"]: (x["state"], x["exit_code"]) for x in report["experiments"]} == {
        "a": ("cancelled", 143), "b": ("cancelled", 143)}
    assert report["exit_code"] == 143 and report["cancelled_by"] == "SIGTERM"
    assert all(_gone(pid) for pid in pids)


def test_regression_the_window_bound_is_one_figure_at_most_the_plan(tiny_target, tmp_path):
    """The window bound of one run read 24 in ``artcache run``'s plan and closing report (Σ windows and held-out
    splits, capped at the plan's samples) and 26 in ``artcache inspect`` and the producer's ``retained`` events (the
    same sum, uncapped) for the same consumer: a window 8:16 plus one held-out sample on a plan of 24 samples. A
    root holds one artifact per sample however many windows cover it, so the bound is the sum at most the plan's
    samples: now 24 everywhere."""
    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", base_toml(tiny_target, out, exp("d", steps=3, eval_samples=1)))
    overrides = ["data.max_samples=24", "experiments.d.window=8:16"]
    plan, _ = plan_run(load_run_config(cfg, overrides))
    assert plan.experiments[0].window_artifacts == 8 + 16 + 1 + 1 and plan.window_bound_artifacts == 24
    proc = artcache_run(cfg, *overrides)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    events = J.read_events(out / "cache" / "journal").events
    assert max(ev.window_bound for ev in events if isinstance(ev, J.Retained)) == 24  # 0 once none is live
    text = CliRunner().invoke(main, ["inspect", "--cache", str(out / "cache")]).stdout
    assert re.search(r"^window bound \(artifacts[^)]*\)\s+24$", text, re.M), text
    assert report_of(out)["shared_production"]["window_bound_artifacts"] == 24
    assert "against a window bound of 24 (the experiments' windows and held-out splits, at most the plan's " \
        "samples)" in proc.stdout, proc.stdout[-3000:]
