"""The artifact encoding artcache writes itself is standard safetensors, deterministic, zero-copy on read."""

import safetensors
import safetensors.torch
import torch

from artcache import store
from artcache.contract import CaptureContract
from artcache.layout import CacheLayout

CONTRACT = CaptureContract(target_name="t", target_revision="r", target_config_hash="c",
                           target_weights_digest="w", layer_ids=(1, 2, 3), max_length=64,
                           tokenizer_digest="t", template_digest="t")


def _capture(t: int = 17, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(t, 3, 8, generator=g).to(torch.bfloat16),
            "input_ids": torch.randint(0, 1000, (t,), generator=g, dtype=torch.int32),
            "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.uint8)}


def test_published_artifact_loads_with_safetensors(tmp_path):
    layout = CacheLayout(tmp_path)
    layout.create()
    fp = "ab" * 20
    tensors = _capture()
    store.publish(layout, fp, CONTRACT, tensors)
    loaded = safetensors.torch.load_file(layout.object_path(fp))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)
    with safetensors.safe_open(layout.object_path(fp), framework="pt") as f:
        meta = f.metadata()
    assert meta["fingerprint"] == fp and meta["contract_id"] == CONTRACT.contract_id
    assert len(meta["content_hash"]) == 32


def test_same_capture_gives_identical_bytes(tmp_path):
    a, b = CacheLayout(tmp_path / "a"), CacheLayout(tmp_path / "b")
    for lay in (a, b):
        lay.create()
        store.publish(lay, "cd" * 20, CONTRACT, _capture(seed=3))
    assert a.object_path("cd" * 20).read_bytes() == b.object_path("cd" * 20).read_bytes()


def test_read_returns_views_of_one_buffer(tmp_path):
    layout = CacheLayout(tmp_path)
    layout.create()
    tensors = _capture(t=33)
    store.publish(layout, "ef" * 20, CONTRACT, tensors)
    art = store.read(layout, "ef" * 20, CONTRACT)
    assert torch.equal(art.hidden_states, tensors["hidden_states"])
    assert torch.equal(art.input_ids, tensors["input_ids"]) and torch.equal(art.loss_mask, tensors["loss_mask"])
    # zero-copy: all tensors live inside the one file buffer
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in (art.hidden_states, art.input_ids, art.loss_mask))
    assert spans[-1][1] - spans[0][0] <= art.nbytes  # one region no larger than the file
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # back to back, no overlap


def test_all_finite_detects_nan_and_inf_in_every_float_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(257).to(dtype)
        x[7] = torch.finfo(dtype).max
        assert store.all_finite(x)
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[100] = bad
            assert not store.all_finite(y), (dtype, bad)
