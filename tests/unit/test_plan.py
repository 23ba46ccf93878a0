from __future__ import annotations

import json
import time

import msgspec
import pytest
import torch

from artcache.errors import ConfigError, DataError
from artcache.plan import (
    Plan,
    PlanSpec,
    build_plan,
    choose_mask_token,
    ensure_plan,
    validate_mask_token,
)

V = 49152


def _write(tmp_path, convs, name="d.json"):
    recs = [{"id": str(i), "conversations": [{"from": f, "value": v} for f, v in c]} for i, c in enumerate(convs)]
    p = tmp_path / name
    p.write_text(json.dumps(recs))
    return p


CONVS = [
    [("human", "What is 2+2?"), ("gpt", "It is 4.")],
    [("system", "Be terse."), ("human", "Name a color."), ("gpt", "Blue."), ("human", "Another?"),
     ("gpt", "  Red, with spaces\n")],
    [("gpt", "I start the chunk with an answer."), ("human", "ok"), ("gpt", "Fine then.")],
    [("human", "a"), ("gpt", "assistant")],  # content equal to a role header word
    [("human", "only a question")],
    [],
]
# a content's leading whitespace merges with the header's newline into one (supervised) token
ASSISTANT = {0: ["It is 4."], 1: ["Blue.", "\n  Red, with spaces\n"], 2: ["I start the chunk with an answer.",
                                                                       "Fine then."], 3: ["assistant"]}


@pytest.fixture()
def small(tmp_path):
    return _write(tmp_path, CONVS)


def _spec(path, **kw):
    kw.setdefault("max_samples", 100)
    return PlanSpec(dataset=str(path), **kw)


def test_loss_mask_is_exactly_assistant_text(small, smollm2_tokenizer):
    tok = smollm2_tokenizer
    plan = build_plan(_spec(small), tok, target_vocab_size=V)
    assert len(plan) == 4
    counts = plan.provenance["counts"]
    assert counts["skipped"] == {"empty": 1, "no_assistant": 1}
    seen = set()
    for s in plan:
        assert s.input_ids.dtype == torch.int32 and s.loss_mask.dtype == torch.uint8
        masked = s.input_ids[s.loss_mask.bool()].tolist()
        for key, texts in ASSISTANT.items():
            if tok.decode(masked) == "".join(t + "<|im_end|>" for t in texts):
                seen.add(key)
        # unmasked tokens never include assistant content: the masked ids are the tokens of the contents
        assert tok.decode(s.input_ids.tolist()).count("<|im_end|>") >= int((s.input_ids[s.loss_mask.bool()] == 2).sum())
    assert seen == set(ASSISTANT)


def test_determinism_and_ids(small, smollm2_tokenizer):
    a = build_plan(_spec(small), smollm2_tokenizer, target_vocab_size=V)
    b = build_plan(_spec(small), smollm2_tokenizer, target_vocab_size=V)
    assert a.plan_id == b.plan_id and torch.equal(a.input_ids, b.input_ids) and torch.equal(a.offsets, b.offsets)
    ids = {a.plan_id}
    for kw in ({"seed": 1}, {"max_length": 64}, {"max_samples": 3}, {"min_loss_tokens": 3}):
        ids.add(build_plan(_spec(small, **kw), smollm2_tokenizer, target_vocab_size=V).plan_id)
    assert len(ids) == 5
    c = build_plan(_spec(small, seed=1), smollm2_tokenizer, target_vocab_size=V)
    assert sorted(c.sample(i).input_ids.tolist() for i in range(4)) == sorted(a.sample(i).input_ids.tolist()
                                                                            for i in range(4))
    # dataset content changes the id
    other = _write(small.parent, CONVS[:4], name="d.json")
    assert build_plan(_spec(other), smollm2_tokenizer, target_vocab_size=V).plan_id != a.plan_id


def test_truncation_max_samples_and_positions(small, smollm2_tokenizer):
    plan = build_plan(_spec(small, max_samples=2), smollm2_tokenizer, target_vocab_size=V)
    assert len(plan) == 2
    # position 5 is in epoch 2 (reshuffled by the plan's seed): the sample EpochOrder names
    order = plan.order()
    assert order.epoch(5) == 2 and plan.at_position(5).index == order.sample(5)
    assert plan.at_position(1).index == 1  # epoch 0: plan order
    with pytest.raises(IndexError):
        plan.sample(2)
    with pytest.raises(IndexError):
        plan.at_position(-1)
    short = build_plan(_spec(small, max_length=40), smollm2_tokenizer, target_vocab_size=V)
    assert all(len(s.input_ids) <= 40 for s in short) and short.provenance["counts"]["truncated"] > 0


def test_save_load_atomic(small, smollm2_tokenizer, tmp_path):
    plan = build_plan(_spec(small), smollm2_tokenizer, target_vocab_size=V)
    plans = tmp_path / "plans"
    d = plan.save(plans)
    assert d.name == plan.plan_id and sorted(p.name for p in d.iterdir()) == ["plan.json", "plan.safetensors"]
    mtime = (d / "plan.json").stat().st_mtime_ns
    assert plan.save(plans) == d and (d / "plan.json").stat().st_mtime_ns == mtime  # theirs is kept
    assert [p.name for p in plans.iterdir()] == [plan.plan_id]  # no temp dirs left
    loaded = Plan.load(d)
    assert loaded.plan_id == plan.plan_id and len(loaded) == len(plan)
    assert torch.equal(loaded.loss_mask, plan.loss_mask) and torch.equal(loaded.input_ids, plan.input_ids)
    prov = json.loads((d / "plan.json").read_text())
    for key in ("spec", "dataset_digest", "tokenizer_digest", "template_digest", "counts", "tokens", "read"):
        assert key in prov
    assert ensure_plan(_spec(small), smollm2_tokenizer, plans, V).plan_id == plan.plan_id


def test_load_detects_tampering(small, smollm2_tokenizer, tmp_path):
    d = build_plan(_spec(small), smollm2_tokenizer, target_vocab_size=V).save(tmp_path / "plans")
    prov = json.loads((d / "plan.json").read_text())
    prov["id_inputs"]["spec"]["seed"] = 99
    (d / "plan.json").write_text(json.dumps(prov))
    with pytest.raises(DataError, match="plan.json: its content does not match its recorded digest"):
        Plan.load(d)
    del prov["digests"]  # a plan saved before plans recorded digests: the id check still holds
    (d / "plan.json").write_text(json.dumps(prov))
    with pytest.raises(DataError, match="plan_id mismatch"):
        Plan.load(d)
    renamed = d.parent / ("0" * 40)
    prov["id_inputs"]["spec"]["seed"] = 0
    (d / "plan.json").write_text(json.dumps(prov))
    d.rename(renamed)
    with pytest.raises(DataError, match="directory"):
        Plan.load(renamed)
    with pytest.raises(DataError):
        Plan.load(tmp_path / "missing")


def test_ensure_plan_builds_once(small, smollm2_tokenizer, tmp_path):
    plans = tmp_path / "plans"
    a = ensure_plan(_spec(small), smollm2_tokenizer, plans, V)
    t0 = time.perf_counter()
    b = ensure_plan(_spec(small), smollm2_tokenizer, plans, V)
    assert a.plan_id == b.plan_id and torch.equal(a.input_ids, b.input_ids)
    assert time.perf_counter() - t0 < 5


def test_empty_result_raises(tmp_path, smollm2_tokenizer):
    p = _write(tmp_path, [[("human", "long question " * 50), ("gpt", "answer")], [("human", "q")]])
    with pytest.raises(DataError, match="0 of 2 conversations"):
        build_plan(_spec(p, max_length=32), smollm2_tokenizer, target_vocab_size=V)
    p2 = _write(tmp_path, [[("human", "q"), ("gpt", "")]], name="e.json")
    with pytest.raises(DataError, match="assistant tokens"):
        build_plan(_spec(p2, min_loss_tokens=2), smollm2_tokenizer, target_vocab_size=V)


def test_spec_validation(tmp_path, smollm2_tokenizer):
    for kw, accepted in (({"max_length": 15}, "an integer >= 16"), ({"max_samples": 0}, "an integer >= 1"),
                         ({"seed": -1}, "an integer >= 0 (0 or a positive integer)"),
                         ({"min_loss_tokens": 0}, "an integer >= 1")):
        [(name, value)] = kw.items()
        # issue 19: the ranges are declared on PlanSpec's fields and reported in the one style (they were a hand
        # check saying "plan max_samples=0 is invalid: accepted is an integer >= 1")
        with pytest.raises(ConfigError) as exc:
            PlanSpec(**kw)
        assert str(exc.value) == f"plan {name} {value} is invalid: accepted {accepted}"
    with pytest.raises(ConfigError, match=r"^plan seed: Expected `int`, got `bool`$"):
        PlanSpec(seed=True)
    assert PlanSpec(max_length=16, max_samples=1, seed=0, min_loss_tokens=1).max_length == 16
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"dataset": "sharegpt", "bogus": 1}, PlanSpec)
    with pytest.raises(ConfigError, match="nope"):
        build_plan(PlanSpec(dataset=str(tmp_path / "nope.json")), smollm2_tokenizer, target_vocab_size=V)


def test_vocab_mismatch(small, smollm2_tokenizer):
    with pytest.raises(ConfigError, match="vocab"):
        build_plan(_spec(small), smollm2_tokenizer, target_vocab_size=100)


def test_mask_token(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    plan = build_plan(_spec(_write(tmp_path, CONVS)), tok, target_vocab_size=V)
    assert choose_mask_token(tok, V, plan) == 16 == tok.convert_tokens_to_ids("<empty_output>")
    validate_mask_token(16, V, plan, tok)
    for bad in (-1, V, 2, 1, 0):
        with pytest.raises(ConfigError, match=str(bad)):
            validate_mask_token(bad, V, plan, tok)
    # a dataset that contains the marker literally: it is in the data, so another token is chosen
    dirty = build_plan(_spec(_write(tmp_path, [[("human", "x <empty_output> y"), ("gpt", "ok ok")]], "m.json")),
                       tok, target_vocab_size=V)
    with pytest.raises(ConfigError, match="16"):
        validate_mask_token(16, V, dirty, tok)
    assert choose_mask_token(tok, V, dirty) == 15
    with pytest.raises(ConfigError):
        choose_mask_token(tok, 3, None)


def test_real_sharegpt_plan(smollm2_target, smollm2_tokenizer, tmp_path):
    t0 = time.perf_counter()
    plan = build_plan(PlanSpec(), smollm2_tokenizer, target_vocab_size=smollm2_target.vocab_size)
    elapsed = time.perf_counter() - t0
    assert len(plan) == 2000 and elapsed < 60
    assert plan.provenance["read"]["bytes_dropped"] > 0
    lengths = plan.offsets.diff()
    assert int(lengths.max()) <= 512
    for i in range(0, 2000, 97):
        s = plan.sample(i)
        m = s.loss_mask.bool()
        assert bool((m[:-1] & m[1:]).any())
        # the header tokens of the assistant turn are never supervised
        assert smollm2_tokenizer.decode(s.input_ids[m].tolist()).count("<|im_start|>") == 0
    assert choose_mask_token(smollm2_tokenizer, smollm2_target.vocab_size, plan) == 16
    d = plan.save(tmp_path)
    assert Plan.load(d).plan_id == plan.plan_id


def test_regression_dropped_records_are_logged(tmp_path, smollm2_tokenizer):
    """A JSONL with a garbage line built a smaller plan without a word (only plan.json recorded it). A user's file
    is read strictly now: the line is refused by its number instead of dropped (only the embedded ShareGPT file,
    cut upstream, drops its tail, with a warning)."""
    good = {"id": "0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DataError, match=rf"data source file '{path}' line 2: not a JSON record"):
        build_plan(_spec(path), smollm2_tokenizer, target_vocab_size=V)
