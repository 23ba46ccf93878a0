"""The GPU recipes of configs/ that name a hub target plan as they are: ``artcache run --dry-run`` on each, with
``Qwen/Qwen3-8B`` answered by a hub cache the test builds (holding the tiny target) and the devices moved to the
CPU, checks every experiment the way a real start would (layers, block sizes, anchors, windows, options)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.app.config import load_run_config
from tests.support import REPO
from tests.unit.test_target_hub import hub_cache

CONFIGS = REPO / "configs"


@pytest.mark.parametrize("name", ["gpu-qwen3-8b.toml", "gpu-node-8x.toml"])
def test_hub_target_recipe_dry_runs(name, tiny_target, tmp_path, monkeypatch):
    path = CONFIGS / name
    cfg = load_run_config(path)
    assert cfg.target.name == "Qwen/Qwen3-8B"
    cache = tmp_path / "hub"
    hub_cache(cache, Path(tiny_target.path), repo="Qwen/Qwen3-8B")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    moved = [f"experiments.{i}.device=cpu" for i, x in enumerate(cfg.experiments) if x.device]
    result = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run", "--out", str(tmp_path / "o"),
                                       "target.device=cpu", "data.max_samples=300", "data.max_length=256",
                                       "capture.draft_layers=3", *moved,
                                       *(f"experiments.{i}.anchors=16" for i, x in enumerate(cfg.experiments)
                                         if x.anchors)])
    assert result.exit_code == 0, result.output
    for x in cfg.experiments:
        assert x.name in result.output
