"""docs/config.md and docs/cli.md are generated (``python -m artcache.app.reference``): the committed pages must be
what the generator writes from the typed config structs and click's help now, so they cannot drift."""

from __future__ import annotations

import shutil
import subprocess
import sys

from artcache.app.reference import pages, stale
from tests.support import REPO

ROOT = REPO


def test_committed_reference_pages_are_what_the_generator_writes():
    assert stale(ROOT / "docs") == [], "regenerate them: python -m artcache.app.reference"


def test_the_pages_cover_every_config_field_and_every_verb():
    import msgspec.inspect as mi

    from artcache.app.cli import main
    from artcache.app.config import RunConfig
    from artcache.trainers.consumer.config import ConsumerConfig

    text = pages()
    for section in mi.type_info(RunConfig).fields:
        t = section.type
        names = [f.name for f in t.fields] if isinstance(t, mi.StructType) else [section.name]
        if isinstance(t, mi.ListType):  # [[experiments]]
            names = [f.name for f in t.item_type.fields]
        for name in names:
            assert f"| `{name}` |" in text["config.md"], (section.name, name)
    for f in mi.type_info(ConsumerConfig).fields:
        assert f"| `{f.name}` |" in text["config.md"], f.name
    for verb in main.commands:
        assert f"## `artcache {verb}`" in text["cli.md"], verb


def test_check_names_a_page_that_differs(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("config.md", "cli.md"):
        shutil.copy(ROOT / "docs" / name, docs / name)
    ok = subprocess.run([sys.executable, "-m", "artcache.app.reference", "--check", "--out", str(docs)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    (docs / "cli.md").write_text((docs / "cli.md").read_text().replace("--steps", "--stepz", 1))
    bad = subprocess.run([sys.executable, "-m", "artcache.app.reference", "--check", "--out", str(docs)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "cli.md" in bad.stderr and "config.md" not in bad.stderr
