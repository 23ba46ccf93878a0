"""Data sources: dataset folders and parquet / arrow / JSON / JSONL files in the OpenAI ``messages`` or ShareGPT
``conversations`` schema, mixed by weight into the plan, a separate evaluation source as the held-out split,
and bad inputs refused in one line each. Every file is written here (parquet and folders through ``datasets``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.app.config import dump_toml, load_run_config
from artcache.app.values import data_flags
from artcache.data.sources import DataSource, parse_data_arg, read_source, record_messages
from artcache.errors import ConfigError, DataError
from artcache.plan import Plan, PlanSpec, apportion, build_plan, plan_id_for
from tests.support import REPO

datasets = pytest.importorskip("datasets")

VOCAB = 49152


def _messages(i: int, tag: str, system: bool = True) -> list[dict]:
    turns = [{"role": "system", "content": "Answer briefly."}] if system else []
    return turns + [{"role": "user", "content": f"Question {tag} {i}: what is {i} plus {i}?"},
                    {"role": "assistant", "content": f"Answer {tag} {i}: {i} plus {i} is {2 * i}, by adding."}]


def _sharegpt(i: int, tag: str) -> dict:
    return {"id": f"{tag}-{i}", "conversations": [{"from": "human", "value": f"Question {tag} {i}, squared?"},
                                                  {"from": "gpt", "value": f"Answer {tag} {i}: {i * i} it is."}]}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mixed_files(d: Path, n: int = 60, n_eval: int = 10) -> tuple[Path, Path, Path]:
    """A parquet file of ``messages`` records (tag alpha, with a system turn), a ShareGPT JSONL (tag beta) and an
    eval JSONL of ``messages`` (tag gamma)."""
    d.mkdir(parents=True, exist_ok=True)
    parquet = d / "alpha.parquet"
    datasets.Dataset.from_list([{"messages": _messages(i, "alpha")} for i in range(n)]).to_parquet(str(parquet))
    jsonl = write_jsonl(d / "beta.jsonl", [_sharegpt(i, "beta") for i in range(n)])
    ev = write_jsonl(d / "eval.jsonl", [{"messages": _messages(i, "gamma", system=False)} for i in range(n_eval)])
    return parquet, jsonl, ev


def tags(plan: Plan, tok, lo: int, hi: int) -> list[str]:
    out = []
    for i in range(lo, hi):
        text = tok.decode(plan.sample(i).input_ids.tolist())
        out.append(next(t for t in ("alpha", "beta", "gamma") if t in text))
    return out


# ---- records -------------------------------------------------------------------------------------------

def test_both_schemas_map_to_the_same_messages():
    openai = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                           {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text",
                                                                                              "text": "B"}]}]}
    share = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "AB"}]}
    a, _ = record_messages(openai, "x")
    b, _ = record_messages(share, "x")
    assert a == b == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                      {"role": "assistant", "content": "AB"}]
    assert record_messages({"messages": [{"role": "user", "content": "Q"}]}, "x") == (None, "no_assistant")
    # arrow rows carry every key of the column's struct: a None tool_calls is "none"
    row = {"messages": [{"role": "user", "content": "Q", "tool_calls": None},
                        {"role": "assistant", "content": "A", "tool_calls": None}]}
    assert record_messages(row, "x")[0] == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


@pytest.mark.parametrize("record, needle", [
    (["not", "an", "object"], "record 3: is a list, not an object; accepted: an object with 'messages'"),
    ({"text": "hi"}, "record 3: has no 'messages' or 'conversations' list (keys: text); accepted"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "turn 0 role 'robot' is not accepted; accepted: system, user"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "turn 0 from 'alien' is not accepted; accepted: human"),
    ({"messages": ["hi"]}, "turn 0 is a str, not an object"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
     "turn 0 has a content part of type 'image_url'; accepted: text content"),
    ({"messages": [{"role": "user", "content": 3}]}, "turn 0 content is a int; accepted: a string"),
    ({"messages": [{"role": "user", "content": None}]}, "turn 0 (user) has no content"),
])
def test_bad_records_are_refused_in_one_line_naming_the_record(record, needle):
    with pytest.raises(DataError) as info:
        record_messages(record, "file 'f.jsonl' record 3")
    msg = str(info.value)
    assert "\n" not in msg and "file 'f.jsonl'" in msg and needle in msg, msg


# ---- files ---------------------------------------------------------------------------------------------

def test_every_file_kind_and_a_saved_folder_read_the_same_records(tmp_path):
    recs = [{"messages": _messages(i, "alpha")} for i in range(5)]
    ds = datasets.Dataset.from_list(recs)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.to_json(str(tmp_path / "a.jsonl"))
    (tmp_path / "a.json").write_text(json.dumps(recs))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "folder"))
    ds.save_to_disk(str(tmp_path / "single"))
    arrow = next((tmp_path / "single").glob("*.arrow"))
    want = [record_messages(r, "x")[0] for r in recs]
    for path, split, n in [("a.parquet", "train", 5), ("a.jsonl", "train", 5), ("a.json", "train", 5),
                           ("folder", "train", 5), ("folder", "test", 2), ("single", "train", 5),
                           (str(arrow), "train", 5)]:
        src = read_source(DataSource(path=str(tmp_path / path), split=split))
        assert len(src) == n, path
        assert [record_messages(src[i], src.where(i))[0] for i in range(n)] == want[:n], path
    with pytest.raises(ConfigError, match=r"no split 'validation'; accepted: test, train"):
        read_source(DataSource(path=str(tmp_path / "folder"), split="validation"))
    with pytest.raises(ConfigError, match=r"split 'test' is not accepted: file .* has only the split 'train'"):
        read_source(DataSource(path=str(tmp_path / "a.parquet"), split="test"))


def test_bad_files_are_refused_in_one_line_naming_the_file(tmp_path):
    good = json.dumps({"messages": _messages(0, "a")})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n\n{good}\n{{not json\n")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp_path / "cut.json").write_text(f"[{good}, {good[:20]}")
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "empty_folder").mkdir()
    cases = [
        ("bad.jsonl", DataError, "file '{p}' line 4: not a JSON record"),
        ("bad.parquet", DataError, "file '{p}': not a readable parquet file"),
        ("cut.json", DataError, "file '{p}': not valid JSON"),
        ("data.csv", ConfigError, "suffix '.csv' is not accepted; accepted: a dataset folder"),
        ("missing.parquet", ConfigError, "data source '{p}' does not exist; accepted"),
        ("empty_folder", DataError, "data source folder '{p}': not a dataset saved with save_to_disk"),
    ]
    for name, cls, needle in cases:
        p = str(tmp_path / name)
        with pytest.raises(cls) as info:
            read_source(DataSource(path=p))
        msg = str(info.value)
        assert "\n" not in msg and needle.format(p=p) in msg, msg
    with pytest.raises(ConfigError, match=r"weight 0 is invalid: accepted a number > 0"):
        DataSource(path="x.jsonl", weight=0)
    with pytest.raises(ConfigError, match=r"weight -1.0 is invalid"):
        parse_data_arg("x.jsonl:-1")


def test_data_flags_parse_path_and_weight():
    assert data_flags(("sharegpt",)) == {"data.dataset": "sharegpt"}
    assert data_flags(("a.parquet:0.7", "dir:with:colons/b.jsonl:0.3"), "ev.jsonl") == {
        "data.sources": [{"path": "a.parquet", "weight": 0.7}, {"path": "dir:with:colons/b.jsonl", "weight": 0.3}],
        "data.eval": {"path": "ev.jsonl"}}
    assert data_flags(("a.parquet", "b.jsonl"))["data.sources"][1] == {"path": "b.jsonl", "weight": 1.0}
    assert data_flags(()) == {}


# ---- the mix in the plan -------------------------------------------------------------------------------

def test_apportion_stays_within_one_of_each_weight():
    for total in range(1, 60):
        for weights in ([0.7, 0.3], [1, 1, 1], [5, 0.1, 2.5]):
            counts = apportion(total, weights)
            assert sum(counts) == total
            assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(counts, weights, strict=True))


def test_mixed_plan_follows_the_weights_and_ends_with_the_eval_source(tmp_path, smollm2_tokenizer):
    """0.7 parquet ``messages`` + 0.3 ShareGPT JSONL + a separate eval JSONL: each source's count in the plan
    (read back from the tokens) is within one sample of its weight's share, the eval samples form the tail
    (``heldout``), and the plan id follows the files' contents and the weights, not the paths."""
    parquet, jsonl, ev = mixed_files(tmp_path / "d")
    tok = smollm2_tokenizer
    spec = PlanSpec(max_samples=33, max_length=128, sources=(DataSource(path=str(parquet), weight=0.7),
                                                             DataSource(path=str(jsonl), weight=0.3)),
                    eval=DataSource(path=str(ev), max_samples=6))
    plan = build_plan(spec, tok, target_vocab_size=VOCAB)
    assert len(plan) == 39 and plan.heldout == 6
    train = tags(plan, tok, 0, 33)
    assert abs(train.count("alpha") - 33 * 0.7) < 1 and abs(train.count("beta") - 33 * 0.3) < 1
    assert train.count("alpha") + train.count("beta") == 33
    assert "alpha" in train[:8] and "beta" in train[:8]  # mixed through the plan, not one source then the other
    assert tags(plan, tok, 33, 39) == ["gamma"] * 6
    prov = plan.provenance
    assert [(s["kept"], s["weight"]) for s in prov["sources"]] == [(train.count("alpha"), 0.7),
                                                                   (train.count("beta"), 0.3)]
    assert prov["eval"]["kept"] == 6 and prov["heldout"] == 6
    # the first (system) turn of a messages record is rendered and unsupervised
    first_alpha = next(i for i, t in enumerate(train) if t == "alpha")
    s = plan.sample(first_alpha)
    assert "Answer briefly." in tok.decode(s.input_ids.tolist())
    assert "Answer briefly." not in tok.decode(s.input_ids[s.loss_mask.bool()].tolist())
    # deterministic; the id is the contents' (a copy elsewhere is the same plan), the weights enter it
    assert build_plan(spec, tok, target_vocab_size=VOCAB).input_ids.equal(plan.input_ids)
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(parquet.read_bytes())
    moved = PlanSpec(max_samples=33, max_length=128, sources=(DataSource(path=str(copy), weight=0.7),
                                                              DataSource(path=str(jsonl), weight=0.3)),
                     eval=DataSource(path=str(ev), max_samples=6))
    assert plan_id_for(moved, tok) == plan.plan_id == plan_id_for(spec, tok)
    for changed in (
            PlanSpec(max_samples=33, max_length=128, sources=(DataSource(path=str(parquet), weight=0.6),
                                                              DataSource(path=str(jsonl), weight=0.3)),
                     eval=DataSource(path=str(ev), max_samples=6)),
            PlanSpec(max_samples=33, max_length=128, sources=(DataSource(path=str(parquet), weight=0.7),
                                                              DataSource(path=str(jsonl), weight=0.3,
                                                                         max_samples=9)),
                     eval=DataSource(path=str(ev), max_samples=6)),
            PlanSpec(max_samples=33, max_length=128, sources=(DataSource(path=str(parquet), weight=0.7),
                                                              DataSource(path=str(jsonl), weight=0.3)))):
        assert plan_id_for(changed, tok) != plan.plan_id
    write_jsonl(jsonl, [_sharegpt(i, "beta") for i in range(61)])  # one more record: another plan
    assert plan_id_for(spec, tok) != plan.plan_id


def test_a_short_source_shrinks_the_mix_to_keep_its_weights(tmp_path, smollm2_tokenizer):
    """A source with fewer usable records (or a smaller max_samples) than its share: the plan keeps the
    weights with fewer samples (the most at which every source stays within one of its share: 6 + 5 at 0.5 /
    0.5 with 5 left in one), rather than filling up from the other source."""
    parquet, _, _ = mixed_files(tmp_path / "d")
    small = write_jsonl(tmp_path / "small.jsonl", [_sharegpt(i, "beta") for i in range(5)])
    for beta, cap in ((small, None), (tmp_path / "d" / "beta.jsonl", 5)):
        spec = PlanSpec(max_samples=40, max_length=128, sources=(DataSource(path=str(parquet), weight=0.5),
                                                                 DataSource(path=str(beta), weight=0.5,
                                                                            max_samples=cap)))
        plan = build_plan(spec, smollm2_tokenizer, target_vocab_size=VOCAB)
        got = tags(plan, smollm2_tokenizer, 0, len(plan))
        assert len(plan) == 11 and got.count("alpha") == 6 and got.count("beta") == 5
        assert [x["kept"] for x in plan.provenance["sources"]] == [6, 5]


def test_tool_calls_the_template_drops_are_refused(tmp_path, smollm2_tokenizer):
    """SmolLM2's ChatML template renders a ``tool`` turn but drops an assistant's ``tool_calls``: such a record
    is refused in one line naming it (its tool call would silently vanish from the plan)."""
    call = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"type": "function", "function": {"name": "get_weather",
                                                               "arguments": "{\"city\": \"Paris\"}"}}]},
                         {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"},
                         {"role": "assistant", "content": "It is 18 C and sunny in Paris."}]}
    f = write_jsonl(tmp_path / "tools.jsonl", [call])
    with pytest.raises(DataError) as info:
        build_plan(PlanSpec(max_samples=4, max_length=128, sources=(DataSource(path=str(f)),)), smollm2_tokenizer,
                   target_vocab_size=VOCAB)
    msg = str(info.value)
    assert "\n" not in msg and f"file '{f}' line 1" in msg and "drops tool calls (no 'get_weather'" in msg, msg
    # a tool turn alone (its answer) is rendered by the template: kept, and unsupervised
    answer = {"messages": [call["messages"][0], {"role": "tool", "content": "18 C, sunny"},
                           call["messages"][3]]}
    f2 = write_jsonl(tmp_path / "tool_answer.jsonl", [answer])
    plan = build_plan(PlanSpec(max_samples=4, max_length=128, sources=(DataSource(path=str(f2)),)),
                      smollm2_tokenizer, target_vocab_size=VOCAB)
    s = plan.sample(0)
    assert "<|im_start|>tool\n18 C, sunny" in smollm2_tokenizer.decode(s.input_ids.tolist())
    supervised = smollm2_tokenizer.decode(s.input_ids[s.loss_mask.bool()].tolist())
    assert "18 C, sunny" not in supervised and "It is 18 C and sunny in Paris." in supervised


def test_an_eval_source_equal_to_a_training_source_is_refused(tmp_path, smollm2_tokenizer):
    parquet, jsonl, _ = mixed_files(tmp_path / "d")
    copy = tmp_path / "again.jsonl"
    copy.write_bytes(jsonl.read_bytes())
    spec = PlanSpec(max_samples=10, sources=(DataSource(path=str(parquet)), DataSource(path=str(jsonl))),
                    eval=DataSource(path=str(copy)))
    with pytest.raises(ConfigError, match=r"data.eval '.*again.jsonl' holds the same data as the training source "
                                          r"'.*beta.jsonl'; accepted: an evaluation source never trained on"):
        plan_id_for(spec, smollm2_tokenizer)
    with pytest.raises(ConfigError, match="data.dataset 'x.json' and data.sources exclude each other"):
        PlanSpec(dataset="x.json", sources=(DataSource(path=str(parquet)),))


def test_regression_two_training_sources_of_the_same_data_are_refused(tmp_path, smollm2_tokenizer):
    """``--data a.jsonl:1 --data a.jsonl:1`` (or a copy of it) planned every sample twice, silently; the same data
    is refused in one line. Two splits of one DatasetDict folder are different data (same digest, other split)."""
    _, jsonl, _ = mixed_files(tmp_path / "d")
    copy = tmp_path / "again.jsonl"
    copy.write_bytes(jsonl.read_bytes())
    for twin in (jsonl, copy):
        spec = PlanSpec(max_samples=10, sources=(DataSource(path=str(jsonl)), DataSource(path=str(twin))))
        with pytest.raises(ConfigError, match=r"data sources '.*beta.jsonl' and '.*(beta|again).jsonl' hold the same "
                                              r"data; accepted: each source once"):
            plan_id_for(spec, smollm2_tokenizer)
    import datasets

    folder = tmp_path / "dd"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "validation": datasets.Dataset.from_list(rows[2:])}).save_to_disk(str(folder))
    spec = PlanSpec(max_samples=2, sources=(DataSource(path=str(folder)),),
                    eval=DataSource(path=str(folder), split="validation"))
    plan_id_for(spec, smollm2_tokenizer)  # the held-out split of the same folder is data never trained on


def test_an_uncapped_eval_source_larger_than_the_training_plan_is_warned_about(tmp_path, smollm2_tokenizer, caplog):
    """``--eval-data FILE`` takes every usable record whatever ``--max-samples`` says (a 485 MB root from a
    4-sample plan and the embedded ShareGPT as eval): the producer says so, and ``data.eval.max_samples`` caps it."""
    parquet, _, ev = mixed_files(tmp_path / "d", n=8, n_eval=6)
    with caplog.at_level("WARNING", logger="artcache.plan"):
        plan = build_plan(PlanSpec(max_samples=2, max_length=128, sources=(DataSource(path=str(parquet)),),
                                   eval=DataSource(path=str(ev))), smollm2_tokenizer, target_vocab_size=VOCAB)
    assert len(plan) == 8 and any("6 held-out samples (every usable record), more than the 2 training samples"
                                  in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="artcache.plan"):
        build_plan(PlanSpec(max_samples=2, max_length=128, sources=(DataSource(path=str(parquet)),),
                            eval=DataSource(path=str(ev), max_samples=2)), smollm2_tokenizer, target_vocab_size=VOCAB)
    assert not any("held-out samples" in r.message for r in caplog.records)


# ---- run configs and the CLI ---------------------------------------------------------------------------

def run_toml(tiny_target, out: Path, parquet: Path, jsonl: Path, ev: Path, steps: int = 4) -> str:
    return f"""
out = "{out}"
[target]
name = "{tiny_target.path}"
threads = 1
[data]
max_length = 96
max_samples = 20
[[data.sources]]
path = "{parquet}"
weight = 0.7
[[data.sources]]
path = "{jsonl}"
weight = 0.3
[data.eval]
path = "{ev}"
max_samples = 4
[capture]
draft_layers = 3
[cache]
done_grace_s = 1.0
demand_timeout_s = 300.0
[[experiments]]
name = "d"
block_size = 4
anchors = 4
batch_size = 2
steps = {steps}
window = "2:8"
threads = 1
log_every = 1
[experiments.consumer]
progress = false
tensorboard = false
"""


def test_run_config_sources_round_trip_and_dry_run(tiny_target, tmp_path):
    """``[[data.sources]]`` and ``[data.eval]`` load, save and reload to the same config; the dry run builds the
    mixed plan, makes its eval samples the experiment's held-out split (and captures the last layer for its
    replay); the CLI's repeated ``--data PATH:WEIGHT`` and ``--eval-data`` give the same config."""
    parquet, jsonl, ev = mixed_files(tmp_path / "d")
    path = tmp_path / "run.toml"
    path.write_text(run_toml(tiny_target, tmp_path / "out", parquet, jsonl, ev))
    cfg = load_run_config(path)
    assert [(s.path, s.weight) for s in cfg.data.sources] == [(str(parquet), 0.7), (str(jsonl), 0.3)]
    assert cfg.data.eval == DataSource(path=str(ev), max_samples=4)
    (tmp_path / "saved.toml").write_text(dump_toml(cfg))
    assert load_run_config(tmp_path / "saved.toml") == cfg
    res = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    exp = plan["experiments"][0]
    assert exp["consumer"]["eval_samples"] == 4
    assert plan["replay_layer"] == tiny_target.num_layers - 1 and plan["replay_layer_for"] == ["d"]
    bare = tmp_path / "bare.toml"
    bare.write_text(run_toml(tiny_target, tmp_path / "out", parquet, jsonl, ev).split("[[data.sources]]")[0]
                    + "[capture]" + run_toml(tiny_target, tmp_path / "out", parquet, jsonl, ev).split("[capture]")[1])
    res2 = CliRunner().invoke(main, ["run", "--config", str(bare), "--dry-run", "--json", "--data",
                                     f"{parquet}:0.7", "--data", f"{jsonl}:0.3", "--eval-data", str(ev)])
    assert res2.exit_code == 0, res2.output
    assert json.loads(res2.stdout)["plan_id"] != plan["plan_id"]  # data.eval without max_samples: every record
    res3 = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run",
                                     "experiments.d.consumer.eval_samples=3"])
    assert res3.exit_code == 2
    assert "eval_samples 3 differs from the plan's held-out split: its last 4 samples" in res3.output


@pytest.mark.timeout(900)
def test_run_mixes_sources_captures_and_trains_with_the_eval_source_held_out(tiny_target, tmp_path):
    """The whole path on CPU: a run config mixing a parquet ``messages`` file (0.7) and a ShareGPT JSONL (0.3)
    with a separate eval JSONL plans, captures and trains; the root's plan holds 14 + 6 training samples and
    the 4 eval samples as its held-out tail, which the experiment evaluates on and never trains on."""
    parquet, jsonl, ev = mixed_files(tmp_path / "d")
    out = tmp_path / "out"
    path = tmp_path / "run.toml"
    path.write_text(run_toml(tiny_target, out, parquet, jsonl, ev))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    d = report["experiments"][0]
    assert d["state"] == "completed" and d["steps_run"] == 4
    plans = list((out / "cache" / "plans").glob("*/plan.json"))
    assert len(plans) == 1
    plan = Plan.load(plans[0].parent)
    assert [s["kept"] for s in plan.provenance["sources"]] == [14, 6] and plan.heldout == 4 and len(plan) == 24
    rows = [r for r in (out / "experiments" / "d" / "metrics.csv").read_text().splitlines() if ",eval/" in r]
    assert rows, "the held-out split from data.eval was evaluated"


def test_dump_toml_keeps_lists_of_tables(tmp_path):
    """The resolved ``config.toml`` a run writes keeps ``[[data.sources]]`` (a list of tables inside a section),
    so a rerun from it trains on the same data."""
    cfg = load_run_config(None, (), {"data.sources": [{"path": "a.parquet", "weight": 0.7},
                                                      {"path": "b.jsonl", "weight": 0.3}]})
    (tmp_path / "c.toml").write_text(dump_toml(cfg))
    assert load_run_config(tmp_path / "c.toml").data.sources == cfg.data.sources


def test_a_root_planned_from_one_mix_names_the_changed_weights(tmp_path, smollm2_tokenizer):
    """A cache root made from one mix refuses another, naming data.sources with both values."""
    from artcache.settings import _plan_differences

    parquet, jsonl, _ = mixed_files(tmp_path / "d")
    spec = PlanSpec(max_samples=10, max_length=128, sources=(DataSource(path=str(parquet), weight=0.7),
                                                             DataSource(path=str(jsonl), weight=0.3)))
    plan = build_plan(spec, smollm2_tokenizer, target_vocab_size=VOCAB)
    saved = plan.save(tmp_path / "plans")
    other = PlanSpec(max_samples=10, max_length=128, sources=(DataSource(path=str(parquet), weight=0.5),
                                                              DataSource(path=str(jsonl), weight=0.5)))
    diffs = _plan_differences(saved / "plan.json", other, str)
    assert len(diffs) == 1 and diffs[0].startswith("sources [") and "'weight': 0.7" in diffs[0]
    assert "'weight': 0.5" in diffs[0].split(" there, ")[1]


def test_bad_source_in_a_run_config_is_one_line_and_nothing_is_written(tiny_target, tmp_path):
    parquet, jsonl, ev = mixed_files(tmp_path / "d")
    (tmp_path / "d" / "beta.jsonl").write_text(jsonl.read_text() + '{"conversations": [{"from": "alien", '
                                                                   '"value": "x"}]}\n')
    path = tmp_path / "run.toml"
    out = tmp_path / "out"
    path.write_text(run_toml(tiny_target, out, parquet, jsonl, ev).replace("max_samples = 20", "max_samples = 100"))
    res = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run"])
    assert res.exit_code == 2
    err = res.output.strip()
    assert len(err.splitlines()) == 1, err
    assert f"data source file '{jsonl}' line 61: turn 0 from 'alien' is not accepted; accepted: human" in err
    assert not out.exists()


def test_a_dataset_file_with_a_separate_eval_source(tmp_path, smollm2_tokenizer):
    """``data.dataset`` (one file) with ``data.eval``: the file's samples, then the eval source's as the tail."""
    _, jsonl, ev = mixed_files(tmp_path / "d")
    spec = PlanSpec(dataset=str(jsonl), max_samples=12, max_length=128, eval=DataSource(path=str(ev)))
    plan = build_plan(spec, smollm2_tokenizer, target_vocab_size=VOCAB)
    assert len(plan) == 22 and plan.heldout == 10
    assert tags(plan, smollm2_tokenizer, 0, 22) == ["beta"] * 12 + ["gamma"] * 10
    assert plan_id_for(spec, smollm2_tokenizer) == plan.plan_id
    assert plan_id_for(PlanSpec(dataset=str(jsonl), max_samples=12, max_length=128), smollm2_tokenizer) != plan.plan_id
