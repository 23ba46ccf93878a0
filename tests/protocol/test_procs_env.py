"""tests/support/procs.child_env: a CLI child imports the same artcache as the test process.

Regression: the GPU machine imports artcache from a link tree (the package's files plus
``trainers/`` and ``bench/`` linked in as ``artcache.trainers`` / ``artcache.bench``, as setuptools'
package-dir does for an install). child_env put the repository first on PYTHONPATH, so every child imported
the bare checkout's ``artcache`` (no ``artcache.trainers``) and died at ``from artcache.trainers import
DRAFT_NAMES``: 4 GPU-lane tests errored at setup and the short bench failed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.procs import REPO


def test_regression_children_import_the_tests_artcache_from_a_link_tree(tmp_path):
    """With artcache imported from a link tree, child_env put the repository first on PYTHONPATH and every child
    imported the bare checkout (no ``artcache.trainers``) and died at import (see the module docstring)."""
    tree = tmp_path / "pkg" / "artcache"
    tree.mkdir(parents=True)
    for f in (REPO / "artcache").iterdir():
        (tree / f.name).symlink_to(f)
    (tree / "trainers").symlink_to(REPO / "trainers")
    (tree / "bench").symlink_to(REPO / "bench")
    probe = (
        f"import subprocess, sys; sys.path.append({str(REPO)!r}); from tests.support import procs; import artcache; "
        "print(artcache.__file__); "
        "print(subprocess.run([sys.executable, '-c', 'import artcache.trainers, artcache; print(artcache.__file__)'], "
        f"env=procs.child_env(), capture_output=True, text=True, cwd={str(tmp_path)!r}).stdout.strip())"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "pkg"), PYTHONSAFEPATH="1")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    parent, child = out.stdout.split()
    assert Path(parent).parent == tree  # the test process imported the link tree ...
    assert child == parent  # ... and so does its child, with artcache.trainers
