"""A user's data file is read by one strict reader however it is given (one ``--data FILE``, ``data.dataset``, a
``[[data.sources]]`` entry, ``--eval-data``); a leading UTF-8 byte order mark is accepted; a root's plan mismatch
names only what differs, by the user's flag. Every file is written here."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.data.sources import DataSource, read_source
from artcache.errors import ConfigError, DataError
from artcache.plan import PlanSpec, build_plan, plan_id_for

VOCAB = 49152


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                         {"role": "assistant", "content": f"Answer {i}: {i} plus {i} is {2 * i}, by adding."}]}


def _sharegpt(i: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"Question {i}, squared?"},
                              {"from": "gpt", "value": f"Answer {i}: {i * i} it is, as always."}]}


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _producer(tmp_path: Path, tiny_target, data: str):
    return CliRunner().invoke(main, ["producer", "--cache", str(tmp_path / "cache"), "--target", tiny_target.path,
                                     "--data", data, "--max-samples", "4", "--max-length", "64", "--threads", "1",
                                     "--draft-layers", "3", "--fill"], catch_exceptions=True)


def _one_error_line(result) -> str:
    assert not (result.exception and not isinstance(result.exception, SystemExit)), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("artcache: error: "), lines
    return lines[0]


def test_regression_one_data_file_reads_the_messages_schema(tmp_path, smollm2_tokenizer):
    """One ``--data FILE`` (``data.dataset``) of OpenAI ``messages`` records was refused ("0 usable records (need
    dicts with a list 'conversations')") while ``FILE:1`` accepted it: a dataset file is now planned exactly as
    the one source of weight 1 (same samples, same plan id)."""
    path = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(8)])
    plan = build_plan(PlanSpec(dataset=str(path), max_samples=6, max_length=96), smollm2_tokenizer,
                      target_vocab_size=VOCAB)
    as_source = PlanSpec(max_samples=6, max_length=96, sources=(DataSource(path=str(path)),))
    same = build_plan(as_source, smollm2_tokenizer, target_vocab_size=VOCAB)
    assert len(plan) == 6 and plan.plan_id == same.plan_id == plan_id_for(as_source, smollm2_tokenizer)
    assert plan_id_for(PlanSpec(dataset=str(path), max_samples=6, max_length=96), smollm2_tokenizer) == plan.plan_id
    assert bool((plan.input_ids == same.input_ids).all())


def test_regression_one_data_file_refuses_a_malformed_line(tmp_path, tiny_target):
    """One ``--data FILE`` with a malformed JSONL line used to drop the line with only a warning and capture the
    rest; it is refused like ``FILE:1``: exit 2, one line naming the file and the line, no cache root written."""
    good = [json.dumps(_sharegpt(i)) for i in range(4)]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good[0], good[1], '{"conversations": [ broken', good[2], good[3]]) + "\n")
    line = _one_error_line(_producer(tmp_path, tiny_target, str(path)))
    assert f"data source file '{path}' line 3: not a JSON record" in line, line
    assert not (tmp_path / "cache").exists()


def test_regression_one_data_file_refuses_bytes_that_are_not_utf8(tmp_path, tiny_target, smollm2_tokenizer):
    """One ``--data FILE`` holding bytes that are not UTF-8 was decoded with replacement characters silently; it
    is refused naming the byte's offset, as a source is."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(_sharegpt(0)).encode() + b"\n" + json.dumps(_sharegpt(1)).replace(
        "squared", "caf\u00e9").encode("latin-1") + b"\n")
    offset = path.read_bytes().index(b"\xe9")
    with pytest.raises(DataError, match=rf"file '{path}': byte {offset} is not UTF-8"):
        build_plan(PlanSpec(dataset=str(path), max_samples=2, max_length=96), smollm2_tokenizer,
                   target_vocab_size=VOCAB)
    line = _one_error_line(_producer(tmp_path, tiny_target, str(path)))
    assert f"byte {offset} is not UTF-8" in line, line
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_regression_a_leading_byte_order_mark_is_accepted(tmp_path, kind):
    """A JSONL file starting with a UTF-8 byte order mark was refused as a source ("Unexpected UTF-8 BOM") and lost
    its first record as one ``--data FILE``; the mark is skipped and every record is read. A byte that is not
    UTF-8 after it is named by its offset in the file."""
    records = [_chat(0), _sharegpt(1), _chat(2)]
    plain = tmp_path / f"plain.{kind}"
    text = "".join(json.dumps(r) + "\n" for r in records) if kind == "jsonl" else json.dumps(records)
    plain.write_text(text)
    bom = tmp_path / f"bom.{kind}"
    bom.write_bytes(codecs.BOM_UTF8 + text.encode())
    got = read_source(DataSource(path=str(bom)))
    assert [got[i] for i in range(len(got))] == records
    if kind == "jsonl":
        assert got.where(0).endswith("line 1")
    bad = tmp_path / f"bad.{kind}"
    bad.write_bytes(codecs.BOM_UTF8 + b"\xff" + text.encode())
    with pytest.raises(DataError, match=r"byte 3 is not UTF-8"):
        read_source(DataSource(path=str(bad)))


def test_regression_a_root_mismatch_names_only_the_plan_settings_that_differ(tmp_path, smollm2_tokenizer):
    """A cache root planned from data sources, opened with the same sources and another max_samples, listed
    ``sources`` among the differences although they were equal (plan.json's list against the spec's tuple), and
    ``artcache producer`` named it ``--sources``, a flag that does not exist: only ``--max-samples`` is named now,
    and a change of data is named ``--data``."""
    from artcache.producer import root_flag
    from artcache.settings import _plan_differences

    a = _jsonl(tmp_path / "a.jsonl", [_chat(i) for i in range(8)])
    b = _jsonl(tmp_path / "b.jsonl", [_sharegpt(i) for i in range(8)])
    mix = (DataSource(path=str(a), weight=2.0), DataSource(path=str(b)))
    saved = build_plan(PlanSpec(max_samples=6, max_length=96, sources=mix), smollm2_tokenizer,
                       target_vocab_size=VOCAB).save(tmp_path / "plans")
    assert _plan_differences(saved / "plan.json", PlanSpec(max_samples=5, max_length=96, sources=mix),
                             root_flag) == ["--max-samples 6 there, 5 here"]
    one = build_plan(PlanSpec(dataset=str(a), max_samples=6, max_length=96), smollm2_tokenizer,
                     target_vocab_size=VOCAB).save(tmp_path / "plans")
    assert _plan_differences(one / "plan.json", PlanSpec(dataset=str(a), max_samples=5, max_length=96),
                             root_flag) == ["--max-samples 6 there, 5 here"]
    diffs = _plan_differences(one / "plan.json", PlanSpec(dataset="synthetic", max_samples=6, max_length=96),
                              root_flag)
    assert len(diffs) == 1 and diffs[0].startswith(f"--data [{{'path': '{a}'") and diffs[0].endswith(
        " there, synthetic here"), diffs


def test_regression_the_dry_run_names_the_data_sources(tmp_path, tiny_target):
    """``artcache run --dry-run`` said ``data sharegpt`` (and its ``--json`` ``data.dataset`` "sharegpt") for a
    plan of ``[[data.sources]]``: the text names each source with its weight and the eval source, the JSON's
    ``dataset`` is null beside its ``sources``."""
    a = _jsonl(tmp_path / "a.jsonl", [_chat(i) for i in range(12)])
    b = _jsonl(tmp_path / "b.jsonl", [_sharegpt(i) for i in range(12)])
    ev = _jsonl(tmp_path / "ev.jsonl", [_chat(100 + i) for i in range(4)])
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""out = "{tmp_path / 'out'}"
[target]
name = "{tiny_target.path}"
threads = 1
[data]
max_length = 96
max_samples = 8
[capture]
draft_layers = 3
[[experiments]]
name = "d"
block_size = 4
anchors = 4
batch_size = 2
steps = 2
window = "2:8"
threads = 1
""")
    args = ["run", "--config", str(cfg), "--dry-run", "--data", f"{a}:3", "--data", f"{b}:1", "--eval-data", str(ev)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("data "))
    assert line.startswith(f"data {a}:3, {b}:1 (eval {ev}) seed 0 max_length 96 max_samples 8"), line
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)["data"]
    assert data["dataset"] is None and [(s["path"], s["weight"]) for s in data["sources"]] == [(str(a), 3.0),
                                                                                             (str(b), 1.0)]
    assert not (tmp_path / "out").exists()


def test_regression_a_bad_weight_and_synthetic_as_a_source_are_named(tmp_path, tiny_target):
    """``--data chat.jsonl:abc`` said the path "does not exist" (or "not a known dataset ... nor an existing file")
    without naming the weight ``abc``; ``--data synthetic:1`` and ``--eval-data synthetic`` said "data source
    'synthetic' does not exist". Each is one line naming what is wrong and what is accepted, nothing written."""
    path = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(4)])
    line = _one_error_line(_producer(tmp_path, tiny_target, f"{path}:abc"))
    assert f"data source '{path}:abc': weight 'abc' after the last ':' is invalid: accepted a number > 0" in line
    line = _one_error_line(_producer(tmp_path, tiny_target, "synthetic:1"))
    assert "data source 'synthetic' is not accepted as a source" in line and "accepted: 'synthetic' alone" in line
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ConfigError, match=r"data source 'synthetic' is not accepted as a source"):
        read_source(DataSource(path="synthetic"))
