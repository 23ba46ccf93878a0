"""GPU lane (``pytest -m gpu``): the CUDA-only parts of the fast consumer path.

- :class:`~artcache.trainers.consumer.reader.DeviceCollator` builds the batch :func:`collate` builds
  (element for element; the layer view selected on the device), with no host synchronisation;
- the sync-free DFlash, EAGLE-3 and DSpark steps on CUDA agree with the CPU reference on the same inputs
  within bf16 tolerance, and Liger's fused linear CE agrees with the reference CE;
- ``--compile on`` and ``graphs`` run every draft's step and give the uncompiled step's loss, and so does
  ``--attn-impl flex`` (DFlash, DSpark);
- the sync-free DSpark step runs under ``torch.cuda.set_sync_debug_mode("error")`` (no synchronisation);
- a packed batch (``--pack-tokens``) trains on CUDA as on the CPU: DFlash's and DSpark's anchors spread over rows of
  N slots, every compile mode.
"""

from __future__ import annotations

import pytest
import torch

from artcache.client import Leased
from artcache.store import Artifact
from artcache.trainers.consumer.reader import DeviceCollator, Retired, collate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _items(lengths, m=7, h=64):
    out = []
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(lengths):
        hs = torch.randn(n, m, h, generator=g).to(torch.bfloat16).pin_memory()
        art = Artifact(
            f"{i:040x}",
            hs,
            torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
            (torch.rand(n, generator=g) < 0.8).to(torch.uint8),
            hs.numel() * 2,
            {},
        )
        out.append(Leased(i, art, f"lease-{i}"))
    return out


@pytest.mark.parametrize("layers", [None, slice(1, 4), torch.tensor([0, 1, 2, 3, 5])])
def test_device_collator_equals_collate(layers):
    items = _items([40, 33, 17])
    ref = collate(items, torch.device("cpu"), layers)
    fetched = DeviceCollator(torch.device("cuda"), layers, length_bucket=0)(items)
    got = fetched.wait()
    for name in ("hidden", "input_ids", "loss_mask", "valid"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
    assert torch.equal(got.supervised_host, ref.loss_mask & ref.valid)
    Retired().retire(fetched)


def test_device_collator_bucket_pads_unsupervised():
    items = _items([40, 33])
    got = DeviceCollator(torch.device("cuda"), None, length_bucket=64)(items).wait()
    assert (
        got.hidden.shape[1] == 64
        and not bool(got.valid[:, 40:].any())
        and not bool(got.loss_mask[:, 40:].any())
    )


def test_liger_matches_reference():
    from artcache.trainers.lm_head_ce import liger_available, linear_ce

    if not liger_available():
        pytest.skip("liger-kernel not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 64, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(1000, 64, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    t = torch.randint(0, 1000, (300,), device="cuda", generator=g)
    rw = torch.rand(300, device="cuda", generator=g)
    ref, _ = linear_ce(h, w, t, rw, chunk_rows=128, impl="reference")
    (gr,) = torch.autograd.grad(ref, h)
    got, _ = linear_ce(h, w, t, rw, chunk_rows=128, impl="liger")
    (gg,) = torch.autograd.grad(got, h)
    assert abs(float(got) - float(ref)) / float(ref) < 1e-2
    assert float((gg - gr).norm() / gr.norm()) < 3e-2


@pytest.mark.parametrize("compile_mode", ["off", "on", "graphs"])
def test_sync_free_steps_match_the_host_reference(compile_mode):
    """Every draft's CUDA step (``--compile off|on|graphs``) gives the CPU reference's loss on the same inputs
    within bf16 rounding."""
    from artcache.trainers.draft import DraftBatch
    from artcache.trainers.speed import SpeedOptions
    from tests.unit.test_fast_consumer import _batch, _dflash, _dspark, _eagle3

    speed = SpeedOptions(sync_free=True, ce_impl="chunked", compile=compile_mode)
    for make, b in ((_dflash, _batch(3, 24, 4, 1)), (_eagle3, _batch(3, 18, 4, 2)), (_dspark, _batch(3, 24, 4, 3))):
        cpu_loss, _ = make().loss(b)
        d = make(speed=speed)
        d.model.cuda()
        gb = DraftBatch(
            b.hidden.cuda(),
            b.input_ids.cuda(),
            b.loss_mask.cuda(),
            b.valid.cuda(),
            supervised_host=b.loss_mask & b.valid,
        )
        speed.step_begin()
        loss, sums = d.loss(gb)
        loss.backward()
        assert abs(float(loss) - float(cpu_loss)) / abs(float(cpu_loss)) < 3e-2
        assert sums.resolve().den
        assert all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                   for p in d.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("compile_mode", ["off", "on", "graphs"])
@pytest.mark.parametrize("draft", ["dflash", "eagle3", "dspark"])
def test_packed_sync_free_step_matches_the_host_step(draft, compile_mode):
    """A packed batch's CUDA step (sync-free; DFlash / DSpark spread a row's anchors over rows of N slots) gives the
    CPU host step's loss on the same documents and anchors within bf16 rounding, with finite gradients."""
    from dataclasses import replace

    from artcache.trainers.speed import SpeedOptions
    from tests.unit.test_fast_consumer import M, _dflash, _dspark, _eagle3
    from tests.unit.test_packing import packed_draft_batch

    make = {"dflash": _dflash, "eagle3": _eagle3, "dspark": _dspark}[draft]
    b = packed_draft_batch(4 if draft == "eagle3" else M)
    cpu_loss, _ = make().loss(b)
    speed = SpeedOptions(sync_free=True, ce_impl="chunked", compile=compile_mode)
    d = make(speed=speed)
    d.model.cuda()
    gb = replace(b, hidden=b.hidden.cuda(), input_ids=b.input_ids.cuda(), loss_mask=b.loss_mask.cuda(),
                 valid=b.valid.cuda(), supervised_host=b.loss_mask & b.valid)
    losses = []
    for _ in range(2):  # a second step (its own anchor draws): a compiled graph's replay
        d.model.zero_grad()
        loss, sums = d.loss(gb)
        loss.backward()
        losses.append(float(loss))
    assert abs(losses[0] - float(cpu_loss)) / abs(float(cpu_loss)) < 3e-2
    assert sums.resolve().den
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all())
               for p in d.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("draft", ["dflash", "dspark"])
def test_flex_attention_step_equals_sdpa(draft):
    """FlexAttention with the block mask (``bench.consumer_speed``'s ``+flex`` variants) computes the dense-SDPA
    step's loss and gradients (SmolLM2-135M shapes, head_dim 64; 2 sequences of 384 tokens, 24 anchors) within bf16
    rounding. The draft's forward runs uncompiled (FlexAttention itself compiled, as always on CUDA): with the whole
    forward compiled, torch 2.11's inductor fails an internal assertion at this shape (``tiling_utils.py``),
    while the 1,024-token rows of the bench compile and run."""
    from artcache.bench import consumer_speed as cs

    layers, block = (5, 16) if draft == "dflash" else (5, 7)
    out = {}
    for attn in ("sdpa", "flex"):
        d, _ = cs.build(draft, "smollm2-135m", "syncfree+compile" + ("+flex" if attn == "flex" else ""),
                        torch.device("cuda"), layers=layers, anchors=24, block=block)
        d._forward_fn = d.model  # the variant table has no eager rows with flex: the same step, uncompiled
        assert d.model.attn_impl == attn
        (b,) = cs.device_batches(2, 384, layers + (draft == "dspark"), 576, 49152, torch.device("cuda"), n=1)
        loss, _ = d.loss(b)
        loss.backward()
        grads = torch.cat([p.grad.flatten().float() for p in d.model.parameters() if p.requires_grad])
        out[attn] = (float(loss), grads)
    (l0, g0), (l1, g1) = out["sdpa"], out["flex"]
    assert abs(l1 - l0) / abs(l0) < 1e-2
    assert float((g1 - g0).norm() / g0.norm()) < 5e-2


def test_sync_free_dspark_step_does_not_synchronise():
    """The DSpark step of the CUDA path (anchors drawn on the host, forward, loss, PendingSums, backward) raises
    no synchronisation error under ``set_sync_debug_mode("error")`` once its pinned inputs are staged."""
    from artcache.trainers.draft import DraftBatch
    from artcache.trainers.speed import SpeedOptions
    from tests.unit.test_fast_consumer import _batch, _dspark

    b = _batch(3, 24, 4, 4)
    d = _dspark(speed=SpeedOptions(sync_free=True, ce_impl="chunked"))
    d.model.cuda()
    gb = DraftBatch(b.hidden.cuda(), b.input_ids.cuda(), b.loss_mask.cuda(), b.valid.cuda(),
                    supervised_host=b.loss_mask & b.valid)
    d.loss(gb)[0].backward()  # warm-up: lazy CUDA initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, sums = d.loss(gb)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sums.resolve().den["tau"] > 0


def _syncs(d, gb) -> int:
    """Synchronisations of one training step (forward, loss, backward) after a warm-up step, as
    ``set_sync_debug_mode("warn")`` reports them."""
    import warnings

    d.loss(gb)[0].backward()  # warm-up: lazy CUDA initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss, _ = d.loss(gb)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


@pytest.mark.parametrize("draft", ["dflash", "eagle3", "dspark"])
def test_packed_step_synchronises_no_more_than_unpacked(draft):
    """A packed batch's CUDA step adds no synchronisation to the unpacked step's (DSpark's has none): its document
    ids and positions reach the device through pinned memory, its anchors are drawn and spread on the host."""
    from dataclasses import replace

    from artcache.trainers.speed import SpeedOptions
    from tests.unit.test_fast_consumer import M, _batch, _dflash, _dspark, _eagle3
    from tests.unit.test_packing import packed_draft_batch

    make = {"dflash": _dflash, "eagle3": _eagle3, "dspark": _dspark}[draft]
    m = 4 if draft == "eagle3" else M
    counts = []
    for b in (_batch(3, 24, m, 4), packed_draft_batch(m)):
        d = make(speed=SpeedOptions(sync_free=True, ce_impl="chunked"))
        d.model.cuda()
        gb = replace(b, hidden=b.hidden.cuda(), input_ids=b.input_ids.cuda(), loss_mask=b.loss_mask.cuda(),
                     valid=b.valid.cuda(), supervised_host=b.loss_mask & b.valid)
        counts.append(_syncs(d, gb))
    assert counts[1] <= counts[0], counts
    if draft == "dspark":
        assert counts == [0, 0]
