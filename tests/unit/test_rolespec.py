"""Role spec files (artcache/rolespec.py): what a launcher writes is what ``--spec`` reads, and a bad file is one
line (exit 2) naming it, before anything starts."""

from __future__ import annotations

import json

import msgspec
import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.errors import ConfigError
from artcache.producer import ProducerConfig
from artcache.rolespec import read_spec, spec_digest, write_spec
from artcache.scheduler import SchedulerLimits
from artcache.trainers.consumer import ConsumerConfig


def test_a_spec_reads_back_field_for_field(tmp_path):
    c = ConsumerConfig(cache=str(tmp_path / "root"), consumer_id="a", lr=1e-3, block_size=8, init_overrides=["target"])
    p = ProducerConfig(cache=str(tmp_path / "root"), layer_ids=[1, 2], template_options={"enable_thinking": False},
                       limits=SchedulerLimits(max_queue=7), exit_when_done=True, expect_consumers=2)
    assert read_spec(write_spec(tmp_path / "c.json", "consumer", c), "consumer", ConsumerConfig) == c
    assert read_spec(write_spec(tmp_path / "p.json", "producer", p), "producer", ProducerConfig) == p
    assert spec_digest(c) != spec_digest(msgspec.structs.replace(c, lr=1e-4))
    assert sorted(json.loads((tmp_path / "c.json").read_text())) == ["format", "role", "spec"]
    assert not list(tmp_path.glob("*.part"))  # no temp file left beside it


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(role="producer"), "is a 'producer' spec; accepted: a 'consumer' spec"),
    (lambda d: d.update(format=9), "has format 9; accepted: 1"),
    (lambda d: d["spec"].update(nproc_typo=2), "nproc_typo"),
    (lambda d: d["spec"].update(lr="fast"), "lr"),
    (lambda d: d.pop("spec"), "is not a role spec file"),
])
def test_a_bad_spec_file_is_one_line_naming_it(tmp_path, edit, needle):
    path = write_spec(tmp_path / "c.json", "consumer", ConsumerConfig(cache=str(tmp_path)))
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="--spec .*c.json") as got:
        read_spec(path, "consumer", ConsumerConfig)
    assert needle in str(got.value) and "\n" not in str(got.value)
    res = CliRunner().invoke(main, ["consume", "--spec", str(path)])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output


def test_spec_takes_no_other_setting(tmp_path):
    path = write_spec(tmp_path / "c.json", "consumer", ConsumerConfig(cache=str(tmp_path)))
    res = CliRunner().invoke(main, ["consume", "--spec", str(path), "--lr", "1e-3"])
    assert res.exit_code == 2 and "holds every setting of this consume; leave out --lr" in res.output
    res = CliRunner().invoke(main, ["producer", "--spec", str(path)])
    assert res.exit_code == 2 and "is a 'consumer' spec; accepted: a 'producer' spec" in res.output
    res = CliRunner().invoke(main, ["consume", "--spec", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and "cannot be read" in res.output
