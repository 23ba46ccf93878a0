"""Draft adapters: layer views over a root's captured layers, metric sums, greedy acceptance replay, the
held-out split, and both drafts behind one interface on the tiny target."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from artcache.errors import ConfigError, ContractMismatch
from artcache.layer_ids import check_layer_ids, layer_view, select_layers, view_slice
from artcache.trainers.dflash.adapter import greedy_replay
from artcache.trainers.draft import DraftBatch, MetricSums, replay_sums
from artcache.trainers.evaluation import epoch_steps, eval_split
from tests.support import TINY_SHAREGPT

# ---- layer views ---------------------------------------------------------------------------------


def test_layer_view_indexes_a_superset_in_the_drafts_order():
    captured = [1, 2, 3, 5, 8]
    assert layer_view(captured, [1, 3], draft="d", flag_hint="") == [0, 2]
    assert layer_view(captured, [8, 1], draft="d", flag_hint="") == [4, 0]  # the draft's own order
    assert layer_view(captured, [1, 2, 2, 5], draft="d", flag_hint="") == [0, 1, 1, 3]  # repeats allowed


def test_layer_view_missing_layer_names_the_producer_flag():
    with pytest.raises(ContractMismatch) as err:
        layer_view([1, 3], [1, 2, 3, 5], draft="an EAGLE-3 draft", flag_hint="")
    msg = str(err.value)
    assert "missing [2, 5]" in msg and "captures [1, 3]" in msg and "--layer-ids 1,2,3,5" in msg


@pytest.mark.parametrize("ids, unique, needles", [
    ([], False, ["--layer-ids x: no layer id given", "0..5"]),
    ([1, "2"], False, ["['2'] are not integers", "0..5"]),
    ([1, True], False, ["[True] are not integers"]),
    ([1, 6, -1], False, ["[6, -1] are not output-of-layer ids of a 6-layer target ('t')", "accepted: 0..5"]),
    ([1, 1, 3, 3], True, ["--layer-ids x captures layer(s) [1, 3] more than once", "list each captured id once"]),
])
def test_check_layer_ids_refuses_in_one_line(ids, unique, needles):
    with pytest.raises(ConfigError) as err:
        check_layer_ids(ids, 6, "--layer-ids x", target="t", unique=unique)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--layer-ids x")
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_check_layer_ids_a_view_may_repeat_an_id():
    assert check_layer_ids((1, 2, 2, 5), 6, "view") == [1, 2, 2, 5]  # EAGLE-3 on a 6-layer target


def test_regression_one_home_for_the_layer_id_check():
    """The capture backend kept its own copy of the range check (another message, no int check)."""
    import artcache.backends.hf as hf

    assert hf.check_layer_ids is check_layer_ids


def test_view_slice_is_a_view_when_contiguous_and_a_copy_otherwise():
    hidden = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).reshape(2, 3, 5, 4)
    sel = view_slice([1, 2, 3])
    assert sel == slice(1, 4)
    out = select_layers(hidden, sel)
    assert out.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()  # no copy
    assert torch.equal(out, hidden[:, :, 1:4])
    sel = view_slice([3, 0, 0])
    assert isinstance(sel, torch.Tensor)
    assert torch.equal(select_layers(hidden, sel), hidden[:, :, [3, 0, 0]])


def test_union_capture_views_equal_solo_captures(tiny_target):
    """One capture of the union of two drafts' layers, sliced per draft, gives exactly the tensors a
    capture of each draft's own layers would (layer union)."""
    from artcache.backends.hf import HFCaptureBackend
    from artcache.contract import CaptureContract
    from artcache.target import load_target_model

    model = load_target_model(tiny_target, "cpu", torch.float32)

    def contract(ids):
        return CaptureContract(target_name="t", target_revision="r", target_config_hash="c",
                               target_weights_digest="w", layer_ids=tuple(ids), max_length=64,
                               tokenizer_digest="t", template_digest="t")

    g = torch.Generator().manual_seed(0)
    samples = [SimpleNamespace(input_ids=torch.randint(0, 49000, (n,), generator=g, dtype=torch.int32),
                               loss_mask=torch.ones(n, dtype=torch.uint8)) for n in (17, 9)]
    def capture(ids):
        backend = HFCaptureBackend(model, contract(ids))
        try:
            return backend.capture(samples)
        finally:
            backend.close()  # its hooks stop the forward at its deepest layer: never leave them on the model

    union = [1, 2, 3, 5]
    got = capture(union)
    for need in ([1, 3], [1, 2, 2, 5], [2, 3]):  # a 2-layer DFlash, EAGLE-3 (L=6), another DFlash
        solo = capture(sorted(set(need)))
        sel = view_slice(layer_view(union, need, draft="d", flag_hint=""))
        for u, s in zip(got, solo, strict=True):
            want = s["hidden_states"][:, [sorted(set(need)).index(i) for i in need]]
            assert torch.equal(select_layers(u["hidden_states"], sel), want), need


def test_collate_applies_the_view_without_copying_a_batch_of_one():
    from artcache.store import Artifact
    from artcache.trainers.consumer.reader import collate

    @dataclass
    class L:
        position: int
        artifact: Artifact
        lease: str = ""

    hs = torch.randn(6, 4, 8).bfloat16()
    art = Artifact("f" * 40, hs, torch.arange(6, dtype=torch.int32), torch.ones(6, dtype=torch.uint8), 0, {})
    b = collate([L(0, art)], torch.device("cpu"), view_slice([1, 2]), last_layer=3)
    assert b.hidden.shape == (1, 6, 2, 8)
    assert b.hidden.untyped_storage().data_ptr() == hs.untyped_storage().data_ptr()
    assert torch.equal(b.last_layer[0], hs[:, 3]) and b.positions == (0,)
    art2 = Artifact("e" * 40, torch.randn(4, 4, 8).bfloat16(), torch.arange(4, dtype=torch.int32),
                    torch.ones(4, dtype=torch.uint8), 0, {})
    b = collate([L(0, art), L(1, art2)], torch.device("cpu"), view_slice([3, 0]))
    assert torch.equal(b.hidden[1, :4], art2.hidden_states[:, [3, 0]]) and not b.hidden[1, 4:].any()
    assert b.valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]


# ---- metric sums and replay ----------------------------------------------------------------------


def test_metric_sums_divide_once():
    a, b = MetricSums(), MetricSums()
    a.add("acc_1", 1, 1)  # 100 % of 1
    b.add("acc_1", 1, 9)  # 11 % of 9
    s = a + b
    assert s.ratio("acc_1") == pytest.approx(0.2)  # 2 / 10, not the mean of ratios (0.556)
    assert MetricSums().ratio("acc_1") is None  # nothing measured: no figure (was NaN)


def test_replay_sums_hand_example():
    # 4 blocks of K = 3 proposals
    preds = torch.tensor([[5, 6, 7], [5, 9, 7], [5, 6, 7], [1, 6, 7]])
    greedy = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    ok = torch.ones(4, 3, dtype=torch.bool)
    on_data = torch.ones(4, 3, dtype=torch.bool)
    on_data[2, 0] = False  # block 2: the target's greedy token 5 is not the data token: path leaves the data
    s = replay_sums(preds, greedy, ok, on_data)
    # accepted: 3, 1, 1 (then unknown: truncated), 0 -> τ = (4 + 2 + 2 + 1) / 4, bonus included
    assert s.ratio("replay_tau") == pytest.approx(9 / 4)
    assert s.ratio("replay_truncated") == pytest.approx(1 / 4)
    ok[0, 1] = False  # an unsupervised position ends the block: not a truncation
    s = replay_sums(preds, greedy, ok, on_data)
    assert s.ratio("replay_tau") == pytest.approx((2 + 2 + 2 + 1) / 4)


def test_dflash_greedy_replay_against_target_argmax():
    """A fake draft whose lm_head is the identity: the hidden state of slot k is the one-hot of its proposal."""
    V = 10

    class Fake:
        def logits(self, h):
            return h @ torch.eye(V)

    ids = torch.tensor([[0, 1, 2, 3, 4, 5]])
    argmax = torch.tensor([[1, 2, 9, 4, 5, 6]])  # the target agrees with the data except after x_2 (9 != 3)
    proposals = {0: [0, 1, 2, 9], 2: [2, 9, 4, 5]}  # anchors 0 and 2, B = 4 (slot 0 = the anchor token)
    anchors = torch.tensor([[0, 2]])
    out = torch.stack([torch.nn.functional.one_hot(torch.tensor(proposals[a]), V).float()
                       for a in (0, 2)])[None]  # [1, N=2, B=4, V]
    sup = torch.ones(1, 6, dtype=torch.bool)
    s = greedy_replay(Fake(), out, ids, sup, anchors, argmax)
    # anchor 0: g_1 = argmax[0] = 1 (accept; 1 == x_1 on data), g_2 = 2 (accept; == x_2), g_3 = argmax[2] = 9
    #   (accept) -> 3 accepted, τ 4. anchor 2: g_1 = argmax[2] = 9 (accept) but 9 != x_3: the greedy path
    #   leaves the data with slots left -> 1 accepted, truncated, τ 2.
    assert s.ratio("replay_tau") == pytest.approx((4 + 2) / 2)
    assert s.ratio("replay_truncated") == pytest.approx(1 / 2)


# ---- the held-out split --------------------------------------------------------------------------


def test_eval_split_and_epoch_steps():
    assert eval_split(40, 0) == (0, 0)  # off: training walks the whole plan, epoch after epoch
    assert eval_split(40, 8) == (32, 40)  # the last 8; training walks the first 32, any number of epochs
    with pytest.raises(ConfigError, match="--eval-samples 40 leaves no training sample"):
        eval_split(40, 40)
    assert epoch_steps(3, 32, 2) == 48 and epoch_steps(1, 33, 2) == 16  # a last partial batch is not taken
    with pytest.raises(ConfigError, match="--epochs 1 over 3 training samples is not one batch of 4"):
        epoch_steps(1, 3, 4)


# ---- both drafts on the tiny target --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory, tiny_target):
    from artcache.layout import CacheLayout
    from artcache.plan import Plan
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.settings import load_settings

    path = tmp_path_factory.mktemp("drafts-root") / "cache"
    data = TINY_SHAREGPT
    prepare_root(ProducerConfig(cache=str(path), target=tiny_target.path, dataset=str(data), max_samples=40,
                                max_length=128, layer_ids=[1, 2, 3, 5]))
    layout = CacheLayout(path)
    settings = load_settings(layout)
    return settings, Plan.load(layout.plan_dir(settings.plan_id))


def batch_for(plan, m: int, H: int = 64) -> DraftBatch:
    s = plan.sample(0)
    T = s.input_ids.shape[0]
    g = torch.Generator().manual_seed(0)
    return DraftBatch(torch.randn(1, T, m, H, generator=g), s.input_ids.long()[None], s.loss_mask.bool()[None],
                      torch.ones(1, T, dtype=torch.bool), (0,))


@pytest.mark.parametrize("draft", ["dflash", "eagle3"])
def test_both_drafts_behind_one_interface(tiny_root, draft):
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.draft import build_draft

    pytest.importorskip("artcache.trainers.eagle3")
    settings, plan = tiny_root
    cfg = ConsumerConfig(cache="-", draft=draft, block_size=4, num_anchors=8, draft_vocab=500, ttt_steps=3,
                         eval_samples=4)
    d = build_draft(cfg, settings, plan, torch.device("cpu"))
    want = {"dflash": (1, 2, 3), "eagle3": (1, 2, 2, 5)}[draft]
    assert d.needed_layer_ids == want
    batch = batch_for(plan, len(want))
    loss, sums = d.loss(batch)
    loss.backward()
    assert math.isfinite(loss.item())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in d.model.parameters())
    summary = d.summary(sums)
    assert summary["loss"] == pytest.approx(loss.item(), rel=1e-4)
    fields = d.journal_fields(sums)
    assert len(fields["acc_correct"]) == len(fields["acc_total"])
    ev = d.evaluate(batch, None)
    es = d.summary(ev)
    if draft == "dflash":
        # every eligible anchor is a block; no target argmax given: no replay
        assert es["blocks"] == int((batch.loss_mask[0, :-1] & batch.loss_mask[0, 1:]).sum())
        assert "replay_tau" not in es and 1.0 <= es["tau"] <= 4.0
    else:
        # the EAGLE-3 draft computes the target's argmax from its own L-1 layer: always a replay
        assert 1.0 <= es["replay_tau"] <= 4.0 and 0.0 <= es["sim_acc_len"] <= 3.0
        assert d.model.d2t.numel() == 500 and int(d.model.t2d.sum()) == 500
        # the vocab map comes from the training samples only (the held-out split is left out)
        from artcache.trainers.eagle3 import build_vocab_map, count_plan_tokens
        from artcache.trainers.eagle3.adapter import TrainingTokens

        d2t, _ = build_vocab_map(count_plan_tokens(TrainingTokens(plan, len(plan) - 4), 49152), 500)
        assert torch.equal(d.model.d2t.cpu(), d2t)


def test_evenly_spaced_anchor_subset():
    from artcache.trainers.dflash.adapter import evenly_spaced

    pos = torch.arange(10, 30)
    assert torch.equal(evenly_spaced(pos, 0), pos) and torch.equal(evenly_spaced(pos, 25), pos)
    assert evenly_spaced(pos, 1).tolist() == [10]
    assert evenly_spaced(pos, 2).tolist() == [10, 29]
    five = evenly_spaced(pos, 5).tolist()
    assert five == [10, 15, 20, 24, 29] and len(set(five)) == 5
    for k in range(1, 21):  # distinct, ordered, deterministic
        sub = evenly_spaced(pos, k).tolist()
        assert len(sub) == k and sub == sorted(set(sub)) and sub == evenly_spaced(pos, k).tolist()


def test_dflash_eval_anchors_caps_blocks_per_sample(tiny_root):
    """--eval-anchors k evaluates k blocks per held-out sample (the full pass cost minutes per eval on CPU)."""
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.draft import build_draft

    settings, plan = tiny_root
    full = build_draft(ConsumerConfig(cache="-", block_size=4, num_anchors=8), settings, plan, torch.device("cpu"))
    capped = build_draft(ConsumerConfig(cache="-", block_size=4, num_anchors=8, eval_anchors=5), settings, plan,
                         torch.device("cpu"))
    capped.model.load_state_dict(full.model.state_dict())
    batch = batch_for(plan, 3)
    eligible = int((batch.loss_mask[0, :-1] & batch.loss_mask[0, 1:]).sum())
    assert eligible > 5
    assert full.summary(full.evaluate(batch, None))["blocks"] == eligible
    assert capped.summary(capped.evaluate(batch, None))["blocks"] == 5
    with pytest.raises(ConfigError, match="--eval-anchors -1"):
        ConsumerConfig(cache="-", eval_anchors=-1).validate()


def test_eagle3_summary_is_computed_from_sums(tiny_root):
    from artcache.trainers.eagle3.adapter import Eagle3Adapter

    pytest.importorskip("artcache.trainers.eagle3")
    a = Eagle3Adapter(None, SimpleNamespace(ttt_steps=2, loss_decay=0.5), (1, 2, 2, 5))
    s = MetricSums()
    s.add("loss_0", 4.0, 2)
    s.add("loss_1", 3.0, 1)
    s.add("acc_1", 1, 2)
    s.add("acc_2", 1, 4)
    out = a.summary(s)
    assert out["loss"] == pytest.approx(2.0 + 0.5 * 3.0)
    assert out["acc"] == [0.5, 0.25]
    assert out["sim_acc_len"] == pytest.approx(0.5 + 0.5 * 0.25) and out["sim_acc_len_includes_bonus"] is False
    assert out["coverage"] == pytest.approx(3 / 6)


def test_explicit_layer_ids_replace_the_formula(tiny_root):
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.draft import build_draft

    settings, plan = tiny_root  # captures [1, 2, 3, 5]
    d = build_draft(ConsumerConfig(cache="-", layer_ids=[5, 1], draft_layers=1), settings, plan, torch.device("cpu"))
    assert d.needed_layer_ids == (5, 1) and d.dcfg.num_context_layers == 2 and d.dcfg.num_layers == 1
    with pytest.raises(ContractMismatch, match=r"missing \[4\].*--layer-ids 1,2,3,4,5"):
        build_draft(ConsumerConfig(cache="-", layer_ids=[4]), settings, plan, torch.device("cpu"))
    with pytest.raises(ConfigError, match="0..5"):
        build_draft(ConsumerConfig(cache="-", layer_ids=[6]), settings, plan, torch.device("cpu"))
    pytest.importorskip("artcache.trainers.eagle3")
    e = build_draft(ConsumerConfig(cache="-", draft="eagle3", layer_ids=[1, 2, 3, 5], draft_vocab=100), settings,
                    plan, torch.device("cpu"))
    assert e.needed_layer_ids == (1, 2, 3, 5)
    with pytest.raises(ConfigError, match="then the last layer 5"):
        build_draft(ConsumerConfig(cache="-", draft="eagle3", layer_ids=[1, 2, 3]), settings, plan,
                    torch.device("cpu"))


def test_regression_evaluation_stops_between_batches_on_a_signal():
    """SIGTERM during an evaluation pass was honoured only after the whole pass (minutes on a CPU):
    the evaluator now checks the stop event before every batch and withdraws its announced demand."""
    import threading

    from artcache.trainers.evaluation import Evaluator

    class Client:
        def __init__(self):
            self.wanted, self.unwanted, self.acquired = [], [], []

        def want_samples(self, samples):  # the held-out split is read by sample index
            self.wanted = list(samples)
            return self.wanted

        def unwant(self, samples, held_out=False):
            assert held_out
            self.unwanted = list(samples)

        def acquire_sample(self, p, stop=None):
            self.acquired.append(p)
            raise AssertionError("acquired after the stop request")

        def release(self, item):
            pass

    draft = SimpleNamespace(model=torch.nn.Linear(1, 1))
    stop = threading.Event()
    stop.set()
    client = Client()
    ev = Evaluator(draft, client, range(10, 14), 2, collate=None, target_argmax=None, stop=stop)
    with pytest.raises(InterruptedError, match="stopped during evaluation"):
        ev.run()
    assert client.acquired == [] and client.wanted == client.unwanted == [10, 11, 12, 13]
    assert draft.model.training  # train mode restored


# ---- the held-out figures each draft declares (--best-metric) -------------------------------------


class _SplitClient:
    """The cache client an :class:`~artcache.trainers.evaluation.Evaluator` reads the split through (no root)."""

    def want_samples(self, samples):
        return list(samples)

    def unwant(self, samples, held_out=False):
        pass

    def acquire_sample(self, p, stop=None):
        return p

    def release(self, item):
        pass


@pytest.mark.parametrize("draft", ["dflash", "eagle3", "dspark"])
def test_regression_declared_eval_figures_equal_a_real_evaluation(tiny_root, draft):
    """An unknown ``--best-metric`` trained the whole run and was only warned at the first
    evaluation. The check before step 1 takes the names from each draft's declared figures
    (``Draft.eval_figures`` / ``eval_slot_figures``); this runs a real held-out evaluation of each draft on
    the tiny target (with the target's argmax, and for DFlash and DSpark without it) and compares the
    declared names with the figures of the summary the consumer's ``checkpoints/best`` reads."""
    import threading

    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.draft import REPLAY_FIGURES, build_draft, draft_class, figures_of
    from artcache.trainers.evaluation import Evaluator, target_argmax_fn

    settings, plan = tiny_root  # captures [1, 2, 3, 5]: L - 1 = 5 is there, so the replay is measured
    opts = {"dflash": {"block_size": 4, "num_anchors": 8}, "eagle3": {"draft_vocab": 500, "ttt_steps": 3},
            "dspark": {"block_size": 4, "num_anchors": 8, "markov_rank": 16}}[draft]
    cfg = ConsumerConfig(cache="-", draft=draft, eval_samples=4, **opts).resolved()
    d = build_draft(cfg, settings, plan, torch.device("cpu"))
    batch = batch_for(plan, len(d.needed_layer_ids))
    batch.last_layer = torch.randn(1, batch.input_ids.shape[1], 64, generator=torch.Generator().manual_seed(1))
    declared = draft_class(draft).held_out_figures(cfg.block_size)
    assert len(set(declared)) == len(declared)
    argmax = target_argmax_fn(d.target_info, d.target_lm_head, torch.device("cpu"))
    for target_argmax in (argmax, None):
        ev = Evaluator(d, _SplitClient(), range(1), 1, collate=lambda items, last: batch,
                       target_argmax=target_argmax, stop=threading.Event()).run()
        replay = target_argmax is not None or draft == "eagle3"  # EAGLE-3 reads L-1 itself: always a replay
        want = [f for f in declared if replay or f not in REPLAY_FIGURES]
        assert sorted(figures_of(ev)) == sorted(want), (draft, replay)
        if draft == "eagle3":
            break


def test_regression_best_metric_is_checked_against_the_drafts_figures():
    """The config check behind ``--best-metric``: a declared figure (a DSpark slot figure up to B - 1) passes,
    any other name is refused naming the draft's figures; EAGLE-3 has no ``tau``."""
    from artcache.trainers.consumer import ConsumerConfig

    ConsumerConfig(cache="-", draft="dspark", eval_samples=2, best_metric="ece_cum@6").validate()  # B 7: 0..6
    ConsumerConfig(cache="-", draft="eagle3", eval_samples=2, best_metric="sim_acc_len").validate()
    with pytest.raises(ConfigError, match=r"--best-metric 'ece_cum@7' is not a held-out figure of the dspark "
                                          r"draft; accepted: loss, .*accept_rate@k, ece@k, ece_cum@k \(k = 0\.\.6\)"):
        ConsumerConfig(cache="-", draft="dspark", eval_samples=2, best_metric="ece_cum@7").validate()
    with pytest.raises(ConfigError, match=r"^--best-metric 'tau' is not a held-out figure of the eagle3 draft; "
                                          r"accepted: loss, sim_acc_len, coverage, replay_tau, replay_truncated_frac"):
        ConsumerConfig(cache="-", draft="eagle3", eval_samples=2, best_metric="tau").validate()
    with pytest.raises(ConfigError, match="--best-metric 'replay-tau' is not a held-out figure of the dflash"):
        ConsumerConfig(cache="-", eval_samples=2, best_metric="replay-tau").validate()


def test_regression_best_metric_direction_minimises_errors_not_only_losses():
    """checkpoints/best minimised only names with 'loss', so `--best-metric ece`
    (or conf_mae, replay_truncated_frac) followed the worst checkpoint. figure_rank is the one order."""
    from artcache.trainers.draft import draft_class, figure_rank

    def best(metric, values):
        return min(values, key=lambda v: figure_rank(metric, v))

    assert best("replay_tau", [1.2, 2.4, 1.9]) == 2.4 and best("accept_rate@3", [0.1, 0.6]) == 0.6
    assert best("loss", [3.0, 1.5]) == 1.5 and best("ce_loss", [2.0, 0.5]) == 0.5
    for m in ("ece", "ece_cum", "ece@2", "conf_mae", "cum_mae", "replay_truncated_frac"):
        assert best(m, [0.30, 0.05, 0.20]) == 0.05, m
    assert best("conf_bias", [0.4, -0.1, 0.2]) == -0.1  # signed: closest to 0
    # every figure a draft declares has a direction that reads right: errors down, acceptance up
    for name in ("dflash", "eagle3", "dspark"):
        for fig in draft_class(name).held_out_figures(4):
            base = fig.split("@")[0]
            up = base in ("tau", "replay_tau", "sim_acc_len", "coverage", "accept_rate")
            assert (figure_rank(fig, 2.0) < figure_rank(fig, 1.0)) is up, fig
