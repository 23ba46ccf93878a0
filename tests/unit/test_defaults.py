"""Defaults agree: a flag of ``artcache producer|consume|bench`` and the config field it maps to
(``PRODUCER_FLAGS``/``CONSUME_FLAGS``/``BENCH_FLAGS``) default to the same value, and so do the role structs
behind them (ProducerConfig, ConsumerConfig, BenchConfig). Found by this test: ``--done-grace`` was 10 s by
flag and 5 s with ``--config``; the bench's warm-up/steps/anchors were 3/15/64 from the CLI, 5/30/32 with
``--config`` and 5/40/32 in BenchConfig (now one table, ``artcache.bench.run.DEVICE_DEFAULTS``)."""

from __future__ import annotations

import dataclasses

import click
import msgspec
import pytest

from artcache.app import cli
from artcache.app import config as C

#: flags whose config field legitimately means something else by default, and why
DIFFERENT = {
    ("producer", "cache"): "the root is required by flag; the config's '' means <out>/cache",
    ("consume", "cache"): "as for the producer",
    ("consume", "device"): "a run config's experiment follows target.device when it names none",
    ("bench", "max_length"): "the bench flag's 0 is the scenario's default; "
                             "data.max_length is shared with the producer",
    ("producer", "retention"): "the flag's unset is the config's '': the rule follows the disk budget",
}
UNSET_FLAGS = (None, click.core.UNSET) if hasattr(click.core, "UNSET") else (None,)


def struct_default(path: str):
    if path.startswith("E."):
        fields = {f.name: f for f in msgspec.structs.fields(C.Experiment)}
        name = path[2:]
        if "." in name:  # experiments.N.consumer.*: the consumer's own struct
            from artcache.trainers.consumer import ConsumerConfig

            cfields = {f.name: f for f in msgspec.structs.fields(ConsumerConfig)}
            return cfields[name.split(".", 1)[1]].default
        return fields[name].default
    obj = C.RunConfig()
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def normal(value):
    if isinstance(value, (list, tuple)):
        return list(value)
    return value


@pytest.mark.parametrize("verb,table", [("producer", C.PRODUCER_FLAGS), ("consume", C.CONSUME_FLAGS),
                                        ("bench", C.BENCH_FLAGS)])
def test_flag_and_config_defaults_agree(verb, table):
    command = getattr(cli, verb)
    wrong = []
    for param in command.params:
        path = table.get(param.name)
        if path is None or (verb, param.name) in DIFFERENT:
            continue
        flag = param.default
        if isinstance(param, click.Option) and param.is_flag and flag in UNSET_FLAGS:
            flag = False
        if flag in UNSET_FLAGS and not (isinstance(param, click.Option) and param.multiple):
            flag = None
        if isinstance(param, click.Option) and param.multiple and flag in UNSET_FLAGS:
            flag = []
        want = struct_default(path)
        if param.name == "devices":  # a comma-separated list on the command line
            flag = cli.parse_devices(flag)
        if isinstance(param, click.Option) and param.multiple and isinstance(want, str) and len(flag) == 1:
            flag = flag[0]  # --data given once is the config's one dataset (several are data.sources)
        if path == "data.template_options":
            want, flag = dict(want), cli.parse_template_options(flag or [])
        if isinstance(flag, str) and isinstance(want, int) and not isinstance(want, bool):
            flag = cli.parse_bytes(flag, param.name)  # byte-size flags take "0", "10G", ...
        if normal(flag) != normal(want):
            wrong.append(f"--{param.name.replace('_', '-')}: flag {flag!r}, config {path} {want!r}")
    assert wrong == []


def test_role_structs_agree_with_the_config():
    from artcache.bench.run import BenchConfig
    from artcache.producer import ProducerConfig

    pc = {f.name: f.default for f in msgspec.structs.fields(ProducerConfig)}
    cache = C.CacheSection()
    assert pc["done_grace_s"] == cache.done_grace_s and pc["heartbeat_timeout_s"] == cache.heartbeat_timeout_s
    bench = {f.name: f.default for f in dataclasses.fields(BenchConfig)}
    section = C.BenchSection()
    for name in ("warmup", "steps", "anchors", "batch_size", "timeout_s", "budget_fraction", "save", "scenario"):
        assert bench[name] == getattr(section, name), name


def test_bench_defaults_have_one_home():
    """The CLI, a config file and BenchConfig() resolve to the same per-device figures."""
    from artcache.bench.run import DEVICE_DEFAULTS, BenchConfig, resolved
    from artcache.bench.scenarios import resolve

    sc = resolve("1p3c")[0]
    for device, want in DEVICE_DEFAULTS.items():
        from_struct = resolved(BenchConfig(device=device), sc)
        from_config = resolved(C.bench_config(C.RunConfig(bench=C.BenchSection(device=device))), sc)
        for rc in (from_struct, from_config):
            assert (rc.warmup, rc.steps, rc.anchors) == (want["warmup"], want["steps"], want["anchors"]), device
