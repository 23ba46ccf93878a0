"""Fingerprints: the hex digest of the canonical encoding of (capture contract, sample).

Encoding (version 1)::

    b"artcache-fp/1\\0" + canonical_json(contract) + b"\\0"
      + len(input_ids) as 8-byte little-endian + input_ids as int32 little-endian
      + loss_mask as uint8 (0/1)

digested with BLAKE2b-160 (40 hex digits). Golden tests in tests/unit/test_fingerprint.py pin it: a
change to this function that changes digests must bump artcache.FORMAT_VERSION.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from artcache.contract import CaptureContract

_PREFIX = b"artcache-fp/1\0"


def _as_numpy(x: torch.Tensor | np.ndarray, dtype: np.dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x).astype(dtype, copy=False))


def fingerprint(contract: CaptureContract | bytes, input_ids, loss_mask) -> str:
    """Fingerprint of one sample under ``contract``.

    Args:
        contract: the capture contract, or its ``canonical()`` bytes (faster in loops).
        input_ids: [T] integer token ids (any int dtype; encoded as int32 little-endian).
        loss_mask: [T] 0/1 mask (any dtype; encoded as uint8).

    Returns:
        40 lower-case hex digits.

    Raises:
        ValueError: lengths differ, or ids do not fit in int32.
    """
    ids = _as_numpy(input_ids, np.dtype("<i8"))
    mask = _as_numpy(loss_mask, np.dtype("u1"))
    if ids.ndim != 1 or mask.shape != ids.shape:
        raise ValueError(f"input_ids {ids.shape} and loss_mask {mask.shape} must be equal 1-D shapes")
    if ids.size and (ids.min() < -(2**31) or ids.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    canon = contract if isinstance(contract, bytes) else contract.canonical()
    h = hashlib.blake2b(digest_size=20)
    h.update(_PREFIX)
    h.update(canon)
    h.update(b"\0")
    h.update(int(ids.size).to_bytes(8, "little"))
    h.update(ids.astype("<i4").tobytes())
    h.update((mask != 0).astype("u1").tobytes())
    return h.hexdigest()


class PlanFingerprints:
    """Fingerprint of each plan sample under one contract, computed once per sample.

    ``fps.of_sample(i)``: sample ``i``'s fingerprint. A run position maps to a sample through
    the consumer's :class:`artcache.plan.EpochOrder` (``plan.order(epoch_len).sample(p)``); a sample read in
    a later epoch has the same fingerprint (and artifact). :meth:`table` computes every sample's (the
    producer's reverse map and duplicate detection).
    """

    def __init__(self, contract: CaptureContract, plan) -> None:
        self._canon = contract.canonical()
        self.plan = plan
        self._cache: dict[int, str] = {}

    def of_sample(self, index: int) -> str:
        """Sample ``index``'s fingerprint. Raises IndexError outside ``[0, len(plan))``."""
        fp = self._cache.get(index)
        if fp is None:
            s = self.plan.sample(index)
            fp = self._cache[index] = fingerprint(self._canon, s.input_ids, s.loss_mask)
        return fp

    def __call__(self, index: int) -> str:
        """:meth:`of_sample` of ``index`` modulo the plan length (a sample index, or a position of a plan
        walked in plan order: epoch 0, or a reader that does not reshuffle)."""
        return self.of_sample(index % len(self.plan))

    def table(self) -> tuple[list[str], dict[str, int], np.ndarray]:
        """(fingerprint of every sample, fingerprint → its first sample, int64 [len(plan)] sample → the
        first sample with the same fingerprint). Hashes every sample not hashed yet (once)."""
        fps = [self.of_sample(i) for i in range(len(self.plan))]
        first: dict[str, int] = {}
        canon = np.empty(len(fps), dtype=np.int64)
        for i, fp in enumerate(fps):
            canon[i] = first.setdefault(fp, i)
        return fps, first, canon
