"""A tiny run through a fake 3-node Slurm cluster on this machine (needs root and Debian's slurm packages; .ci/slurm-
lane). The launcher's scripts without a cluster: tests/protocol/test_slurm.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from artcache.app.slurm import collect
from tests.protocol.test_slurm import config
from tests.support.procs import REPO, child_env


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """The fake 3-node cluster for this module; SLURM_CONF points at it meanwhile. Skips without root or a
    way to install Slurm, or fails there when ``ARTCACHE_REQUIRE_SLURM=1`` (.ci/slurm-lane)."""
    missing = pytest.fail if os.environ.get("ARTCACHE_REQUIRE_SLURM") == "1" else pytest.skip
    if os.geteuid() != 0:
        missing("the fake Slurm cluster needs root (slurmd runs jobs as any user)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        missing("no slurmctld and no apt-get to install Debian's slurmd slurmctld slurm-client munge")
    d = tmp_path_factory.mktemp("slurm-cluster")
    script = REPO / ".ci" / "slurm-cluster.sh"
    res = subprocess.run(["bash", str(script), "start", str(d)], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.fail(f"the fake cluster did not start:\n{res.stdout}\n{res.stderr}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(d / "slurm.conf")
    try:
        yield d
    finally:
        subprocess.run(["bash", str(script), "stop", str(d)], capture_output=True, text=True, timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def test_tiny_run_through_slurm(tmp_path, slurm_cluster):
    # retention by need (a disk budget): a consumer lagging more than its lookahead behind the others keeps
    # what it will still read. Under the windows-only rule (no budget) such a position is evicted once the
    # faster consumers end and is recaptured by design, which made "one capture per position" depend on the
    # load of the machine (CI: 13 captures for 12 positions, one consumer lagging on 2 busy cores)
    cfg = config(tmp_path, cache='disk_budget = "auto"')
    proc = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(cfg), "--launcher", "slurm",
                           "--submit", "--wait"], capture_output=True, text=True, cwd=tmp_path,
                          env=child_env(SLURM_CONF=os.environ["SLURM_CONF"]), timeout=900)
    run = tmp_path / "run"
    job_out = "\n".join(p.read_text(errors="replace") for p in (run / "logs").glob("slurm-*.out"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + job_out
    res = collect(run, ["producer", "c1", "c2", "c3"])
    assert res["ok"], json.dumps(res, indent=1)
    roles = res["roles"]
    assert {n: r["node"] for n, r in roles.items()} == {"producer": "n1", "c1": "n1", "c2": "n2", "c3": "n3"}
    # every step saw one GPU of its own: Slurm's gres binding (fake GPUs 0 and 1 per node)
    seen = {n: r["cuda_visible_devices"] for n, r in roles.items()}
    assert all(v in ("0", "1") for v in seen.values()), seen
    assert seen["producer"] != seen["c1"], seen  # the two roles on n1 got different GPUs
    assert len({r["step"] for r in roles.values()}) == 4
    acc = res["inspect"]
    assert acc["violations"] == [], acc["violations"]
    c = acc["cache"]
    counts = json.dumps({k: v for k, v in c.items() if not isinstance(v, (dict, list))})  # pytest cuts a dict's repr
    assert c["retention"] == "need", counts
    assert c["distinct_positions_consumed"] == 12 and c["recaptures"] == 0, counts
    assert c["captures_per_consumed_position"] <= 1.05, counts
    for name in roles:
        assert (run / "logs" / f"{name}.log").stat().st_size > 0
    assert (run / "experiments" / "c3" / "checkpoints" / "latest").exists()
    assert "inspect: ok" in proc.stdout
