"""Fingerprints: golden values, sensitivity to every input, dtype independence, input validation."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import numpy as np
import pytest
import torch

from artcache import FORMAT_VERSION
from artcache.contract import CaptureContract
from artcache.fingerprint import fingerprint


def make_contract(**kw) -> CaptureContract:
    base = dict(target_name="tiny-target", target_revision="rev-0001", target_config_hash="cfg0123456789abcdef",
                target_weights_digest="w0123456789abcdef", layer_ids=(1, 4, 7), max_length=32,
                tokenizer_digest="tok0123456789abcdef", template_digest="tpl0123456789abcdef")
    base.update(kw)
    return CaptureContract(**base)


C = make_contract()
IDS = [1, 2, 3, 4, 5]
MASK = [0, 0, 1, 1, 1]

# ---- golden values: computed once with the encoding of artcache.fingerprint (version 1). A change to any
# of these literals means the on-disk meaning of fingerprints changed: bump FORMAT_VERSION.
GOLDEN_CANONICAL = (
    b'{"backend":"hf","compute_dtype":"float32","dtype":"bfloat16","format_version":1,'
    b'"include_last_hidden":false,"include_target_argmax":false,"layer_convention":"output-of-layer",'
    b'"layer_ids":[1,4,7],"loss_mask_policy":"assistant-content+eot","max_length":32,'
    b'"target_config_hash":"cfg0123456789abcdef","target_name":"tiny-target","target_revision":"rev-0001",'
    b'"target_weights_digest":"w0123456789abcdef","template_digest":"tpl0123456789abcdef",'
    b'"tokenizer_digest":"tok0123456789abcdef"}')
GOLDEN_CONTRACT_ID = "0f454347b6fee652923779292a41f760ca1c8b58"
GOLDEN = [
    (dict(), IDS, MASK, "7b7f70cc4464bfe7d349272ff2908f51b94d9549"),
    (dict(), [], [], "c37926557746ed7831de0a7598f9061b8b6c2171"),
    (dict(), [0, 49151, 2**31 - 1, 7], [1, 0, 1, 0], "cf00ecf00879193217f3f7e91a6b3561809be03a"),
    (dict(include_last_hidden=True, dtype="float16"), IDS, MASK, "d7d97da7550f12df8cb524e917409b86be6e4002"),
    # fp8 artifacts: the row-scaled e4m3fn scheme is named by the contract's dtype alone, so every
    # earlier golden value stays as it was
    (dict(dtype="float8_e4m3fn", compute_dtype="bfloat16"), IDS, MASK, "027b8445fdd05d2c9db2b21971596fbe500b3566"),
]
GOLDEN_FP8_CONTRACT_ID = "93dff5f61b0d396e3920da2fd87cb39719f55980"


def test_format_version_is_pinned():
    # the goldens below were computed under format 1
    assert FORMAT_VERSION == 1


def test_golden_canonical_contract_and_id():
    assert C.canonical() == GOLDEN_CANONICAL
    assert C.contract_id == GOLDEN_CONTRACT_ID


def test_golden_fp8_contract():
    c = make_contract(dtype="float8_e4m3fn", compute_dtype="bfloat16")
    assert c.canonical() == GOLDEN_CANONICAL.replace(b'"compute_dtype":"float32","dtype":"bfloat16"',
                                                     b'"compute_dtype":"bfloat16","dtype":"float8_e4m3fn"')
    assert c.contract_id == GOLDEN_FP8_CONTRACT_ID
    bf16 = make_contract(compute_dtype="bfloat16")
    assert fingerprint(c, IDS, MASK) != fingerprint(bf16, IDS, MASK)  # never served for a bf16 request


def test_fp8_alias_is_stored_under_its_full_name():
    from artcache.contract import stored_bytes_per_token, stored_dtype

    assert stored_dtype("fp8") == "float8_e4m3fn" and stored_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="'fp4' not accepted"):
        stored_dtype("fp4")
    with pytest.raises(msgspec.ValidationError):  # the contract itself holds only full names
        msgspec.convert({**msgspec.to_builtins(C), "dtype": "fp8"}, CaptureContract)
    # Qwen3-8B-shaped rows: 5 layers of 4096; fp8 is half of bf16 plus 20 B of scales per token
    assert stored_bytes_per_token("bfloat16", 5, 4096) == 40965
    assert stored_bytes_per_token("fp8", 5, 4096) == 20480 + 20 + 5


@pytest.mark.parametrize(("kw", "ids", "mask", "want"), GOLDEN)
def test_golden_fingerprints(kw, ids, mask, want):
    c = make_contract(**kw)
    assert fingerprint(c, ids, mask) == want
    # the canonical-bytes fast path gives the same digest
    assert fingerprint(c.canonical(), ids, mask) == want


def test_encoding_matches_documented_spec():
    """An independent implementation of the docstring's encoding gives the same digest."""
    ids = [5, 0, 70000, 3]
    mask = [1, 0, 1, 1]
    h = hashlib.blake2b(digest_size=20)
    h.update(b"artcache-fp/1\0" + C.canonical() + b"\0")
    h.update(struct.pack("<Q", len(ids)))
    h.update(struct.pack(f"<{len(ids)}i", *ids))
    h.update(bytes(mask))
    assert fingerprint(C, ids, mask) == h.hexdigest()


def test_fingerprint_is_40_lower_hex():
    fp = fingerprint(C, IDS, MASK)
    assert len(fp) == 40 and fp == fp.lower() and int(fp, 16) >= 0


# ---- sensitivity ------------------------------------------------------------------------------------
_ALT = {
    "target_name": "other-target",
    "target_revision": "rev-0002",
    "target_config_hash": "cfg0123456789abcdeF",
    "target_weights_digest": "w0123456789abcdee",
    "layer_ids": (1, 4, 8),
    "dtype": "float16",
    "compute_dtype": "bfloat16",
    "include_last_hidden": True,
    "include_target_argmax": True,
    "max_length": 33,
    "tokenizer_digest": "tok0123456789abcdeg",
    "template_digest": "tpl0123456789abcdeg",
    "loss_mask_policy": "all-tokens",
    "backend": "vllm",
    "format_version": 2,
}


def test_every_contract_field_is_covered_by_the_sensitivity_table():
    fields = set(CaptureContract.__struct_fields__) - {"layer_convention"}  # a one-value Literal
    assert fields == set(_ALT)


@pytest.mark.parametrize("field", sorted(_ALT))
def test_any_contract_field_changes_fingerprint(field):
    other = make_contract(**{field: _ALT[field]})
    assert other != C
    assert fingerprint(other, IDS, MASK) != fingerprint(C, IDS, MASK)
    assert other.contract_id != C.contract_id


def test_layer_order_matters():
    assert fingerprint(make_contract(layer_ids=(7, 4, 1)), IDS, MASK) != fingerprint(C, IDS, MASK)


@pytest.mark.parametrize("i", range(len(IDS)))
def test_one_token_id_changes_fingerprint(i):
    ids = list(IDS)
    ids[i] += 1
    assert fingerprint(C, ids, MASK) != fingerprint(C, IDS, MASK)


@pytest.mark.parametrize("i", range(len(MASK)))
def test_one_mask_bit_changes_fingerprint(i):
    mask = list(MASK)
    mask[i] ^= 1
    assert fingerprint(C, IDS, mask) != fingerprint(C, IDS, MASK)


def test_length_changes_fingerprint():
    base = fingerprint(C, IDS, MASK)
    assert fingerprint(C, IDS[:-1], MASK[:-1]) != base
    assert fingerprint(C, IDS + [0], MASK + [0]) != base
    # a trailing zero token with a zero mask must not collide with the shorter sample
    assert fingerprint(C, [1, 2], [1, 1]) != fingerprint(C, [1, 2, 0], [1, 1, 0])


def test_ids_and_mask_do_not_alias():
    # moving a byte between the id section and the mask section must change the digest (length prefix)
    assert fingerprint(C, [1], [1]) != fingerprint(C, [256], [0])


def test_distinct_samples_distinct_fps():
    rng = np.random.default_rng(0)
    fps = set()
    for _ in range(300):
        n = int(rng.integers(1, 20))
        fps.add(fingerprint(C, rng.integers(0, 50000, n), rng.integers(0, 2, n)))
    assert len(fps) == 300


# ---- dtype independence ----------------------------------------------------------------------------
def test_id_and_mask_dtype_independence():
    want = fingerprint(C, IDS, MASK)
    variants_ids = [
        IDS,
        torch.tensor(IDS, dtype=torch.int32),
        torch.tensor(IDS, dtype=torch.int64),
        torch.tensor(IDS, dtype=torch.int16),
        np.array(IDS, dtype=np.int32),
        np.array(IDS, dtype=np.int64),
        np.array(IDS, dtype=np.uint16),
        np.array(IDS, dtype=">i8"),  # big-endian input is encoded little-endian
        torch.tensor([0] + IDS)[1:],  # a non-contiguous-offset view
    ]
    variants_mask = [
        MASK,
        torch.tensor(MASK, dtype=torch.bool),
        torch.tensor(MASK, dtype=torch.uint8),
        torch.tensor(MASK, dtype=torch.int64),
        np.array(MASK, dtype=bool),
        np.array(MASK, dtype=np.int32),
    ]
    for ids in variants_ids:
        for mask in variants_mask:
            assert fingerprint(C, ids, mask) == want, (type(ids), getattr(ids, "dtype", None), mask)


def test_strided_tensor_ids():
    strided = torch.tensor([1, 99, 2, 99, 3, 99, 4, 99, 5, 99])[::2]
    assert not strided.is_contiguous()
    assert fingerprint(C, strided, MASK) == fingerprint(C, IDS, MASK)


def test_nonzero_mask_values_encode_as_one():
    assert fingerprint(C, IDS, [0, 0, 2, 5, 1]) == fingerprint(C, IDS, MASK)


# ---- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("ids", "mask"), [
    ([1, 2, 3], [1, 1]),
    ([1, 2], [1, 1, 1]),
    (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 1]])),  # 2-D
    (torch.tensor([1, 2, 3]), torch.tensor([[1, 1, 1]])),
    ([], [1]),
])
def test_mismatched_shapes_raise(ids, mask):
    with pytest.raises(ValueError):
        fingerprint(C, ids, mask)


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_ids_outside_int32_raise(bad):
    with pytest.raises(ValueError):
        fingerprint(C, [1, bad], [1, 1])


def test_contract_struct_is_frozen_and_strict():
    with pytest.raises(AttributeError):
        C.max_length = 64  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(C.canonical().replace(b'"backend"', b'"bogus":1,"backend"'), type=CaptureContract)
