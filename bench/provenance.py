"""Which code a benchmark result came from: the one home of the ``commit`` field of every bench JSON.

A device machine runs a copy of the tree whose ``.git`` (when one travels at all) may be older than the
files beside it, so a commit named by the caller in ``$ARTCACHE_COMMIT`` wins over what ``git`` reports.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["hardware", "record", "source_commit"]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def source_commit() -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the code running now.

    ``commit``: ``$ARTCACHE_COMMIT`` when set (the sender of a copied tree names it), else ``git rev-parse
    HEAD`` of this checkout, else ``"unknown"``. ``dirty``: tracked files differ from that commit (``git
    status --porcelain --untracked-files=no``); None when it cannot be told (no git, or git's HEAD is not the
    named commit); False for a named commit outside any checkout (the sender vouches for it).
    """
    named = os.environ.get("ARTCACHE_COMMIT") or None
    head = _git("rev-parse", "HEAD")
    commit = named or head or "unknown"
    if head is None:
        return commit, False if named else None
    if named and head != named:
        return commit, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def _mount_of(path: Path) -> dict:
    """Filesystem type, device and mount options of the mount holding ``path`` (from /proc/mounts)."""
    best: dict = {}
    target = str(path.resolve())
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        dev, mnt, fstype, opts = line.split()[:4]
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best.get("mount", "")):
            best = {"mount": mnt, "device": dev, "fstype": fstype, "options": opts}
    return best


def hardware(device=None, roots: list[Path] = ()) -> dict:
    """What the figures were measured on: CPU model and count, memory (bytes), kernel, Python and torch, the
    load average, each of ``roots``' mount (/proc/mounts) and, for a CUDA ``device`` (``torch.device`` or
    str), the GPU name, count and memory (bytes), CUDA version and driver (nvidia-smi). Fields that cannot be
    read are left out."""
    import platform

    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    out = {"cpu": cpu, "cpu_count": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
           "python": platform.python_version(), "torch": str(torch.__version__),
           "roots": {str(r): _mount_of(r.parent if not r.exists() else r) for r in roots}}
    with contextlib.suppress(OSError, ValueError):
        out["load_average"] = list(os.getloadavg())
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_count"] = torch.cuda.device_count()
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        out["cuda"] = torch.version.cuda
        with contextlib.suppress(Exception):
            import subprocess

            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
    return out


def record(module: str | None, argv: list[str] | None = None, device=None, roots: list[Path] = ()) -> dict:
    """The provenance every bench JSON starts with: ``command`` (``[python, "-m", module, *argv]``; for
    ``module=None`` this process's command line, ``artcache`` standing for the CLI's entry point; ``argv``
    defaults to ``sys.argv[1:]``), ``commit`` and ``dirty`` (:func:`source_commit`), ``date`` (local ISO 8601)
    and ``hardware`` (:func:`hardware` of ``device`` and ``roots``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    commit, dirty = source_commit()
    prog = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    prog_name = "artcache" if prog.name == "artcache" or prog.parts[-2:] == ("artcache", "__main__.py") else str(prog)
    return {"command": [prog_name, *args] if module is None else [sys.executable, "-m", module, *args],
            "commit": commit, "dirty": dirty, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "hardware": hardware(device, roots)}
