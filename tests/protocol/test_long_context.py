"""Long samples: chunked prefill in the producer (``--prefill-chunk``), the batch-token limit per forward pass,
the target's position limit, and a 32,768-token plan end to end on the tiny random target."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from artcache.contract import CaptureContract
from artcache.errors import ConfigError
from artcache.scheduler import SchedulerLimits, Want, next_batch


def _tiny_model(max_positions: int = 4096):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=max_positions,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _contract(layer_ids=(0, 2), dtype="float32") -> CaptureContract:
    return CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                           layer_ids=layer_ids, dtype=dtype, max_length=4096, tokenizer_digest="t",
                           template_digest="t")


class _Sample:
    def __init__(self, ids: torch.Tensor) -> None:
        self.input_ids = ids.to(torch.int32)
        self.loss_mask = torch.ones(ids.shape[0], dtype=torch.uint8)


def _capture(model, samples, chunk: int, dtype: str = "float32"):
    from artcache.backends.hf import HFCaptureBackend

    backend = HFCaptureBackend(model, _contract(dtype=dtype), prefill_chunk=chunk)
    try:
        return backend.capture(samples)
    finally:
        backend.close()  # its hooks would cut the next backend's forward short


@pytest.mark.parametrize("chunk", [7, 64, 100])
def test_chunked_prefill_equals_one_pass(chunk):
    """A batch of unequal lengths (right padding) prefilled in chunks through the KV cache captures what one pass
    captures, to fp32 rounding, for a chunk that divides the length, one that does not, and one past a row's end;
    a chunk at least the batch's length is the one-pass path itself."""
    model = _tiny_model()
    gen = torch.Generator().manual_seed(1)
    samples = [_Sample(torch.randint(0, 256, (n,), generator=gen)) for n in (192, 131)]
    ref = _capture(model, samples, 0)
    got = _capture(model, samples, chunk)
    for r, g in zip(ref, got, strict=True):
        assert g["hidden_states"].shape == r["hidden_states"].shape
        torch.testing.assert_close(g["hidden_states"], r["hidden_states"], rtol=1e-5, atol=1e-5)
        assert torch.equal(g["input_ids"], r["input_ids"]) and torch.equal(g["loss_mask"], r["loss_mask"])
    same = _capture(model, samples, 192)
    for r, g in zip(ref, same, strict=True):
        assert torch.equal(g["hidden_states"], r["hidden_states"])


def test_chunked_prefill_fp8_is_the_quantised_float_capture():
    """An fp8 contract's chunked capture holds the row-scaled codes of the float chunked capture."""
    from artcache.fp8 import SCALES, quantize_rows

    model = _tiny_model()
    samples = [_Sample(torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(2)))]
    ref = _capture(model, samples, 40)
    got = _capture(model, samples, 40, dtype="float8_e4m3fn")
    codes, scales = quantize_rows(ref[0]["hidden_states"])
    assert torch.equal(got[0]["hidden_states"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got[0][SCALES], scales)


def test_prefill_chunk_refused_negative():
    from artcache.backends.hf import HFCaptureBackend

    with pytest.raises(ConfigError, match="prefill_chunk -1 is invalid"):
        HFCaptureBackend(_tiny_model(), _contract(), prefill_chunk=-1)


def test_batch_tokens_bound_one_forward_pass():
    """Without chunking a full-length sample must fit ``max_batch_tokens`` (the error names --prefill-chunk as the
    way out); with chunking one chunk per row must, and the scheduler counts a long row as one chunk."""
    with pytest.raises(ConfigError, match=r"accepted an integer >= 32768, the plan's max length .*prefill_chunk"):
        SchedulerLimits(max_batch_tokens=8192).validate(32768)
    SchedulerLimits(max_batch_tokens=8192, prefill_chunk=8192).validate(32768)
    with pytest.raises(ConfigError, match=r"max_batch_tokens 4096 is invalid: accepted an integer >= 8192, "
                                          r"prefill_chunk"):
        SchedulerLimits(max_batch_tokens=4096, prefill_chunk=8192).validate(32768)
    lengths = {0: 32768, 1: 32768, 2: 100}
    queue = [Want(fp=f"f{i}", sample=i, priority=(1, float(i))) for i in lengths]
    limits = SchedulerLimits(max_batch_tokens=16384, prefill_chunk=8192)
    assert [w.sample for w in next_batch(queue, lengths.get, limits)] == [0, 1]  # 2 rows x one 8192-token chunk
    limits = SchedulerLimits(max_batch_tokens=8192, prefill_chunk=8192)
    assert [w.sample for w in next_batch(queue, lengths.get, limits)] == [0]


def test_prefill_chunk_flag_and_config(tmp_path):
    """``--prefill-chunk`` reaches the scheduler limits; the run config's ``capture.prefill_chunk`` too; the vLLM
    backend and a tensor-parallel target refuse it in one line."""
    from artcache.app.config import RunConfig, producer_config
    from artcache.producer import ProducerConfig

    cfg = msgspec.convert({"out": str(tmp_path), "capture": {"prefill_chunk": 4096}}, RunConfig)
    assert producer_config(cfg).limits.prefill_chunk == 4096
    bad = ProducerConfig(cache=str(tmp_path / "c"), backend="vllm", limits=SchedulerLimits(prefill_chunk=64))
    with pytest.raises(ConfigError, match="--prefill-chunk 64 is invalid with --backend vllm"):
        bad.validate()
    bad = ProducerConfig(cache=str(tmp_path / "c"), tensor_parallel_size=2, limits=SchedulerLimits(prefill_chunk=64))
    with pytest.raises(ConfigError, match="--prefill-chunk 64 is invalid with --tensor-parallel-size 2"):
        bad.validate()


def test_prefill_chunk_changes_no_contract_or_fingerprint(tmp_path):
    """Two roots of the same plan, captured with and without chunking, have the same contract and plan, so the
    same fingerprints: the chunk size is a producer setting, not part of what a capture is."""
    from artcache.fingerprint import PlanFingerprints
    from artcache.producer import ProducerConfig, prepare_root

    got = []
    for chunk in (0, 16):
        cfg = ProducerConfig(cache=str(tmp_path / f"c{chunk}"), target="random:tiny-llama", dataset="synthetic",
                             max_length=64, max_samples=4, draft_layers=3,
                             limits=SchedulerLimits(max_batch_tokens=64 if not chunk else 16, prefill_chunk=chunk))
        _, settings, plan, _, _ = prepare_root(cfg)
        got.append((settings.contract.contract_id, plan.plan_id, PlanFingerprints(settings.contract, plan).table()[0]))
    assert got[0] == got[1]


def test_chunked_fill_publishes_the_same_artifacts(tmp_path):
    """A producer filling a root with 16-token prefill chunks (``--batch-tokens 16`` < the 64-token plan) publishes
    the one-pass root's fingerprints, with the same tokens and float32 values to 1e-5."""
    from artcache import store
    from artcache.fingerprint import PlanFingerprints
    from artcache.layout import CacheLayout
    from artcache.plan import Plan
    from artcache.producer import ProducerConfig, run_producer
    from artcache.settings import load_settings

    roots = {}
    for chunk in (0, 16):
        root = tmp_path / f"c{chunk}"
        cfg = ProducerConfig(cache=str(root), target="random:tiny-llama", dataset="synthetic", max_length=64,
                             max_samples=3, draft_layers=3, dtype="float32", fill=True, poll_interval_s=0.0,
                             threads=1, limits=SchedulerLimits(max_batch_tokens=64 if not chunk else 16,
                                                               max_batch_samples=2, prefill_chunk=chunk))
        assert run_producer(cfg).fill_complete
        layout = CacheLayout(root)
        settings = load_settings(layout)
        fps = PlanFingerprints(settings.contract, Plan.load(layout.plan_dir(settings.plan_id))).table()[0]
        roots[chunk] = {fp: store.read(layout, fp, settings.contract, verify_tokens=True) for fp in fps}
    assert roots[0].keys() == roots[16].keys() and len(roots[0]) == 3
    for fp, ref in roots[0].items():
        got = roots[16][fp]
        assert torch.equal(got.input_ids, ref.input_ids)
        torch.testing.assert_close(got.hidden_states, ref.hidden_states, rtol=1e-5, atol=1e-5)


def test_max_length_beyond_target_positions_refused(tmp_path):
    """A plan longer than the target's max_position_embeddings is refused in one line, and nothing is written."""
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.target import resolve_target

    limit = resolve_target("random:tiny-llama").max_positions
    assert limit == 32768
    cfg = ProducerConfig(cache=str(tmp_path / "c"), target="random:tiny-llama", dataset="synthetic",
                         max_length=limit + 1, max_samples=2, draft_layers=3,
                         limits=SchedulerLimits(prefill_chunk=8192))
    with pytest.raises(ConfigError, match=r"--max-length 32769 is invalid for target 'random:tiny-llama': accepted "
                                          r"an integer <= 32768, its max_position_embeddings"):
        prepare_root(cfg)
    assert not (tmp_path / "c").exists()


def test_random_target_of_an_older_config_is_rewritten(tmp_path):
    """A random target directory written from an older config (another max_position_embeddings) is rewritten from
    today's, so its described limits are today's."""
    from artcache.target import resolve_target

    first = resolve_target("random:tiny-llama", home=tmp_path)
    cfg_path = tmp_path / "targets" / "random-tiny-llama-s0" / "config.json"
    old = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(old, max_position_embeddings=4096)))
    assert resolve_target("random:tiny-llama", home=tmp_path) == first
    assert json.loads(cfg_path.read_text()) == old


# ---- a 32,768-token plan end to end ----------------------------------------------------------------------
