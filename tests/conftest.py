"""The lanes by folder, and the shared fixtures.

A test's lane is the first folder under tests/ when that folder is named after a lane marker
(tests/reliability/... gets ``@pytest.mark.reliability``, tests/gpu/... ``gpu``, and so on): pyproject's
``addopts`` leaves every lane out of the default run, and ``pytest -m LANE`` selects one (tests/README.md).
Test files do not repeat their folder's marker.

Fixtures: the real SmolLM2 target (converted once, cached under the artcache home), a tiny random-weight
Llama target of the same vocabulary and tokenizer, fake plans and contracts for protocol tests, a full disk
for atomic writes, and a Mooncake service."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from artcache.target import DEFAULT_TARGET, TargetInfo, resolve_target
from tests.support.reliability_figures import pytest_terminal_summary  # noqa: F401 - prints the reliability lane's figures

#: the lane markers (pyproject.toml's ``markers``) that name a folder of tests/
LANES = ("slow", "reliability", "distributed", "gpu", "vllm", "multihost", "mooncake", "slurm", "speculators")
TESTS = Path(__file__).resolve().parent

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's lane (a no-op for tests/unit, tests/protocol, ...)."""
    for item in items:
        path = Path(str(item.path)).resolve()
        folder = path.relative_to(TESTS).parts[0] if TESTS in path.parents else ""
        if folder in LANES:
            item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture(scope="session")
def smollm2_target() -> TargetInfo:
    """The real SmolLM2-135M-Instruct target (first run converts the GGUF, ~30 s; later runs are cached)."""
    return resolve_target(DEFAULT_TARGET)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_target):
    from artcache.target import load_tokenizer

    return load_tokenizer(smollm2_target)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_target) -> TargetInfo:
    """A random-weight tiny Llama (vocab 49152, hidden 64, 6 layers, 4 heads / 2 KV heads, intermediate 128,
    tied embeddings) saved as safetensors with SmolLM2's tokenizer files: a fast real-architecture target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-target")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    for name in _TOKENIZER_FILES:
        src = Path(smollm2_target.path) / name
        if src.is_file():
            shutil.copy(src, out / name)
    return resolve_target(str(out))


@pytest.fixture()
def full_temp_writes(monkeypatch):
    """A full disk for :func:`artcache.fsio.atomic_write`, from when the test calls the returned function: every
    ``os.write`` to a ``.part`` temp file raises ENOSPC (other writes go through)."""
    import errno
    import os

    from artcache import fsio

    real_write = fsio.os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    return lambda: monkeypatch.setattr(fsio.os, "write", full)


@pytest.fixture()
def layout(tmp_path):
    """A fresh cache root initialised with crash_child's fake settings (``tmp_path/root``). Modules that
    want a bare root, or more in it, define their own ``layout``."""
    from artcache.layout import CacheLayout
    from artcache.settings import init_settings
    from tests.support import crash_child as K

    lay = CacheLayout(tmp_path / "root")
    lay.create()
    init_settings(lay, K.settings())
    return lay


@dataclass
class FakeSample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


class FakePlan:
    """A 4-sample plan of 8 tokens each (distinct ids per sample), for protocol tests without a tokenizer."""

    def order(self, epoch_len: int = 0):
        from artcache.plan import EpochOrder

        return EpochOrder(len(self), epoch_len or len(self), 0)

    def __len__(self) -> int:
        return 4

    def sample(self, i: int) -> FakeSample:
        return FakeSample(torch.arange(8, dtype=torch.int32) + i, torch.ones(8, dtype=torch.uint8))


@pytest.fixture
def fake_plan() -> FakePlan:
    return FakePlan()


@pytest.fixture
def small_contract():
    from artcache.contract import CaptureContract

    return CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                           layer_ids=(1,), max_length=64, tokenizer_digest="t", template_digest="t")


# ---- payload backends ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def mooncake_service(tmp_path_factory):
    """One Mooncake master + payload holder on loopback for the session (tests/support/mooncake_store.py); skips
    when Mooncake is not installed."""
    from tests.support.mooncake_store import MooncakeService

    svc = MooncakeService(tmp_path_factory.mktemp("mooncake"))
    yield svc
    from artcache.payload import close_all

    close_all()
    svc.close()
