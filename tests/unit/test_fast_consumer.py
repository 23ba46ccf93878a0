"""The GPU speed work keeps the CPU path bit for bit, and its fast paths compute the same function.

- :func:`cpu_figures` trains each draft two steps on fixed inputs through its adapter (the consumer's
  code path) on the CPU and returns the losses, metric sums and gradient norms as exact float hex strings.
  :data:`GOLDEN` holds what it returned on main before this work (commit f0f6163, torch 2.13.0 CPU, one
  thread: ``python -m tests.unit.test_fast_consumer`` prints it); :data:`DSPARK_GOLDEN` the DSpark entry on main at
  ec10ecb, before DSpark took the same path. The tests assert every figure within 1e-6 relative
  (float32 rounding; the kernels' reduction order is the machine's, see :func:`_same_figures`).
- The chunked bf16 lm_head loss, its compiled body, the static-row DFlash and DSpark losses and the sync-free
  EAGLE-3 loss agree with the reference within bf16 / float rounding on fresh random inputs (CPU).
- :class:`~artcache.trainers.draft.PendingSums` resolves to exactly the MetricSums of the host path (DSpark:
  plus zero-count ECE bins); the sync-free DSpark step reads nothing back to the host (:class:`_NoHostSync`).
"""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from artcache.trainers.consumer.config import ConsumerConfig
from artcache.trainers.dflash import DFlashConfig, DFlashDraft, dflash_loss, sample_anchors
from artcache.trainers.dflash.adapter import DFlashAdapter
from artcache.trainers.draft import DraftBatch
from artcache.trainers.dspark import DSparkConfig, DSparkDraft
from artcache.trainers.dspark.adapter import DSparkAdapter
from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft
from artcache.trainers.eagle3.adapter import Eagle3Adapter
from artcache.trainers.eagle3.loss import eagle3_loss
from artcache.trainers.eagle3.vocab import build_vocab_map
from artcache.trainers.speed import AUTO_COMPILE_MIN_STEPS, SpeedOptions

V, H, M = 96, 32, 4


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(b: int, T: int, m: int, seed: int) -> DraftBatch:
    """A collated-looking batch: bf16 hidden states, right padding (lengths T, T-5, ...), a prompt prefix. No run
    positions: DFlash and DSpark draw its anchors from their generator (the golden figures' draws), not per position
    (tests/protocol/test_consumer_group.py covers those)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [max(4, T - 5 * i) for i in range(b)]
    hidden = torch.zeros(b, T, m, H, dtype=torch.bfloat16)
    ids = torch.zeros(b, T, dtype=torch.long)
    mask = torch.zeros(b, T, dtype=torch.bool)
    valid = torch.zeros(b, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        hidden[i, :n] = torch.randn(n, m, H, generator=g).to(torch.bfloat16)
        ids[i, :n] = torch.randint(0, V - 2, (n,), generator=g)
        mask[i, 3:n] = torch.rand(n - 3, generator=g) < 0.85
        valid[i, :n] = True
    return DraftBatch(hidden, ids, mask, valid)


def _dflash(seed: int = 0, **speed) -> DFlashAdapter:
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=V,
        num_context_layers=M,
        mask_token_id=V - 1,
        block_size=4,
        num_anchors=5,
        logit_chunk=16,
    )
    emb = (torch.randn(V, H) * 0.5).to(torch.bfloat16)
    head = (torch.randn(V, H) * 0.3).to(torch.bfloat16)
    model = DFlashDraft(cfg, emb, head)
    return DFlashAdapter(model, cfg, list(range(M)), torch.Generator().manual_seed(seed), **speed)


def _eagle3(seed: int = 0, **speed) -> Eagle3Adapter:
    torch.manual_seed(seed)
    cfg = Eagle3Config(
        hidden_size=H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=V,
        draft_vocab_size=40,
        ttt_steps=3,
        logit_chunk=16,
    )
    emb = (torch.randn(V, H) * 0.5).to(torch.bfloat16)
    head = (torch.randn(V, H) * 0.3).to(torch.bfloat16)
    norm_w = 1 + 0.1 * torch.randn(H)
    counts = torch.zeros(V, dtype=torch.long)
    counts[torch.arange(0, V, 2)] = 5
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    model = Eagle3Draft(cfg, emb, norm_w, head, d2t, t2d)
    return Eagle3Adapter(model, cfg, [1, 2, 3, 4], **speed)


def _dspark(seed: int = 0, **speed) -> DSparkAdapter:
    """A DSpark draft reading M - 1 context layers and the last layer (view order: context, then L - 1)."""
    torch.manual_seed(seed)
    cfg = DSparkConfig(
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=V,
        num_context_layers=M - 1,
        mask_token_id=V - 1,
        block_size=4,
        num_anchors=5,
        logit_chunk=16,
        markov_rank=6,
    )
    emb = (torch.randn(V, H) * 0.5).to(torch.bfloat16)
    head = (torch.randn(V, H) * 0.3).to(torch.bfloat16)
    norm_w = 1 + 0.1 * torch.randn(H)
    model = DSparkDraft(cfg, emb, head, norm_w)
    return DSparkAdapter(model, cfg, list(range(M)), torch.Generator().manual_seed(seed), **speed)


def _train(draft, batches: list[DraftBatch]) -> list[dict]:
    """Two AdamW steps through ``draft.loss`` (as the consumer's step does); exact figures per step."""
    params = [p for p in draft.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95))
    out = []
    for batch in batches:
        loss, sums = draft.loss(batch)
        if hasattr(sums, "resolve"):
            sums = sums.resolve()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        out.append(
            {
                "loss": float(loss.detach()).hex(),
                "grad_norm": float(gnorm).hex(),
                "num": {k: float(v).hex() for k, v in sorted(sums.num.items())},
                "den": {k: float(v).hex() for k, v in sorted(sums.den.items())},
            }
        )
    return out


def cpu_figures() -> dict:
    """Each draft's two-step figures on the CPU (the golden values' source; runs on main as well)."""
    return {
        "dflash": _train(_dflash(), [_batch(3, 24, M, 1), _batch(3, 20, M, 2)]),
        "eagle3": _train(_eagle3(), [_batch(3, 18, 4, 3), _batch(3, 16, 4, 4)]),
    }


def dspark_cpu_figures() -> list[dict]:
    """DSpark's two-step figures on the CPU (as :func:`cpu_figures`; :data:`DSPARK_GOLDEN`'s source)."""
    return _train(_dspark(), [_batch(3, 24, M, 11), _batch(3, 20, M, 12)])


#: :func:`cpu_figures` on main at f0f6163 (before the GPU speed work), torch 2.13.0+cpu, one thread.
GOLDEN: dict = {
    "dflash": [
        {
            "loss": "0x1.64abe60000000p+2",
            "grad_norm": "0x1.2abf260000000p+0",
            "num": {
                "acc_1": "0x0.0p+0",
                "acc_2": "0x0.0p+0",
                "acc_3": "0x0.0p+0",
                "loss": "0x1.30477c0000000p+7",
                "tau": "0x1.e000000000000p+3",
            },
            "den": {
                "acc_1": "0x1.e000000000000p+3",
                "acc_2": "0x1.a000000000000p+3",
                "acc_3": "0x1.8000000000000p+3",
                "loss": "0x1.b4ca8c0000000p+4",
                "tau": "0x1.e000000000000p+3",
            },
        },
        {
            "loss": "0x1.7b99400000000p+2",
            "grad_norm": "0x1.6ada400000000p+0",
            "num": {
                "acc_1": "0x1.0000000000000p+0",
                "acc_2": "0x0.0p+0",
                "acc_3": "0x0.0p+0",
                "loss": "0x1.285b580000000p+7",
                "tau": "0x1.0000000000000p+4",
            },
            "den": {
                "acc_1": "0x1.e000000000000p+3",
                "acc_2": "0x1.6000000000000p+3",
                "acc_3": "0x1.2000000000000p+3",
                "loss": "0x1.8fb9580000000p+4",
                "tau": "0x1.e000000000000p+3",
            },
        },
    ],
    "eagle3": [
        {
            "loss": "0x1.213b860000000p+3",
            "grad_norm": "0x1.a2398c0000000p+0",
            "num": {
                "acc_1": "0x0.0p+0",
                "acc_2": "0x0.0p+0",
                "acc_3": "0x0.0p+0",
                "loss_0": "0x1.471f400000000p+5",
                "loss_1": "0x1.44d2040000000p+5",
                "loss_2": "0x1.2809d40000000p+5",
            },
            "den": {
                "acc_1": "0x1.a000000000000p+4",
                "acc_2": "0x1.a000000000000p+4",
                "acc_3": "0x1.7000000000000p+4",
                "loss_0": "0x1.6000000000000p+3",
                "loss_1": "0x1.6000000000000p+3",
                "loss_2": "0x1.4000000000000p+3",
            },
        },
        {
            "loss": "0x1.20b35e0000000p+3",
            "grad_norm": "0x1.f292a40000000p+0",
            "num": {
                "acc_1": "0x1.0000000000000p+0",
                "acc_2": "0x0.0p+0",
                "acc_3": "0x0.0p+0",
                "loss_0": "0x1.da40500000000p+4",
                "loss_1": "0x1.d60cfc0000000p+4",
                "loss_2": "0x1.a052ce0000000p+4",
            },
            "den": {
                "acc_1": "0x1.2000000000000p+4",
                "acc_2": "0x1.2000000000000p+4",
                "acc_3": "0x1.0000000000000p+4",
                "loss_0": "0x1.0000000000000p+3",
                "loss_1": "0x1.0000000000000p+3",
                "loss_2": "0x1.c000000000000p+2",
            },
        },
    ],
}


#: :func:`dspark_cpu_figures` on main at ec10ecb (before DSpark read SpeedOptions), torch 2.13.0+cpu,
#: one thread; the ``conf_mae`` / ``conf_bias`` / ``cum_mae`` / ``cum_bias`` sums since they are weighted by the
#: slot decay (numerator Σ w·err, denominator Σ w, as DeepSpec's), every other figure unchanged.
DSPARK_GOLDEN: list = [
    {
        "loss": "0x1.4733a80000000p+1",
        "grad_norm": "0x1.aa72900000000p-1",
        "num": {
            "acc_0": "0x0.0p+0",
            "acc_1": "0x0.0p+0",
            "acc_2": "0x1.0000000000000p+0",
            "acc_3": "0x0.0p+0",
            "accept_rate@0": "0x1.e7abc88000000p+1",
            "accept_rate@1": "0x1.4f904d8000000p+1",
            "accept_rate@2": "0x1.2bb36a8000000p+1",
            "accept_rate@3": "0x1.d4d9930000000p+0",
            "ce_loss": "0x1.5384420000000p+7",
            "conf_bias": "0x1.03f2a0d74ce1bp+3",
            "conf_loss": "0x1.694b4c0000000p+4",
            "conf_mae": "0x1.03f2a0d74ce1bp+3",
            "cum_bias": "0x1.82a1465c2b01cp+2",
            "cum_mae": "0x1.82a1465c2b01cp+2",
            "ece@0.n4": "0x1.c000000000000p+2",
            "ece@0.n5": "0x1.0000000000000p+3",
            "ece@0.p4": "0x1.acb45c96a9f9ap+1",
            "ece@0.p5": "0x1.0a1413a8c3aa5p+2",
            "ece@0.t4": "0x1.bd32bf0000000p+0",
            "ece@0.t5": "0x1.0912690000000p+1",
            "ece@1.n4": "0x1.6000000000000p+3",
            "ece@1.p4": "0x1.577848e83b6ddp+2",
            "ece@1.t4": "0x1.4f904d8000000p+1",
            "ece@2.n4": "0x1.4000000000000p+3",
            "ece@2.p4": "0x1.3850447ab04ebp+2",
            "ece@2.t4": "0x1.2bb36a8000000p+1",
            "ece@3.n4": "0x1.c000000000000p+2",
            "ece@3.p4": "0x1.b56249dfa1850p+1",
            "ece@3.t4": "0x1.d4d9930000000p+0",
            "ece_cum@0.n4": "0x1.c000000000000p+2",
            "ece_cum@0.n5": "0x1.0000000000000p+3",
            "ece_cum@0.p4": "0x1.acb45c96a9f9ap+1",
            "ece_cum@0.p5": "0x1.0a1413a8c3aa5p+2",
            "ece_cum@0.t4": "0x1.bd32bf0000000p+0",
            "ece_cum@0.t5": "0x1.0912690000000p+1",
            "ece_cum@1.n2": "0x1.6000000000000p+3",
            "ece_cum@1.p2": "0x1.56d372b048dc4p+1",
            "ece_cum@1.t2": "0x1.6853298753e20p-1",
            "ece_cum@2.n1": "0x1.4000000000000p+3",
            "ece_cum@2.p1": "0x1.2f38c463cd956p+0",
            "ece_cum@2.t1": "0x1.37a7882598445p-3",
            "ece_cum@3.n0": "0x1.c000000000000p+2",
            "ece_cum@3.p0": "0x1.a0ae67707b937p-2",
            "ece_cum@3.t0": "0x1.9a3acf44afc14p-6",
            "l1_loss": "0x1.8cd42e0000000p+5",
            "loss": "0x1.50ccc1b333334p+6",
            "tau": "0x1.3b0df02056fb8p+4"
        },
        "den": {
            "acc_0": "0x1.e000000000000p+3",
            "acc_1": "0x1.6000000000000p+3",
            "acc_2": "0x1.4000000000000p+3",
            "acc_3": "0x1.c000000000000p+2",
            "accept_rate@0": "0x1.e000000000000p+3",
            "accept_rate@1": "0x1.6000000000000p+3",
            "accept_rate@2": "0x1.4000000000000p+3",
            "accept_rate@3": "0x1.c000000000000p+2",
            "ce_loss": "0x1.07826c0000000p+5",
            "conf_bias": "0x1.07826c0000000p+5",
            "conf_loss": "0x1.07826c0000000p+5",
            "conf_mae": "0x1.07826c0000000p+5",
            "cum_bias": "0x1.07826c0000000p+5",
            "cum_mae": "0x1.07826c0000000p+5",
            "l1_loss": "0x1.07826c0000000p+5",
            "loss": "0x1.07826c0000000p+5",
            "tau": "0x1.e000000000000p+3"
        }
    },
    {
        "loss": "0x1.4ed5540000000p+1",
        "grad_norm": "0x1.1d4a000000000p-1",
        "num": {
            "acc_0": "0x0.0p+0",
            "acc_1": "0x0.0p+0",
            "acc_2": "0x0.0p+0",
            "acc_3": "0x0.0p+0",
            "accept_rate@0": "0x1.f4c7008000000p+1",
            "accept_rate@1": "0x1.e326168000000p+1",
            "accept_rate@2": "0x1.20f8298000000p+1",
            "accept_rate@3": "0x1.0fbef60000000p+1",
            "ce_loss": "0x1.bddde40000000p+7",
            "conf_bias": "0x1.89a2c08db4740p+2",
            "conf_loss": "0x1.6587a60000000p+4",
            "conf_mae": "0x1.8cf5e41a0d5c6p+2",
            "cum_bias": "0x1.4b68656026c25p+2",
            "cum_mae": "0x1.4b68656026c25p+2",
            "ece@0.n4": "0x1.0000000000000p+3",
            "ece@0.n5": "0x1.c000000000000p+2",
            "ece@0.p4": "0x1.d655f0406f038p+1",
            "ece@0.p5": "0x1.d011e1fa9bb6fp+1",
            "ece@0.t4": "0x1.c1983c0000000p+0",
            "ece@0.t5": "0x1.13fae28000000p+1",
            "ece@1.n4": "0x1.a000000000000p+3",
            "ece@1.p4": "0x1.5b2cd675c99bep+2",
            "ece@1.t4": "0x1.e326168000000p+1",
            "ece@2.n4": "0x1.2000000000000p+3",
            "ece@2.p4": "0x1.e031c162b2c47p+1",
            "ece@2.t4": "0x1.20f8298000000p+1",
            "ece@3.n4": "0x1.0000000000000p+3",
            "ece@3.p4": "0x1.aaa89e80fe33fp+1",
            "ece@3.t4": "0x1.0fbef60000000p+1",
            "ece_cum@0.n4": "0x1.0000000000000p+3",
            "ece_cum@0.n5": "0x1.c000000000000p+2",
            "ece_cum@0.p4": "0x1.d655f0406f038p+1",
            "ece_cum@0.p5": "0x1.d011e1fa9bb6fp+1",
            "ece_cum@0.t4": "0x1.c1983c0000000p+0",
            "ece_cum@0.t5": "0x1.13fae28000000p+1",
            "ece_cum@1.n1": "0x1.c000000000000p+2",
            "ece_cum@1.n2": "0x1.8000000000000p+2",
            "ece_cum@1.p1": "0x1.5530bbf8dd631p+0",
            "ece_cum@1.p2": "0x1.45a8846ca97eap+0",
            "ece_cum@1.t1": "0x1.b056676fc0200p-2",
            "ece_cum@1.t2": "0x1.011fafa9caf60p-1",
            "ece_cum@2.n0": "0x1.2000000000000p+3",
            "ece_cum@2.p0": "0x1.87dc3b1bbcf58p-1",
            "ece_cum@2.t0": "0x1.4e63021c0cb8ep-3",
            "ece_cum@3.n0": "0x1.0000000000000p+3",
            "ece_cum@3.p0": "0x1.238e601420315p-2",
            "ece_cum@3.t0": "0x1.367b4e5997266p-5",
            "l1_loss": "0x1.9235440000000p+5",
            "loss": "0x1.678ca8e666666p+6",
            "tau": "0x1.409b3ad6723d3p+4"
        },
        "den": {
            "acc_0": "0x1.e000000000000p+3",
            "acc_1": "0x1.a000000000000p+3",
            "acc_2": "0x1.2000000000000p+3",
            "acc_3": "0x1.0000000000000p+3",
            "accept_rate@0": "0x1.e000000000000p+3",
            "accept_rate@1": "0x1.a000000000000p+3",
            "accept_rate@2": "0x1.2000000000000p+3",
            "accept_rate@3": "0x1.0000000000000p+3",
            "ce_loss": "0x1.12e59e0000000p+5",
            "conf_bias": "0x1.12e59e0000000p+5",
            "conf_loss": "0x1.12e59e0000000p+5",
            "conf_mae": "0x1.12e59e0000000p+5",
            "cum_bias": "0x1.12e59e0000000p+5",
            "cum_mae": "0x1.12e59e0000000p+5",
            "l1_loss": "0x1.12e59e0000000p+5",
            "loss": "0x1.12e59e0000000p+5",
            "tau": "0x1.e000000000000p+3"
        }
    },
]


def _same_figures(got, golden, rel: float = 1e-6) -> bool:
    """The same structure and every figure within ``rel`` relative of the golden (float32 rounding: 2^-23 is
    1.2e-7). Not bit-exact: the CPU kernels' reduction order follows the machine and the process (on an AMD
    EPYC under pytest EAGLE-3's step-1 gradient norm came out 1 ulp apart, and standalone its step-2 loss),
    while any change to the arithmetic moves these figures by far more than 1e-6."""
    if isinstance(golden, dict):
        return isinstance(got, dict) and got.keys() == golden.keys() and all(
            _same_figures(got[k], golden[k], rel) for k in golden)
    if isinstance(golden, list):
        return isinstance(got, list) and len(got) == len(golden) and all(
            _same_figures(x, y, rel) for x, y in zip(got, golden, strict=True))
    x, y = float.fromhex(got), float.fromhex(golden)
    return abs(x - y) <= rel * abs(y)


def test_cpu_losses_unchanged_to_the_last_bit():
    """The CPU path of both drafts computes what it computed before the GPU work."""
    got = cpu_figures()
    assert _same_figures(got, GOLDEN), json.dumps(got, indent=1)


def test_regression_cpu_figures_compared_within_float32_rounding():
    """The last-bit comparison failed on an AMD EPYC (and passed on other CPUs) by 1 ulp of float32 in
    EAGLE-3's figures; a 1e-6 relative bound passes that and still fails a change of 1e-5 anywhere."""
    moved = json.loads(json.dumps(GOLDEN))
    moved["eagle3"][0]["grad_norm"] = "0x1.a2398a0000000p+0"
    moved["eagle3"][1]["loss"] = "0x1.20b3600000000p+3"
    assert _same_figures(moved, GOLDEN)
    for draft, key in (("eagle3", "grad_norm"), ("dflash", "loss")):
        bad = json.loads(json.dumps(GOLDEN))
        bad[draft][0][key] = float(1.00001 * float.fromhex(GOLDEN[draft][0][key])).hex()
        assert not _same_figures(bad, GOLDEN), (draft, key)
    bad = json.loads(json.dumps(GOLDEN))
    bad["dflash"][1]["num"]["acc_2"] = "0x1.0000000000000p+0"  # a count that was 0
    assert not _same_figures(bad, GOLDEN)


def test_dspark_cpu_figures_unchanged_to_the_last_bit():
    """DSpark's CPU path (loss, gradient norm, every metric sum) computes what it
    computed before it took the sync-free path."""
    got = dspark_cpu_figures()
    assert _same_figures(got, DSPARK_GOLDEN), json.dumps(got, indent=1)


# ---- the fast paths compute the same function (CPU) ---------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("compile", [False, True])
def test_chunked_lm_head_ce_matches_reference(compile):
    from artcache.trainers.lm_head_ce import linear_ce

    g = torch.Generator().manual_seed(7)
    R, Hh, Vv = 37, 24, 131
    weight = torch.randn(Vv, Hh, generator=g) * 0.4
    h = torch.randn(R, Hh, generator=g, dtype=torch.float64).float().requires_grad_()
    t = torch.randint(0, Vv, (R,), generator=g)
    w = torch.rand(R, generator=g) * (torch.rand(R, generator=g) < 0.8)
    ref_sum, ref_pred = linear_ce(
        h, weight.double(), t, w.double(), chunk_rows=R, impl="reference", acc_dtype=torch.float64
    )
    (ref_grad,) = torch.autograd.grad(ref_sum, h)
    got_sum, got_pred = linear_ce(h, weight, t, w, chunk_rows=8, impl="chunked", compile=compile)
    (got_grad,) = torch.autograd.grad(got_sum, h)
    assert got_sum.dtype == torch.float32 and torch.isfinite(got_sum)
    assert abs(float(got_sum) - float(ref_sum)) / abs(float(ref_sum)) < 1e-2
    assert 1e-5 < _rel(got_grad, ref_grad) < 2e-2  # bf16 matmuls: not exact, but close
    # argmax of bf16 logits: equal except where two logits are within bf16 rounding
    assert (got_pred == ref_pred).float().mean() > 0.9


def test_static_rows_and_chunked_dflash_loss_match_reference():
    draft = _dflash()
    model = draft.model
    batch = _batch(3, 24, M, 5)
    anchors, avalid = sample_anchors(batch.supervised_on_host(), 5, torch.Generator().manual_seed(3))
    out = model(batch.hidden, batch.input_ids, anchors, avalid, context_valid=batch.valid)
    ref, ref_stats = dflash_loss(
        model, out, batch.input_ids, batch.loss_mask, anchors, avalid, context_valid=batch.valid
    )
    (ref_g,) = torch.autograd.grad(ref, out, retain_graph=True)
    stat, stat_stats = dflash_loss(
        model,
        out,
        batch.input_ids,
        batch.loss_mask,
        anchors,
        avalid,
        context_valid=batch.valid,
        static_rows=True,
    )
    (stat_g,) = torch.autograd.grad(stat, out, retain_graph=True)
    assert abs(float(stat) - float(ref)) < 1e-6 and _rel(stat_g, ref_g) < 1e-6
    for name in ("correct", "total", "tau_sum", "num_blocks"):
        assert torch.equal(getattr(stat_stats, name), getattr(ref_stats, name)), name
    fast, fast_stats = dflash_loss(
        model,
        out,
        batch.input_ids,
        batch.loss_mask,
        anchors,
        avalid,
        context_valid=batch.valid,
        static_rows=True,
        mode="chunked",
    )
    (fast_g,) = torch.autograd.grad(fast, out)
    assert abs(float(fast) - float(ref)) / float(ref) < 1e-2 and _rel(fast_g, ref_g) < 3e-2
    assert torch.equal(fast_stats.total, ref_stats.total) and torch.equal(
        fast_stats.num_blocks, ref_stats.num_blocks
    )


def test_sync_free_eagle3_loss_matches_reference():
    draft = _eagle3()
    batch = _batch(3, 18, 4, 6)
    aux, last = batch.hidden[:, :, :3], batch.hidden[:, :, 3]
    ref, ref_stats = eagle3_loss(draft.model, aux, last, batch.input_ids, batch.loss_mask, batch.valid)
    params = [p for p in draft.model.parameters() if p.requires_grad]
    ref_g = torch.autograd.grad(ref, params)
    got, got_stats = eagle3_loss(
        draft.model, aux, last, batch.input_ids, batch.loss_mask, batch.valid, sync_free=True
    )
    got_g = torch.autograd.grad(got, params)
    assert abs(float(got) - float(ref)) < 1e-5 * max(1.0, abs(float(ref)))
    assert max(_rel(a, b) for a, b in zip(got_g, ref_g, strict=True)) < 1e-4
    for name in ("kept", "correct", "total"):
        assert torch.equal(getattr(got_stats, name), getattr(ref_stats, name)), name
    assert torch.allclose(got_stats.loss_sum, ref_stats.loss_sum, rtol=1e-5)


def _dspark_inputs(draft: DSparkAdapter, seed: int):
    batch = _batch(3, 24, M, seed)
    anchors, avalid = sample_anchors(batch.supervised_on_host(), 5, torch.Generator().manual_seed(seed))
    ctx, last = batch.hidden[:, :, : M - 1], batch.hidden[:, :, M - 1]
    out = draft.model(ctx, batch.input_ids, anchors, avalid, context_valid=batch.valid)
    return batch, anchors, avalid, last, out


@pytest.mark.parametrize("mode", ["fused", "chunked"])
def test_static_rows_dspark_loss_matches_reference(mode):
    """The sync-free DSpark loss (every slot scored, Σ w divided on the device; ``chunked``: bf16 lm_head
    matmuls) gives the reference's loss, gradients and per-slot outputs on the same inputs and anchors."""
    from artcache.trainers.dspark import dspark_loss

    draft = _dspark()
    batch, anchors, avalid, last, out = _dspark_inputs(draft, 5)
    params = [p for p in draft.model.parameters() if p.requires_grad]
    args = (draft.model, out, last, batch.input_ids, batch.loss_mask, anchors, avalid)
    ref, ref_o = dspark_loss(*args, context_valid=batch.valid)
    ref_g = torch.autograd.grad(ref, params, retain_graph=True)
    got, got_o = dspark_loss(*args, context_valid=batch.valid, mode=mode, static_rows=True)
    got_g = torch.autograd.grad(got, params)
    tol = 1e-5 if mode == "fused" else 2e-2  # float summation order / bf16 matmuls
    got, ref = float(got.detach()), float(ref.detach())
    assert abs(got - ref) <= tol * abs(ref)
    # the bf16 lm_head's gradient rows are bf16 products in both paths, scaled by 1 / Σ w before (reference) or
    # after (static rows) their rounding: a bf16 ulp apart
    assert max(_rel(a, b) for a, b in zip(got_g, ref_g, strict=True)) < (1e-2 if mode == "fused" else 3e-2)
    assert torch.equal(got_o.supervised, ref_o.supervised) and torch.equal(got_o.valid, ref_o.valid)
    assert float(got_o.weight_sum) == pytest.approx(float(ref_o.weight_sum), rel=1e-6)  # float32 sums, any order
    if mode == "fused":
        assert torch.equal(got_o.correct, ref_o.correct)
    for name in ("alpha", "conf_logit", "ce_sum", "l1_sum", "conf_sum"):
        a, b = getattr(got_o, name), getattr(ref_o, name)
        assert torch.allclose(a, b, rtol=tol, atol=tol), name
        if a.dim():
            assert torch.equal(a[~ref_o.supervised], torch.zeros_like(a[~ref_o.supervised])), name


def test_dspark_pending_sums_resolve_to_the_host_sums():
    """The sync-free DSpark step's PendingSums resolve to the host step's MetricSums (same anchors: the same
    generator seed), plus zero-count ECE bins the host leaves out, and summarize to the same figures."""
    from artcache.trainers.dspark.metrics import summarize

    batch = _batch(3, 24, M, 8)
    host, dev = _dspark(), _dspark(speed=SpeedOptions(sync_free=True))
    _, hs = host.loss(batch)
    _, ds = dev.loss(batch)
    resolved = ds.resolve()
    assert set(hs.num) <= set(resolved.num) and set(hs.den) == set(resolved.den)
    extra = set(resolved.num) - set(hs.num)
    assert extra and all(".n" in k or ".p" in k or ".t" in k for k in extra)
    assert all(resolved.num[k] == 0.0 for k in extra)
    for k in hs.den:  # counts exact; sums within float rounding (the static rows sum zero-weighted terms)
        assert resolved.den[k] == pytest.approx(hs.den[k], rel=1e-6), k
    for k in hs.num:
        assert resolved.num[k] == pytest.approx(hs.num[k], rel=1e-5, abs=1e-9), k
    a, b = summarize(resolved, 4), summarize(hs, 4)
    assert a.keys() == b.keys()
    for k in b:
        if isinstance(b[k], float):
            assert a[k] == pytest.approx(b[k], rel=1e-5), k


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op of a forward that reads tensor data back to the host (``.item()``, ``float()``,
    ``bool()``: ``aten._local_scalar_dense``; ``nonzero``; boolean-mask indexing), and ``Tensor.tolist``
    (not an op): on CUDA each would be a synchronisation."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCING:
            self.seen.append(name)
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or ())
        ):
            self.seen.append(f"{name}[bool]")
        return func(*args, **(kwargs or {}))


def _host_syncs(step, monkeypatch) -> list[str]:
    mode = _NoHostSync()
    tolist = torch.Tensor.tolist

    def recorded_tolist(t):
        mode.seen.append("tolist")
        return tolist(t)

    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "tolist", recorded_tolist)
        with mode:
            step()
    return mode.seen


@pytest.mark.parametrize("ce_impl", ["reference", "chunked"])
def test_sync_free_dspark_step_reads_nothing_back(ce_impl, monkeypatch):
    """The sync-free DSpark training step (forward, loss, metric sums, backward) reads no tensor back to the
    host; the reference step does (``nonzero`` row selection, the ``.tolist()`` of its sums): the check works."""
    batch = _batch(3, 24, M, 9)
    for speed, want_none in ((SpeedOptions(sync_free=True, ce_impl=ce_impl), True), (SpeedOptions(), False)):
        draft = _dspark(speed=speed)

        def step(draft=draft):
            loss, sums = draft.loss(batch)
            loss.backward()

        seen = _host_syncs(step, monkeypatch)
        assert (seen == []) == want_none, seen


def test_dspark_refuses_liger():
    """``--loss-impl liger`` has no DSpark form (Liger computes CE only, DSpark also needs the L1 term): a
    ConfigError naming the alternative, not a silent fallback."""
    from artcache.errors import ConfigError

    with pytest.raises(ConfigError, match="liger does not apply to DSpark.*--loss-impl chunked"):
        _dspark(speed=SpeedOptions(sync_free=True, ce_impl="liger"))


def test_pending_sums_resolve_to_the_host_sums():
    from artcache.trainers.speed import SpeedOptions

    for make, b in ((_dflash, _batch(3, 24, M, 8)), (_eagle3, _batch(3, 18, 4, 9))):
        host, dev = make(), make(speed=SpeedOptions(sync_free=True))
        _, hs = host.loss(b)
        _, ds = dev.loss(b)
        resolved = ds.resolve()
        assert set(resolved.num) == set(hs.num) and set(resolved.den) == set(hs.den)
        for k in hs.den:  # counts exact; loss sums within float rounding (static rows sum more terms)
            assert math.isclose(resolved.den[k], hs.den[k], rel_tol=1e-6), k
        from artcache.trainers.draft import PendingSums

        both = PendingSums.resolve_all([ds, hs, ds])
        assert both[0].num == resolved.num and both[1] is hs and both[2].den == resolved.den


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps({**cpu_figures(), "dspark": dspark_cpu_figures()}, indent=1))


@pytest.mark.parametrize(("device", "steps", "want"), [
    ("cpu", 100_000, "off"), ("cuda", AUTO_COMPILE_MIN_STEPS - 1, "off"), ("cuda", AUTO_COMPILE_MIN_STEPS, "on"),
])
def test_compile_auto_compiles_only_long_cuda_runs(device, steps, want):
    """``--compile auto``: ``on`` on CUDA from AUTO_COMPILE_MIN_STEPS planned steps (the H200-measured break-even),
    ``off`` on a CPU and for shorter runs; an explicit mode is kept as given."""
    cfg = ConsumerConfig(cache="c", draft="dflash", steps=steps)
    assert SpeedOptions.for_device(cfg, torch.device(device)).compile == want
    explicit = msgspec.structs.replace(cfg, compile="off")
    assert SpeedOptions.for_device(explicit, torch.device(device)).compile == "off"


@pytest.mark.parametrize("mode", ["on", "graphs"])
def test_regression_compile_on_off_cuda_is_refused(mode):
    """Bug: ``--compile on`` on a CPU was accepted and did nothing (the host step never runs the compiled forward),
    so a run said it compiled while it trained uncompiled. ``on`` and ``graphs`` off CUDA are refused in one line."""
    from artcache.errors import ConfigError

    cfg = ConsumerConfig(cache="c", draft="dflash", compile=mode)
    with pytest.raises(ConfigError, match=rf"^--compile {mode} .*CUDA.*use --compile off or auto$"):
        SpeedOptions.for_device(cfg, torch.device("cpu"))
    assert SpeedOptions.for_device(cfg, torch.device("cuda")).compile == mode
