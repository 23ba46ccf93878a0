"""What ``pip install .`` installs: one package, ``artcache`` (trainers/ and bench/ are its subpackages)."""

from __future__ import annotations

import ast
import sys

from tests.support import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = REPO
FOLDERS = {"artcache": "artcache", "artcache.trainers": "trainers", "artcache.bench": "bench"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_package_dir_maps_the_folders_into_artcache():
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == FOLDERS


def test_packages_list_every_folder_with_an_init():
    """A subpackage missing from ``packages`` would be left out of a non-editable install."""
    found = set()
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert set(_pyproject()["tool"]["setuptools"]["packages"]) == found


def test_no_module_imports_the_folders_as_top_level_packages():
    """``import trainers`` / ``import bench`` would load a second copy of the modules from a checkout
    (and nothing at all from an installed wheel)."""
    bad = []
    for folder in ("artcache", "trainers", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if n.split(".")[0] in ("trainers", "bench")]
    assert bad == []
