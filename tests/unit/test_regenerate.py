"""``artcache regenerate``: target-generated answers written as a new ShareGPT JSONL (artcache/data/regenerate.py).

On the tiny random-weight Llama target (SmolLM2's tokenizer and chat template) with a small ShareGPT file
written here: the output schema, first assistant turn only, skip counting, greedy determinism, refusing to
overwrite, bad input (exit 2, one line, nothing written), and that the producer plans the output.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.data.regenerate import (
    Generation,
    RegenerateConfig,
    _cut,
    regenerate,
    roundtrip_exact,
    select_prompts,
    write_atomic,
)
from artcache.data.sharegpt import read_sharegpt
from artcache.errors import ConfigError

MAX_NEW = 12
RECORDS = [
    {"id": "sys-multi", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "Name three rivers."},
        {"from": "gpt", "value": "Nile, Amazon, Danube."},
        {"from": "human", "value": "And one more?"},
        {"from": "gpt", "value": "Rhine."}]},
    {"id": "plain", "conversations": [
        {"from": "human", "value": "What is bread made of?"},
        {"from": "gpt", "value": "Flour, water, yeast and salt."}]},
    {"id": "gpt-first", "conversations": [
        {"from": "gpt", "value": "Hello, how can I help?"},
        {"from": "human", "value": "Say hi."},
        {"from": "gpt", "value": "Hi."}]},
    {"id": "no-assistant", "conversations": [{"from": "human", "value": "Anyone there?"}]},
    {"id": "odd-role", "conversations": [
        {"from": "narrator", "value": "Once upon a time"}, {"from": "gpt", "value": "..."}]},
    {"id": "line-sep", "conversations": [
        {"from": "human", "value": "Two lines\u2028with a separator\x85and a NEL."},
        {"from": "gpt", "value": "Noted."}]},
    {"id": "long", "conversations": [
        {"from": "human", "value": "Describe the sea. " * 40},
        {"from": "gpt", "value": "It is large."}]},
    {"id": "user-user", "conversations": [
        {"from": "human", "value": "First question."},
        {"from": "user", "value": "Second question, same turn run."},
        {"from": "chatgpt", "value": "Both answered."}]},
]
USABLE = ["sys-multi", "plain", "line-sep", "long", "user-user"]


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "src.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def invoke(*args: str):
    return CliRunner().invoke(main, ["regenerate", *args], catch_exceptions=True)


def regen_args(tiny_target, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--target", tiny_target.path, "--data", str(data), "--out", str(out),
            "--max-new-tokens", str(MAX_NEW), "--batch-size", "3", "--threads", "1", "--no-progress", *extra]


def ok_summary(result) -> dict:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_bad(result, *needles: str) -> str:
    assert not (result.exception and not isinstance(result.exception, SystemExit)), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("artcache: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ---- the output --------------------------------------------------------------------------------------

def test_schema_first_turn_only_and_skips(tiny_target, data, tmp_path):
    out = tmp_path / "regen.jsonl"
    s = ok_summary(invoke(*regen_args(tiny_target, data, out)))
    assert s["samples"] == len(USABLE) and s["records"] == len(RECORDS) and s["visited"] == len(RECORDS)
    assert s["skipped"] == {"no_assistant": 1, "no_user_before_assistant": 1, "role:narrator": 1}
    assert s["skipped_total"] == 3
    assert s["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() and s["out"] == str(out)
    assert 0 < s["generated_tokens"] <= MAX_NEW * len(USABLE) and s["prompt_tokens"] > 0
    assert s["roundtrip_exact"] + s["roundtrip_mismatch"] == s["samples"]
    assert 0.0 <= s["finished_fraction"] <= 1.0 and s["generated_tokens_per_s"] > 0

    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(USABLE)  # U+2028 / NEL inside values did not break a line
    by_id = {r["id"]: r for r in RECORDS}
    got = [json.loads(line) for line in lines]
    assert [r["id"] for r in got] == USABLE  # file order
    for rec in got:
        src = by_id[rec["id"]]["conversations"]
        first = next(i for i, t in enumerate(src) if t["from"] in ("gpt", "chatgpt"))
        assert rec["conversations"][:-1] == src[:first]  # system / human turns verbatim, later turns dropped
        answer = rec["conversations"][-1]
        assert answer["from"] == "gpt" and isinstance(answer["value"], str)
        assert "<|im_end|>" not in answer["value"] or not rec["regenerated"]["finished"]
        meta = rec["regenerated"]
        assert set(meta) >= {"target", "weights_digest", "backend", "max_new_tokens", "temperature", "finished",
                             "generated_tokens"}
        assert meta["target"] == tiny_target.name and meta["weights_digest"] == tiny_target.weights_digest
        assert meta["backend"] == "hf" and meta["max_new_tokens"] == MAX_NEW and meta["temperature"] == 0.0
        assert isinstance(meta["finished"], bool) and 0 <= meta["generated_tokens"] <= MAX_NEW
        assert meta["finished"] or meta["generated_tokens"] == MAX_NEW
    assert len(got[0]["conversations"]) == 3  # sys-multi: system, human, regenerated gpt
    # the reader of every dataset reads it back, line separators included
    back = read_sharegpt(out)
    assert back.records_dropped == 0 and [r["conversations"] for r in back.records] == \
        [r["conversations"] for r in got]
    assert leftovers(tmp_path) == []


def test_greedy_is_deterministic(tiny_target, data, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    sa = ok_summary(invoke(*regen_args(tiny_target, data, a)))
    sb = ok_summary(invoke(*regen_args(tiny_target, data, b)))
    assert a.read_bytes() == b.read_bytes() and sa["sha256"] == sb["sha256"]


def test_sampling_with_seed_is_reproducible(tiny_target, data, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (a, b):
        ok_summary(invoke(*regen_args(tiny_target, data, out, "--temperature", "0.8", "--seed", "3")))
    assert a.read_bytes() == b.read_bytes()
    meta = json.loads(a.read_text().splitlines()[0])["regenerated"]
    assert meta["temperature"] == 0.8 and meta["seed"] == 3


def test_max_samples_takes_the_first_usable_in_file_order(tiny_target, data, tmp_path):
    out = tmp_path / "o.jsonl"
    s = ok_summary(invoke(*regen_args(tiny_target, data, out, "--max-samples", "2")))
    assert s["samples"] == 2 and [json.loads(x)["id"] for x in out.read_text().splitlines()] == USABLE[:2]
    assert s["visited"] == 2 and s["skipped_total"] == 0


def test_prompt_length_skips_are_counted(tiny_target, smollm2_tokenizer, data, tmp_path):
    prompts, _, _ = select_prompts(RECORDS, smollm2_tokenizer, max_samples=100, max_prompt_tokens=10**6)
    lengths = {p.record_id: len(p.ids) for p in prompts}
    assert list(lengths) == USABLE
    limit = sorted(lengths.values())[2]  # keeps the three shortest prompts (ties included)
    keep = [i for i in USABLE if lengths[i] <= limit]
    out = tmp_path / "o.jsonl"
    s = ok_summary(invoke(*regen_args(tiny_target, data, out, "--max-prompt-tokens", str(limit))))
    assert s["skipped"].get("prompt_too_long") == len(USABLE) - len(keep) > 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == keep
    assert s["prompt_tokens"] == sum(lengths[i] for i in keep)


def test_producer_plans_the_output(tiny_target, data, tmp_path):
    from artcache.producer import ProducerConfig, prepare_root

    out = tmp_path / "regen.jsonl"
    ok_summary(invoke(*regen_args(tiny_target, data, out, "--max-new-tokens", "16")))
    _layout, _settings, plan, _info, _tok = prepare_root(ProducerConfig(
        cache=str(tmp_path / "cache"), target=tiny_target.path, dataset=str(out), max_length=256,
        max_samples=100, draft_layers=2))
    assert len(plan) == len(USABLE)
    assert plan.provenance["dataset_path"] == str(out) and plan.provenance["counts"]["skipped"] == {}


# ---- refusing and bad input --------------------------------------------------------------------------

def test_refuses_to_overwrite_without_force(tiny_target, data, tmp_path):
    out = tmp_path / "exists.jsonl"
    out.write_text("keep me\n")
    assert_bad(invoke(*regen_args(tiny_target, data, out)), str(out), "--force")
    assert out.read_text() == "keep me\n" and leftovers(tmp_path) == []
    s = ok_summary(invoke(*regen_args(tiny_target, data, out, "--force")))
    assert s["samples"] == len(USABLE) and out.read_text() != "keep me\n"


@pytest.mark.parametrize(("args", "needles"), [
    (("--max-new-tokens", "0"), ("--max-new-tokens 0", ">= 1")),
    (("--max-new-tokens", "-5"), ("--max-new-tokens -5",)),
    (("--max-prompt-tokens", "0"), ("--max-prompt-tokens 0",)),
    (("--batch-size", "0"), ("--batch-size 0",)),
    (("--max-samples", "0"), ("--max-samples 0",)),
    (("--temperature", "-1"), ("--temperature -1",)),
    (("--temperature", "nan"), ("--temperature nan",)),
    (("--backend", "tgi"), ("'--backend': 'tgi' is not one of 'hf', 'vllm'",)),
    (("--dtype", "int8"), ("'--dtype': 'int8' is not one of 'auto', 'float32', 'bfloat16', 'float16'",)),
    (("--cache", "paged"), ("'--cache': 'paged' is not one of 'auto', 'dynamic', 'static'",)),
    (("--device", "tpu"), ("--device 'tpu'",)),
    (("--chat-template-option", "oops"), ("'oops'", "NAME=VALUE")),
])
def test_bad_values_exit_2_and_write_nothing(tiny_target, data, tmp_path, args, needles):
    out = tmp_path / "o.jsonl"
    assert_bad(invoke(*regen_args(tiny_target, data, out, *args)), *needles)
    assert not out.exists() and leftovers(tmp_path) == []


def test_regression_regenerate_backend_dtype_cache_are_choices():
    """--backend/--dtype/--cache were free text checked only by RegenerateConfig.validate: --help did not list
    the accepted values. They are click Choices of the module's own tuples (one list each)."""
    import click

    from artcache.data.regenerate import BACKENDS, CACHES, DTYPES

    params = {p.name: p for p in main.commands["regenerate"].params}
    for name, accepted in (("backend", BACKENDS), ("dtype", DTYPES), ("cache", CACHES)):
        assert isinstance(params[name].type, click.Choice) and tuple(params[name].type.choices) == accepted, name
    help_text = CliRunner().invoke(main, ["regenerate", "--help"], terminal_width=200).output
    assert "[hf|vllm]" in help_text and "[auto|dynamic|static]" in help_text


@pytest.mark.parametrize(("args", "message"), [
    (("--max-new-tokens", "0"), "--max-new-tokens 0 is invalid: accepted an integer >= 1"),
    (("--max-prompt-tokens", "-3"), "--max-prompt-tokens -3 is invalid: accepted an integer >= 1"),
    (("--seed", "-1"), "--seed -1 is invalid: accepted an integer >= 0 (0 or a positive integer)"),
    (("--threads", "-2"), "--threads -2 is invalid: accepted an integer >= 0 (0 or a positive integer)"),
    (("--temperature", "-1"), "--temperature -1.0 is invalid: accepted a finite number >= 0"),
    (("--temperature", "inf"), "--temperature inf is invalid: accepted a finite number >= 0"),
])
def test_regression_regenerate_ranges_in_the_one_style(tiny_target, data, tmp_path, args, message):
    """RegenerateConfig.validate checked (field, min) pairs by hand in its own message form (``--seed -1
    is not accepted: an integer >= 0``); the ranges are declared on its fields now and reported in the one style."""
    out = tmp_path / "o.jsonl"
    result = invoke(*regen_args(tiny_target, data, out, *args))
    assert result.exit_code == 2 and result.stderr.strip() == f"artcache: error: {message}"
    assert not out.exists() and leftovers(tmp_path) == []
    with pytest.raises(ConfigError, match=r"^--batch-size 0 is invalid: accepted an integer >= 1$"):
        RegenerateConfig(out=str(out), batch_size=0).validate()


def test_missing_data_and_out_directory(tiny_target, tmp_path):
    out = tmp_path / "o.jsonl"
    missing = tmp_path / "nope.jsonl"
    assert_bad(invoke(*regen_args(tiny_target, missing, out)), str(missing))
    assert not out.exists()
    assert_bad(invoke(*regen_args(tiny_target, missing, tmp_path)), "is a directory")


def test_no_usable_record(tiny_target, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(RECORDS[2]) + "\n" + json.dumps(RECORDS[3]) + "\n")
    out = tmp_path / "o.jsonl"
    assert_bad(invoke(*regen_args(tiny_target, data, out)), str(data), "no_user_before_assistant")
    assert not out.exists()


def test_vllm_not_installed(tiny_target, data, tmp_path, monkeypatch):
    import artcache.backends.vllm as V

    monkeypatch.setattr(V, "vllm_available", lambda: False)
    out = tmp_path / "o.jsonl"
    assert_bad(invoke(*regen_args(tiny_target, data, out, "--backend", "vllm")), "needs vLLM")
    assert not out.exists() and leftovers(tmp_path) == []


def test_random_target_has_no_tokenizer(data, tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer"):
        regenerate(RegenerateConfig(out=str(tmp_path / "o.jsonl"), target="random:tiny-llama", dataset=str(data)))
    assert not (tmp_path / "o.jsonl").exists()


# ---- pieces ------------------------------------------------------------------------------------------

def test_cut_at_stop_or_cap():
    assert _cut([5, 6, 2, 9, 2], [2], 8) == Generation([5, 6], True)
    assert _cut([5, 6, 7], [2, 0], 3) == Generation([5, 6, 7], False)
    assert _cut([0], [2, 0], 3) == Generation([], True)


def test_write_atomic_never_clobbers_without_force(tmp_path):
    out = tmp_path / "sub" / "o.jsonl"
    write_atomic(out, b"one\n", force=False)
    with pytest.raises(ConfigError, match="exists"):
        write_atomic(out, b"two\n", force=False)
    assert out.read_bytes() == b"one\n"
    write_atomic(out, b"three\n", force=True)
    assert out.read_bytes() == b"three\n" and leftovers(out.parent) == []


def test_roundtrip_exact_detects_retokenisation_drift(smollm2_tokenizer):
    tok = smollm2_tokenizer
    head = [{"role": "user", "content": "Say hello."}]
    prompt = tok(tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    answer = "Hello there, friend."
    canonical = tok(answer, add_special_tokens=False)["input_ids"]
    messages = [*head, {"role": "assistant", "content": answer}]
    assert roundtrip_exact(messages, prompt, canonical, tok)
    # the same text as a non-canonical split (one token per character): the plan would tokenize it differently
    chars = [tok.convert_tokens_to_ids(c) for c in "Hello"] + canonical[1:]
    assert tok.decode(chars) == answer and chars != canonical
    assert not roundtrip_exact(messages, prompt, chars, tok)


def test_help_and_console_script_exit_status(tmp_path):
    import subprocess
    import sys

    result = CliRunner().invoke(main, ["regenerate", "--help"])
    assert result.exit_code == 0 and "--max-new-tokens" in result.stdout and "--force" in result.stdout
    assert "regenerate" in CliRunner().invoke(main, ["--help"]).stdout
    out = tmp_path / "o.jsonl"
    proc = subprocess.run([sys.executable, "-m", "artcache", "regenerate", "--out", str(out),
                           "--max-new-tokens", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("artcache: error: --max-new-tokens 0")
    assert list(tmp_path.iterdir()) == []


def test_regression_unwritable_out_is_refused_before_generating(tiny_target, data, tmp_path, monkeypatch):
    """Breakfix report: `artcache regenerate --out` on a read-only mount generated every answer, then died with
    an OSError traceback (EROFS, from the cleanup of the temp file it never created). An --out whose directory
    cannot be made (a parent that is a file) failed the same way after generation. Now: refused before
    generating; a write that still fails at the end is one line naming --out (exit 1)."""
    import errno
    import os

    import artcache.data.regenerate as R

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "o.jsonl"
    assert_bad(invoke(*regen_args(tiny_target, data, out)), str(out), "cannot be written")
    assert blocker.read_text() == "x"

    def erofs(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(R.os, "open", erofs)
    with pytest.raises(R.NotWritable, match="could not be written"):
        R.write_atomic(tmp_path / "o.jsonl", b"{}\n", force=False)
    assert leftovers(tmp_path) == []


def test_static_cache_gives_the_dynamic_answers(tiny_target, data, tmp_path):
    """``--cache static`` (one padded shape for every batch, a short last batch filled with copies) writes the
    same greedy answers as the dynamic cache (float32 on the CPU): the padding rows' answers are dropped and
    the longer left padding changes nothing a real token sees."""
    dyn = ok_summary(invoke(*regen_args(tiny_target, data, tmp_path / "dyn.jsonl", "--cache", "dynamic")))
    sta = ok_summary(invoke(*regen_args(tiny_target, data, tmp_path / "sta.jsonl", "--cache", "static")))
    assert (dyn["cache"], sta["cache"]) == ("dynamic", "static")
    assert dyn["samples"] == len(USABLE) and len(USABLE) % 3  # --batch-size 3: the last batch is padded
    assert (tmp_path / "sta.jsonl").read_bytes() == (tmp_path / "dyn.jsonl").read_bytes()
    auto = ok_summary(invoke(*regen_args(tiny_target, data, tmp_path / "auto.jsonl")))
    assert auto["cache"] == "dynamic"  # auto on the CPU


def _bar_text(monkeypatch, columns: int, draw) -> str:
    """What ``draw()`` shows on a pseudo-terminal of ``columns`` x 24 (0: one that reports no size) as stderr."""
    import fcntl
    import os
    import pty
    import struct
    import sys
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    tty = os.fdopen(slave, "w", encoding="utf-8")
    monkeypatch.setattr(sys, "stderr", tty)
    try:
        draw()
        tty.flush()
        os.set_blocking(master, False)
        chunks = []
        while True:
            try:
                chunks.append(os.read(master, 65536))
            except BlockingIOError:
                break
        return b"".join(chunks).decode(errors="replace")
    finally:
        monkeypatch.undo()
        tty.close()
        os.close(master)


@pytest.mark.parametrize("columns", [0, 100])
def test_regression_progress_bar_shows_on_a_terminal_that_reports_no_size(monkeypatch, columns):
    """``artcache regenerate`` showed no progress bar on a terminal that reports no size (0 x 0: ``script``,
    ``docker exec -t``, some CI terminals): tqdm sized the bar from the terminal and hid it. The consumer's bar
    (:class:`~artcache.trainers.tracking.Progress`) was hidden the same way. Both now draw on such a terminal."""
    from artcache.data.regenerate import _progress
    from artcache.trainers.tracking import Progress

    def regen():
        with _progress(4, True) as bar:
            bar.update(4)

    def consumer():
        p = Progress(3, 0, True, "dflash-0")
        for _ in range(3):
            p.update(1.0, 2.0, 0.1)
        p.close()

    text = _bar_text(monkeypatch, columns, regen)
    assert "regenerate: 100%" in text and "4/4" in text, repr(text)
    text = _bar_text(monkeypatch, columns, consumer)
    assert "dflash-0: 100%" in text and "3/3" in text, repr(text)
    assert _bar_text(monkeypatch, columns, lambda: _progress(4, False).close()) == ""  # --no-progress
