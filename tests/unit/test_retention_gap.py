"""bench/retention_gap.py: seeded stream families, their figures, and bad arguments."""

from __future__ import annotations

import json
import random

import pytest

from artcache.bench import retention_gap as rg


def test_families_are_seeded_and_near_floor_load_shares_near_floor_streams():
    for fam in rg.FAMILIES:
        a, b = (rg.draw(fam, random.Random(7)) for _ in range(2))
        assert a[0] == b[0] and a[2] == b[2]
    cons, _, budget, plan = rg.draw("near-floor", random.Random(3))
    load, _, budget_l, _ = rg.draw("near-floor-load", random.Random(3))
    assert budget == budget_l and plan == 25_000
    assert [c.start_s for c in cons] == [c.load_s for c in load] and {c.start_s for c in load} == {0.0}
    assert rg.floor_of(cons) <= budget <= rg.floor_of(cons) + 0.2 * (plan - rg.floor_of(cons))
    together, _, _, _ = rg.draw("together", random.Random(3))
    assert {c.start_s for c in together} == {0.0}
    staggered = [rg.draw("staggered", random.Random(k))[0] for k in range(5)]
    assert any(len({c.start_s for c in s}) > 1 for s in staggered)


def test_a_short_run_writes_figures_and_provenance(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rg, "POSITIONS", 3000)
    out = tmp_path / "g.json"
    assert rg.main(["--family", "staggered", "--streams", "2", "--workers", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["n"] == 2 and doc["summary"]["violations"] == 0 and "hardware" in doc and doc["commit"]
    for r in doc["streams"]:
        assert r["pinned_optimum"] <= r["policy"] and r["gap"] == pytest.approx(r["policy"] - r["pinned_optimum"])
    assert "staggered: 2 streams" in capsys.readouterr().out


@pytest.mark.parametrize("args, msg", [
    (["--family", "nope"], "--family 'nope': accepted together"),
    (["--family", "together", "--streams", "0"], "--streams 0: accepted an integer >= 1"),
    (["--family", "together", "--workers", "0"], "--workers 0: accepted 1 .. "),
    (["--family", "together", "--workers", "100000"], "--workers 100000: accepted 1 .. "),
    (["--family", "together", "--out", "/nonexistent-dir/x.json"], "its directory does not exist"),
    (["--family", "together", "--out", "/"], "--out /: is a directory; accepted: a file path"),  # regression
])
def test_bad_arguments_are_one_line_exit_2(args, msg, capsys):
    assert rg.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_regression_retention_gap_out_on_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys, full_temp_writes):
    """An --out that is a directory ran every stream and then gave atomic_write's PublishError as
    a traceback (refused before the run now, above); one on a full disk still fails at the write: one line
    naming --out and the path, exit 1, nothing written."""


    monkeypatch.setattr(rg, "POSITIONS", 2000)
    full_temp_writes()
    out = tmp_path / "g.json"
    assert rg.main(["--family", "together", "--streams", "1", "--workers", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"retention_gap: error: --out {out}: writing {out} failed: No space left on device"
    assert list(tmp_path.iterdir()) == []
