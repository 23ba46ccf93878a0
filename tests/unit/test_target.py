from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from artcache.errors import ConfigError
from artcache.hashing import canonical_json, digest_bytes, digest_file, strong_digest
from artcache.target import (
    load_embedding_and_lm_head,
    load_target_model,
    load_tokenizer,
    resolve_target,
    template_digest,
    tokenizer_digest,
)


def test_hashing_helpers(tmp_path):
    f = tmp_path / "x.bin"
    data = b"hello" * 1000
    f.write_bytes(data)
    assert digest_file(f, chunk=7) == digest_file(f) == digest_bytes(data)
    assert len(digest_bytes(b"")) == 32
    assert len(strong_digest(b"a")) == 40 and strong_digest(b"a") != strong_digest(b"b")
    assert canonical_json({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'
    assert canonical_json({"b": 1, "a": 2}) == canonical_json({"a": 2, "b": 1})


def test_unknown_name_lists_accepted(tmp_path):
    with pytest.raises(ConfigError, match="smollm2-135m-instruct"):
        resolve_target("gpt-17", home=tmp_path)


def test_directory_without_weights_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="safetensors"):
        resolve_target(str(tmp_path))


def test_smollm2_info(smollm2_target):
    info = smollm2_target
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert info.architecture == "LlamaForCausalLM" and info.tie_word_embeddings and info.final_norm == "rmsnorm"
    assert len(info.weights_digest) == 32 and len(info.config_hash) == 40
    assert "gguf." in info.revision
    config = json.loads(Path(info.path, "config.json").read_text())
    assert "quantization_config" not in config
    # cached: a second resolve is cheap and identical
    assert resolve_target("smollm2-135m-instruct") == info


def test_smollm2_embedding_and_tokenizer(smollm2_target):
    embed, head = load_embedding_and_lm_head(smollm2_target)
    assert embed.shape == head.shape == (49152, 576)
    assert torch.equal(embed, head)
    tok = load_tokenizer(smollm2_target)
    assert tokenizer_digest(tok) == tokenizer_digest(load_tokenizer(smollm2_target))
    assert len(template_digest(tok)) == 40
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_tiny_target_resolves_and_loads(tiny_target, smollm2_target):
    assert (tiny_target.num_layers, tiny_target.hidden_size, tiny_target.vocab_size) == (6, 64, 49152)
    assert tiny_target.revision == "local" and tiny_target.tie_word_embeddings
    assert tiny_target.weights_digest != smollm2_target.weights_digest
    model = load_target_model(tiny_target)
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.bfloat16
    embed, head = load_embedding_and_lm_head(tiny_target)
    assert embed.shape == (49152, 64) and torch.equal(embed, head)
    tok = load_tokenizer(tiny_target)
    assert tokenizer_digest(tok) == tokenizer_digest(load_tokenizer(smollm2_target))
    ids = torch.tensor([tok.encode("hello world")])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], 49152) and len(out.hidden_states) == 7


def test_weights_digest_sidecar_reused(tiny_target):
    # the sidecar written on first resolve makes a second resolve return the same digest without rehashing
    again = resolve_target(tiny_target.path)
    assert again.weights_digest == tiny_target.weights_digest
    assert again.config_hash == tiny_target.config_hash
