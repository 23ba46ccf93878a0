"""fp8 artifacts: the row-scaled float8_e4m3fn scheme, its artifacts in the store (hash over the
scales, validation, fsck), dequantisation on read in the consumer's collate, the HF backend's capture, and
``artcache producer --dtype fp8`` end to end with a consumer, inspect, fsck and export."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from artcache import store
from artcache.contract import CaptureContract, stored_bytes_per_token
from artcache.errors import IntegrityError
from artcache.fingerprint import fingerprint
from artcache.fp8 import E4M3_MAX, SCALES, dequantize_rows, quantize_rows, relative_error
from artcache.layout import CacheLayout
from tests.support import TINY_SHAREGPT
from tests.support.procs import Proc, inspect_json

C8 = CaptureContract(target_name="tiny-target", target_revision="rev-0001", target_config_hash="cfg01",
                     target_weights_digest="w01", layer_ids=(1, 3), max_length=64, dtype="float8_e4m3fn",
                     tokenizer_digest="tok01", template_digest="tpl01")
C16 = msgspec.structs.replace(C8, dtype="bfloat16")
H = 32
DATA = TINY_SHAREGPT


def capture(t: int = 12, seed: int = 0, zero_row: int | None = None) -> tuple[torch.Tensor, dict]:
    """(float32 hidden states [t, 2, H], the fp8 capture tensors of them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 2, H, generator=g) * torch.logspace(-3, 2, t)[:, None, None]
    if zero_row is not None:
        x[zero_row, 1] = 0
    codes, scales = quantize_rows(x)
    return x, {"hidden_states": codes, SCALES: scales,
               "input_ids": torch.randint(0, 50000, (t,), generator=g, dtype=torch.int32),
               "loss_mask": torch.ones(t, dtype=torch.uint8)}


def fp_of(ts: dict, contract: CaptureContract = C8) -> str:
    return fingerprint(contract, ts["input_ids"], ts["loss_mask"])


@pytest.fixture()
def layout(tmp_path) -> CacheLayout:
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    return lay


# ---- the scheme ---------------------------------------------------------------------------------------

def test_scheme_matches_an_independent_numpy_implementation():
    """scale = absmax / 448 per row (fp32); code = e4m3fn(x / scale), round to nearest even; 0 rows: scale 0."""
    x, ts = capture(zero_row=3)
    xf = x.numpy()
    absmax = np.abs(xf).max(axis=-1).astype(np.float32)
    want_scales = absmax / np.float32(448.0)
    assert np.array_equal(ts[SCALES].numpy(), want_scales)
    div = np.where(want_scales > 0, want_scales, np.float32(1))
    y = np.clip(xf / div[..., None], -448, 448)
    # e4m3fn's non-negative codes 0x00..0x7E in increasing value order (0x7F is NaN): round |y| to the
    # nearest, a tie to the even code (mantissa lowest bit 0); the sign bit is separate
    table = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.all(np.diff(table) > 0) and table[-1] == 448
    mag = np.abs(y).reshape(-1)
    hi = np.clip(np.searchsorted(table, mag), 1, 126)
    lo = hi - 1
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo).astype(np.uint8)
    code |= np.where(np.signbit(y.reshape(-1)) & (code != 0), 0x80, 0).astype(np.uint8)
    got = ts["hidden_states"].view(torch.uint8).numpy().reshape(-1)
    nonzero = code != 0  # -0 and +0 are both zero codes; compare them as values
    assert np.array_equal(got[nonzero], code[nonzero]) and not np.any(got[~nonzero] & 0x7F)


def test_zero_rows_have_scale_zero_and_dequantise_to_exact_zeros():
    x, ts = capture(zero_row=5)
    assert float(ts[SCALES][5, 1]) == 0.0 and not bool(ts["hidden_states"][5, 1].float().any())
    deq = dequantize_rows(ts["hidden_states"], ts[SCALES])
    assert bool((deq[5, 1] == 0).all()) and bool(torch.isfinite(deq).all())


def test_error_bound_and_saturation():
    x, ts = capture(t=40)
    deq = dequantize_rows(ts["hidden_states"], ts[SCALES])
    s = ts[SCALES][..., None]
    normal = (x / s).abs() >= 2.0 ** -6
    assert bool(((deq - x).abs() <= 2.0 ** -4 * x.abs() + 1e-30)[normal].all())
    assert bool(((deq - x).abs() <= 2.0 ** -10 * s.expand_as(x) * 1.0001)[~normal].all())
    # every row's absmax element maps to +-448 exactly (the top code), so nothing clips
    assert torch.equal(ts["hidden_states"].float().abs().amax(-1), torch.full((40, 2), E4M3_MAX))
    err = relative_error(x, ts["hidden_states"], ts[SCALES])
    assert err.shape == (2,) and 0 < float(err.max()) < 2.0 ** -4


def test_dequantize_rejects_mismatched_inputs():
    _, ts = capture()
    with pytest.raises(ValueError, match="do not match"):
        dequantize_rows(ts["hidden_states"], ts[SCALES][:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_rows(ts["hidden_states"].float(), ts[SCALES])


# ---- the store ----------------------------------------------------------------------------------------

def test_fp8_artifact_round_trip_half_the_bytes_and_loads_with_safetensors(layout, tmp_path):
    x, ts = capture(t=64)
    fp = fp_of(ts)
    n8 = store.publish(layout, fp, C8, ts, verify_tokens=True)
    bf = {"hidden_states": x.to(torch.bfloat16), "input_ids": ts["input_ids"], "loss_mask": ts["loss_mask"]}
    n16 = store.publish(layout, fp_of(bf, C16), C16, bf)
    # data: T·m·H codes + T·m fp32 scales + 5 B/token against T·m·H·2 + 5 B/token, plus each header
    for n, contract, f in ((n8, C8, fp), (n16, C16, fp_of(bf, C16))):
        (hlen,) = struct.unpack("<Q", layout.object_path(f).read_bytes()[:8])
        assert n == 8 + hlen + 64 * stored_bytes_per_token(contract.dtype, 2, H)
    # regression (ckpt-gpu-lane rebase): the disk bound the bench and `artcache run` plan with counts fp8's
    # scales (it sized fp8 as 1 B per value alone, below the file it bounds)
    for n, contract, f in ((n8, C8, fp), (n16, C16, fp_of(bf, C16))):
        (hlen,) = struct.unpack("<Q", layout.object_path(f).read_bytes()[:8])
        bound = store.artifact_bytes_bound(contract, H, 64)
        assert bound >= n and bound - store.ARTIFACT_HEADER_BOUND >= n - 8 - hlen  # the data part alone too
    art = store.read(layout, fp, C8, verify_tokens=True)
    assert art.hidden_states.dtype == torch.float8_e4m3fn and art.hidden_scales.dtype == torch.float32
    assert torch.equal(art.hidden_states.view(torch.uint8), ts["hidden_states"].view(torch.uint8))
    assert torch.equal(art.hidden_scales, ts[SCALES]) and art.extras == {}
    assert torch.equal(art.hidden(), dequantize_rows(ts["hidden_states"], ts[SCALES]))
    assert art.hidden(torch.bfloat16).dtype == torch.bfloat16
    loaded = load_file(str(layout.object_path(fp)))
    assert loaded["hidden_states"].dtype == torch.float8_e4m3fn and torch.equal(loaded[SCALES], ts[SCALES])


def _scales_offset(path: Path) -> int:
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    return 8 + hlen + json.loads(raw[8:8 + hlen])[SCALES]["data_offsets"][0]


def test_a_flipped_scale_byte_is_caught_and_quarantined(layout):
    _, ts = capture()
    fp = fp_of(ts)
    store.publish(layout, fp, C8, ts)
    path = layout.object_path(fp)
    raw = bytearray(path.read_bytes())
    raw[_scales_offset(path) + 5] ^= 0x40  # one bit of one scale's exponent/mantissa
    path.write_bytes(bytes(raw))
    assert store.verify(layout, fp, C8) == f"artifact {fp} failed its content hash"
    with pytest.raises(IntegrityError, match="content hash"):
        store.read(layout, fp, C8)
    assert not store.exists(layout, fp) and len(list(layout.quarantine.iterdir())) == 1


def test_fp8_validation_refuses_missing_wrong_or_bad_scales(layout):
    _, ts = capture()
    fp = fp_of(ts)
    cases = [
        ({k: v for k, v in ts.items() if k != SCALES}, C8, "needs tensor 'hidden_scales'"),
        ({**ts, SCALES: ts[SCALES].to(torch.bfloat16)}, C8, "must be float32"),
        ({**ts, SCALES: ts[SCALES][:, :1].contiguous()}, C8, "must be float32 \\[12, 2\\]"),
        ({**ts, SCALES: ts[SCALES].clone().index_fill_(0, torch.tensor([2]), float("nan"))}, C8, "NaN, Inf or"),
        ({**ts, SCALES: -ts[SCALES]}, C8, "negative"),
        ({**ts, "hidden_states": ts["hidden_states"].clone().view(torch.uint8).index_fill_(
            0, torch.tensor([1]), 0x7F).view(torch.float8_e4m3fn)}, C8, "NaN or Inf"),
        ({**ts, "hidden_states": ts["hidden_states"].float().to(torch.bfloat16)}, C8, "!= contract dtype"),
        ({**ts, "hidden_states": ts["hidden_states"].float().to(torch.bfloat16)}, C16, "fp8 captures only"),
    ]
    for tensors, contract, match in cases:
        with pytest.raises(IntegrityError, match=match):
            store.publish(layout, fp, contract, tensors)
    assert not store.exists(layout, fp) and not list(layout.tmp.iterdir())


# ---- the consumer's collate ---------------------------------------------------------------------------

def _leased(art: store.Artifact, pos: int):
    from artcache.client import Leased

    return Leased(pos, art, f"lease-{pos}")


def test_collate_dequantises_fp8_into_the_compute_dtype(layout):
    from artcache.trainers.consumer.reader import collate

    arts = []
    for t, seed in ((12, 0), (7, 1)):
        _, ts = capture(t=t, seed=seed)
        fp = fp_of(ts)
        store.publish(layout, fp, C8, ts)
        arts.append(store.read(layout, fp, C8))
    one = collate([_leased(arts[0], 0)], torch.device("cpu"))
    assert one.hidden.dtype == torch.float32 and torch.equal(one.hidden[0], arts[0].hidden())
    both = collate([_leased(a, i) for i, a in enumerate(arts)], torch.device("cpu"), layers=torch.tensor([1, 1, 0]),
                   last_layer=1)
    assert both.hidden.shape == (2, 12, 3, H) and both.hidden.dtype == torch.float32
    for i, a in enumerate(arts):
        n = a.input_ids.shape[0]
        assert torch.equal(both.hidden[i, :n], a.hidden()[:, [1, 1, 0]])
        assert not bool(both.hidden[i, n:].any())
        assert torch.equal(both.last_layer[i, :n], a.hidden()[:, 1])
    bf = collate([_leased(arts[0], 0)], torch.device("cpu"), layers=slice(0, 1), hidden_dtype=torch.bfloat16)
    assert bf.hidden.dtype == torch.bfloat16 and bf.hidden.shape == (1, 12, 1, H)


# ---- the HF backend -----------------------------------------------------------------------------------

def test_hf_backend_fp8_capture_is_the_quantised_float_capture(tiny_target):
    from artcache.backends.hf import HFCaptureBackend
    from artcache.plan import PlanSpec, build_synthetic_plan
    from artcache.target import load_target_model

    model = load_target_model(tiny_target, device="cpu", dtype=torch.float32)
    base = CaptureContract(target_name=tiny_target.name, target_revision=tiny_target.revision,
                           target_config_hash=tiny_target.config_hash, target_weights_digest=tiny_target.weights_digest,
                           layer_ids=(0, 2, 4), dtype="float32", max_length=32, tokenizer_digest="t",
                           template_digest="t")
    plan = build_synthetic_plan(PlanSpec(dataset="synthetic", max_length=32, max_samples=3),
                                target_vocab_size=tiny_target.vocab_size)
    samples = [plan.sample(0), plan.sample(1)]
    backend = HFCaptureBackend(model, base)
    ref = backend.capture(samples)
    backend.close()  # its hooks would cut the next backend's forward short
    assert ref.ready() == [False, False]  # CPU: values are checked at publication
    backend = HFCaptureBackend(model, msgspec.structs.replace(base, dtype="float8_e4m3fn"))
    got = backend.capture(samples)
    backend.close()
    for r, g in zip(ref, got, strict=True):
        codes, scales = quantize_rows(r["hidden_states"])
        assert torch.equal(g["hidden_states"].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(g[SCALES], scales) and g[SCALES].shape == r["hidden_states"].shape[:2]
        store.validate_capture(msgspec.structs.replace(base, dtype="float8_e4m3fn"), g)
        err = relative_error(r["hidden_states"], g["hidden_states"], g[SCALES])
        assert float(err.max()) < 0.05


# ---- end to end ---------------------------------------------------------------------------------------

def test_producer_dtype_fp8_end_to_end(tmp_path, tiny_target):
    """``artcache producer --dtype fp8``: the contract stores float8_e4m3fn; a consumer trains from it; inspect
    counts it as any root; fsck passes it and catches a flipped scale; export of the draft is unaffected."""
    from artcache.app.cli import main
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.settings import load_settings

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=12,
                                max_length=96, draft_layers=3, dtype="fp8"))  # the root, as the producer makes it
    prod = Proc("producer", ["producer", "--cache", str(cache), "--target", tiny_target.path, "--data", str(DATA),
                             "--max-samples", "12", "--max-length", "96", "--draft-layers", "3", "--threads", "1",
                             "--dtype", "fp8", "--exit-when-done", "--done-grace", "1"], tmp_path)
    cons = Proc("c", ["consume", "--cache", str(cache), "--id", "c", "--block-size", "4", "--window", "2:8",
                      "--anchors", "4", "--steps", "3", "--batch-size", "2", "--threads", "1",
                      "--demand-timeout", "180", "--out", str(tmp_path / "runs" / "c")], tmp_path)
    cons.expect(0)
    prod.expect(0)
    layout = CacheLayout(cache)
    assert load_settings(layout).contract.dtype == "float8_e4m3fn"
    acc = inspect_json(cache)
    assert acc["violations"] == [] and acc["cache"]["failures"] == 0 and acc["cache"]["publications"] >= 6
    # every publication was fp8: its size is the fp8 data of its tokens plus a header (about half of bf16)
    from artcache import journal as J
    from artcache.plan import Plan

    contract = load_settings(layout).contract
    plan = Plan.load(layout.plan_dir(load_settings(layout).plan_id))
    tokens = {fingerprint(contract, plan.sample(i).input_ids, plan.sample(i).loss_mask):
              int(plan.sample(i).input_ids.shape[0]) for i in range(len(plan))}
    pubs = [e for e in J.read_events(layout.journal).events if isinstance(e, J.Publish)]
    assert pubs
    for e in pubs:
        data = tokens[e.fp] * stored_bytes_per_token("float8_e4m3fn", 3, 64)
        assert data < e.nbytes < data + 4096
        assert e.nbytes < 0.6 * tokens[e.fp] * stored_bytes_per_token("bfloat16", 3, 64)
    # fsck on the fp8 root: a published artifact passes; with one scale bit flipped it is reported
    from artcache.backends.hf import HFCaptureBackend
    from artcache.target import load_target_model

    backend = HFCaptureBackend(load_target_model(tiny_target, device="cpu", dtype=torch.float32), contract)
    s = plan.sample(0)
    fp = fingerprint(contract, s.input_ids, s.loss_mask)
    store.publish(layout, fp, contract, backend.capture([s])[0], verify_tokens=True)
    backend.close()
    runner = CliRunner()
    r = runner.invoke(main, ["fsck", "--cache", str(cache), "--json"])
    assert r.exit_code == 0, r.output
    path = layout.object_path(fp)
    raw = bytearray(path.read_bytes())
    raw[_scales_offset(path)] ^= 0x01
    path.write_bytes(bytes(raw))
    r = runner.invoke(main, ["fsck", "--cache", str(cache), "--json"])
    assert r.exit_code != 0 and "content hash" in r.output, r.output
    ck = tmp_path / "runs" / "c"
    out = tmp_path / "export"
    r = runner.invoke(main, ["export", "--checkpoint", str(ck), "--out", str(out), "--target", tiny_target.path])
    assert r.exit_code == 0, r.output
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_regression_bad_fp8_scales_behind_a_recomputed_hash_are_quarantined_on_read(layout, bad):
    """An fp8 artifact whose scales are NaN, Inf or negative, with its content hash recomputed over them (a writer
    that skipped validation, or damage re-hashed), was read and trained on: a read did not look at values, so
    the run diverged later (TrainingDiverged blaming --lr) without naming the artifact. A read now checks the
    scales, names the artifact and the bad scale, and quarantines the file like any corruption."""
    _, ts = capture()
    fp = fp_of(ts)
    scales = ts[SCALES].clone()
    scales[3, 1] = bad
    header, chunks = store._encode(fp, C8, {**ts, SCALES: scales})  # the writer's own encoding: hash matches
    layout.object_path(fp).parent.mkdir(parents=True, exist_ok=True)
    layout.object_path(fp).write_bytes(header + b"".join(bytes(c) for c in chunks))
    assert "hidden_scales[3, 1]" in store.verify(layout, fp, C8)  # fsck's check: the same one
    with pytest.raises(IntegrityError, match=rf"artifact {fp}: hidden_scales .*\[3, 1\]"):
        store.read(layout, fp, C8, verify_tokens=True)
    assert not store.exists(layout, fp) and len(list(layout.quarantine.iterdir())) == 1
