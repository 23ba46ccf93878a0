"""Typed run configs: files (TOML, YAML), ``section.field=value`` overrides, rejection of unknown fields,
unknown override paths and type errors (naming the field and what it accepts), the saved resolved
config, and CLI flags as shortcuts for config fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app import config as C
from artcache.app.cli import main
from artcache.errors import ConfigError
from tests.support import REPO

CONFIGS = REPO / "configs"
RECIPES = sorted(p for p in CONFIGS.iterdir() if p.suffix in (".toml", ".yaml", ".yml"))

TWO = """
out = "o"
[data]
max_length = 128
[[experiments]]
name = "a"
lr = 1e-3
[[experiments]]
name = "b"
draft = "eagle3"
[experiments.consumer]
ttt_steps = 3
"""


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def rejected(tmp_path: Path, text: str, *overrides: str, name: str = "run.toml") -> str:
    with pytest.raises(ConfigError) as info:
        C.load_run_config(write(tmp_path, text, name), overrides)
    return str(info.value)


# ---- files -------------------------------------------------------------------------------------------

def test_defaults_without_a_file():
    cfg = C.load_run_config(None)
    assert cfg == C.RunConfig()
    assert cfg.target.name == "smollm2-135m-instruct" and cfg.experiments == []


def test_toml_file_sections_and_experiments(tmp_path):
    cfg = C.load_run_config(write(tmp_path, TWO))
    assert cfg.out == "o" and cfg.data.max_length == 128 and cfg.data.max_samples == 2000
    assert [e.name for e in cfg.experiments] == ["a", "b"]
    assert cfg.experiments[0].lr == 1e-3 and cfg.experiments[1].draft == "eagle3"
    assert cfg.experiments[1].consumer == {"ttt_steps": 3}


def test_toml_and_yaml_twins_load_equal():
    """configs/dflash-2lr.toml and its YAML twin are the same config (YAML 1e-3 is a float, not text)."""
    toml = C.load_run_config(CONFIGS / "dflash-2lr.toml")
    yaml = C.load_run_config(CONFIGS / "dflash-2lr.yaml")
    assert toml == yaml
    assert isinstance(yaml.experiments[1].lr, float) and yaml.experiments[1].lr == 2e-3


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    cfg = C.load_run_config(write(tmp_path, "experiments:\n  - name: a\n    lr: 1e-3\n", "r.yaml"))
    assert cfg.experiments[0].lr == 1e-3


def test_json_file(tmp_path):
    cfg = C.load_run_config(write(tmp_path, '{"experiments": [{"name": "a", "steps": 3}]}', "r.json"))
    assert cfg.experiments[0].steps == 3


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    cfg = C.load_run_config(path)
    assert cfg == C.load_run_config(path)  # deterministic
    if path.name.startswith("bench"):
        assert cfg.bench.scenario == "1p3c"
    else:
        assert cfg.experiments, path


# ---- rejection: files --------------------------------------------------------------------------------

def test_unknown_section_names_accepted_sections(tmp_path):
    msg = rejected(tmp_path, "[trget]\nname = 'x'\n")
    assert "'trget'" in msg and "target, data, capture, cache, experiments, bench" in msg


def test_unknown_field_in_section_names_accepted_fields(tmp_path):
    msg = rejected(tmp_path, "[data]\nmax_len = 3\n")
    assert "'data.max_len'" in msg and "dataset, seed, max_length, max_samples" in msg


def test_capture_replay_layer_is_a_typed_field(tmp_path):
    assert C.load_run_config(None).capture.replay_layer is True
    assert C.load_run_config(write(tmp_path, "[capture]\nreplay_layer = false\n")).capture.replay_layer is False
    assert C.load_run_config(None, ["capture.replay_layer=false"]).capture.replay_layer is False
    msg = rejected(tmp_path, "[capture]\nreplay_layers = false\n")
    assert "'capture.replay_layers'" in msg and "replay_layer" in msg
    msg = rejected(tmp_path, "[capture]\nreplay_layer = 'no'\n")
    assert "capture.replay_layer" in msg


def test_regression_unknown_field_in_an_experiment_named_by_its_name(tmp_path):
    """Bug: an unknown key of an experiment was named by the experiment's index (``experiments.1.bogus``) while every
    other message names the experiment (``experiments.<name>.<key>``). An unnamed one keeps its index."""
    msg = rejected(tmp_path, "[[experiments]]\nname = 'a'\nlearning_rate = 1.0\n")
    assert "'experiments.a.learning_rate'" in msg and "accepted fields of experiments.a:" in msg
    assert "lr" in msg and "block_size" in msg
    msg = rejected(tmp_path, "[[experiments]]\nlearning_rate = 1.0\n")
    assert "'experiments.0.learning_rate'" in msg


def test_type_error_names_field_and_accepted_type(tmp_path):
    msg = rejected(tmp_path, "[[experiments]]\nname = 'a'\nsteps = 'many'\n")
    assert "experiments.a.steps" in msg and "Expected `int`, got `str`" in msg and "an integer" in msg


def test_literal_error_lists_accepted_values(tmp_path):
    msg = rejected(tmp_path, "[[experiments]]\nname = 'a'\ndraft = 'medusa'\n")
    assert "experiments.a.draft" in msg and "dflash, dspark, eagle3" in msg


def test_missing_experiment_name(tmp_path):
    msg = rejected(tmp_path, "[[experiments]]\nlr = 1.0\n")
    assert "name" in msg and "experiments.0" in msg


def test_duplicate_experiment_names(tmp_path):
    msg = rejected(tmp_path, "[[experiments]]\nname = 'a'\n[[experiments]]\nname = 'a'\n")
    assert "experiments.1.name 'a' is used twice" in msg


@pytest.mark.parametrize("text, needle", [
    ("window = '64-256'", "LOOKBEHIND:LOOKAHEAD"),
    ("steps = 0", "experiments.a.steps 0"),
    ("lr = -1.0", "experiments.a.lr -1.0"),
    ("block_size = 1", "experiments.a.block_size 1 is invalid: accepted an integer >= 2"),  # regression: >= 1
    ("layer_ids = []", "experiments.a.layer_ids is empty"),  # regression: silently the default view
    ("name = 'a/b'", "experiments.0.name"),
])
def test_bad_experiment_values(tmp_path, text, needle):
    body = text if text.startswith("name") else f"name = 'a'\n{text}"
    assert needle in rejected(tmp_path, f"[[experiments]]\n{body}\n")


def test_bad_files(tmp_path):
    assert "accepted: .toml, .yaml, .yml, .json" in rejected(tmp_path, "", name="run.ini")
    assert "is not valid TOML" in rejected(tmp_path, "[data\n")
    assert "cannot be read" in str(pytest.raises(ConfigError, C.load_run_config, tmp_path / "nope.toml").value)
    assert "top level must be a table" in rejected(tmp_path, "- 1\n- 2\n", name="r.yaml")


# ---- overrides -------------------------------------------------------------------------------------

def test_parse_override():
    assert C.parse_override("experiments.0.lr=1e-3") == (["experiments", "0", "lr"], "1e-3")
    assert C.parse_override(" data.dataset = a=b ") == (["data", "dataset"], "a=b")
    for bad in ("data.max_length", "=3", "data..seed=1", ".x=1"):
        with pytest.raises(ConfigError, match="SECTION.FIELD=VALUE"):
            C.parse_override(bad)


def test_overrides_are_typed_by_field(tmp_path):
    cfg = C.load_run_config(write(tmp_path, TWO), [
        "data.max_length=64", "experiments.0.lr=2e-4", "experiments.b.steps=7", "capture.layer_ids=1,8,14",
        "experiments.a.draft_layers=none", "experiments.1.consumer.ttt_steps=5", "experiments.0.resume=true",
        "target.name=123", "experiments.a.consumer.tensorboard=false", "out=elsewhere",
        "experiments.0.layer_ids=[2, 4]"])
    assert cfg.data.max_length == 64 and cfg.out == "elsewhere"
    assert cfg.experiments[0].lr == 2e-4 and cfg.experiments[0].resume is True
    assert cfg.experiments[0].layer_ids == [2, 4] and cfg.experiments[0].draft_layers is None
    assert cfg.experiments[1].steps == 7 and cfg.experiments[1].consumer == {"ttt_steps": 5}
    assert cfg.experiments[0].consumer == {"tensorboard": False}
    assert cfg.capture.layer_ids == [1, 8, 14] and cfg.target.name == "123"


@pytest.mark.parametrize("override, needles", [
    ("data.max_len=3", ["unknown field 'max_len' in data", "max_length"]),
    ("nosuch.x=1", ["unknown field 'nosuch'", "target, data"]),
    ("experiments.5.lr=1", ["no experiments entry '5'", "0..1", "a, b"]),
    ("experiments.zed.lr=1", ["no experiments entry 'zed'"]),
    ("experiments.0.lrr=1", ["unknown field 'lrr' in experiments.0", "lr"]),
    ("experiments.0=1", ["name a field of the entry"]),
    ("data=1", ["data is a table with fields", "data.FIELD=VALUE"]),
    ("data.seed.x=1", ["data.seed is a single value"]),
    ("data.max_length=abc", ["data.max_length='abc'", "expected an integer"]),
    ("experiments.0.lr=fast", ["expected a number"]),
    ("experiments.0.resume=maybe", ["expected true or false"]),
    ("experiments.0.draft=medusa", ["expected one of dflash, dspark, eagle3"]),
    ("capture.layer_ids=1,x", ["capture.layer_ids[1]", "expected an integer"]),
    ("capture.layer_ids=1,,2", ["capture.layer_ids='1,,2'"]),  # regression: the empty item was skipped
    ("capture.layer_ids=", ["capture.layer_ids is empty"]),  # regression: silently the union
    ("target.dtype=fp4", ["one of bfloat16, float16, float32, float8_e4m3fn, fp8"]),  # fp8 is accepted
])
def test_bad_overrides_name_the_path_and_accepted(tmp_path, override, needles):
    msg = rejected(tmp_path, TWO, override)
    for n in needles:
        assert n in msg, (n, msg)


@pytest.mark.parametrize("override, none", [("capture.replay_layer=maybe", False),
                                            ("experiments.0.resume=maybe", True)])
def test_regression_bad_bool_override_lists_the_accepted_spellings(tmp_path, override, none):
    """A bad bool override said only "expected true or false" while the parser also takes
    yes/on/1 and no/off/0 (any case); the message lists exactly the spellings it takes (and none's, when
    the field is optional), each of which is then accepted."""
    msg = rejected(tmp_path, TWO, override)
    assert "(accepted, any case: true, yes, on, 1 or false, no, off, 0" in msg, msg
    assert ("none, null, ~ for none" in msg) == none, msg
    key = override.split("=")[0]
    spellings = {True: ["true", "yes", "on", "1", "TRUE", "Yes"], False: ["false", "no", "off", "0", "OFF"]}
    for want, texts in spellings.items():
        for text in texts:
            cfg = C.load_run_config(write(tmp_path, TWO), [f"{key}={text}"])
            got = cfg.capture.replay_layer if key.startswith("capture") else cfg.experiments[0].resume
            assert got is want, (text, got)


def test_regression_consumer_bool_override_takes_the_same_spellings(tmp_path):
    """`experiments.0.consumer.progress=yes` (or `=1`, `=OFF`) was refused with "Expected `bool`, got
    `str`; accepted: true or false" while `capture.replay_layer=yes` is taken: the free-form consumer table
    parsed the text as TOML. A ConsumerConfig bool takes the typed fields' spellings, and a bad one lists them."""
    spellings = {True: ["true", "yes", "on", "1", "TRUE"], False: ["false", "no", "off", "0", "OFF"]}
    for want, texts in spellings.items():
        for text in texts:
            cfg = C.load_run_config(write(tmp_path, TWO), [f"experiments.a.consumer.progress={text}"])
            assert cfg.experiments[0].consumer["progress"] is want, text
            assert C.consumer_config(cfg, "a").progress is want, text
    msg = rejected(tmp_path, TWO, "experiments.a.consumer.tensorboard=nah")
    assert "experiments.a.consumer.tensorboard='nah': expected true or false (accepted, any case: true, yes" in msg
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.a.consumer.save_every=2"])  # not a bool: as before
    assert cfg.experiments[0].consumer["save_every"] == 2


def test_override_into_empty_experiments(tmp_path):
    assert "experiments is empty" in rejected(tmp_path, "", "experiments.0.lr=1")


def test_override_creates_absent_sections(tmp_path):
    cfg = C.load_run_config(write(tmp_path, "[[experiments]]\nname = 'a'\n"), ["cache.root=/x", "bench.steps=3"])
    assert cfg.cache.root == "/x" and cfg.bench.steps == 3


def test_flags_override_file_and_overrides(tmp_path):
    flags = C.flag_paths("consume", {"lr": 5e-4, "steps": 3, "consumer_id": "z", "save_every": 2}, "a")
    assert flags == {"experiments.a.lr": 5e-4, "experiments.a.steps": 3, "experiments.a.consumer.save_every": 2}
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.a.lr=1e-2"], flags)
    assert cfg.experiments[0].lr == 5e-4 and cfg.experiments[0].steps == 3
    pflags = C.flag_paths("producer", {"layer_ids": "1,2", "threads": 1, "exit_when_done": True,
                                       "template_options": ("enable_thinking=false",)})
    assert pflags == {"capture.layer_ids": "1,2", "target.threads": 1,
                      "data.template_options": {"enable_thinking": False}}
    cfg = C.load_run_config(write(tmp_path, TWO), (), {**pflags, **C.flag_paths("consume", {"layer_ids": "3,1"}, "b")})
    assert cfg.capture.layer_ids == [1, 2] and cfg.experiments[1].layer_ids == [3, 1]
    assert cfg.data.template_options == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="--nosuch has no config field"):
        C.flag_paths("bench", {"nosuch": 1})


# ---- saving ------------------------------------------------------------------------------------------

def test_dump_toml_round_trips(tmp_path):
    cfg = C.load_run_config(write(tmp_path, TWO), [
        "capture.layer_ids=1,2", 'experiments.a.init_from=/p/"q"', "experiments.b.env.CUDA_VISIBLE_DEVICES=1",
        "experiments.a.consumer.eval_samples=4", "bench.warmup=2"])
    path = C.save_config(cfg, tmp_path / "saved" / "config.toml")
    assert C.load_run_config(path) == cfg
    for recipe in RECIPES:
        r = C.load_run_config(recipe)
        assert C.load_run_config(C.save_config(r, tmp_path / f"{recipe.stem}.toml")) == r


# ---- builders ----------------------------------------------------------------------------------------

def test_consumer_config_from_an_experiment(tmp_path):
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.a.window=4:8", "experiments.a.consumer.save_every=2"])
    cc = C.consumer_config(cfg, "a")
    assert cc.consumer_id == "a" and cc.lr == 1e-3 and (cc.lookbehind, cc.lookahead) == (4, 8)
    assert cc.draft_layers == 5 and cc.save_every == 2 and cc.cache == str(Path("o") / "cache")
    assert cc.out_dir == str(Path("o") / "experiments" / "a")
    with pytest.raises(ConfigError, match="no experiment 'zz' in this config; accepted: a, b"):
        C.consumer_config(cfg, "zz")


def test_context_parallelism_is_an_experiments_consumer_setting(tmp_path):
    """experiments.X.consumer.cp and nproc reach the consumer (DFlash and EAGLE-3); a cp that does not divide nproc
    is refused in one line naming the settings and what is accepted."""
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.a.consumer.cp=2", "experiments.a.consumer.nproc=4"])
    cc = C.consumer_config(cfg, "a")
    assert (cc.cp, cc.nproc, cc.global_batch) == (2, 4, 2 * cc.batch_size)
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.b.consumer.cp=2", "experiments.b.consumer.nproc=2"])
    cc = C.consumer_config(cfg, "b")
    assert (cc.draft, cc.cp, cc.nproc) == ("eagle3", 2, 2)
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.b.consumer.cp=2", "experiments.b.consumer.nproc=3"])
    with pytest.raises(ConfigError, match="experiments.b.consumer.cp 2 does not divide experiments.b.consumer.nproc 3"
                       ".*accepted experiments.b.consumer.nproc a multiple of 2"):
        C.consumer_config(cfg, "b")


def test_consumer_config_rejects_a_setting_the_consumer_lacks(tmp_path):
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.a.consumer.no_such_knob=1"])
    with pytest.raises(ConfigError, match="the consumer has no setting 'no_such_knob'"):
        C.consumer_config(cfg, "a")
    cfg = C.load_run_config(write(tmp_path, TWO), ["experiments.a.consumer.ttt_steps=x"])
    with pytest.raises(ConfigError, match="^experiments.a.consumer.ttt_steps: "):
        C.consumer_config(cfg, "a")


@pytest.mark.parametrize("key, value, needle", [("consumer_id", "b", "the experiment's name"),
                                                ("cache", "/elsewhere", "cache.root"), ("out_dir", "/x", "set out")])
def test_regression_an_experiment_cannot_override_what_the_run_sets(tmp_path, key, value, needle):
    """``experiments.a.consumer.consumer_id=b`` passed --dry-run and the run then failed with experiment a "not
    started" (its id was b's); ``consumer.cache`` pointed a consumer at another root than its producer's. Both, and
    ``out_dir``, are refused in one line naming the key and where the run takes it from."""
    cfg = C.load_run_config(write(tmp_path, TWO), [f"experiments.a.consumer.{key}={value}"])
    with pytest.raises(ConfigError, match=f"experiments.a.consumer.{key}: set by the run.*{needle}"):
        C.consumer_config(cfg, "a")


def test_producer_and_bench_configs(tmp_path):
    cfg = C.load_run_config(CONFIGS / "bench-1p3c.toml", ["cache.root=/tmp/r"])
    pc = C.producer_config(cfg, exit_when_done=True, expect_consumers=None, idle_exit=3.0, producer_id="p",
                           expect_timeout=7.0)
    assert pc.cache == "/tmp/r" and pc.max_length == 256 and pc.exit_when_done and pc.idle_exit_s == 3.0
    assert pc.expect_timeout_s == 7.0
    assert pc.layer_ids is None and pc.draft_layers == 5 and pc.producer_id == "p"
    bc = C.bench_config(cfg)
    assert (bc.scenario, bc.warmup, bc.steps, bc.anchors, bc.max_length) == ("1p3c", 3, 12, 16, 256)
    assert bc.draft_layers == 5 and bc.window == "16:64"


# ---- the CLI -----------------------------------------------------------------------------------------

def assert_one_error_line(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("artcache: error: "), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("verb, extra", [("run", []), ("producer", []), ("consume", ["--experiment", "a"]),
                                         ("bench", [])])
def test_cli_bad_override_exits_2_and_starts_nothing(tmp_path, monkeypatch, verb, extra):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, TWO)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(main, [verb, "--config", str(path), *extra, "experiments.0.lrr=1"])
    assert_one_error_line(result, "unknown field 'lrr' in experiments.0")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("args, needle", [
    (["bench.steps=0"], "bench.steps 0 is not accepted"),
    (["bench.window=banana"], "bench.window 'banana' is not LOOKBEHIND:LOOKAHEAD"),
    (["bench.save=weights", "--steps", "0"], "--steps 0 is not accepted"),  # a flag given is named as the flag
])
def test_regression_bench_config_errors_name_the_key_the_file_set(tmp_path, monkeypatch, args, needle):
    """``artcache bench --config FILE`` with ``[bench] steps = 0`` in the file said ``--steps 0 is not accepted``,
    naming a flag the user never gave, and left ``bench-out/config.toml`` behind; a value from the file or an override
    is named by its run-config key, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, TWO)
    result = CliRunner().invoke(main, ["bench", "--config", str(path), *args])
    assert_one_error_line(result, needle)
    assert not (tmp_path / "bench-out").exists()


def test_file_keys_skip_the_flags_given():
    """The flags given on the command line keep their names; the others map to the keys that set them."""
    params = main.commands["bench"].params
    keys = C.file_keys("bench", params, {"steps": 0})
    assert "--steps" not in keys and keys["--out"] == "bench.out" and keys["--max-length"] == "data.max_length"
    text = "--warmup -1 and --warmup-x and --outline"
    assert C.name_keys(text, keys) == "bench.warmup -1 and --warmup-x and --outline"


def test_cli_overrides_need_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["producer", "--cache", str(tmp_path / "c"), "data.seed=1"])
    assert_one_error_line(result, "need --config FILE")
    assert_one_error_line(CliRunner().invoke(main, ["consume"]), "--cache DIR is required")
    assert_one_error_line(CliRunner().invoke(main, ["consume", "--config", str(write(tmp_path, TWO))]),
                          "needs --experiment NAME")
    assert_one_error_line(CliRunner().invoke(main, ["run", "--config", str(tmp_path / "none.toml")]),
                          "cannot be read")
    assert not (tmp_path / "c").exists() and not (tmp_path / "o").exists()


def test_struct_fields_documented():
    """Every field of every section is named in its struct's docstring (the reference users read)."""
    for cls in (C.TargetSection, C.DataSection, C.CaptureSection, C.CacheSection, C.Experiment):
        doc = cls.__doc__ or ""
        missing = [f for f in cls.__struct_fields__ if f not in doc]
        assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_regression_binary_config_is_one_line(tmp_path, suffix):
    """Breakfix report: `artcache run --config bin.toml --dry-run` on a file that is not UTF-8 died with a
    UnicodeDecodeError traceback (exit 1)."""
    path = tmp_path / f"bin{suffix}"
    path.write_bytes(b"\x00\xff\xfe[target]\n")
    assert_one_error_line(CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run"]), "is not UTF-8 text",
                          "TOML, YAML or JSON")


@pytest.mark.parametrize("text, overrides, needle", [
    ("[[experiments]]\nname = 'a'\nblock_size = 100000000\n", (),
     "experiments.a.block_size 100000000 is invalid: accepted an integer >= 2 and <= 64"),
    ("[[experiments]]\nname = 'a'\nwindow = '1:10000000000000'\n", (),
     "experiments.a.window 1:10000000000000 is invalid: accepted LOOKBEHIND:LOOKAHEAD, each side an integer >= 0 "
     "and <= 16777216"),
    ("[cache]\ndisk_budget = 2305843009213693952\n", (),
     "cache.disk_budget 2305843009213693952 is invalid: accepted an integer >= 0 and <= 1152921504606846976"),
    ("[[experiments]]\nname = 'a'\n", ("experiments.a.window=1:99999999999",), "experiments.a.window 1:99999999999"),
])
def test_regression_run_config_bounds(tmp_path, text, overrides, needle):
    """The run config declares the same bounds as the flags
    (msgspec.Meta on the fields, the one window parser), named by their config path."""
    msg = rejected(tmp_path, text, *overrides)
    assert msg.startswith(f"--config {str(tmp_path / 'run.toml')!r}: ") and needle in msg, msg


@pytest.mark.parametrize("field, value, accepted", [
    ("compile", "fast", "accepted: one of auto, graphs, off, on"),
    ("loss_impl", "fused", "accepted: one of auto, chunked, liger, reference"),
    ("markov_head", "gru", "accepted: one of gated, vanilla or none"),
])
def test_regression_consumer_setting_choices_list_the_accepted_values(field, value, accepted):
    """`experiments.N.consumer.compile = "fast"` said only "Invalid enum value 'fast'"; the message
    lists the accepted values, as the flags' click.Choice does (`consume --compile fast`)."""
    cfg = C.convert({"experiments": [{"name": "a", "draft": "dspark", "consumer": {field: value}}]})
    with pytest.raises(ConfigError) as info:
        C.consumer_config(cfg, "a")
    assert f"experiments.a.consumer.{field}: Invalid enum value '{value}'; {accepted}" in str(info.value)


@pytest.mark.parametrize("flag, value", [("--compile", "fast"), ("--loss-impl", "fused"), ("--markov-head", "gru")])
def test_regression_choice_flags_list_the_accepted_values(tmp_path, flag, value):
    """The flags of those settings are click.Choice: their one error line lists the accepted values."""
    from artcache.trainers import COMPILE_MODES, LOSS_IMPLS

    choices = {"--compile": COMPILE_MODES, "--loss-impl": LOSS_IMPLS, "--markov-head": ("vanilla", "gated")}[flag]
    result = CliRunner().invoke(main, ["consume", "--cache", str(tmp_path / "c"), flag, value])
    assert_one_error_line(result, f"Invalid value for '{flag}': '{value}' is not one of "
                          + ", ".join(repr(c) for c in choices))
    assert not (tmp_path / "c").exists()


def test_regression_empty_choice_is_named_in_a_refusal(tmp_path):
    """Bug: a field whose choices include the empty string (``cache.retention``: "", need, windows) was refused
    with "expected one of , need, windows": the empty choice printed as nothing, so the line read as a typo and
    did not say how to follow the budget. The refusal names it as ``""``."""
    msg = rejected(tmp_path, TWO, "cache.retention=Need")
    assert 'expected one of "", need, windows' in msg, msg
    assert C.load_run_config(write(tmp_path, TWO), ["cache.retention="]).cache.retention == ""


@pytest.mark.parametrize("text, overrides, want", [
    ('[cache]\ndisk_budget = "100M"\n', (), (100 << 20, 0)),
    ('[cache]\ndisk_budget = "AUTO"\n', (), ("auto", 0)),
    ("", ("cache.disk_budget=1.5G", "bench.disk_budget=2K"), (3 << 29, 2048)),
    ('[bench]\ndisk_budget = "1T"\n', (), (0, 1 << 40)),
])
def test_regression_config_disk_budget_takes_the_flags_spellings(tmp_path, text, overrides, want):
    """``--disk-budget 100M``, ``1.5G`` and ``AUTO`` worked on the command line, but ``cache.disk_budget = "100M"``
    in a run config (or as an override) was refused with msgspec's ``Invalid enum value '100M'``. The config
    fields go through the flag's parser now."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    cfg = C.load_run_config(path, overrides)
    assert (cfg.cache.disk_budget, cfg.bench.disk_budget) == want


def test_regression_config_disk_budget_refusal_names_the_accepted_forms(tmp_path):
    """A bad ``cache.disk_budget`` is refused in one line naming the field, the value and the forms accepted."""
    msg = rejected(tmp_path, '[cache]\ndisk_budget = "100X"\n')
    assert "cache.disk_budget '100X' is not accepted" in msg and "500G or 1.5T" in msg and "or auto" in msg, msg


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("key", ["--out", "out", "cache.root", "experiments.eagle3.out", "under a file"])
def test_regression_run_refuses_an_out_that_is_a_file(tmp_path, key, dry_run):
    """Bug: ``artcache run`` (and ``--dry-run``) took an ``out`` (or ``cache.root``, an experiment's ``out``) that is
    an existing file, such as ``/etc/passwd``: the dry run went on to resolve the target and build the plan, then
    named only a derived path (``<out>/experiments/<name>``) as "not a writable directory", and the real run
    would fail late. Symptom: no one-line refusal naming the path the user gave and what is accepted. Now it is
    refused first (exit 2), naming the key, the path and "a writable directory, existing or creatable", and the file is
    left untouched."""
    victim = tmp_path / "passwd"
    victim.write_text("root:x:0:0\n")
    before = victim.stat()
    args = {"--out": ["--out", str(victim)], "out": [f"out={victim}"], "cache.root": [f"cache.root={victim}"],
            "experiments.eagle3.out": [f"experiments.eagle3.out={victim}"],
            "under a file": ["--out", str(victim / "run")]}[key]
    named = {"--out": "out (--out)", "out": "out (--out)", "under a file": "out (--out)"}.get(key, key)
    path = victim / "run" if key == "under a file" else victim
    if key not in ("--out", "out", "under a file"):
        args.append(f"out={tmp_path / 'run'}")
    res = CliRunner().invoke(main, ["run", "--config", str(CONFIGS / "dflash-eagle3.toml"), *args]
                             + (["--dry-run"] if dry_run else []))
    assert_one_error_line(res, f"{named} {str(path)!r}", "a regular file", "accepted: a writable directory, "
                          "existing or creatable")
    after = victim.stat()
    assert victim.read_text() == "root:x:0:0\n" and (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns,
                                                                                           before.st_size)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwd"]


@pytest.mark.parametrize("overrides, needle", [
    (["experiments.dflash-b8.draft_layers=40"], "experiments.dflash-b8.draft_layers 40 is invalid for a target of 30 "
     "layers: accepted an integer in [1, 27]"),
    (["experiments.dflash-b8.consumer.eval_interval=5"], "experiment 'dflash-b8': experiments.dflash-b8.consumer."
     "eval_interval 5 needs a held-out split: pass experiments.dflash-b8.consumer.eval_samples N"),
])
def test_regression_run_messages_name_the_config_key(tmp_path, overrides, needle):
    """Bug: a run config's bad value was named by an internal field or another command's flag: ``draft_layers =
    40`` said ``num_draft_layers=40 must be in [1, 27] for num_target_layers=30``, and an experiment's
    ``consumer.eval_interval`` said ``--eval-interval 5 ... pass --eval-samples N`` (flags of ``artcache consume``,
    which the user never typed). Symptom: the user cannot tell which key to change. Each now names the key."""
    res = CliRunner().invoke(main, ["run", "--config", str(CONFIGS / "dflash-eagle3.toml"), "--dry-run",
                                    f"out={tmp_path / 'run'}", *overrides])
    assert_one_error_line(res, needle)
    assert "num_draft_layers" not in res.stderr and "--" not in res.stderr.split("error: ", 1)[1]


# ---- one home for an experiment's settings; messages naming the key written -------------------------

D4 = """
out = "o"
[data]
max_length = 128
[[experiments]]
name = "d4"
"""


@pytest.mark.parametrize("key, value, home", [
    ("layer_ids", "[1, 99]", "experiments.d4.layer_ids"), ("layer_ids", "[6, 7]", "experiments.d4.layer_ids"),
    ("draft_layers", "2", "experiments.d4.draft_layers"), ("num_anchors", "8", "experiments.d4.anchors"),
    ("lookahead", "8", "experiments.d4.window"), ("draft", '"eagle3"', "experiments.d4.draft"),
])
def test_regression_consumer_layer_settings_have_one_home(tmp_path, key, value, home):
    """Bug: ``layer_ids`` (or ``draft_layers``, ``draft``, ...) under ``[experiments.consumer]`` reached the
    consumer only: ``run --dry-run`` exited 0 showing the experiment's default view (``1,2,3,4,5``) and capture
    union, and the run started the producer and siblings, then the experiment failed inside its ranks (``--layer-ids
    [1, 99]: ...``, or "missing [6]" for ids the union lacked). Symptom: the dry run's plan was not what ran. Such a
    setting is now refused when the config is loaded, in one line naming the experiment-level key."""
    msg = rejected(tmp_path, D4 + f"[experiments.consumer]\n{key} = {value}\n")
    assert f"experiments.d4.consumer.{key} is the experiment's own setting: set {home} instead" in msg
    assert "\n" not in msg
    res = CliRunner().invoke(main, ["run", "--config", str(write(tmp_path, D4)), "--dry-run",
                                    f"experiments.d4.consumer.{key}={value}"])
    assert_one_error_line(res, f"set {home} instead")


def test_experiment_consumer_keys_are_the_shared_fields():
    """Every ConsumerConfig field an experiment sets from a key of its own is refused under ``consumer``."""
    from artcache.trainers.consumer import ConsumerConfig

    shared = set(ConsumerConfig.__struct_fields__) & set(C.Experiment.__struct_fields__)
    assert set(C.EXPERIMENT_CONSUMER_KEYS) == shared | {"num_anchors", "lookbehind", "lookahead"}


@pytest.mark.parametrize("override, want", [
    ("experiments.d4.consumer.nprocs=2", "experiments.d4.consumer.nprocs: the consumer has no setting 'nprocs'; did "
     "you mean experiments.d4.consumer.nproc?"),
    ('experiments.d4.consumer.nproc="two"', "experiments.d4.consumer.nproc: Expected `int`, got `str`; accepted: an "
     "integer >= 1"),
    ("experiments.d4.consumer.group_timeout_s=7200", "experiments.d4.consumer.group_timeout_s 7200 is invalid: "
     "accepted seconds > 0 and <= 3600"),
    ("experiments.d4.lr=-1", "experiments.d4.lr -1.0 is invalid: accepted a finite number > 0"),
    ("experiments.d4.consumer.devices=[-1, 2]", "experiments.d4.consumer.devices.0: Expected `int` >= 0; accepted: a "
     "list, each an integer >= 0 (0 or a positive integer)"),
])
def test_regression_consumer_errors_name_the_key_written(tmp_path, override, want):
    """Bug: run-config errors named internal things: ``consumer.nprocs`` listed ~60 "accepted ConsumerConfig
    fields", ``consumer.nproc = "two"`` said "consumer setting nproc", ``experiments.d4.lr=-1`` said
    ``experiments.0.lr`` and a list of counts was "a list of integer >= 0 (0 or a positive integer)s". Symptom: the
    user could not match the message to the key they wrote. Each now names ``experiments.<name>.[consumer.]<field>``,
    an unknown setting suggests the closest one."""
    with pytest.raises(ConfigError) as info:
        C.consumer_config(C.load_run_config(write(tmp_path, D4), [override]), "d4")
    msg = str(info.value)
    assert msg.endswith(want), msg
    assert "ConsumerConfig" not in msg and "\n" not in msg and ")s" not in msg


def test_unknown_consumer_setting_far_from_any_is_named_alone(tmp_path):
    cfg = C.load_run_config(write(tmp_path, D4), ["experiments.d4.consumer.zzqqxx=1"])
    with pytest.raises(ConfigError, match=r"^experiments.d4.consumer.zzqqxx: the consumer has no setting 'zzqqxx' "
                       r"\(`artcache consume --help` lists its settings\)$"):
        C.consumer_config(cfg, "d4")


@pytest.mark.parametrize("text, needle", [
    ("experiments:\n  - name: a\n    consumer: {nproc: 2, nproc: 2}\n",
     "key 'nproc' is given twice in one table (line 3); give it once"),
    ("out: o\nout: p\n", "key 'out' is given twice in one table (line 2)"),
    ("experiments:\n  - name: a\n    window: 4:8\n",
     'window: 4:8 (line 3) is read by YAML 1.1 as the base-60 number 248; quote it: window: "4:8"'),
])
def test_regression_yaml_duplicate_keys_and_base60_numbers(tmp_path, text, needle):
    """Bug: a YAML config with a key given twice (``{nproc: 2, nproc: 2}``) was taken silently (the last value
    won) while TOML refuses it, and an unquoted ``window: 4:8`` failed with "Expected `str`, got `int`" (YAML 1.1
    reads it as the base-60 number 248). Symptom: a silent surprise, or a type error the user cannot explain. Both
    are refused in one line naming the key (and, for the number, how to quote it)."""
    msg = rejected(tmp_path, text, name="run.yaml")
    assert needle in msg and "\n" not in msg, msg
    ok = C.load_run_config(write(tmp_path, 'experiments:\n  - name: a\n    window: "4:8"\n    lr: 1e-3\n', "ok.yaml"))
    assert ok.experiments[0].window == "4:8" and ok.experiments[0].lr == 1e-3


def test_regression_disk_budget_zero_with_fill_is_refused(tmp_path):
    """Bug: ``artcache producer --disk-budget 0 --fill`` started, saying "--fill without --disk-budget: auto" although
    a budget was given. 0 means no budget (the windows-only rule, which keeps no fill): the pair is refused in one
    line before anything is written, with or without --config."""
    root = tmp_path / "root"
    res = CliRunner().invoke(main, ["producer", "--cache", str(root), "--disk-budget", "0", "--fill"])
    assert_one_error_line(res, "--disk-budget 0 (no budget: the windows-only rule, which keeps no fill) cannot go "
                          "with --fill; accepted: BYTES, auto, or leave --disk-budget out (auto)")
    res = CliRunner().invoke(main, ["producer", "--config", str(write(tmp_path, D4)), f"cache.root={root}",
                                    "--disk-budget", "0B", "--fill"])
    assert_one_error_line(res, "--disk-budget 0B (no budget")
    assert not root.exists()


@pytest.mark.parametrize("mode", ["on", "graphs"])
def test_regression_run_refuses_compile_on_a_cpu_before_starting(tmp_path, monkeypatch, mode):
    """Bug: ``experiments.X.consumer.compile = "on"`` (or ``graphs``) for an experiment on a CPU passed ``artcache
    run --dry-run`` (exit 0), and ``artcache run`` wrote its run directory and started the producer and consumer;
    the consumer then refused it ("--compile on compiles the CUDA step only", naming the flag, not the key) and the
    run ended exit 1 with the experiment "not started". Now the run refuses it in one line naming
    ``experiments.<name>.consumer.compile`` and what is accepted, exit 2, before anything is written."""
    monkeypatch.chdir(tmp_path)
    text = TWO.replace('out = "o"', f'out = "{tmp_path / "o"}"')
    path = write(tmp_path, text + "[target]\nname = 'random:tiny-llama'\ndevice = 'cpu'\n")
    cfg = C.load_run_config(path, [f"experiments.a.consumer.compile={mode}"])
    with pytest.raises(ConfigError, match=rf"experiments.a.consumer.compile {mode} needs a CUDA device: on cpu .*; "
                                          r"accepted experiments.a.consumer.compile off or auto$"):
        C.consumer_config(cfg, "a")
    result = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run",
                                       f"experiments.a.consumer.compile={mode}"])
    assert_one_error_line(result, f"experiments.a.consumer.compile {mode} needs a CUDA device")
    assert not (tmp_path / "o").exists()


def test_regression_an_experiment_name_that_is_a_number_is_refused(tmp_path):
    """Bug: experiments named ``"1"`` and ``"0"`` were accepted, and the override ``experiments.0.lr=1e-3`` silently
    set the lr of the experiment at index 0 (named ``"1"``), not of the one named ``"0"``. Now a name of digits
    only is refused in one line naming the entry and what is accepted."""
    text = "[[experiments]]\nname = \"1\"\n[[experiments]]\nname = \"0\"\n"
    msg = rejected(tmp_path, text, "experiments.0.lr=1e-3")
    assert msg.endswith("experiments.0.name '1' is a number, which an override experiments.1.FIELD=VALUE reads as "
                        "an index; accepted: a name with a letter or another character of A-Z a-z _ . -"), msg
    assert "\n" not in msg
    assert C.load_run_config(write(tmp_path, text.replace('"1"', '"e1"').replace('"0"', '"e0"'))).experiments


def test_regression_run_refuses_pack_tokens_below_max_length_before_starting(tmp_path, monkeypatch):
    """Bug: ``experiments.X.consumer.pack_tokens`` below ``data.max_length`` passed ``artcache run --dry-run``
    (exit 0), and ``artcache run`` wrote its run directory and started the producer and consumer; the consumer then
    refused it naming ``--pack-tokens`` and the run ended exit 1 with the experiment "not started". Now the run
    refuses it in one line naming ``experiments.<name>.consumer.pack_tokens`` and what is accepted, exit 2."""
    monkeypatch.chdir(tmp_path)
    text = TWO.replace('out = "o"', f'out = "{tmp_path / "o"}"').replace("max_length = 128", "max_length = 32")
    path = write(tmp_path, text + "[target]\nname = 'random:tiny-llama'\ndevice = 'cpu'\n")
    for extra in (["--dry-run"], []):
        result = CliRunner().invoke(main, ["run", "--config", str(path), *extra, "data.dataset=synthetic",
                                           "data.max_samples=8", "experiments.a.consumer.pack_tokens=16"])
        assert_one_error_line(result, "experiments.a.consumer.pack_tokens 16 is below data.max_length 32: a sample is "
                                      "never truncated or split; accepted: 0 (off) or >= 32")
        assert not (tmp_path / "o").exists()


def test_bench_config_saves_the_resolved_config_beside_the_reports(tmp_path, monkeypatch):
    """``artcache bench --config FILE``: once the settings are checked, ``<out>/config.toml`` holds the resolved
    config (a rerun's ``--config``), before any scenario runs."""
    import artcache.bench.run as R

    monkeypatch.chdir(tmp_path)
    seen = []

    def scenario(cfg, sc, plan):
        seen.append((tmp_path / "bo" / "config.toml").exists())
        return {"scenario": sc.name, "checks": {"ran": True}}

    monkeypatch.setattr(R, "run_scenario", scenario)
    monkeypatch.setattr(R, "format_report", lambda r: "report")
    result = CliRunner().invoke(main, ["bench", "--config", str(write(tmp_path, TWO)), "bench.out=bo",
                                       "target.name=random:tiny-llama", "data.dataset=synthetic", "bench.steps=1"])
    assert result.exit_code == 0, result.output + str(result.exception)
    assert seen == [True]
    saved = C.load_run_config(tmp_path / "bo" / "config.toml")
    assert saved.bench.out == "bo" and saved.bench.steps == 1
