"""artcache.fsio.publish_dir: the one directory publication (plans, checkpoints, exports, converted targets)."""

from __future__ import annotations

import pytest

from artcache.fsio import publish_dir, remove_orphan_parts


def _names(d) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_a_directory_appears_whole_or_not_at_all(tmp_path):
    final = tmp_path / "d"
    with publish_dir(final) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-") and not final.exists()
        (tmp / "a").write_text("1")
    assert _names(tmp_path) == {"d"} and (final / "a").read_text() == "1"
    with pytest.raises(RuntimeError, match="boom"), publish_dir(tmp_path / "e") as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("boom")
    assert _names(tmp_path) == {"d"}  # nothing of the failed one, not even its temp directory


@pytest.mark.parametrize("existing, kept", [("keep", "old"), ("replace", "new"), ("aside", "new")])
def test_an_existing_directory(tmp_path, existing, kept):
    final = tmp_path / "d"
    final.mkdir()
    (final / "f").write_text("old")
    with publish_dir(final, existing=existing, complete=lambda d: (d / "f").is_file()) as tmp:
        (tmp / "f").write_text("new")
    assert (final / "f").read_text() == kept and _names(tmp_path) == {"d"}


def test_aside_is_restored_when_check_refuses_or_the_rename_fails(tmp_path, monkeypatch):
    import artcache.fsio as fsio

    final = tmp_path / "d"
    final.mkdir()
    (final / "f").write_text("old")

    def refuse(d):
        raise ValueError(f"{d} is not ours")

    with pytest.raises(ValueError, match="not ours"), publish_dir(final, existing="aside", check=refuse) as tmp:
        (tmp / "f").write_text("new")
    assert (final / "f").read_text() == "old" and _names(tmp_path) == {"d"}
    real = fsio.os.rename

    def no_second_rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(fsio.os, "rename", no_second_rename)
    with pytest.raises(OSError, match="Input/output"), publish_dir(final, existing="aside") as tmp:
        (tmp / "f").write_text("new")
    assert (final / "f").read_text() == "old" and _names(tmp_path) == {"d"}


def test_a_dead_writers_temp_directory_is_swept(tmp_path):
    """A temp directory named by publish_dir carries its writer's token: the one sweep removes it once that
    writer is gone, never while it lives."""
    import subprocess
    import sys

    code = ("import sys, os, signal; from pathlib import Path; from artcache.fsio import publish_dir\n"
            "with publish_dir(Path(sys.argv[1]) / 'd', tmp_name='.d.tmp-') as t:\n"
            "    (t / 'f').write_bytes(b'x' * 10); os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".d.tmp-")
    with publish_dir(tmp_path / "e", tmp_name=".d.tmp-") as live:
        freed: list[int] = []
        assert remove_orphan_parts(tmp_path, prefix=".d.tmp-", suffix="", dirs=True, freed=freed) == 1
        assert freed == [10] and live.is_dir() and not left.exists()


def test_existing_must_be_known(tmp_path):
    with pytest.raises(ValueError, match="'merge' is not accepted"), publish_dir(tmp_path / "d", existing="merge"):
        pass
