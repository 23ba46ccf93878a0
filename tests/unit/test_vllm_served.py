"""The "served by vLLM" tooling: the serving-style replay walk, the per-block accepted counts behind
``replay_sums``, the held-out prompt reconstruction (plan order, not file order), the offline figure line and
``tests/support/vllm_spec_decode.py --prompts-file`` parsing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from artcache.bench.replay_served import walk
from artcache.trainers.draft import replay_accepted, replay_sums
from tests.support import SUPPORT


def test_walk_jumps_past_accepted_tokens():
    # positions 0..7 with accepted counts; the walk visits 0 (a=2) -> 3 (a=0) -> 4 (a=3) -> 8: stop
    drafts, total, per_pos = walk([2, 9, 9, 0, 3, 9, 9, 9])
    assert (drafts, total, per_pos) == (3, 5, [2, 2, 1])


def test_walk_is_the_harmonic_mean_on_alternating_runs():
    # a region of 1 + a = 4 followed by one of 1 + a = 1, each 4 positions long: the position mean is 2.5,
    # the walk visits the first region once and the second four times: 8 tokens in 5 drafts = 1.6, the
    # harmonic mean of 1 + a (8 / (4/4 + 4/1))
    acc = [3, 3, 3, 3, 0, 0, 0, 0]
    drafts, total, _ = walk(acc)
    assert 1 + total / drafts == pytest.approx(1.6)
    assert 1 + sum(acc) / len(acc) == pytest.approx(2.5)  # the offline (position) mean


def test_replay_accepted_is_what_replay_sums_counts():
    g = torch.Generator().manual_seed(0)
    N, K = 200, 7
    greedy = torch.randint(0, 3, (N, K), generator=g)
    preds = torch.where(torch.rand(N, K, generator=g) < 0.7, greedy, torch.randint(0, 3, (N, K), generator=g))
    ok = torch.rand(N, K, generator=g) < 0.95
    on_data = torch.rand(N, K, generator=g) < 0.9
    acc, trunc = replay_accepted(preds, greedy, ok, on_data)
    s = replay_sums(preds, greedy, ok, on_data)
    assert s.num["replay_tau"] == float((acc + 1).sum()) and s.den["replay_tau"] == N
    assert s.num["replay_truncated"] == float(trunc.sum())
    assert int(acc.sum()) > 0 and int(acc.max()) <= K
    # a walk is the longest accepted prefix
    for i in range(N):
        m = ((preds[i] == greedy[i]) & ok[i]).tolist()
        lead = next((k for k, v in enumerate(m) if not v), K)
        assert int(acc[i]) <= lead


def _spec_decode():
    spec = importlib.util.spec_from_file_location("vllm_spec_decode", SUPPORT / "vllm_spec_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports vLLM only inside main()
    return mod


def test_prompts_file_accepts_strings_messages_and_the_heldout_object(tmp_path):
    mod = _spec_decode()
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["hi", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]))
    msgs, rec = mod.load_prompts_file(str(f))
    assert msgs == [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"},
                                                           {"role": "user", "content": "u"}]] and rec is None
    f.write_text(json.dumps({"prompts": ["hi"], "prompt_token_ids": [[1, 2]]}))
    assert mod.load_prompts_file(str(f)) == ([[{"role": "user", "content": "hi"}]], [[1, 2]])


@pytest.mark.parametrize("bad", [[], {"prompts": 3}, [3], [[{"role": "user"}]],
                                 {"prompts": ["a"], "prompt_token_ids": []}])
def test_prompts_file_bad_input_exits_2(tmp_path, bad):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(SystemExit) as e:
        _spec_decode().load_prompts_file(str(f))
    assert e.value.code == 2


def _sharegpt_xz(tmp_path, n: int) -> tuple[Path, list[dict]]:
    """``n`` one-turn ShareGPT records as an xz JSONL file; every 5th from the 3rd has no user turn before
    the assistant's (regenerate skips it)."""
    import lzma

    recs = []
    for i in range(n):
        conv = [{"from": "human", "value": f"question {i}?"}, {"from": "gpt", "value": f"answer {i}."}]
        if i % 5 == 2:
            conv = conv[1:]  # no user before the assistant: skipped
        recs.append({"id": f"r{i}", "conversations": conv})
    src = tmp_path / "sharegpt.jsonl.xz"
    with lzma.open(src, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return src, recs


def test_heldout_prompts_are_the_plans_last_samples(tmp_path, smollm2_target):
    """The held-out split is the plan's last E samples; the plan of the regenerated file (one source) visits its
    records in a default_rng([seed, 0]) permutation and shuffles them with default_rng(seed), so the prompts are the
    selected ones at that order's last E (not the file's last E). Checked against build_plan on a
    regenerated-style file of the same prompts."""

    from artcache.bench.heldout_prompts import main as heldout_main
    from artcache.plan import PlanSpec, build_plan
    from artcache.target import load_tokenizer

    tok = load_tokenizer(smollm2_target)
    src, recs = _sharegpt_xz(tmp_path, 14)
    n_lines, kept = 12, [r for r in recs[:12] if r["conversations"][0]["from"] == "human"]
    summary = tmp_path / "regenerate.jsonl"
    prompt_tokens = sum(len(tok(tok.apply_chat_template([{"role": "user", "content": r["conversations"][0]["value"]}],
                                                        tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"]) for r in kept)
    summary.write_text(json.dumps({"samples": len(kept), "visited": n_lines,
                                   "skipped": {"no_user_before_assistant": n_lines - len(kept)},
                                   "prompt_tokens": prompt_tokens}) + "\n")
    out = tmp_path / "held.json"
    args = ["--sharegpt", str(src), "--shard-lines", str(n_lines), "--target", smollm2_target.path,
            "--regenerate-summary", str(summary), "--plan-len", str(len(kept)), "--eval-samples", "3",
            "--out", str(out)]
    assert heldout_main(args) == 0
    held = json.loads(out.read_text())
    # the plan of the regenerated file (same records, answers kept), its last 3 samples
    regen = tmp_path / "regen.jsonl"
    regen.write_text("".join(json.dumps(r) + "\n" for r in kept))
    plan = build_plan(PlanSpec(dataset=str(regen), max_length=256, max_samples=1000), tok,
                      target_vocab_size=len(tok))
    for i, p in zip(range(len(kept) - 3, len(kept)), held["prompt_token_ids"], strict=True):
        sample = plan.sample(i)
        assert sample.input_ids[:len(p)].tolist() == p and not bool(sample.loss_mask[:len(p)].any())
        assert bool(sample.loss_mask[len(p)])  # the answer starts right after the rendered prompt
    order = np.random.default_rng([0, 0]).permutation(len(kept))[np.random.default_rng(0).permutation(len(kept))]
    assert held["record_ids"] == [kept[i]["id"] for i in order[-3:]]
    assert held["provenance"]["plan_order"] == "source"
    assert held["record_ids"] != [r["id"] for r in kept[-3:]]  # plan order, not file order
    # a summary that does not match: exit 1, nothing written
    summary.write_text(json.dumps({"samples": len(kept) + 1, "visited": n_lines, "skipped": {},
                                   "prompt_tokens": 0}) + "\n")
    out.unlink()
    assert heldout_main(args) == 1 and not out.exists()


def test_heldout_prompts_sums_shard_summaries(tmp_path, smollm2_target):
    """A run regenerated in consecutive shards has one summary line per shard: the lines are summed and
    checked against one selection over all the shards' lines (the same held-out prompts as one summary line
    of the same totals); a shard that stopped at --max-samples (visited < records) exits 2, nothing written."""

    from artcache.bench.heldout_prompts import main as heldout_main
    from artcache.target import load_tokenizer

    tok = load_tokenizer(smollm2_target)
    src, recs = _sharegpt_xz(tmp_path, 12)

    def shard_summary(shard: list[dict], visited: int | None = None) -> dict:
        kept = [r for r in shard if r["conversations"][0]["from"] == "human"]
        tokens = sum(len(tok(tok.apply_chat_template([{"role": "user", "content": r["conversations"][0]["value"]}],
                                                     tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]) for r in kept)
        return {"samples": len(kept), "records": len(shard), "visited": len(shard) if visited is None else visited,
                "skipped": {"no_user_before_assistant": len(shard) - len(kept)}, "prompt_tokens": tokens}

    shards = [shard_summary(recs[:6]), shard_summary(recs[6:])]
    plan_len = shards[0]["samples"] + shards[1]["samples"]
    summary = tmp_path / "regenerate.jsonl"
    out = tmp_path / "held.json"
    args = ["--sharegpt", str(src), "--shard-lines", "12", "--max-samples", "12", "--target", smollm2_target.path,
            "--regenerate-summary", str(summary), "--plan-len", str(plan_len), "--eval-samples", "3",
            "--out", str(out)]
    one = shard_summary(recs)
    summary.write_text(json.dumps(one) + "\n")
    assert heldout_main(args) == 0
    single = json.loads(out.read_text())
    out.unlink()
    summary.write_text("".join(json.dumps(s) + "\n" for s in shards))
    assert heldout_main(args) == 0
    summed = json.loads(out.read_text())
    assert summed["record_ids"] == single["record_ids"] and summed["prompt_token_ids"] == single["prompt_token_ids"]
    assert summed["provenance"]["selection"] == {k: one[k] for k in ("samples", "visited", "skipped",
                                                                     "prompt_tokens")}
    # wrong per-shard counts still fail the check
    summary.write_text("".join(json.dumps(s) + "\n" for s in [shards[0], {**shards[1], "samples": 1}]))
    out.unlink()
    assert heldout_main(args) == 1 and not out.exists()
    # a shard cut by its --max-samples: its selection is not the whole-file selection's, unusable input (exit 2)
    summary.write_text("".join(json.dumps(s) + "\n" for s in [{**shards[0], "visited": 5}, shards[1]]))
    assert heldout_main(args) == 2 and not out.exists()


_SUMMARY_LINE = {"samples": 6, "records": 6, "visited": 6, "skipped": {}, "prompt_tokens": 60}


def _heldout_bad(tmp_path, capsys, summary: str | None = None, **flags) -> tuple[int, str]:
    """heldout_prompts over a 12-record shard with ``flags`` overriding (``shard_lines`` -> ``--shard-lines``) and
    ``summary`` as the summary file's text: (exit status, stderr); asserts nothing was written to ``--out``. The
    target defaults to a path that does not exist: what is refused before it is loaded needs none."""
    from artcache.bench.heldout_prompts import main as heldout_main

    src, _recs = _sharegpt_xz(tmp_path, 12)
    (tmp_path / "summary.jsonl").write_text(json.dumps(_SUMMARY_LINE) + "\n" if summary is None else summary)
    args = {"sharegpt": str(src), "shard_lines": "12", "target": "/unused/target", "regenerate_summary":
            str(tmp_path / "summary.jsonl"), "plan_len": "12", "eval_samples": "3", "out": str(tmp_path / "held.json")}
    args.update(flags)
    code = heldout_main([x for k, v in args.items() for x in (f"--{k.replace('_', '-')}", v)])
    assert not Path(args["out"]).exists() and not (tmp_path / "held.json").exists()
    return code, capsys.readouterr().err


_BAD_INPUT = [
    ("summary line not JSON", "{not json\n", {}, ["--regenerate-summary", "line 1: JSON is malformed", "accepted:"]),
    ("summary missing a field", json.dumps({"samples": 6}) + "\n", {},
     ["line 1: Object missing required field `visited`", "accepted:"]),
    ("summary negative count", json.dumps({**_SUMMARY_LINE, "samples": -1}) + "\n", {}, ["line 1:", ">= 0"]),
    ("shard summaries without records", "".join(json.dumps({k: v for k, v in _SUMMARY_LINE.items() if k != "records"})
                                                 + "\n" for _ in range(2)), {},
     ["line 1: no records (needed to sum shards)"]),
    ("missing summary file", None, {"regenerate_summary": "no-such-summary.jsonl"},
     ["--regenerate-summary 'no-such-summary.jsonl': cannot read it (No such file"]),
    ("missing sharegpt file", None, {"sharegpt": "no-such.jsonl.xz"}, ["--sharegpt 'no-such.jsonl.xz': no such file"]),
    ("corrupt xz", None, {"sharegpt": "CORRUPT"}, ["--sharegpt", "cannot read its first 12 lines"]),
    ("missing target", None, {"target": "/no/such/target"}, ["unknown target '/no/such/target'", "accepted"]),
    ("out in a missing directory", None, {"out": "/no/such/dir/held.json"},
     ["--out '/no/such/dir/held.json': its directory '/no/such/dir' does not exist", "accepted"]),
    ("eval samples = plan length", None, {"eval_samples": "12"},
     ["--eval-samples 12 leaves no training sample", "accepted: 1 .. 11"]),
    ("eval samples > plan length", None, {"eval_samples": "13"}, ["--eval-samples 13", "accepted: 1 .. 11"]),
]


@pytest.mark.parametrize(("case", "summary", "flags", "needles"), _BAD_INPUT, ids=[c[0] for c in _BAD_INPUT])
def test_regression_heldout_prompts_bad_input_is_one_line_exit_2(tmp_path, smollm2_target, capsys, case, summary,
                                                                 flags, needles):
    """A summary line that is not JSON or lacks a field, a missing input file, --out in a missing
    directory, --eval-samples >= --plan-len each gave a Python traceback (exit 1), some after the tokenizer had
    loaded. Each is one line naming the value and what is accepted, exit 2, nothing written."""
    if flags.get("sharegpt") == "CORRUPT":
        (tmp_path / "bad.jsonl.xz").write_bytes(b"\xfd7zXZ\x00not xz at all")
        flags = {**flags, "sharegpt": str(tmp_path / "bad.jsonl.xz")}
    code, err = _heldout_bad(tmp_path, capsys, summary, **{"target": smollm2_target.path, **flags})
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("heldout_prompts: error: "), (case, err)
    assert all(n in lines[0] for n in needles), (case, lines[0])


@pytest.mark.parametrize(("flag", "value", "accepted"), [
    ("shard_lines", "0", "an integer >= 1"), ("shard_lines", "-3", "an integer >= 1"),
    ("max_samples", "0", "an integer >= 1"), ("max_prompt_tokens", "0", "an integer >= 1"),
    ("plan_len", "0", "an integer >= 1"), ("eval_samples", "0", "an integer >= 1"),
    ("plan_seed", "-1", "an integer >= 0")])
def test_regression_heldout_prompts_refuses_flags_outside_their_declared_range(tmp_path, capsys, flag, value,
                                                                               accepted):
    """--shard-lines 0 was accepted (an empty shard); --plan-seed -1 gave numpy's traceback. Every
    count flag is declared (heldout_prompts.RANGES) and refused with the range's one line, before the target
    is loaded (no target needed here)."""
    code, err = _heldout_bad(tmp_path, capsys, **{flag: value})
    name = f"--{flag.replace('_', '-')}"
    assert code == 2 and err.strip() == f"heldout_prompts: error: {name} {value} is invalid: accepted {accepted}" \
        + (" (0 or a positive integer)" if accepted.endswith(">= 0") else ""), err


def test_regression_heldout_prompts_visited_more_than_records_is_not_called_a_max_samples_stop(tmp_path, capsys):
    """A summary line with visited > records was reported as "the shard stopped at --max-samples
    (visited 7 of 6 records)": a stop visits fewer records, never more. It is a summary regenerate cannot have
    written, and the line says so (one line or several); a real stop (visited < records) keeps its message."""
    over = json.dumps({**_SUMMARY_LINE, "visited": 7}) + "\n"
    for text in (over, over + json.dumps(_SUMMARY_LINE) + "\n"):
        code, err = _heldout_bad(tmp_path, capsys, text)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "line 1: visited 7 is more than its 6 records" in err and "not a summary regenerate wrote" in err
        assert "stopped at --max-samples" not in err
    stop = json.dumps({**_SUMMARY_LINE, "visited": 5}) + "\n" + json.dumps(_SUMMARY_LINE) + "\n"
    code, err = _heldout_bad(tmp_path, capsys, stop)
    assert code == 2 and "line 1: the shard stopped at --max-samples (visited 5 of 6 records)" in err, err


def test_regression_heldout_prompts_out_on_a_full_disk_is_one_line(tmp_path, smollm2_target, capsys, monkeypatch,
                                                                   full_temp_writes):
    """An --out on a full filesystem gave atomic_write's PublishError as a traceback, after the
    selection had been made. It is one line naming --out and the full path, exit 1, nothing written (no temp
    file left beside it either)."""


    from artcache.target import load_tokenizer

    tok = load_tokenizer(smollm2_target)
    _src, recs = _sharegpt_xz(tmp_path, 12)
    kept = [r for r in recs if r["conversations"][0]["from"] == "human"]
    tokens = sum(len(tok(tok.apply_chat_template([{"role": "user", "content": r["conversations"][0]["value"]}],
                                                 tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]) for r in kept)
    summary = json.dumps({"samples": len(kept), "visited": 12, "skipped": {"no_user_before_assistant": 12 - len(kept)},
                          "prompt_tokens": tokens}) + "\n"
    full_temp_writes()
    code, err = _heldout_bad(tmp_path, capsys, summary, target=smollm2_target.path, plan_len=str(len(kept)))
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0] == (f"heldout_prompts: error: --out {str(tmp_path / 'held.json')!r}: writing "
                        f"{tmp_path / 'held.json'} failed: No space left on device")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def test_regression_the_printed_offline_figure_names_what_the_metrics_hold():
    """Regression: a draft evaluated without the target's last layer (no ``replay_tau``) was printed as
    "offline held-out replay tau nan"; its data-token τ is printed, named as such."""
    from artcache.bench.vllm_served import offline_line

    assert offline_line({"step": 10, "replay_tau": 2.5, "tau": 2.6}) == \
        "offline held-out replay tau 2.500 (incl. +1 bonus, step 10)"
    line = offline_line({"step": 10000, "tau": 3.7238, "loss": 3.1})
    assert "tau on the data tokens (no replay evaluated) 3.724" in line and "nan" not in line
    assert "no offline held-out tau at step 7" in offline_line({"step": 7, "loss": 1.0})
    assert "no --metrics" in offline_line(None)
