"""`artcache export --check` against speculators' registry (the rest: tests/unit/test_export_check.py)."""

from __future__ import annotations

import pytest

from artcache.errors import ConfigError
from artcache.trainers import export_check
from artcache.trainers.export_check import check_export
from tests.unit import test_export_check as unit_part
from tests.unit.test_export_check import _craft, _needs

exports = unit_part.exports  # a fixture of tests/unit/test_export_check.py


@_needs("speculators")
def test_speculators_resolves_every_speculators_export(exports):
    for name in ("dflash-speculators", "eagle3-speculators", "dspark-speculators"):
        rep = check_export(exports[name], exports["target"], engines=("speculators",))
        line = next(c for c in rep.checked if c.startswith("speculators: "))
        assert rep.layout.speculators_class in line and str(rep.layout.aux_ids) in line, line


@_needs("speculators")
@pytest.mark.parametrize("src,edit,key", [
    ("eagle3-speculators", lambda c: c.update(norm_before_residual=True), "norm_before_residual"),
    ("eagle3-speculators", lambda c: c.update(fc_norm=True), "fc_norm"),
    ("dflash-speculators", lambda c: c.pop("sliding_window_non_causal"), "sliding_window_non_causal"),
    ("dflash-speculators", lambda c: c.update(speculators_model_type="dflash2"), "speculators_model_type"),
    ("dspark-speculators", lambda c: c.update(sample_from_anchor=False), "sample_from_anchor"),
], ids=["norm before residual", "fc norm", "causal blocks (speculators' default)", "another model type",
        "sample_from_anchor false"])
def test_speculators_resolution_refuses_silent_collapses(exports, tmp_path, src, edit, key):
    """speculators' registry and pydantic defaults, resolved on an export the static reading already accepted."""
    d = _craft(exports[src], tmp_path / "x", edit)
    layout = check_export(exports[src], exports["target"], engines=()).layout
    with pytest.raises(ConfigError) as e:
        export_check._check_speculators(d, layout, str(d), 900)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
