"""A second DSpark `artcache run` (the first: tests/protocol/test_dspark_run.py)."""

from __future__ import annotations

from tests.protocol import test_dspark_run as first_run
from tests.protocol.test_dspark_run import dspark_exp
from tests.protocol.test_run import artcache_run, base_toml, report_of, write

dspark_exports = first_run.dspark_exports  # a fixture of tests/protocol/test_dspark_run.py
dspark_run = first_run.dspark_run  # a fixture of tests/protocol/test_dspark_run.py


# a second `artcache run` (~20 s on 2 cores)
def test_a_run_starts_from_the_dspark_export(tiny_target, dspark_exports, tmp_path):
    """A new run starts from the export (its names mapped back; strict keys) on a fresh root."""
    _, dirs = dspark_exports
    out2 = tmp_path / "out2"
    seed = dirs["speculators"]
    seeded = dspark_exp("s2", 2).replace('window = "2:8"', f'window = "2:8"\ninit_from = "{seed}"')
    proc = artcache_run(write(tmp_path / "run2.toml", base_toml(tiny_target, out2, seeded)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert report_of(out2)["checks"]["every_experiment_completed"]
