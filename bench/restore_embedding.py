"""Put a removed tensor back into an exported draft from the target it was copied from, into a new directory.

An export (``artcache export``) copies the target's token embedding into the draft's safetensors (EAGLE-3:
``embed_tokens.weight``). To ship an export off a machine the copy can be dropped and described in
``embed_removed.json`` (``{name: {"shape", "dtype", "sha256"}}``; sha256 of the tensor's raw bytes, row-major).
This script rebuilds it from the target's tensor (``--target-key``, cast to the recorded dtype), checks shape,
dtype and sha256 against the record and only then writes ``--out`` (every other file of the export copied
unchanged, ``model.safetensors`` rewritten with the tensor added, ``embed_removed.json`` left out). A mismatch
exits 1 and writes nothing. The source export is never modified.

Run: ``python -m artcache.bench.restore_embedding --export DIR --target-weights model.safetensors
--target-key model.embed_tokens.weight --out NEW_DIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RECORD = "embed_removed.json"
WEIGHTS = "model.safetensors"


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of ``t``'s raw bytes, row-major (``t.contiguous().view(-1).view(torch.uint8)``)."""
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, type=Path)
    ap.add_argument("--target-weights", required=True, type=Path, help="the target's model.safetensors")
    ap.add_argument("--target-key", default="model.embed_tokens.weight")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    if a.out.exists():
        print(f"restore_embedding: --out {str(a.out)!r} exists; accepted: a new directory", file=sys.stderr)
        return 2
    record = json.loads((a.export / RECORD).read_text())
    with safe_open(a.export / WEIGHTS, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    with safe_open(a.target_weights, "pt") as f:
        source = f.get_tensor(a.target_key)
    checks = {}
    for name, want in record.items():
        if name in tensors:
            print(f"restore_embedding: {name!r} is already in the export", file=sys.stderr)
            return 1
        dtype = getattr(torch, want["dtype"].removeprefix("torch."))
        t = source.to(dtype).contiguous()
        got = {"shape": list(t.shape), "dtype": str(t.dtype), "sha256": tensor_sha256(t)}
        if got != {"shape": list(want["shape"]), "dtype": want["dtype"], "sha256": want["sha256"]}:
            print(f"restore_embedding: {a.target_key!r} of {str(a.target_weights)!r} does not reproduce {name!r}: "
                  f"got {got}, recorded {want}", file=sys.stderr)
            return 1
        tensors[name] = t
        checks[name] = got
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=a.out.name + ".", dir=a.out.parent))
    for p in a.export.iterdir():
        if p.name not in (RECORD, WEIGHTS) and p.is_file():
            shutil.copy2(p, tmp / p.name)
    save_file(tensors, tmp / WEIGHTS, metadata=meta)
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    tmp.rename(a.out)
    print(json.dumps({"out": str(a.out), "restored": checks, "source_key": a.target_key}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
