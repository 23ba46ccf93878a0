"""Checkpoints: safetensors + JSON only, atomic directories, optimizer / RNG round trips that make a resumed
run continue exactly as an uninterrupted one, lookup by recorded cursor, pruning, strict weight seeding."""

from __future__ import annotations

import json

import msgspec
import pytest
import safetensors.torch
import torch

from artcache.errors import ConfigError
from artcache.trainers import checkpoint as ck
from artcache.trainers.consumer import lr_at
from artcache.trainers.consumer.restore import load_weights_strict


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2, bias=False)
        self.register_buffer("frozen", torch.ones(2), persistent=False)

    def trainable_state_dict(self):
        return dict(self.state_dict())

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def train(model, opt, gen: torch.Generator, steps: range) -> list[float]:
    """Steps whose data and dropout come from ``gen`` and torch's global RNG; returns the losses."""
    losses = []
    for step in steps:
        x = torch.randn(5, 4, generator=gen)
        noise = torch.rand(5, 2)  # torch's global CPU generator
        for g in opt.param_groups:
            g["lr"] = lr_at(step, 10, 1e-2, 0.2, 0.1)
        loss = ((model(x) - noise) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def save(run_dir, step, model, opt, gen, **state):
    return ck.save_checkpoint(run_dir, step=step, cursor=2 * step, weights=model.trainable_state_dict(),
                              optimizer=opt, generators={"anchors": gen}, extra_tensors={}, state=state)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    model, opt = make()
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(123)
    straight = train(model, opt, gen, range(0, 10))
    final_straight = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt = make()
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(123)
    first = train(model, opt, gen, range(0, 4))
    path = save(tmp_path, 4, model, opt, gen, consumer_id="c")
    train(model, opt, gen, range(4, 7))  # progress after the checkpoint that a crash loses

    loaded = ck.load_checkpoint(path)
    model2, opt2 = make(seed=99)  # different init: everything must come from the checkpoint
    gen2 = torch.Generator().manual_seed(0)
    load_weights_strict(model2, loaded.weights, "test")
    ck.restore_optimizer(opt2, loaded.optimizer, loaded.state.param_groups)
    ck.restore_rng(loaded.rng, {"anchors": gen2})
    assert (loaded.state.step, loaded.state.cursor, loaded.state.consumer_id) == (4, 8, "c")
    rest = train(model2, opt2, gen2, range(4, 10))
    assert first + rest == straight
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final_straight[k]), k


def test_checkpoint_holds_only_safetensors_and_json(tmp_path):
    model, opt = make()
    gen = torch.Generator().manual_seed(1)
    train(model, opt, gen, range(2))
    path = ck.save_checkpoint(tmp_path, step=2, cursor=4, weights=model.trainable_state_dict(), optimizer=opt,
                              generators={"anchors": gen}, extra_tensors={"d2t": torch.arange(3)}, state={"x": 1})
    assert sorted(p.name for p in path.iterdir()) == ["extra.safetensors", "model.safetensors",
                                                      "optimizer.safetensors", "rng.safetensors", "state.json"]
    for p in path.glob("*.safetensors"):
        safetensors.torch.load_file(p)  # loads without any pickle
    rng = safetensors.torch.load_file(path / "rng.safetensors")
    assert rng["torch_cpu"].dtype == torch.uint8 and rng["generator.anchors"].dtype == torch.uint8
    opt_t = safetensors.torch.load_file(path / "optimizer.safetensors")
    assert set(opt_t) == {f"state.{i}.{n}" for i in range(3) for n in ("step", "exp_avg", "exp_avg_sq")}
    state = json.loads((path / "state.json").read_text())
    assert (state["format"], state["step"], state["cursor"], state["x"]) == (ck.CHECKPOINT_FORMAT, 2, 4, 1)
    assert state["param_groups"][0]["betas"] == [0.9, 0.95]
    assert ck.load_checkpoint(path).extra["d2t"].tolist() == [0, 1, 2]


def test_a_failed_save_leaves_nothing_and_keeps_the_previous(tmp_path, monkeypatch):
    model, opt = make()
    gen = torch.Generator()
    first = save(tmp_path, 1, model, opt, gen)
    ck.point_latest(tmp_path, first)
    real = safetensors.torch.save_file
    calls = []

    def failing(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:  # the optimizer file: the model file is already written
            raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError):
        save(tmp_path, 2, model, opt, gen)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000001"]
    assert (tmp_path / "checkpoints" / "latest").resolve() == first


def test_find_checkpoint_by_cursor_and_prune(tmp_path):
    model, opt = make()
    gen = torch.Generator()
    paths = {s: save(tmp_path, s, model, opt, gen) for s in (2, 4, 6, 8)}
    assert ck.find_checkpoint(tmp_path, cursor=8) == paths[4]  # cursor = 2 × step
    assert ck.find_checkpoint(tmp_path, cursor=5) is None
    (tmp_path / "checkpoints" / ".tmp-half").mkdir()  # a crashed save's temp dir is never a checkpoint
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 4, 6, 8]
    removed = ck.prune(tmp_path, 2, protect=paths[2])
    assert sorted(removed) == [paths[4]]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 6, 8]
    assert ck.prune(tmp_path, 0, protect=paths[2]) == []


def test_restore_optimizer_rejects_another_model(tmp_path):
    model, opt = make()
    train(model, opt, torch.Generator(), range(1))
    tensors, groups = ck.optimizer_tensors(opt)
    other = torch.nn.Linear(4, 5)
    other.trainable_state_dict = lambda: dict(other.state_dict())
    opt2 = torch.optim.AdamW(other.parameters())
    with pytest.raises(ConfigError, match="optimizer state"):
        ck.restore_optimizer(opt2, tensors, groups)


def test_restore_rng_needs_every_named_generator(tmp_path):
    tensors = ck.rng_tensors({})
    with pytest.raises(ConfigError, match="'anchors' generator"):
        ck.restore_rng(tensors, {"anchors": torch.Generator()})


def test_strict_weights_both_ways():
    model, _ = make()
    own = {k: v.clone() for k, v in model.trainable_state_dict().items()}
    with pytest.raises(ConfigError, match=r"missing 1 key\(s\) \['b.weight'\]"):
        load_weights_strict(model, {k: v for k, v in own.items() if k != "b.weight"}, "src")
    with pytest.raises(ConfigError, match=r"unexpected 1 key\(s\) \['c.weight'\]"):
        load_weights_strict(model, {**own, "c.weight": torch.zeros(1)}, "src")
    with pytest.raises(ConfigError, match=r"shape mismatches \['a.bias \(4,\) != \(3,\)'\]"):
        load_weights_strict(model, {**own, "a.bias": torch.zeros(4)}, "src")
    changed = {k: v + 1 for k, v in own.items()}
    load_weights_strict(model, changed, "src")
    assert all(torch.equal(model.trainable_state_dict()[k], changed[k]) for k in own)


def test_find_checkpoint_is_the_one_lookup(tmp_path):
    """--init-from (a published draft is enough), export / artcache run (a checkpoint) and --resume (by cursor)."""
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.consumer.restore import init_source

    with pytest.raises(ConfigError, match="no model.safetensors"):
        init_source(ConsumerConfig(cache="-", init_from=str(tmp_path / "missing")), settings=None)
    assert ck.find_checkpoint(tmp_path / "missing", published=True) is None
    model, opt = make()
    path = save(tmp_path / "run", 3, model, opt, torch.Generator())
    ck.point_latest(tmp_path / "run", path)
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints", path):  # run dir, checkpoints/, step-N
        assert ck.find_checkpoint(given) == path
        assert ck.find_checkpoint(given, published=True) == path
    assert ck.find_checkpoint(tmp_path / "run", cursor=6) == path
    published = tmp_path / "draft"
    published.mkdir()
    safetensors.torch.save_file({"w": torch.zeros(1)}, str(published / "model.safetensors"))
    assert ck.find_checkpoint(published) is None  # no state.json: not a checkpoint
    assert ck.find_checkpoint(published, published=True) == published


def test_checkpoint_state_reads_older_and_newer_files(tmp_path):
    """Fields an older state.json lacks read as None / empty, fields this version does not know are
    ignored; step and cursor are required and the schedule (written only by the consumer) is strict."""
    d = tmp_path / "c"
    d.mkdir()
    (d / "state.json").write_text(json.dumps({"format": 1, "step": 4, "cursor": 8, "draft": "dflash",
                                              "from_the_future": {"x": 1}}))
    st = ck.read_state(d)
    assert (st.step, st.cursor, st.draft, st.target_path, st.layer_ids, st.run) == (4, 8, "dflash", None, None, {})
    assert st.view_layer_ids is None
    (d / "state.json").write_text(json.dumps({"step": 1, "cursor": 2, "layer_ids": [1, 3],
                                              "draft_config": {"layer_ids": [5, 6]}}))
    assert ck.read_state(d).view_layer_ids == [5, 6]  # the draft's own record first
    for bad, needle in (({"cursor": 2}, "step"), ({"step": "4", "cursor": 8}, "step"), ([1], "object"),
                        ({"step": 1, "cursor": 2, "schedule": {"kind": "k", "base_lr": 1.0, "warmup_frac": 0.0,
                                                               "min_lr_frac": 0.0, "total_steps": 1, "next_step": 1,
                                                               "extra": 1}}, "extra")):
        (d / "state.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=needle):
            ck.read_state(d)


def test_save_checkpoint_refuses_a_state_that_would_not_read_back(tmp_path):
    model, opt = make()
    with pytest.raises(msgspec.ValidationError, match="consumer_id"):
        save(tmp_path, 1, model, opt, torch.Generator(), consumer_id=7)
    assert ck.list_checkpoints(tmp_path) == [] and list((tmp_path / "checkpoints").iterdir()) == []


def test_regression_resume_names_only_the_draft_options_that_differ():
    """A resume with another draft configuration printed both configs whole (two long dicts); now it names
    the differing keys only."""
    from artcache.trainers.consumer.restore import config_diffs

    saved = {"num_layers": 3, "block_size": 16, "layer_ids": [1, 14, 27], "gamma": 7.0}
    ours = {"num_layers": 2, "block_size": 16, "layer_ids": [1, 27], "gamma": 7.0, "new": 1}
    assert config_diffs(saved, ours) == ["layer_ids [1, 27] (checkpoint: [1, 14, 27])",
                                         "new 1 (checkpoint: None)", "num_layers 2 (checkpoint: 3)"]
    assert config_diffs(saved, dict(saved)) == []
