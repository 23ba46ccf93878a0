"""The vLLM backend's pieces that need no vLLM (default suite): the contract's ``backend`` field in the
fingerprint (golden values), the layer-id convention mapping, the token check that rejects short or
different captures, and the clear error when vLLM is not installed. The engine itself is tested in
tests/vllm/test_vllm_backend.py (lane ``-m vllm``)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.backends.vllm import (
    INSTALL_HINT,
    VLLMCaptureBackend,
    check_tokens,
    from_vllm_layer_ids,
    to_vllm_layer_ids,
    vllm_available,
)
from artcache.contract import BACKENDS, CaptureContract
from artcache.errors import ArtcacheError, CaptureMismatch, ConfigError
from artcache.fingerprint import fingerprint

BASE = dict(target_name="tiny-target", target_revision="rev-0001", target_config_hash="cfg0123456789abcdef",
            target_weights_digest="w0123456789abcdef", layer_ids=(1, 4, 7), max_length=32,
            tokenizer_digest="tok0123456789abcdef", template_digest="tpl0123456789abcdef")
IDS = [1, 2, 3, 4, 5]
MASK = [0, 0, 1, 1, 1]

# golden values (fingerprint encoding version 1): the hf one equals tests/unit/test_fingerprint.py's GOLDEN[0]
GOLDEN = {
    "hf": ("0f454347b6fee652923779292a41f760ca1c8b58", "7b7f70cc4464bfe7d349272ff2908f51b94d9549"),
    "vllm": ("92c57c54bad9bda7651f943046ea1c13321ac0b7", "33eb700b9f19fb179fb1f8f07fda05c6afe9fa22"),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_backend_fingerprints(backend):
    c = CaptureContract(**BASE, backend=backend)
    assert f'"backend":"{backend}"'.encode() in c.canonical()
    assert (c.contract_id, fingerprint(c, IDS, MASK)) == GOLDEN[backend]


def test_hf_and_vllm_fingerprints_differ():
    """Backends may differ in the last bits: an hf artifact is never served for a vllm contract."""
    hf, vllm = (CaptureContract(**BASE, backend=b) for b in ("hf", "vllm"))
    assert hf.contract_id != vllm.contract_id
    assert fingerprint(hf, IDS, MASK) != fingerprint(vllm, IDS, MASK)
    # both store artcache's convention: only the backend differs
    assert hf.layer_convention == vllm.layer_convention == "output-of-layer"


def test_unknown_backend_is_refused_when_decoding():
    bad = CaptureContract(**BASE).canonical().replace(b'"backend":"hf"', b'"backend":"sglang"')
    with pytest.raises(msgspec.ValidationError, match="backend"):
        msgspec.json.decode(bad, type=CaptureContract)


# ---- layer convention ------------------------------------------------------------------------------------

def test_layer_ids_map_to_vllm_plus_one():
    # output of decoder layer i is the residual stream entering layer i + 1: vLLM's aux id i + 1
    assert to_vllm_layer_ids([0, 1, 14, 29]) == [1, 2, 15, 30]
    assert to_vllm_layer_ids((27, 1, 8)) == [28, 2, 9]  # order kept
    assert from_vllm_layer_ids(to_vllm_layer_ids([5, 0, 29])) == [5, 0, 29]


@pytest.mark.parametrize(("fn", "ids"), [(to_vllm_layer_ids, [3, -1]), (from_vllm_layer_ids, [0, 4])])
def test_layer_ids_outside_the_convention_are_refused(fn, ids):
    with pytest.raises(ConfigError, match=str(ids[1])):
        fn(ids)


# ---- token check -----------------------------------------------------------------------------------------

def test_check_tokens_accepts_an_exact_match_in_any_int_dtype():
    check_tokens(0, torch.tensor([5, 6, 7], dtype=torch.int32), torch.tensor([5, 6, 7], dtype=torch.int64))


def test_check_tokens_rejects_a_short_capture():
    with pytest.raises(CaptureMismatch, match=r"sample 2 .* captured 2 tokens, 3 were requested"):
        check_tokens(2, torch.tensor([5, 6, 7]), torch.tensor([5, 6]))


def test_check_tokens_rejects_a_different_id():
    with pytest.raises(CaptureMismatch, match=r"token id 9 at position 1, 6 was requested"):
        check_tokens(0, torch.tensor([5, 6, 7]), torch.tensor([5, 9, 7]))


def test_capture_mismatch_is_a_retryable_artcache_runtime_error():
    err = CaptureMismatch("x")
    assert isinstance(err, ArtcacheError) and isinstance(err, RuntimeError) and err.retryable


# ---- configuration ---------------------------------------------------------------------------------------

def test_backend_refuses_a_non_vllm_contract():
    with pytest.raises(ConfigError, match="backend 'hf'"):
        VLLMCaptureBackend("/nonexistent", CaptureContract(**BASE, backend="hf"))


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_cli_vllm_backend_without_vllm_is_a_clear_error(tmp_path):
    cache = tmp_path / "cache"
    res = CliRunner().invoke(main, ["producer", "--cache", str(cache), "--backend", "vllm"])
    assert res.exit_code == 2, res.output
    assert "install artcache[vllm]" in res.output and INSTALL_HINT in res.output
    assert not cache.exists()  # refused before anything was written


def test_cli_refuses_an_unknown_backend(tmp_path):
    res = CliRunner().invoke(main, ["producer", "--cache", str(tmp_path / "c"), "--backend", "sglang"])
    assert res.exit_code == 2 and "sglang" in res.output and "vllm" in res.output
    assert not (tmp_path / "c").exists()


def test_producer_config_refuses_an_unknown_backend(tmp_path):
    from artcache.producer import ProducerConfig, prepare_root

    with pytest.raises(ConfigError, match=r"--backend 'sglang' is not accepted: use one of hf, vllm"):
        prepare_root(ProducerConfig(cache=str(tmp_path / "c"), backend="sglang"))
    assert not (tmp_path / "c").exists()


def test_vllm_refuses_a_random_weight_target(tmp_path, monkeypatch):
    from artcache.backends import vllm as vllm_backend
    from artcache.producer import ProducerConfig, prepare_root

    monkeypatch.setattr(vllm_backend, "require_vllm", lambda: None)
    with pytest.raises(ConfigError, match="random-weight"):
        prepare_root(ProducerConfig(cache=str(tmp_path / "c"), backend="vllm", target="random:tiny-llama",
                                    dataset="synthetic", max_samples=4, max_length=32, draft_layers=2))
    assert not (tmp_path / "c").exists()


def test_backend_flows_into_the_root_contract(tmp_path, tiny_target, monkeypatch):
    """prepare_root records backend 'vllm' in artcache.json; an hf producer is then refused on that root."""
    from artcache.backends import vllm as vllm_backend
    from artcache.producer import ProducerConfig, prepare_root

    monkeypatch.setattr(vllm_backend, "require_vllm", lambda: None)  # the root only; no engine is started
    kw = dict(cache=str(tmp_path / "c"), target=tiny_target.path, max_samples=4, max_length=64, layer_ids=[1, 3])
    _layout, settings, _plan, _info, _tok = prepare_root(ProducerConfig(**kw, backend="vllm"))
    assert settings.contract.backend == "vllm"
    with pytest.raises(ConfigError, match="differs in: --backend vllm there, hf here"):
        prepare_root(ProducerConfig(**kw, backend="hf"))
