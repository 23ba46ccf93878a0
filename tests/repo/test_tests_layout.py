"""tests/ keeps the layout of tests/README.md: every test file sits in a floor or lane folder, a lane folder is
named after a marker of pyproject.toml, and no test file repeats the lane marker its folder gives it."""

from __future__ import annotations

import re
import sys

from tests.conftest import LANES
from tests.support import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TESTS = REPO / "tests"
FLOORS = ("unit", "protocol", "properties", "repo")
LANE_MARK = re.compile(r"pytest\.mark\.(" + "|".join(LANES) + r")\b")


def test_every_test_file_sits_in_a_floor_or_lane_folder():
    """A test file at tests/ root or in an unknown folder would run in the default lane whatever it needs."""
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.relative_to(TESTS).parts[0] not in (*FLOORS, *LANES)]
    assert misplaced == [], f"move these into a folder of tests/README.md: {misplaced}"


def test_the_lane_folders_are_the_markers_of_pyproject():
    markers = {m.split(":")[0] for m in tomllib.loads((REPO / "pyproject.toml").read_text())
               ["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(LANES) == markers
    assert all((TESTS / lane / "__init__.py").is_file() for lane in (*FLOORS, *LANES))


def test_no_test_file_repeats_a_lane_marker():
    """The folder marks the lane (tests/conftest.py); a marker in a file would drift from its folder."""
    found = [f"{p.relative_to(TESTS)}:{n}" for p in TESTS.rglob("test_*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if LANE_MARK.search(line)]
    assert found == []


def test_test_file_names_are_unique_across_folders():
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
