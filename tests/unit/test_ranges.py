"""Ranges declared on typed fields (artcache/ranges.py): one message style for the run config, the consumer,
and the producer (ranges on the fields, not hand checks)."""

from __future__ import annotations

import math

import msgspec
import msgspec.inspect as mi
import pytest

from artcache.app import config as C
from artcache.errors import ConfigError
from artcache.producer import ProducerConfig
from artcache.ranges import Count, NonNegative, NonNegativeFloat, Positive, check_ranges, check_value, describe_number
from artcache.trainers.consumer import ConsumerConfig


class S(msgspec.Struct, kw_only=True):
    n: Count = 1
    k: NonNegative = 0
    x: Positive = 1.0
    wait_s: Positive = 1.0
    o: Count | None = None


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, "n 0 is invalid: accepted an integer >= 1"),
    ("k", -1, "k -1 is invalid: accepted an integer >= 0 (0 or a positive integer)"),
    ("x", 0.0, "x 0.0 is invalid: accepted a finite number > 0"),
    ("x", math.inf, "x inf is invalid: accepted a finite number > 0"),
    ("x", math.nan, "x nan is invalid: accepted a finite number > 0"),
    ("wait_s", -2.0, "wait_s -2.0 is invalid: accepted finite seconds > 0"),
    ("o", 0, "o 0 is invalid: accepted an integer >= 1"),
])
def test_check_ranges_names_the_field_value_and_range(field, value, message):
    with pytest.raises(ConfigError) as exc:
        check_ranges(S(**{field: value}))
    assert str(exc.value) == message


class Outer(msgspec.Struct, kw_only=True):
    inner: S = msgspec.field(default_factory=S)


def test_a_nested_struct_field_is_named_by_its_dotted_path():
    with pytest.raises(ConfigError, match=r"^inner\.n 0 is invalid: accepted an integer >= 1$"):
        check_ranges(Outer(inner=S(n=0)))
    with pytest.raises(ConfigError, match=r"^--n-flag 0 is invalid: accepted an integer >= 1$"):
        check_ranges(Outer(inner=S(n=0)), {"inner.n": "--n-flag"}.get)


class Checked(msgspec.Struct, frozen=True):
    n: Count = 1

    def __post_init__(self) -> None:
        check_ranges(self, lambda f: f"checked {f}")


def test_check_ranges_from_post_init_checks_construction_and_conversion():
    """A struct may check itself on construction (PlanSpec does): check_ranges checks field by field, so it
    does not re-enter __post_init__."""
    assert Checked(n=2).n == 2
    with pytest.raises(ConfigError, match=r"^checked n 0 is invalid: accepted an integer >= 1$"):
        Checked(n=0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"n": 0}, Checked)


def test_check_value_names_a_lone_value():
    check_value(None, NonNegativeFloat | None, "--observe", seconds=True)
    check_value(0.0, NonNegativeFloat, "--observe", seconds=True)
    with pytest.raises(ConfigError, match=r"^--observe -1.0 is invalid: accepted finite seconds >= 0$"):
        check_value(-1.0, NonNegativeFloat | None, "--observe", seconds=True)
    with pytest.raises(ConfigError, match=r"^--n: Expected `int`, got `str`$"):
        check_value("x", Count, "--n")


def test_check_ranges_passes_values_inside_and_uses_the_flag_name():
    check_ranges(S(n=3, k=0, x=1e-9, o=None))
    with pytest.raises(ConfigError, match=r"^--n 0 is invalid"):
        check_ranges(S(n=0), lambda f: f"--{f}")
    assert describe_number(mi.type_info(Positive)) == "a finite number > 0"


@pytest.mark.parametrize("struct, field, ranged", [
    (C.Experiment, "steps", "ge"), (C.Experiment, "lr", "gt"), (C.Experiment, "block_size", "ge"),
    (C.CacheSection, "heartbeat_timeout_s", "gt"), (C.TargetSection, "threads", "ge"),
    (ConsumerConfig, "batch_size", "ge"), (ConsumerConfig, "demand_timeout_s", "gt"),
    (ProducerConfig, "heartbeat_timeout_s", "gt"), (ProducerConfig, "max_inflight_batches", "ge"),
    (ProducerConfig, "poll_interval_s", "ge"), (ProducerConfig, "lease_ttl_s", "gt"),
])
def test_ranges_are_declared_on_the_fields(struct, field, ranged):
    t = next(f.type for f in mi.type_info(struct).fields if f.name == field)
    t = next((x for x in t.types if not isinstance(x, mi.NoneType)), t) if isinstance(t, mi.UnionType) else t
    assert getattr(t, ranged) is not None


def test_the_role_structs_give_the_one_message():
    with pytest.raises(ConfigError, match=r"^--batch-size 0 is invalid: accepted an integer >= 1$"):
        ConsumerConfig(cache="c", batch_size=0).validate()
    with pytest.raises(ConfigError, match=r"^--expect-timeout 0.0 is invalid: accepted finite seconds > 0$"):
        ProducerConfig(cache="c", expect_timeout_s=0.0).validate()
    with pytest.raises(ConfigError, match=r"^config: cache.demand_timeout_s -1 is invalid: accepted finite seconds"):
        C.convert({"cache": {"demand_timeout_s": -1}})
    with pytest.raises(ConfigError, match=r"^experiments.a.consumer.ttt_steps 0 is invalid: accepted"):
        C.consumer_config(C.convert({"experiments": [{"name": "a", "draft": "eagle3", "consumer": {"ttt_steps": 0}}]}),
                          "a")


def test_regression_disk_budget_range_is_declared_not_hand_checked():
    """``--disk-budget`` kept a hand check in its own style ("is not accepted: bytes >= 1
    (or 0: the default)") in the producer and in ``parse_bytes``; both now give the one message."""
    from artcache.app.values import parse_bytes

    accepted = r"accepted an integer >= 0 and <= 1152921504606846976"  # 2**60 bytes (test_regression_disk_budget_...)
    with pytest.raises(ConfigError, match=r"^--disk-budget -1 is invalid: " + accepted + "$"):
        ProducerConfig(cache="c", disk_budget=-1).validate()
    with pytest.raises(ConfigError, match=r"^--disk-budget -5 is invalid: " + accepted + " bytes"):
        parse_bytes(-5, "disk-budget")
    assert parse_bytes("2K", "disk-budget") == 2048 and parse_bytes(0, "disk-budget") == 0


@pytest.mark.parametrize("budget", [-1, 2**60 + 1])
def test_regression_bench_disk_budget_is_the_declared_range(tmp_path, budget):
    """``run_bench`` kept its own ``disk_budget < 0`` check in another style (and let 2**60 + 1 through); a
    BenchConfig built in Python now gets the declared range's message, before anything is written."""
    from artcache.bench.run import BenchConfig, run_bench

    out = tmp_path / "bench"
    with pytest.raises(ConfigError, match=rf"^--disk-budget {budget} is invalid: accepted an integer >= 0 and <= "):
        run_bench(BenchConfig(out_dir=str(out), disk_budget=budget))
    assert not out.exists()
