"""The HF backend's GPU capture path: device NaN/Inf flags per sample without a host sync, fp8
quantised on the device, the device-to-host copy on a side stream finished by ``ready()``; bf16 and fp8
artifacts published from it read back as captured. Needs CUDA (``pytest -m gpu``)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from artcache import store
from artcache.contract import CaptureContract
from artcache.fp8 import SCALES, quantize_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def setup(tiny_target):
    from artcache.plan import PlanSpec, build_synthetic_plan
    from artcache.target import load_target_model

    model = load_target_model(tiny_target, device="cuda", dtype=torch.bfloat16)
    base = CaptureContract(target_name=tiny_target.name, target_revision=tiny_target.revision,
                           target_config_hash=tiny_target.config_hash, target_weights_digest=tiny_target.weights_digest,
                           layer_ids=(0, 2, 4), dtype="bfloat16", compute_dtype="bfloat16", max_length=64,
                           tokenizer_digest="t", template_digest="t")
    plan = build_synthetic_plan(PlanSpec(dataset="synthetic", max_length=64, max_samples=4),
                                target_vocab_size=tiny_target.vocab_size)
    return model, base, plan


def _cut(sample, n: int):
    from artcache.plan import Sample

    return Sample(index=sample.index, input_ids=sample.input_ids[:n], loss_mask=sample.loss_mask[:n])


def _capture(model, contract, samples):
    from artcache.backends.hf import HFCaptureBackend

    backend = HFCaptureBackend(model, contract, device="cuda")
    try:
        batch = backend.capture(samples)
        return batch, batch.ready()
    finally:
        backend.close()


def test_gpu_fp8_capture_is_the_quantised_bf16_capture(setup, tmp_path):
    from artcache.layout import CacheLayout

    model, base, plan = setup
    samples = [plan.sample(0), plan.sample(1)]
    samples[1] = _cut(samples[1], 40)  # a shorter row: the batch is padded
    ref, ok_ref = _capture(model, base, samples)
    fp8 = msgspec.structs.replace(base, dtype="float8_e4m3fn")
    got, ok = _capture(model, fp8, samples)
    assert ok_ref == ok == [True, True]
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert r["hidden_states"].is_pinned() and g["hidden_states"].is_pinned()
        assert g["hidden_states"].shape == r["hidden_states"].shape == (samples[i].input_ids.shape[0], 3, 64)
        codes, scales = quantize_rows(r["hidden_states"].cuda())  # the same values, quantised on the GPU
        assert torch.equal(g["hidden_states"].view(torch.uint8), codes.cpu().view(torch.uint8))
        assert torch.equal(g[SCALES], scales.cpu())
        for contract, tensors in ((base, r), (fp8, g)):
            fp = f"{i + 1:02d}" + ("a" if contract is base else "b") * 38
            store.publish(layout, fp, contract, tensors, values_checked=True)
            art = store.read(layout, fp, contract, pin=True)
            assert torch.equal(art.hidden_states.view(torch.uint8), tensors["hidden_states"].view(torch.uint8))


def test_gpu_nan_flags_cover_real_tokens_only(setup):
    model, base, plan = setup
    samples = [plan.sample(0), _cut(plan.sample(1), 30)]
    from artcache.backends.hf import decoder_layers

    for where, want in (((0, 5), [False, True]), ((1, 10), [True, False]), ((1, 50), [True, True])):
        def poison(_m, _i, output, where=where):
            hs = output[0] if isinstance(output, tuple) else output
            hs[where[0], where[1], 3] = float("nan")  # row, token (50 is padding of the 30-token row)
            return output

        # poison the output of decoder layer 4 = layer id 4 (artcache's ids are output-of-layer i,
        # artcache/layer_ids.py), the deepest captured one; its hook is registered before the backend's, so the
        # capture sees the NaN and then stops the forward. Poisoning an earlier layer (layer 3, read
        # as id 4 by mistake) lets the next layer's masked attention carry a padding NaN into the row's real
        # tokens on CUDA (a masked score is NaN + -inf = NaN: the fused kernels do not skip padded keys): the
        # model's output, not a flag over padding (it failed so at (1, 50))
        h = decoder_layers(model)[4].register_forward_hook(poison)
        try:
            for contract in (base, msgspec.structs.replace(base, dtype="float8_e4m3fn")):
                _, ok = _capture(model, contract, samples)
                assert ok == want, (where, contract.dtype, ok)
        finally:
            h.remove()
