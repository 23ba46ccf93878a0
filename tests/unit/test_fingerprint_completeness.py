"""Fingerprint completeness through the real producer path (``prepare_root``: target, tokenizer, chat template
and its options, plan, contract): every input that changes the bytes of an artifact changes the
fingerprint, and nothing else does.

Changes the fingerprint: target weights, target config, captured layer ids, stored dtype, compute dtype, max
length, tokenizer, chat template, chat template options (``enable_thinking``), loss-mask policy, a sample's
tokens. (The layer convention has one value; ``format_version`` and ``backend`` are covered at the contract
level in tests/unit/test_fingerprint.py.) Conservatively also: a template option the template ignores, and the
target's name (for a local directory, its name): identity, not bytes; they cause a recapture, never a
wrong hit.

Does not: the cache root, producer id, threads, batch limits, heartbeat, start line, group sharing, the plan
seed or sample count (same sample, same fingerprint, wherever it sits in the plan), the dataset's path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from artcache import plan as plan_mod
from artcache.fingerprint import PlanFingerprints
from artcache.producer import ProducerConfig, prepare_root
from tests.support import TINY_SHAREGPT

DATA = TINY_SHAREGPT
BASE = dict(layer_ids=[1, 3], max_length=64, max_samples=12)
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['role'] == 'assistant' and enable_thinking is defined and not enable_thinking %}"
    "{{'<think>\\n\\n</think>\\n'}}{% endif %}{{message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tiny_target):
    """Variants of the tiny target, each in a directory named ``tgt`` (the name is part of the contract)."""
    root = tmp_path_factory.mktemp("fp-targets")

    def variant(name: str, edit=None) -> Path:
        d = root / name / "tgt"
        shutil.copytree(tiny_target.path, d, ignore=shutil.ignore_patterns(".artcache-weights.json*"))
        (d / "chat_template.jinja").write_text(THINKING_TEMPLATE)
        if edit is not None:
            edit(d)
        return d

    def weights(d: Path) -> None:
        ts = load_file(str(d / "model.safetensors"))
        key = next(k for k in sorted(ts) if k.endswith("layers.0.mlp.down_proj.weight"))
        ts[key] = ts[key] * 1.01
        (d / "model.safetensors").unlink()
        save_file(ts, str(d / "model.safetensors"))

    def config(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 2
        (d / "config.json").write_text(json.dumps(cfg))

    def tokenizer(d: Path) -> None:
        tok = json.loads((d / "tokenizer.json").read_text())
        tok["added_tokens"].append({"id": 49151, "content": "<|artcache-test|>", "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False, "special": True})
        (d / "tokenizer.json").write_text(json.dumps(tok))

    def template(d: Path) -> None:
        (d / "chat_template.jinja").write_text(THINKING_TEMPLATE.replace("'\\n'}}{% if", "'\\n\\n'}}{% if", 1))

    return {"base": variant("base"), "weights": variant("weights", weights), "config": variant("config", config),
            "tokenizer": variant("tokenizer", tokenizer), "template": variant("template", template)}


class Run:
    """One ``prepare_root`` in a fresh root: per-sample fingerprints keyed by the sample's tokens."""

    n = 0

    def __init__(self, tmp: Path, target: Path, data: Path = DATA, **kw) -> None:
        Run.n += 1
        cfg = ProducerConfig(cache=str(tmp / f"root-{Run.n}"), target=str(target), dataset=str(data),
                             **{**BASE, **kw})
        layout, settings, plan, _info, _tok = prepare_root(cfg)
        self.contract, self.plan = settings.contract, plan
        fp_of = PlanFingerprints(settings.contract, plan)
        self.by_tokens = {}
        for i in range(len(plan)):
            s = plan.sample(i)
            self.by_tokens[(tuple(s.input_ids.tolist()), tuple(s.loss_mask.tolist()))] = fp_of(i)
        self.fps = set(self.by_tokens.values())


@pytest.fixture(scope="module")
def base(tmp_path_factory, targets):
    return Run(tmp_path_factory.mktemp("fp-base"), targets["base"])


# ---- inputs that change the bytes change the fingerprint -------------------------------------------------------

@pytest.mark.parametrize("what", ["weights", "config", "tokenizer", "template"])
def test_target_files_change_every_fingerprint(tmp_path, targets, base, what):
    other = Run(tmp_path, targets[what])
    assert other.contract != base.contract
    assert not other.fps & base.fps


@pytest.mark.parametrize("kw", [dict(layer_ids=[1, 4]), dict(layer_ids=[3, 1]), dict(dtype="float16"),
                                dict(dtype="float8_e4m3fn"), dict(compute_dtype="bfloat16"), dict(max_length=48)],
                         ids=["layer-ids", "layer-order", "dtype", "dtype-fp8", "compute-dtype", "max-length"])
def test_capture_settings_change_every_fingerprint(tmp_path, targets, base, kw):
    other = Run(tmp_path, targets["base"], **kw)
    assert not other.fps & base.fps


def test_thinking_option_changes_tokens_and_fingerprints(tmp_path, targets, base):
    off = Run(tmp_path, targets["base"], template_options={"enable_thinking": False})
    on = Run(tmp_path, targets["base"], template_options={"enable_thinking": True})
    assert not off.fps & base.fps and not on.fps & base.fps and not off.fps & on.fps
    # off renders a think block: other token ids; on renders as without the option, yet the option is
    # part of the contract's template digest, so the fingerprints differ too
    assert set(on.by_tokens) == set(base.by_tokens) and not set(off.by_tokens) & set(base.by_tokens)
    assert on.contract.template_digest != base.contract.template_digest != off.contract.template_digest


def test_ignored_template_option_still_changes_the_fingerprint(tmp_path, targets, base):
    other = Run(tmp_path, targets["base"], template_options={"unused_flag": 3})
    assert set(other.by_tokens) == set(base.by_tokens) and not other.fps & base.fps


def test_loss_mask_policy_changes_fingerprints(tmp_path, targets, base, monkeypatch):
    monkeypatch.setattr(plan_mod, "LOSS_MASK_POLICY", "every-token/test")
    monkeypatch.setattr(plan_mod, "_mask_from_offsets", lambda offsets, spans: torch.ones(len(offsets),
                                                                                          dtype=torch.uint8).numpy())
    other = Run(tmp_path, targets["base"])
    assert not other.fps & base.fps


def test_a_samples_tokens_change_only_its_fingerprint(tmp_path, targets, base):
    data = json.loads(DATA.read_text())
    edited = next(r for r in data if r["id"] == "fixture-00")
    turn = next(t for t in edited["conversations"] if t["from"] == "human")  # early: inside max_length
    turn["value"] = turn["value"].replace("rivers", "lakes", 1)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    other = Run(tmp_path, targets["base"], data=path, max_samples=len(data))
    full = Run(tmp_path, targets["base"], max_samples=len(data))
    assert len(full.fps - other.fps) == 1 and len(other.fps - full.fps) == 1


# ---- nothing else changes it ------------------------------------------------------------------------------------

def test_process_settings_do_not_change_fingerprints(tmp_path, targets, base):
    from artcache.scheduler import SchedulerLimits

    other = Run(tmp_path, targets["base"], producer_id="another", threads=1, heartbeat_timeout_s=5.0,
                expect_consumers=3, idle_exit_s=9.0, group_shared=True, max_inflight_batches=1, lease_ttl_s=1.0,
                exit_when_done=True, limits=SchedulerLimits(max_queue=7, max_batch_samples=1, max_batch_tokens=64))
    assert other.contract == base.contract and other.by_tokens == base.by_tokens


def test_seed_sample_count_and_dataset_path_do_not_change_a_samples_fingerprint(tmp_path, targets, base):
    n = len(json.loads(DATA.read_text()))
    everything = Run(tmp_path, targets["base"], max_samples=n)
    reseeded = Run(tmp_path, targets["base"], max_samples=n, seed=7)
    assert reseeded.plan.plan_id != everything.plan.plan_id
    assert [reseeded.plan.sample(i).input_ids.tolist() for i in range(3)] != \
        [everything.plan.sample(i).input_ids.tolist() for i in range(3)]  # another order
    assert reseeded.by_tokens == everything.by_tokens  # same sample, same fingerprint
    assert base.by_tokens.items() <= everything.by_tokens.items()  # a shorter plan: a subset
    copy = tmp_path / "copy" / "data.json"
    copy.parent.mkdir()
    shutil.copy(DATA, copy)
    moved = Run(tmp_path, targets["base"], data=copy, max_samples=n)
    assert moved.by_tokens == everything.by_tokens
    # regression: the plan id hashed the path string too, so a root built from `data.json` refused the same
    # file given as `/abs/path/data.json` or copied elsewhere ("differs in: plan_id")
    assert moved.plan.plan_id == everything.plan.plan_id


def test_regression_plan_id_ignores_the_dataset_path_not_its_content():
    """The plan id hashed the dataset path as given, so the same file as a relative and an absolute path (or a
    copy elsewhere) was refused as another plan by its own root; the id now covers the file's content."""
    a, b = plan_mod.PlanSpec(dataset="data.jsonl"), plan_mod.PlanSpec(dataset="/elsewhere/copy-of-data.jsonl")
    assert plan_mod.compute_plan_id(a, "d1", "t", "m")[0] == plan_mod.compute_plan_id(b, "d1", "t", "m")[0]
    assert plan_mod.compute_plan_id(a, "d1", "t", "m")[0] != plan_mod.compute_plan_id(a, "d2", "t", "m")[0]
    named = plan_mod.PlanSpec(dataset="sharegpt")  # a named dataset keeps its name among the id inputs
    assert plan_mod.compute_plan_id(named, "d1", "t", "m")[1]["spec"]["dataset"] == "sharegpt"


def test_template_options_keep_old_plan_ids_when_absent():
    """Roots made before template options existed keep their plan id (no option: the same id inputs)."""
    spec = plan_mod.PlanSpec(dataset="x.json")
    with_empty = plan_mod.compute_plan_id(spec, "d", "t", "m")
    assert "template_options" not in with_empty[1]["spec"]
    opt = plan_mod.PlanSpec(dataset="x.json", template_options={"enable_thinking": False})
    assert plan_mod.compute_plan_id(opt, "d", "t", "m")[0] != with_empty[0]


@pytest.mark.parametrize("bad", [{"no-dash": True}, {"x": [1]}, {"x": None}])
def test_bad_template_options_are_config_errors(bad):
    from artcache.errors import ConfigError

    with pytest.raises(ConfigError, match="chat template option"):
        plan_mod.PlanSpec(dataset="x.json", template_options=bad)


def test_cli_parses_template_options():
    from artcache.app.cli import parse_template_options
    from artcache.errors import ConfigError

    assert parse_template_options(["enable_thinking=false", "k=3", "t=0.5", "s=hi"]) == \
        {"enable_thinking": False, "k": 3, "t": 0.5, "s": "hi"}
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_template_options(["novalue"])
