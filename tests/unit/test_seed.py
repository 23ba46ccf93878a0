"""``--init-from``: one loader for every published layout (artcache checkpoints and run directories, both
artcache export formats of every draft, z-lab / speculators / SpecForge layouts), the checks before
loading, and the kept EAGLE-3 vocab map's coverage.

Round trips: a trained-shape draft (random weights in every tensor) is saved as a consumer checkpoint,
exported in every format and rewritten as the peers publish it; each form seeds a fresh draft of the
same run, whose outputs must equal the source's exactly (float32 everywhere).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from artcache.errors import ConfigError, ContractMismatch
from artcache.trainers.checkpoint import point_latest, replace_file, save_checkpoint, write_state
from artcache.trainers.consumer import ConsumerConfig
from artcache.trainers.consumer.restore import jsonable, load_weights_strict, plan_init
from artcache.trainers.draft import build_draft
from artcache.trainers.export import export_checkpoint
from artcache.trainers.seed import load_seed, map_back, read_seed
from tests.support import TINY_SHAREGPT

DATA = TINY_SHAREGPT
CAPTURED = [1, 2, 3, 5]  # tiny target: 6 layers; DFlash 3 layers reads [1, 2, 3], EAGLE-3 [1, 2, 2, 5]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory, tiny_target):
    from artcache.layout import CacheLayout
    from artcache.plan import Plan
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.settings import load_settings

    path = tmp_path_factory.mktemp("seed-root") / "cache"
    prepare_root(ProducerConfig(cache=str(path), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, layer_ids=CAPTURED))
    layout = CacheLayout(path)
    settings = load_settings(layout)
    return settings, Plan.load(layout.plan_dir(settings.plan_id))


def cfg_for(draft: str, **kw) -> ConsumerConfig:
    base = {"dflash": dict(block_size=4, num_anchors=8, draft_layers=3),
            "eagle3": dict(ttt_steps=2, draft_vocab=500)}[draft]
    return ConsumerConfig(cache="-", draft=draft, **{**base, **kw}).resolved()


def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def save_source(run: Path, draft, cfg, settings) -> Path:
    """``draft`` as a consumer checkpoint (the state fields the consumer records), ``latest`` pointed at it."""
    c = settings.contract
    opt = torch.optim.AdamW(draft.model.parameters(), lr=1e-3)
    state = {"consumer_id": "src", "draft": cfg.draft, "draft_config": jsonable(draft.config_dict()),
             "plan_id": settings.plan_id, "contract_id": c.contract_id, "target_name": c.target_name,
             "target_path": settings.target_path, "target_weights_digest": c.target_weights_digest,
             "dtype": c.dtype, "layer_convention": c.layer_convention, "layer_ids": list(draft.needed_layer_ids)}
    path = save_checkpoint(run, step=3, cursor=6, weights=draft.model.trainable_state_dict(), optimizer=opt,
                           generators={}, extra_tensors=draft.extra_tensors(), state=state)
    point_latest(run, path)
    return path


def outputs(draft, plan, seed: int = 5):
    """The draft model's outputs on random hidden states (its forward, all TTT steps / blocks)."""
    s = plan.sample(0)
    T = s.input_ids.shape[0]
    g = torch.Generator().manual_seed(seed)
    m = len(draft.needed_layer_ids)
    hidden = torch.randn(1, T, m, 64, generator=g)
    ids = s.input_ids.long()[None]
    with torch.no_grad():
        if draft.name == "dflash":
            anchors = torch.tensor([[1, 5, 9]])
            out = draft.model(hidden, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))
            return [draft.model.logits(out.reshape(-1, 64))]
        return [draft.model.draft_logits(h.reshape(-1, 64))
                for h in draft.model(hidden[:, :, :3], ids, torch.ones_like(ids, dtype=torch.bool), steps=2)]


def seed_into(path, cfg, settings, plan, **kw) -> tuple:
    """A fresh draft of ``cfg`` (another init seed) seeded from ``path`` exactly as the consumer does it."""
    cfg = ConsumerConfig(**{**__import__("msgspec").structs.asdict(cfg), "init_from": str(path), "seed": 99, **kw})
    cfg = cfg.resolved()
    info = __import__("artcache.trainers.draft", fromlist=["check_target"]).check_target(settings)
    src = read_seed(cfg.init_from, info.num_layers)
    from artcache.trainers.seed import seed_vocab_map

    fresh = build_draft(cfg, settings, plan, torch.device("cpu"), vocab_map=seed_vocab_map(src))
    own = {k: tuple(v.shape) for k, v in fresh.model.trainable_state_dict().items()}
    sp = plan_init(cfg, src, fresh.config_dict(), own, fresh.target_info, settings.contract, plan)
    load_weights_strict(fresh.model, load_seed(sp), str(path))
    return fresh, sp


def peer_layouts(out: Path, export_hf: Path, export_spec: Path, draft: str, target) -> dict[str, Path]:
    """The source rewritten as the peers publish it (no artcache export.json)."""
    made = {}
    if draft == "dflash":
        z = out / "zlab"
        shutil.copytree(export_hf, z)
        (z / "export.json").unlink()
        c = json.loads((z / "config.json").read_text())
        c.pop("eagle_aux_hidden_state_layer_ids")  # z-lab writes dflash_config.target_layer_ids only
        (z / "config.json").write_text(json.dumps(c))
        made["z-lab DFlashDraftModel"] = z
        sf = out / "specforge"
        shutil.copytree(z, sf)
        c = json.loads((sf / "config.json").read_text())
        c["dflash_config"].pop("target_layer_ids")  # SpecForge: the formula over num_target_layers
        c["dflash_config"].pop("block_size")
        (sf / "config.json").write_text(json.dumps(c))
        made["SpecForge DFlashDraftModel"] = sf
    else:
        sf = out / "specforge"
        shutil.copytree(export_hf, sf)
        (sf / "export.json").unlink()
        t = safetensors.torch.load_file(sf / "model.safetensors")
        from artcache.target import load_embedding_and_lm_head

        t["embed_tokens.weight"] = load_embedding_and_lm_head(target)[0]  # SpecForge ships the embedding
        safetensors.torch.save_file(t, str(sf / "model.safetensors"))
        made["SpecForge LlamaForCausalLMEagle3"] = sf
    sp = out / "speculators-peer"
    shutil.copytree(export_spec, sp)
    (sp / "export.json").unlink()  # speculators' own save: the verifier's name is the target identity
    made[f"speculators {draft}"] = sp
    return made


@pytest.mark.parametrize("draft", ["dflash", "eagle3"])
def test_every_layout_of_every_draft_seeds_a_run_with_the_sources_outputs(tmp_path, tiny_root, draft):
    """``artcache export --format hf`` of a DFlash checkpoint could not seed a run
    (``missing ['context_norm.weight']; unexpected ['hidden_norm.weight']``), nor the EAGLE-3 speculators
    export (``layers.0.*``). Every form below seeds a fresh draft whose outputs equal the source's."""
    settings, plan = tiny_root
    cfg = cfg_for(draft)
    source = build_draft(cfg, settings, plan, torch.device("cpu"))
    perturb(source.model, 1)
    ckpt = save_source(tmp_path / "run", source, cfg, settings)
    forms = {"checkpoint": ckpt, "run directory": tmp_path / "run",
             "model.safetensors file": ckpt / "model.safetensors"}
    for fmt in ("hf", "speculators"):
        export_checkpoint(tmp_path / "run", tmp_path / fmt, fmt, dtype="float32")
        forms[f"artcache export {fmt}"] = tmp_path / fmt
    forms.update(peer_layouts(tmp_path, tmp_path / "hf", tmp_path / "speculators", draft, source.target_info))
    want = outputs(source, plan)
    for name, path in forms.items():
        overrides = ["target"] if name.startswith("z-lab") or name.startswith("SpecForge DFlash") else []
        fresh, sp = seed_into(path, cfg, settings, plan, init_overrides=overrides)
        got = outputs(fresh, plan)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), name
        assert sp.source.draft == draft


def test_map_back_renames_only_where_the_model_lacks_the_key():
    """The serving renames are not injective across drafts: ``layers.0.*`` is EAGLE-3's ``midlayer.*`` but
    DFlash's own ``layers.0.*``; a key the model has is never renamed."""
    renames = (("midlayer.", "layers.0."),)
    mapping, target = map_back({"layers.0.w": (2,), "fc.weight": (1,), "embed_tokens.weight": (3,)},
                               {"midlayer.w": (2,), "fc.weight": (1,)}, renames, {"embed_tokens.weight": "embed"}, "x")
    assert mapping == {"layers.0.w": "midlayer.w", "fc.weight": "fc.weight"} and target == ["embed_tokens.weight"]
    mapping, _ = map_back({"layers.0.w": (2,)}, {"layers.0.w": (2,)}, renames, {}, "x")
    assert mapping == {"layers.0.w": "layers.0.w"}
    with pytest.raises(ConfigError, match=r"missing 1 key\(s\) \['b'\].*unexpected 1 key\(s\) \['c'\]"):
        map_back({"a": (1,), "c": (1,)}, {"a": (1,), "b": (1,)}, (), {}, "x")
    with pytest.raises(ConfigError, match="mapped twice"):
        map_back({"layers.0.w": (2,), "midlayer.w": (2,)}, {"midlayer.w": (2,)}, renames, {}, "x")
    with pytest.raises(ConfigError, match=r"shape mismatches \['a \(2,\) != \(3,\)'\]"):
        map_back({"a": (2,)}, {"a": (3,)}, (), {}, "x")


def test_regression_layer_ids_that_differ_are_refused_naming_both(tmp_path, tiny_root):
    """A source trained on [1, 3, 4, 7] loaded into ``--layer-ids 2,3,4,7`` (and
    [1..5] into [5..1]). The layers are compared in order and never overridden."""
    settings, plan = tiny_root
    cfg = cfg_for("dflash")
    src = build_draft(cfg, settings, plan, torch.device("cpu"))
    save_source(tmp_path / "run", src, cfg, settings)
    for ids in ([1, 2, 5], [3, 2, 1]):
        with pytest.raises(ConfigError, match=re.escape(f"trained on layers [1, 2, 3], this run reads {ids}")):
            seed_into(tmp_path / "run", cfg_for("dflash", layer_ids=ids), settings, plan,
                      init_overrides=["block_size", "mask_token", "target"])


def test_regression_mask_token_block_size_and_target_are_compared(tmp_path, tiny_root):
    """Mask token and block size were not compared, and a published draft without
    state.json got no target check. Each is refused naming the field and both values; its override
    accepts it."""
    settings, plan = tiny_root
    cfg = cfg_for("dflash")
    src = build_draft(cfg, settings, plan, torch.device("cpu"))
    ckpt = save_source(tmp_path / "run", src, cfg, settings)
    with pytest.raises(ConfigError, match=r"block_size differs: seed 4, this run 8 \(--block-size\); pass "
                                          "--init-override block_size"):
        seed_into(ckpt, cfg_for("dflash", block_size=8), settings, plan)
    _, sp = seed_into(ckpt, cfg_for("dflash", block_size=8), settings, plan, init_overrides=["block_size"])
    assert any("block_size differs" in n for n in sp.notes)
    state = json.loads((ckpt / "state.json").read_text())
    state["draft_config"]["mask_token_id"] = 7
    write_state(ckpt, state)
    with pytest.raises(ConfigError, match="mask_token_id differs: seed 7, this run"):
        seed_into(ckpt, cfg, settings, plan)
    seed_into(ckpt, cfg, settings, plan, init_overrides=["mask_token"])
    state["draft_config"]["mask_token_id"] = src.dcfg.mask_token_id
    state["target_weights_digest"] = "0" * 32
    write_state(ckpt, state)
    with pytest.raises(ContractMismatch, match="weights digest 0000"):
        seed_into(ckpt, cfg, settings, plan)
    seed_into(ckpt, cfg, settings, plan, init_overrides=["target"])
    state["target_weights_digest"] = settings.contract.target_weights_digest
    write_state(ckpt, state)
    # a published draft with no target identity at all (a z-lab directory): refused unless overridden
    export_checkpoint(tmp_path / "run", tmp_path / "hf", "hf", dtype="float32", target=settings.target_path)
    (tmp_path / "hf" / "export.json").unlink()
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    c.pop("num_target_layers")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ContractMismatch, match="records no target identity"):
        seed_into(tmp_path / "hf", cfg, settings, plan)
    c["num_target_layers"] = 30
    (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ContractMismatch, match="target of 30 layers"):
        seed_into(tmp_path / "hf", cfg, settings, plan, init_overrides=[])


def test_seeds_that_are_not_seeds_or_of_another_draft_are_refused(tmp_path, tiny_root):
    settings, plan = tiny_root
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="is a file but not model.safetensors"):
        read_seed(tmp_path / "notes.txt", 6)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no model.safetensors there"):
        read_seed(tmp_path / "empty", 6)
    bare = tmp_path / "bare"
    bare.mkdir()
    safetensors.torch.save_file({"w": torch.zeros(1)}, str(bare / "model.safetensors"))
    with pytest.raises(ConfigError, match="neither a state.json .* nor a config.json"):
        read_seed(bare, 6)
    (bare / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"]}))
    with pytest.raises(ConfigError, match="no registered draft reads its config.json"):
        read_seed(bare, 6)
    cfg = cfg_for("dflash")
    save_source(tmp_path / "run", build_draft(cfg, settings, plan, torch.device("cpu")), cfg, settings)
    with pytest.raises(ConfigError, match="holds a dflash draft, not eagle3"):
        seed_into(tmp_path / "run", cfg_for("eagle3"), settings, plan)


def test_published_options_artcache_does_not_compute_are_refused(tmp_path, tiny_root):
    """A layout that would load but predict differently (speculators' default norm_before_residual,
    sliding-window DFlash layers) is refused naming the option."""
    settings, plan = tiny_root
    for draft, edit, needle in (("eagle3", lambda c: c.pop("norm_before_residual"), "norm_before_residual"),
                                ("dflash", lambda c: c["transformer_layer_config"].update(
                                    layer_types=["sliding_attention"] * 3), "full_attention")):
        cfg = cfg_for(draft)
        save_source(tmp_path / draft, build_draft(cfg, settings, plan, torch.device("cpu")), cfg, settings)
        out = tmp_path / f"{draft}-spec"
        export_checkpoint(tmp_path / draft, out, "speculators", dtype="float32")
        c = json.loads((out / "config.json").read_text())
        edit(c)
        (out / "config.json").write_text(json.dumps(c))
        with pytest.raises(ConfigError, match=needle):
            read_seed(out, 6)


def test_regression_kept_vocab_map_coverage_is_measured(tmp_path, tiny_root, caplog):
    """An EAGLE-3 draft seeded onto other data kept its vocab map (right) but covered
    0 % of the new positions: loss printed 0.000 and the run "completed". The coverage of the plan's
    supervised training tokens is measured: refused below --min-vocab-coverage unless --keep-vocab-map
    (then warned with the figure)."""
    from artcache.trainers.eagle3 import vocab_map_from_used
    from artcache.trainers.eagle3.vocab import count_plan_tokens

    settings, plan = tiny_root
    cfg = cfg_for("eagle3")
    src = build_draft(cfg, settings, plan, torch.device("cpu"))
    ckpt = save_source(tmp_path / "run", src, cfg, settings)
    _, sp = seed_into(ckpt, cfg, settings, plan)
    assert sp.coverage is not None and sp.coverage > 0.9  # its map was built from this very plan
    counts = count_plan_tokens(plan, 49152)
    unseen = torch.nonzero(counts == 0).squeeze(1)[:500]  # a map of tokens this plan never supervises
    d2t, t2d = vocab_map_from_used(torch.sort(unseen).values, 49152)
    for f in ("model.safetensors", "extra.safetensors"):
        if not (ckpt / f).is_file():
            continue
        t = safetensors.torch.load_file(ckpt / f)
        t["d2t"], t["t2d"] = d2t, t2d
        replace_file(ckpt, f, safetensors.torch.save(t))  # the recorded digest follows
    with pytest.raises(ConfigError, match=r"covers 0.0% of this plan's supervised training tokens, below "
                                          r"--min-vocab-coverage 0.5.*--keep-vocab-map"):
        seed_into(ckpt, cfg, settings, plan)
    with caplog.at_level("WARNING", logger="artcache.consumer"):
        fresh, sp = seed_into(ckpt, cfg, settings, plan, keep_vocab_map=True)
    assert sp.coverage == 0.0 and any("covers 0.0%" in r.message for r in caplog.records if r.levelname == "WARNING")
    assert torch.equal(fresh.model.t2d, t2d)  # never replaced under the loaded weights
    seed_into(ckpt, cfg, settings, plan, min_vocab_coverage=0.0)  # the threshold is the user's


def test_options_a_draft_does_not_use_are_refused_naming_the_draft():
    """``ttt_steps`` on DFlash and ``block_size`` on EAGLE-3 were accepted silently."""
    with pytest.raises(ConfigError,
                       match="--ttt-steps 3 is an option of the eagle3 draft; the dflash draft does not use"):
        ConsumerConfig(cache="-", draft="dflash", ttt_steps=3).validate()
    # named with every draft that takes it (it said "of the dflash draft" only, though DSpark takes it too)
    with pytest.raises(ConfigError,
                       match="--block-size 8 is an option of the dflash and dspark drafts; the eagle3 draft"):
        ConsumerConfig(cache="-", draft="eagle3", block_size=8).validate()
    with pytest.raises(ConfigError, match="--anchors 8 is an option of the dflash and dspark drafts"):
        ConsumerConfig(cache="-", draft="eagle3", num_anchors=8).validate()
    r = ConsumerConfig(cache="-", draft="eagle3").resolved()
    assert (r.ttt_steps, r.draft_vocab, r.block_size, r.num_anchors) == (7, 32000, None, None)
    r = ConsumerConfig(cache="-", draft="dflash").resolved()
    assert (r.block_size, r.num_anchors, r.ttt_steps) == (16, 64, None)
