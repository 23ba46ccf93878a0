"""Checkpoints: safetensors + JSON only, atomic directories, optimizer / RNG round trips that make a resumed
run continue exactly as an uninterrupted one, lookup by recorded cursor, pruning, strict weight seeding."""

from __future__ import annotations

import errno
import json
import os
import re

import hypothesis
import msgspec
import pytest
import safetensors.torch
import torch
from hypothesis import strategies as st

from artcache.errors import CheckpointCorrupt, CheckpointWriteError, ConfigError, InsufficientSpace, IntegrityError
from artcache.trainers import checkpoint as ck
from artcache.trainers.consumer import lr_at
from artcache.trainers.consumer.restore import load_weights_strict
from tests.support.ckpt_damage import flip_byte, truncate


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


#: what safetensors raised when the disk filled during the issue-14 bench's final checkpoints
ENOSPC_MESSAGE = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                  'device" }) (os error 28)')


def test_regression_enospc_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The disk filled while a checkpoint was written and the run died with a bare
    SafetensorError. Now the half-written directory is removed, ``latest`` and the earlier checkpoint stay,
    and the error is a typed CheckpointWriteError naming the errno and the last good checkpoint."""
    model, opt = make()
    gen = torch.Generator()
    first = save(tmp_path, 1, model, opt, gen)
    ck.point_latest(tmp_path, first)
    real = safetensors.torch.save_file
    calls = []

    def failing(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:  # the optimizer file: the model file is already written, this one half-way
            real(tensors, path, *a, **k)
            with open(path, "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise safetensors.SafetensorError(ENOSPC_MESSAGE)
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(CheckpointWriteError) as info:
        save(tmp_path, 2, model, opt, gen)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    exc = info.value
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC and exc.retryable is False
    assert exc.last_good == str(first)
    text = str(exc)
    assert "ENOSPC: No space left on device" in text and str(ck.step_dir(tmp_path, 2)) in text
    assert f"the last good checkpoint is {first} (step 1, cursor 2)" in text and "latest is unchanged" in text
    assert "\n" not in text
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000001"]
    assert (tmp_path / "checkpoints" / "latest").resolve() == first
    assert ck.load_checkpoint(first).state.step == 1  # still whole


def test_a_failed_fsync_is_typed_and_retryable_and_names_that_there_is_no_earlier_checkpoint(tmp_path, monkeypatch):
    model, opt = make()
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, os.strerror(errno.EIO))))
    with pytest.raises(CheckpointWriteError) as info:
        save(tmp_path, 1, model, opt, torch.Generator())
    monkeypatch.setattr(os, "fsync", real)
    assert info.value.errno == errno.EIO and info.value.retryable is True and info.value.last_good is None
    assert "this run has no earlier checkpoint" in str(info.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []


_FSIZE_CHILD = """
import resource, signal, sys, torch
from artcache.errors import CheckpointWriteError
from artcache.trainers import checkpoint as ck
run = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 64)).sum().backward()
opt.step()
kw = dict(cursor=1, weights=dict(model.state_dict()), optimizer=opt, generators={}, extra_tensors={}, state={})
ck.point_latest(run, ck.save_checkpoint(run, step=1, **kw))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel then fails the write with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))  # model file ~16.9 KB, optimizer ~33 KB
try:
    ck.save_checkpoint(run, step=2, **kw)
except CheckpointWriteError as exc:
    print(exc.errno, exc.last_good)
    print(exc)
"""


def test_a_kernel_write_error_inside_safetensors_keeps_the_previous_checkpoint(tmp_path):
    """A real errno from the kernel, raised inside safetensors' own (Rust) writer: a child process lowers
    RLIMIT_FSIZE below the optimizer file's size, so its write fails with EFBIG half-way."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, last = proc.stdout.splitlines()[0].split()
    first = ck.step_dir(tmp_path, 1)
    assert int(code) == errno.EFBIG and last == str(first)
    assert "EFBIG: File too large" in proc.stdout and f"the last good checkpoint is {first}" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000001"]
    assert ck.load_checkpoint(first).state.step == 1


def test_find_checkpoint_by_cursor_and_prune(tmp_path):
    model, opt = make()
    gen = torch.Generator()
    paths = {s: save(tmp_path, s, model, opt, gen) for s in (2, 4, 6, 8)}
    assert ck.find_checkpoint(tmp_path, cursor=8) == paths[4]  # cursor = 2 × step
    assert ck.find_checkpoint(tmp_path, cursor=5) is None
    (tmp_path / "checkpoints" / ".tmp-half").mkdir()  # a crashed save's temp dir is never a checkpoint
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 4, 6, 8]
    removed = ck.prune(tmp_path, 2, paths[2])
    assert sorted(removed) == [paths[4]]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 6, 8]
    assert ck.prune(tmp_path, 0, paths[2]) == []


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
    from artcache.trainers.seed import read_seed

    with pytest.raises(ConfigError, match="does not exist"):
        read_seed(tmp_path / "missing", 6)
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


# ---- weights-only checkpoints ------------------------------------------------------------------------------

def test_weights_only_checkpoint_is_seeded_from_never_resumed(tmp_path):
    from artcache.trainers.seed import SeedPlan, load_seed, read_seed

    model, opt = make()
    train(model, opt, torch.Generator(), range(2))
    path = ck.save_checkpoint(tmp_path / "run", step=2, cursor=4, weights=model.trainable_state_dict(),
                              optimizer=None, generators={"anchors": torch.Generator()}, extra_tensors={},
                              state={"draft": "dflash"})
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "state.json"]
    state = ck.read_state(path)
    assert state.resumable is False and state.param_groups == [] and (state.step, state.cursor) == (2, 4)
    with pytest.raises(ConfigError, match=r"weights-only .* cannot be resumed, only seeded from: start a new run "
                                          r"with --init-from .*step-00000002"):
        ck.load_checkpoint(path)
    assert ck.find_checkpoint(tmp_path / "run", cursor=4) == path  # --resume finds it, then refuses it, by name
    src = read_seed(path, 4)  # the one seed loader (--init-from) reads it
    assert src.path == path.resolve() and src.layout == "artcache checkpoint" and src.state.resumable is False
    got = load_seed(SeedPlan(src, {k: k for k in src.shapes}))
    assert all(torch.equal(got[k], v) for k, v in model.trainable_state_dict().items())
    full = save(tmp_path / "full", 2, model, opt, torch.Generator())
    assert ck.read_state(full).resumable is True  # and an older state.json without the field reads as full
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "state.json").write_text(json.dumps({"step": 1, "cursor": 2}))
    assert ck.read_state(tmp_path / "old").resumable is True


# ---- content digests ---------------------------------------------------------------------------------------

KINDS = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "extra.safetensors", "state.json")


def full(run_dir):
    """A full checkpoint holding every file kind (extra included) after two training steps."""
    model, opt = make()
    gen = torch.Generator().manual_seed(1)
    train(model, opt, gen, range(2))
    return ck.save_checkpoint(run_dir, step=2, cursor=4, weights=model.trainable_state_dict(), optimizer=opt,
                              generators={"anchors": gen}, extra_tensors={"d2t": torch.arange(3)},
                              state={"consumer_id": "c", "draft": "dflash"})


def test_a_good_checkpoint_records_every_file_and_round_trips(tmp_path, caplog):
    from artcache.hashing import digest_file
    from artcache.trainers.seed import read_seed

    path = full(tmp_path)
    state = ck.read_state(path)
    assert state.digests is not None and state.digests.algorithm == "xxh3_128" and state.digests.replacing == {}
    assert sorted(state.digests.files) == sorted(k for k in KINDS if k != "state.json")
    for name, rec in state.digests.files.items():
        assert (rec.size, rec.digest) == ((path / name).stat().st_size, digest_file(path / name)), name
    with caplog.at_level("WARNING", logger="artcache.consumer"):
        assert ck.verify_checkpoint(path, state) is True
        loaded = ck.load_checkpoint(path)
        st, weights, extra = ck.read_weights(path)
        read_seed(path, 4)
    assert not caplog.records  # verified: nothing to warn about
    assert (loaded.state.step, loaded.state.cursor, st.step) == (2, 4, 2) and extra["d2t"].tolist() == [0, 1, 2]
    assert set(weights) == set(loaded.weights) and all(torch.equal(weights[k], loaded.weights[k]) for k in weights)
    # state.json is rewritten only with its digest recomputed: an edit through write_state reads back
    doc, _ = ck.read_document(path)
    ck.write_state(path, {**doc, "draft": "eagle3", "custom": {"kept": [1, 2]}})
    doc2, st2 = ck.read_document(path)
    assert st2.draft == "eagle3" and doc2["custom"] == {"kept": [1, 2]} and ck.load_checkpoint(path).state.step == 2
    assert st2.digests.files == state.digests.files and st2.digests.state != state.digests.state


@pytest.mark.parametrize("kind", KINDS)
def test_regression_a_flipped_byte_in_any_checkpoint_file_is_refused_before_use(tmp_path, kind):
    """A byte flipped on disk inside a tensor's data loads without complaint (safetensors checks
    only the header) and --resume / --init-from / export used the garbage. Every file kind is now checked
    against the digest recorded when it was written, and a mismatch is refused naming the file and both
    digests, before anything is loaded. Export and --init-from read only the weight files and state.json."""
    from artcache.hashing import digest_file
    from artcache.trainers.seed import read_seed

    path = full(tmp_path)
    state = ck.read_state(path)
    before = ({k: v.clone() for k, v in safetensors.torch.load_file(path / kind).items()}
              if kind.endswith(".safetensors") else None)
    flip_byte(path / kind)
    if before is not None:  # the damage is silent to safetensors: it loads, with a changed tensor
        after = safetensors.torch.load_file(path / kind)
        assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(CheckpointCorrupt) as info:
        ck.load_checkpoint(path)  # --resume
    msg = str(info.value)
    assert isinstance(info.value, IntegrityError) and info.value.exit_code == 1 and not info.value.retryable
    assert str(path / kind) in msg and "\n" not in msg
    if kind == "state.json":
        assert f"expected xxh3_128 {state.digests.state}, actual " in msg
        assert "cursor" not in msg  # refused before a field (here: step) is trusted
        with pytest.raises(CheckpointCorrupt):
            ck.find_checkpoint(tmp_path, cursor=4)  # --resume's lookup by the recorded cursor
    else:
        rec = state.digests.files[kind]
        assert f"expected xxh3_128 {rec.digest} ({rec.size:,} B), actual {digest_file(path / kind)} ({rec.size:,} B)" \
            in msg
    if kind in ("model.safetensors", "extra.safetensors", "state.json"):  # what export and --init-from read
        ck.point_best(tmp_path, path)  # checkpoints/best is the same checkpoint, checked the same way
        for read in (ck.read_weights, lambda p: read_seed(p, 4)):
            for given in (path, tmp_path / "checkpoints" / "best"):
                with pytest.raises(CheckpointCorrupt, match=re.escape(str(path / kind))):
                    read(ck.find_checkpoint(given))
    else:  # export and --init-from do not read the optimizer or RNG state: their weights are intact
        assert ck.read_weights(path)[0].step == 2 and read_seed(path, 4).state.step == 2


@pytest.mark.parametrize("kind", ["model.safetensors", "optimizer.safetensors"])
def test_regression_a_truncated_checkpoint_file_is_refused(tmp_path, kind):
    """A checkpoint file cut short on disk must be refused by its recorded digest and size (CheckpointCorrupt naming
    the file, the expected and the actual digest and size), not loaded as a shorter tensor or a raw error."""
    path = full(tmp_path)
    rec = ck.read_state(path).digests.files[kind]
    truncate(path / kind, 4)
    with pytest.raises(CheckpointCorrupt, match=rf"{re.escape(str(path / kind))} does not match .*expected xxh3_128 "
                                                rf"{rec.digest} \({rec.size:,} B\), actual [0-9a-f]{{32}} "
                                                rf"\({rec.size - 4:,} B\)"):
        ck.load_checkpoint(path)


def test_a_missing_recorded_file_or_an_unrecorded_tensor_file_is_refused(tmp_path):
    path = full(tmp_path)
    (path / "rng.safetensors").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"rng.safetensors is missing: its state.json records it"):
        ck.load_checkpoint(path)
    model, opt = make()
    bare = save(tmp_path / "bare", 1, model, opt, torch.Generator())  # no extra.safetensors recorded
    safetensors.torch.save_file({"d2t": torch.arange(3)}, str(bare / "extra.safetensors"))
    for read in (ck.load_checkpoint, ck.read_weights):
        with pytest.raises(CheckpointCorrupt, match=r"extra.safetensors is not among the files its state.json "
                                                    r"records \(model.safetensors, optimizer.safetensors"):
            read(bare)


def test_regression_a_checkpoint_without_digests_still_loads_with_one_warning(tmp_path, caplog):
    """Checkpoints written before digests were recorded have none: they load (resume, seed, export) as before,
    with one warning per checkpoint that their files are unverified."""
    from artcache.trainers.seed import read_seed

    path = full(tmp_path)
    doc = json.loads((path / "state.json").read_text())
    del doc["digests"]
    (path / "state.json").write_text(json.dumps(doc, indent=1))  # as an older artcache wrote it
    with caplog.at_level("WARNING", logger="artcache.consumer"):
        assert ck.read_state(path).digests is None
        assert ck.verify_checkpoint(path, ck.read_state(path)) is False
        assert ck.load_checkpoint(path).state.step == 2
        assert ck.read_weights(path)[2]["d2t"].tolist() == [0, 1, 2]
        assert read_seed(path, 4).state.step == 2
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"checkpoint {path} records no content digests (written before artcache recorded them): its "
                      "files are used unverified"]
    ck.write_state(path, {**doc, "draft": "eagle3"})  # a rewrite does not invent digests for unverified files
    assert ck.read_state(path).digests is None and ck.read_state(path).draft == "eagle3"


def test_replace_file_keeps_the_record_true_when_interrupted(tmp_path, monkeypatch):
    """calibrate replaces extra.safetensors in place: state.json first records the new content (the old one
    under ``replacing``), then the file, then state.json without ``replacing`` — a crash between any two
    leaves a checkpoint that verifies."""
    from artcache.errors import PublishError

    path = full(tmp_path)
    old = (path / "extra.safetensors").read_bytes()
    new = safetensors.torch.save({"d2t": torch.arange(5)})
    real, calls = ck.atomic_write, []

    def crash_at_the_file(dest, *a, **k):
        calls.append(dest.name)
        if dest.name == "extra.safetensors":
            raise PublishError("injected crash before the file was replaced")
        return real(dest, *a, **k)

    monkeypatch.setattr(ck, "atomic_write", crash_at_the_file)
    with pytest.raises(PublishError):
        ck.replace_file(path, "extra.safetensors", new)
    monkeypatch.setattr(ck, "atomic_write", real)
    assert calls == ["state.json", "extra.safetensors"]
    st = ck.read_state(path)
    assert set(st.digests.replacing) == {"extra.safetensors"} and (path / "extra.safetensors").read_bytes() == old
    assert ck.load_checkpoint(path).extra["d2t"].tolist() == [0, 1, 2]  # the old content still verifies
    ck.replace_file(path, "extra.safetensors", new)
    st = ck.read_state(path)
    assert st.digests.replacing == {} and st.digests.files["extra.safetensors"].size == len(new)
    assert ck.load_checkpoint(path).extra["d2t"].tolist() == [0, 1, 2, 3, 4]
    (path / "extra.safetensors").write_bytes(old)  # once complete, the old content is no longer accepted
    with pytest.raises(CheckpointCorrupt, match="extra.safetensors does not match"):
        ck.load_checkpoint(path)


# ---- sizes and the free-space preflight ------------------------------------------------------------------

def _file_sizes(path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir()}


@pytest.mark.parametrize("fused", [False, True])
def test_checkpoint_size_before_step_1_bounds_the_files_written(tmp_path, fused):
    """The size computed before the first step (AdamW state from the parameters) is what the checkpoint
    takes after it: tensor bytes exact, safetensors headers bounded by a few bytes per tensor."""
    torch.manual_seed(0)
    model = Tiny()
    model.extra = torch.nn.Linear(2, 2).requires_grad_(False)  # a frozen parameter has no optimizer state
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), fused=fused)
    gen = torch.Generator().manual_seed(3)
    extra = {"d2t": torch.arange(5), "t2d": torch.ones(9, dtype=torch.bool)}
    before = ck.checkpoint_size(model.trainable_state_dict(), extra, ck.adamw_state_specs(params), {"anchors": gen})
    train(model, opt, gen, range(1))
    tensors, _ = ck.optimizer_tensors(opt)
    specs = ck.adamw_state_specs(params)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == \
        {k: (tuple(v.shape), v.dtype) for k, v in specs.items()}
    path = ck.save_checkpoint(tmp_path, step=1, cursor=1, weights=model.trainable_state_dict(), optimizer=opt,
                              generators={"anchors": gen}, extra_tensors=extra, state={"consumer_id": "c"})
    got = _file_sizes(path)
    for name, bound in (("model.safetensors", before.weights), ("optimizer.safetensors", before.optimizer),
                        ("rng.safetensors", before.rng), ("extra.safetensors", before.extra)):
        n = len(safetensors.torch.load_file(path / name))
        assert got[name] <= bound <= got[name] + 32 * n + 8, (name, got[name], bound)
    assert got["state.json"] <= before.state == ck.STATE_JSON_BOUND
    assert before.total >= sum(got.values())
    weights_only = ck.checkpoint_size(model.trainable_state_dict(), extra, None)
    assert (weights_only.optimizer, weights_only.rng) == (0, 0) and weights_only.total == before.weights_only
    assert ck.safetensors_bytes({}) == 0


def test_an_fp32_adamw_checkpoint_is_three_times_its_weights():
    """Why --no-checkpoint-optimizer matters: AdamW keeps two moments of every fp32 weight (a
    1.05 B-parameter DFlash draft, 4.2 GB of weights, 12.6 GB per checkpoint)."""
    weights = {f"w{i}": torch.empty(1024, 1024, device="meta") for i in range(4)}
    size = ck.checkpoint_size(weights, {}, ck.adamw_state_specs(list(weights.values())))
    assert size.optimizer / size.weights == pytest.approx(2.0, rel=1e-4)


@pytest.mark.parametrize("start,steps,every,saves", [
    (0, 10, 0, 1), (0, 10, 3, 4), (0, 9, 3, 3), (3, 9, 3, 2), (9, 9, 3, 0), (0, 1, 1, 1), (4, 10, 0, 1)])
def test_planned_saves(start, steps, every, saves):
    assert ck.planned_saves(start, steps, every) == saves


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(start=st.integers(0, 30), extra=st.integers(0, 30), every=st.integers(0, 7), keep=st.integers(0, 5),
                  existing=st.integers(0, 6), best_every=st.integers(0, 5), improves=st.lists(st.booleans()))
def test_peak_checkpoints_is_what_the_save_and_prune_loop_leaves_on_disk(start, extra, every, keep, existing,
                                                                          best_every, improves):
    """Simulate the consumer's loop (a save at every multiple of --save-every below --steps, the final one at
    --steps, prune to the newest --keep-checkpoints after each write, never removing checkpoints/best; with
    best tracking an evaluation every ``best_every`` steps that beats the best so far — as ``improves``
    says, or only the first, so best stays the oldest) — checkpoints its step and moves best there): the
    directories on disk at once never exceed peak_checkpoints, nor the writes planned_saves; without best
    tracking they are exactly what both say."""
    steps = start + extra
    for worst in (False, True):
        on_disk, peak, written, best = list(range(-existing, 0)), existing, 0, None
        flags = iter(improves)
        for s in range(start + 1, steps + 1):
            evaluated = bool(best_every) and (s % best_every == 0 or s == steps)
            improved = evaluated and ((best is None) if worst else next(flags, True))
            if not (improved or s == steps or (every and s % every == 0)):
                continue
            on_disk.append(s)
            written += 1
            peak = max(peak, len(on_disk))
            if improved:
                best = s
            if keep:
                on_disk = [c for i, c in enumerate(on_disk) if i >= len(on_disk) - keep or c == best]
        bound = ck.peak_checkpoints(keep, ck.planned_saves(start, steps, every, best_every), existing,
                                    best=bool(best_every))
        assert written <= ck.planned_saves(start, steps, every, best_every) and peak <= bound
        if not best_every:
            assert written == ck.planned_saves(start, steps, every) and peak == ck.peak_checkpoints(keep, written,
                                                                                                   existing)


def test_regression_space_preflight_counts_an_older_best_checkpoint():
    """checkpoints/best is never pruned, so with --keep-checkpoints 2 and a best left at
    step 1, steps 4 and 5 plus the one being written and best make 4 on disk, not keep + 1 = 3; and every
    evaluation that improves writes a checkpoint of its own."""
    assert ck.peak_checkpoints(2, 10, best=True) == 4 and ck.peak_checkpoints(2, 10) == 3
    assert ck.planned_saves(0, 10, 5, best_every=2) == 6  # steps 2, 4, 5, 6, 8 and the final 10


def test_check_checkpoint_space_refuses_naming_the_bytes_and_the_ways_out(tmp_path, monkeypatch):
    size = ck.CheckpointSize(weights=4_194_304_000, optimizer=8_388_608_000, rng=6_000, state=1 << 20)
    fs = 64 * 10**9
    reserve = min(64 << 20, fs // 20)
    monkeypatch.setattr(ck, "free_space", lambda p: (2 * size.total + reserve, fs, tmp_path))
    run = tmp_path / "runs" / "d16"  # not made yet: its nearest existing ancestor is measured
    assert ck.check_checkpoint_space(run, size, keep=3, saves=1) == size.total
    assert ck.check_checkpoint_space(run, size, keep=1, saves=5) == 2 * size.total  # keep 1: two while writing
    assert ck.check_checkpoint_space(run, size, keep=3, saves=0) == 0
    with pytest.raises(InsufficientSpace) as info:
        ck.check_checkpoint_space(run, size, keep=3, saves=10, what="consumer 'd16'")
    text = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in text
    assert f"checkpoints of consumer 'd16' need {4 * size.total:,} B" in text and f"under {run}" in text
    assert f"{tmp_path} has {2 * size.total + reserve:,} B" in text
    for way in ("--keep-checkpoints", "--no-checkpoint-optimizer", "another --out"):
        assert way in text, way
    # weights-only and one checkpoint at a time: only another --out is left to suggest
    with pytest.raises(InsufficientSpace) as info:
        ck.check_checkpoint_space(run, ck.CheckpointSize(weights=10**12), keep=3, saves=1)
    assert "a smaller --keep-checkpoints" not in str(info.value) and "--no-checkpoint-optimizer" not in str(info.value)
    assert not run.exists()


def test_free_space_measures_the_nearest_existing_ancestor(tmp_path):
    from artcache.fsio import free_space

    free, total, at = free_space(tmp_path / "a" / "b")
    assert at == tmp_path and 0 < free <= total


def test_regression_a_save_killed_mid_way_leaves_no_temp_directory_behind_the_next_start(tmp_path):
    """Kill -9 during save_checkpoint left checkpoints/.tmp-<writer>.<nonce> (a whole
    checkpoint's bytes) for ever; nothing removed it and the free-space check did not count it. The next
    start removes a dead writer's temp directory and leaves a live writer's and foreign names alone."""
    import subprocess
    import sys

    from artcache.layout import unique_suffix
    from artcache.trainers.checkpoint import remove_orphan_temps

    dead = subprocess.run([sys.executable, "-c", "from artcache.layout import unique_suffix; print(unique_suffix())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ck = tmp_path / "checkpoints"
    orphan, live, foreign = ck / f".tmp-{dead}", ck / f".tmp-{unique_suffix()}", ck / ".tmp-not-ours"
    for d in (orphan, live, foreign):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    assert remove_orphan_temps(tmp_path) == (1, 1000)
    assert not orphan.exists() and live.is_dir() and foreign.is_dir()
    assert remove_orphan_temps(tmp_path) == (0, 0) and remove_orphan_temps(tmp_path / "none") == (0, 0)


def test_regression_one_walk_of_the_step_directories(tmp_path, monkeypatch):
    """Regression: stateless_checkpoints repeated list_checkpoints' walk of checkpoints/. Both are now views of
    one walk (ck._step_dirs): together they hold every step-N directory once, each ascending by step."""
    parent = tmp_path / "checkpoints"
    for step, complete in ((12, True), (3, False), (7, True), (1, False)):
        d = parent / f"step-{step:08d}"
        d.mkdir(parents=True)
        if complete:
            (d / "state.json").write_text("{}")
    (parent / "step-1").mkdir()  # not a step-N name
    (parent / "step-00000099").symlink_to(parent / "step-00000012")  # a link is no checkpoint
    assert ck.list_checkpoints(tmp_path) == [(7, parent / "step-00000007"), (12, parent / "step-00000012")]
    assert ck.stateless_checkpoints(tmp_path) == [parent / "step-00000001", parent / "step-00000003"]
    assert ck.list_checkpoints(tmp_path / "nothing") == [] and ck.stateless_checkpoints(tmp_path / "nothing") == []
    fake = [(5, parent / "x", True), (6, parent / "y", False)]
    monkeypatch.setattr(ck, "_step_dirs", lambda run_dir: fake)
    assert ck.list_checkpoints(tmp_path) == [(5, parent / "x")] and ck.stateless_checkpoints(tmp_path) == [parent / "y"]


@pytest.mark.parametrize("damage, message", [
    ((b'"digests":', b'"digezts":'), r"records its content digests under the key 'digezts', not 'digests'"),
    ((b'"digests":', b'"Digests":'), r"under the key 'Digests', not 'digests'"),
    ("null", r"its 'digests' record is not an object but null"),
    ("no state", r"its 'digests' record lacks 'state'"),
])
def test_regression_a_damaged_digests_record_is_corrupt_not_an_old_checkpoint(tmp_path, caplog, damage, message):
    """Regression: a damaged ``digests`` key name in state.json read as a checkpoint written before digests were
    recorded, so every file was used unverified (one warning). Only a checkpoint with no record at all is one."""
    from artcache.trainers.seed import read_seed

    path = full(tmp_path)
    raw = (path / "state.json").read_bytes()
    if isinstance(damage, tuple):  # the key's bytes changed on disk, the rest intact
        assert raw.count(damage[0]) == 1
        raw = raw.replace(*damage)
    else:
        doc = json.loads(raw)
        doc["digests"] = None if damage == "null" else {k: v for k, v in doc["digests"].items() if k != "state"}
        raw = json.dumps(doc, indent=1).encode()
    (path / "state.json").write_bytes(raw)
    with caplog.at_level("WARNING", logger="artcache.consumer"):
        for read in (ck.read_state, ck.load_checkpoint, ck.read_weights, lambda p: read_seed(p, 4)):
            with pytest.raises(CheckpointCorrupt, match=message) as info:
                read(path)
            assert str(path / "state.json") in str(info.value) and "restore it from a copy" in str(info.value)
    assert not [r for r in caplog.records if "unverified" in r.getMessage()]
