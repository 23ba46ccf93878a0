"""The "served by vLLM" tooling: the serving-style replay walk, the per-block accepted counts behind
``replay_sums``, the offline figure line and ``tests/vllm_spec_decode.py --prompts-file`` parsing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from artcache.bench.replay_served import walk
from artcache.trainers.draft import replay_accepted, replay_sums


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
    spec = importlib.util.spec_from_file_location("vllm_spec_decode", Path(__file__).with_name("vllm_spec_decode.py"))
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
