"""Read back what the trackers wrote, for the tests: W&B offline run files, an MLflow file store, TensorBoard event
files; each as ``{tag: [(step, value), ...]}`` (NaN kept)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

_BLOCK = 32768  # W&B's run file is a LevelDB-style log: 32 KiB blocks of records with a 7-byte header


def wandb_records(path: Path):
    """The protobuf ``Record`` messages of one ``run-<id>.wandb`` file (header ``:W&B``, then records of
    type FULL 1, FIRST 2, MIDDLE 3, LAST 4, each ``crc32 u32, length u16, type u8`` + data)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            yield rec


def wandb_runs(wandb_dir: Path) -> dict[str, dict]:
    """Every offline run under ``wandb_dir``: ``{display name: {"id", "project", "scalars": {tag: [(step, v)]}}}``
    (runs resumed under one id merge)."""
    out: dict[str, dict] = {}
    for f in sorted(Path(wandb_dir).rglob("run-*.wandb")):
        name, info, scalars = None, {}, {}
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                name = rec.run.display_name
                info = {"id": rec.run.run_id, "project": rec.run.project}
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                step = row.pop("_step", None)
                for tag, v in row.items():
                    if not tag.startswith("_"):
                        scalars.setdefault(tag, []).append((step, float(v) if v is not None else math.nan))
        entry = out.setdefault(name, {**info, "scalars": {}})
        for tag, pts in scalars.items():
            entry["scalars"].setdefault(tag, []).extend(pts)
    return out


def _nan(v):
    if isinstance(v, str):
        return float(v)  # W&B writes "NaN" / "Infinity" as strings
    return v


def mlflow_runs(uri: str, experiment: str = "artcache") -> dict[str, dict]:
    """Every run of ``experiment`` in the store at ``uri``: ``{run name: {"id", "status", "scalars"}}``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    out = {}
    for run in client.search_runs([exp.experiment_id]):
        scalars = {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
                   for k in run.data.metrics}
        out[run.info.run_name] = {"id": run.info.run_id, "status": run.info.status, "scalars": scalars,
                                  "tags": dict(run.data.tags)}
    return out


def tensorboard_scalars(tb_dir: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def same_points(a: dict, b: dict, rel: float = 1e-6) -> bool:
    """Whether two ``{tag: [(step, value)]}`` hold the same tags, steps and values (float32 tolerance; NaN
    equals NaN)."""
    if set(a) != set(b):
        return False
    for tag in a:
        pa, pb = sorted(a[tag]), sorted(b[tag])
        if [s for s, _ in pa] != [s for s, _ in pb]:
            return False
        for (_, x), (_, y) in zip(pa, pb, strict=True):
            x, y = float(_nan(x)), float(_nan(y))
            if not ((math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=rel, abs_tol=1e-6)):
                return False
    return True
