"""The code base is ruff clean (the configuration lives in pyproject.toml)."""

import shutil
import subprocess

import pytest

from tests.support import REPO

ROOT = REPO


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the [test] extra)")
    proc = subprocess.run([ruff, "check", "artcache", "trainers", "bench", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
