"""The plan: the ordered, deterministic list of samples (token ids + loss mask) every consumer walks.

A plan is derived from (dataset file, seed, tokenizer, chat template, max length, max samples, min loss
tokens). ``plan_id`` is the strong digest of those inputs, so the same inputs give the same id and any
change gives a new one. On disk: ``plans_dir/<plan_id>/plan.safetensors`` (``input_ids`` int32 [total],
``loss_mask`` uint8 [total], ``offsets`` int64 [N+1]) and ``plan.json`` (provenance).

A consumer's run walks *positions* 0, 1, 2, ...: epoch after epoch over the training part of the plan
(its first ``epoch_len`` samples; the rest is a held-out split), in the order :class:`EpochOrder` gives:
epoch 0 in plan order, every later epoch reshuffled by the plan's epoch seed (``plan.json``
``epoch_order``), the same for every consumer of the root.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from artcache.data.sharegpt import locate_sharegpt, read_sharegpt, to_messages
from artcache.data.sources import (
    DataSource,
    read_source,
    record_messages,
    resolve_source,
    source_digest,
    tool_call_texts,
)
from artcache.errors import ArtcacheError, ConfigError, DataError, PublishError
from artcache.fsio import (
    RETRYABLE_ERRNOS,
    apply_share_mode,
    check_free_space,
    describe_errno,
    errno_of,
    publish_dir,
)
from artcache.hashing import canonical_json, check_file, check_record, digest_bytes, digest_file, sealed, strong_digest
from artcache.locking import cache_lock
from artcache.ranges import Count, MaxLength, NonNegative, check_ranges
from artcache.target import template_digest, tokenizer_digest

log = logging.getLogger("artcache.plan")

PLAN_FORMAT_VERSION = 1
#: Part of the plan id: changing how the loss mask is derived must change every plan id.
LOSS_MASK_POLICY = "assistant-content-and-eot/token-overlap/v1"
DATASETS = ("sharegpt", "synthetic")
#: Token ids >= vocab_size - SYNTHETIC_RESERVED never occur in synthetic data (room for a MASK id).
SYNTHETIC_RESERVED = 64
#: how later epochs are shuffled (plan.json ``epoch_order.version``); a change must bump it
EPOCH_ORDER_VERSION = 1
_BATCH = 64  # conversations rendered and tokenized per batch (the fast tokenizer batches in parallel)


class PlanSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a plan is built from. ``dataset``: ``"sharegpt"``, ``"synthetic"`` or a data file (planned exactly as
    the one source of weight 1, :func:`as_sources`: read strictly, in either chat schema).
    ``template_options``: keyword arguments for the chat template (``apply_chat_template``), e.g.
    ``{"enable_thinking": False}``; part of the plan id and of the contract's template digest.
    ``sources``: a weighted mix of data sources (:class:`artcache.data.sources.DataSource`) replacing
    ``dataset`` (:func:`build_mixed_plan`); ``eval``: a separate evaluation source whose samples end the plan as
    the held-out split every consumer shares (``plan.json`` ``heldout``). Both enter the plan id by each source's
    content digest, weight, split and cap.

    Raises ConfigError on construction if a value is outside the range declared on its field (max_length >= 16,
    max_samples >= 1, min_loss_tokens >= 1, seed >= 0: ``plan max_samples 0 is invalid: accepted an integer >= 1``,
    :func:`artcache.ranges.check_ranges`), or a template option is not ``identifier: bool | int | float | str``.
    """

    dataset: str = "sharegpt"
    seed: NonNegative = 0
    max_length: MaxLength = 512
    max_samples: Count = 2000
    min_loss_tokens: Count = 2
    template_options: dict[str, bool | int | float | str] = msgspec.field(default_factory=dict)
    sources: tuple[DataSource, ...] = ()
    eval: DataSource | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ConfigError(f"plan dataset={self.dataset!r} is invalid: accepted {list(DATASETS)} or a file path")
        if self.sources and self.dataset != "sharegpt":
            raise ConfigError(f"data.dataset {self.dataset!r} and data.sources exclude each other: list every "
                              "training source under [[data.sources]] (or give --data several times)")
        if self.eval is not None and not self.sources and self.dataset == "synthetic":
            raise ConfigError("data.eval needs chat data: --data synthetic has no held-out source; give data.sources "
                              "or a dataset file")
        for key, value in dict(self.template_options).items():  # before the field check: its own message
            if not (isinstance(key, str) and key.isidentifier()) or not isinstance(value, (bool, int, float, str)):
                raise ConfigError(f"chat template option {key!r}={value!r} is invalid: accepted NAME=VALUE with a "
                                  "Python identifier NAME and a bool, number or string VALUE")
        check_ranges(self, lambda field: f"plan {field}")
        if self.template_options and self.dataset == "synthetic":
            raise ConfigError("chat template options have no effect on --data synthetic (no chat template is used)")


@dataclass(frozen=True)
class Sample:
    """One plan entry: ``input_ids`` torch.int32 [T], ``loss_mask`` torch.uint8 [T] (1 = supervised)."""

    index: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


def resolve_dataset(dataset: str) -> Path:
    """``"sharegpt"`` -> the bundled ShareGPT file; otherwise an existing file path. ConfigError if neither."""
    if dataset == "sharegpt":
        return locate_sharegpt()
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise ConfigError(f"plan dataset {dataset!r}: not a known dataset {list(DATASETS)} nor an existing file")
    return path.resolve()


def as_sources(spec: PlanSpec) -> PlanSpec:
    """``spec`` with a ``dataset`` that is a file (not ``sharegpt`` / ``synthetic``) moved into ``sources`` as its
    one source of weight 1, so ``--data FILE``, ``data.dataset = "FILE"`` and ``--data FILE:1`` are the same plan
    (same id, same samples), read by the strict reader (:func:`artcache.data.sources.read_source`). Any other spec
    is returned as it is."""
    if spec.dataset in DATASETS or spec.sources:
        return spec
    return msgspec.structs.replace(spec, dataset="sharegpt", sources=(DataSource(path=spec.dataset),))


def compute_plan_id(spec: PlanSpec, dataset_digest: str, tok_digest: str, tmpl_digest: str, *,
                    source_digests: dict | None = None) -> tuple[str, dict]:
    """(plan_id, id inputs): plan_id = strong digest of the canonical json of the id inputs. A dataset file
    enters by its digest only (``spec.dataset`` is replaced by ``"file"``); named datasets by name and digest.
    A mixed plan (``spec.sources`` / ``spec.eval``) enters each source by its content digest in place of its path
    (``source_digests``: ``{"sources": [digest, ...], "eval": digest | None}``, :func:`mix_digests`) with its
    weight, split and cap."""
    spec_inputs = msgspec.to_builtins(spec)
    if not spec_inputs.get("template_options"):  # no options: the id plans had before options existed
        spec_inputs.pop("template_options", None)
    if not spec_inputs.get("sources"):  # no mix, no eval source: the id plans had before either existed
        spec_inputs.pop("sources", None)
    if spec_inputs.get("eval") is None:
        spec_inputs.pop("eval", None)
    if spec.sources or spec.eval is not None:
        if source_digests is None:
            raise ValueError("a mixed plan's id needs its sources' digests (mix_digests)")
        if spec.sources:  # else the one training source is spec.dataset, in by its digest as dataset_digest
            for entry, digest in zip(spec_inputs["sources"], source_digests["sources"], strict=True):
                entry["path"] = digest
        if "eval" in spec_inputs:
            spec_inputs["eval"]["path"] = source_digests["eval"]
    if spec.dataset not in DATASETS:
        # a file is identified by its content digest, never by the path it was given as: the same file
        # given as a relative or absolute path, or copied elsewhere, is the same plan (the path is kept in
        # plan.json as provenance)
        spec_inputs["dataset"] = "file"
    inputs = {"spec": spec_inputs, "dataset_digest": dataset_digest, "tokenizer_digest": tok_digest,
              "template_digest": tmpl_digest, "format_version": PLAN_FORMAT_VERSION,
              "loss_mask_policy": LOSS_MASK_POLICY}
    return strong_digest(canonical_json(inputs)), inputs


def _end_of_turn(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    return "<|im_end|>" if "<|im_end|>" in vocab else (tokenizer.eos_token or "")


def template_is_verbatim(tokenizer, options: dict | None = None) -> bool:
    """Whether the chat template copies message contents verbatim (probed with padded, odd contents)."""
    probe = [{"role": "user", "content": "  Q \n\t"}, {"role": "assistant", "content": "\n A  {x}\n "}]
    try:
        return render_with_spans(probe, tokenizer, "", verbatim=False, options=options)[2]
    except DataError:
        return False


def render_with_spans(messages: list[dict[str, str]], tokenizer, eot: str, *, verbatim: bool = False,
                      options: dict | None = None) -> tuple[str, list[tuple[int, int]], bool]:
    """The chat-template text of ``messages``, the char spans ``[start, end)`` of each assistant content
    plus its end-of-turn marker ``eot`` when the template puts it right after the content, and whether
    the sentinel rendering matched the real one.

    Contents are located by rendering with private-use sentinels in place of each content and
    substituting the contents back. Unless ``verbatim`` (the template is known to copy contents as is,
    see :func:`template_is_verbatim`) the real rendering is compared, and on a mismatch contents are
    searched forward in it instead. Raises DataError if a content cannot be found.
    """
    kw = dict(options or {})  # chat template options, e.g. enable_thinking
    text = None if verbatim else tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    skeleton = tokenizer.apply_chat_template(
        [{**m, "content": s} for m, s in zip(messages, marks, strict=True)], tokenize=False, **kw)
    starts: list[int] = []
    rebuilt: list[str] = []
    pos = out = 0
    for m, s in zip(messages, marks, strict=True):
        i = skeleton.find(s, pos)
        if i < 0:
            break
        rebuilt.append(skeleton[pos:i])
        out += i - pos
        starts.append(out)
        rebuilt.append(m["content"])
        out += len(m["content"])
        pos = i + len(s)
    rebuilt.append(skeleton[pos:])
    matched = len(starts) == len(messages)
    if text is None:
        if not matched:
            raise DataError("chat template output does not contain a message's content verbatim")
        text = "".join(rebuilt)
    matched = matched and "".join(rebuilt) == text
    if not matched:
        starts, pos = [], 0
        for m in messages:
            i = text.find(m["content"], pos)
            if i < 0:
                raise DataError("chat template output does not contain a message's content verbatim")
            starts.append(i)
            pos = i + len(m["content"])
    spans = []
    for m, a in zip(messages, starts, strict=True):
        if m["role"] == "assistant":
            b = a + len(m["content"])
            if eot and text.startswith(eot, b):
                b += len(eot)
            spans.append((a, b))
    return text, spans, matched


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [T]: 1 for tokens whose char span overlaps an assistant span. A token that straddles the start
    of a content (e.g. ``"\n "`` = header newline + the content's leading space) counts as assistant text."""
    arr = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(arr), dtype=np.uint8)
    for a, b in spans:
        mask[(arr[:, 0] < b) & (arr[:, 1] > a)] = 1
    return mask


_CUT_MARGIN = 64  # chars kept clear of a prefix cut; only a >64-char pre-token across it could differ


def encode_truncated(tokenizer, texts: list[str],
                     max_length: int) -> list[tuple[list[int], list[tuple[int, int]], bool]]:
    """Tokenize ``texts`` (no added special tokens) and keep the first ``max_length`` tokens of each:
    [(ids, char offsets, truncated)].

    For speed, a text is first tokenized as a char prefix (about 5 chars per wanted token, doubled while
    too short); a prefix result is used only if at least ``max_length + 1`` tokens end ``_CUT_MARGIN``
    chars before the cut, so the kept tokens equal those of the full text (byte-level BPE only changes
    the pre-token that straddles the cut). Otherwise the whole text is tokenized.
    """
    out: list[tuple[list[int], list[tuple[int, int]], bool] | None] = [None] * len(texts)
    budget = {i: max_length * 5 + _CUT_MARGIN for i in range(len(texts))}
    while budget:
        todo = sorted(budget)
        enc = tokenizer([texts[i][: budget[i]] for i in todo], add_special_tokens=False,
                        return_offsets_mapping=True)
        for k, i in enumerate(todo):
            ids, offs = enc["input_ids"][k], enc["offset_mapping"][k]
            cut = budget[i]
            if cut >= len(texts[i]):  # the whole text was tokenized: exact
                out[i] = (ids[:max_length], offs[:max_length], len(ids) > max_length)
                del budget[i]
            elif len(ids) > max_length and offs[max_length][1] <= cut - _CUT_MARGIN:
                out[i] = (ids[:max_length], offs[:max_length], True)
                del budget[i]
            else:
                budget[i] = cut * 2
    return out  # type: ignore[return-value]


def _stats(lengths: list[int]) -> dict[str, float]:
    arr = np.asarray(lengths, dtype=np.float64)
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p90": float(np.percentile(arr, 90)),
            "max": int(arr.max()), "min": int(arr.min()), "total": int(arr.sum())}


class Plan:
    """An in-memory plan. ``len(plan)`` samples; ``sample(i)``; ``at_position(p)`` wraps epoch after epoch."""

    def __init__(self, plan_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor,
                 provenance: dict[str, Any]) -> None:
        self.plan_id = plan_id
        self.input_ids = input_ids
        self.loss_mask = loss_mask
        self.offsets = offsets
        self.provenance = provenance
        self._orders: dict[int, EpochOrder] = {}

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def verified(self) -> bool:
        """Whether :meth:`load` checked this plan's files against recorded digests (False for a plan saved
        before plans recorded them: ``plan.json`` has no ``digests``)."""
        return self.provenance.get("digests") is not None

    def sample(self, i: int) -> Sample:
        """Sample ``i`` (0 <= i < len). Raises IndexError outside that range."""
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"plan {self.plan_id[:12]}: sample {i} out of range [0, {n})")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(index=i, input_ids=self.input_ids[a:b], loss_mask=self.loss_mask[a:b])

    @property
    def heldout(self) -> int:
        """Samples at the plan's end that come from its evaluation source (``data.eval``; plan.json
        ``heldout``): the held-out split every consumer evaluates on and never trains on. 0: none."""
        return int(self.provenance.get("heldout", 0) or 0)

    @property
    def epoch_seed(self) -> int:
        """Seed of the per-epoch reshuffle (plan.json ``epoch_order.seed``; plans written before it was
        recorded use the plan's seed, which is what it records)."""
        order = self.provenance.get("epoch_order") or {}
        if order.get("version", EPOCH_ORDER_VERSION) != EPOCH_ORDER_VERSION:
            raise DataError(f"plan {self.plan_id[:12]}: epoch_order version {order.get('version')!r} is not "
                            f"{EPOCH_ORDER_VERSION}; this artcache cannot walk its epochs")
        return int(order.get("seed", self.provenance.get("spec", {}).get("seed", 0)))

    def order(self, epoch_len: int = 0) -> EpochOrder:
        """The position order of a consumer training on the first ``epoch_len`` samples (0: all of them);
        one object per length is cached (its epoch permutations are reused)."""
        n = epoch_len or len(self)
        if n not in self._orders:
            self._orders[n] = EpochOrder(len(self), n, self.epoch_seed)
        return self._orders[n]

    def at_position(self, p: int, epoch_len: int = 0) -> Sample:
        """Sample at run position ``p`` >= 0 of a consumer training on the first ``epoch_len`` samples
        (:meth:`order`). Raises IndexError for p < 0."""
        return self.sample(self.order(epoch_len).sample(p))

    def __iter__(self) -> Iterator[Sample]:
        return (self.sample(i) for i in range(len(self)))

    def save(self, plans_dir: str | Path) -> Path:
        """Publish to ``plans_dir/<plan_id>/`` atomically (unique temp dir + rename). If that directory
        already exists (another process published first) it is kept and this copy discarded. Returns it.

        Raises:
            PublishError: ``plans_dir`` has less free space than the plan's tensors plus the filesystem's
                reserve (bytes needed and free named, ENOSPC, before anything is written), or a write, fsync
                or rename failed (its errno named, also when safetensors raised it); nothing was published
                and the temp directory is removed.
        """
        plans_dir = Path(plans_dir)
        plans_dir.mkdir(parents=True, exist_ok=True)
        final = plans_dir / self.plan_id
        if (final / "plan.json").is_file():
            return final
        tensors = (self.input_ids, self.loss_mask, self.offsets)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        try:
            check_free_space(plans_dir, nbytes)
        except PublishError as exc:
            raise PublishError(f"plan {self.plan_id[:12]} ({nbytes} B of tokens) cannot be saved: {exc}; free "
                               "space there (or give another --cache) and start the producer again",
                               errno_=exc.errno) from None
        # named .tmp-<plan id[:12]>-<writer token>.<nonce> (publish_dir): fsck removes it only when that writer is gone
        try:
            with publish_dir(final, existing="keep", complete=lambda d: (d / "plan.json").is_file(), in_root=True,
                             tmp_name=f".tmp-{self.plan_id[:12]}-") as tmp:
                save_file({"input_ids": self.input_ids.contiguous(), "loss_mask": self.loss_mask.contiguous(),
                           "offsets": self.offsets.contiguous()}, str(tmp / "plan.safetensors"),
                          metadata={"plan_id": self.plan_id})
                # plan.json records the digest of the tensors file and of itself (load checks both)
                written = (tmp / "plan.safetensors").read_bytes()
                doc = sealed(json.loads(json.dumps({k: v for k, v in self.provenance.items() if k != "digests"})),
                             {"plan.safetensors": {"size": len(written), "digest": digest_bytes(written)}})
                (tmp / "plan.json").write_text(json.dumps(doc, indent=2, sort_keys=True))
                self.provenance = doc
                # safetensors writes 0600 whatever the umask: a group-shared root's members must read the plan
                apply_share_mode(tmp / "plan.safetensors", tmp / "plan.json")
        except (OSError, SafetensorError) as exc:
            if isinstance(exc, ArtcacheError):
                raise
            code = errno_of(exc)
            raise PublishError(f"plan {self.plan_id[:12]} ({nbytes} B of tokens) could not be written under "
                               f"{plans_dir} ({describe_errno(code, exc)}); nothing was published",
                               errno_=code, retryable=code in RETRYABLE_ERRNOS) from exc
        return final

    @classmethod
    def load(cls, plan_dir: str | Path) -> Plan:
        """Load and verify a saved plan: ``plan.json``'s ``digests`` record (its own content and
        ``plan.safetensors``' size and xxh3-128 digest, :func:`artcache.hashing.check_record`; a plan saved
        before plans recorded digests has none and loads unverified, :attr:`Plan.verified`), then the id,
        dtypes, shapes and offsets.

        Raises:
            DataError: files are missing or unreadable, a file does not match its recorded digest (damaged:
                the message names the file and both digests), the id does not match its inputs or directory
                name, or tensor dtypes/shapes/offsets are inconsistent.
        """
        plan_dir = Path(plan_dir)
        try:
            prov = json.loads((plan_dir / "plan.json").read_text())
            data = (plan_dir / "plan.safetensors").read_bytes()
        except (OSError, ValueError) as exc:
            raise DataError(f"plan {str(plan_dir)!r}: unreadable ({exc})") from exc
        if not isinstance(prov, dict):
            raise DataError(f"plan {str(plan_dir)!r}: plan.json is not an object")
        damaged = check_record(prov)
        damaged = f"plan.json: {damaged}" if damaged else check_file(prov, "plan.safetensors", data)
        if damaged is not None:
            raise DataError(f"plan {str(plan_dir)!r} is damaged ({damaged}); move the plan directory away and "
                            "start the producer again (it rebuilds the same plan)")
        try:
            tensors = load(data)
        except (SafetensorError, ValueError) as exc:
            raise DataError(f"plan {str(plan_dir)!r}: plan.safetensors unreadable ({exc})") from exc
        try:
            if prov.get("format_version") != PLAN_FORMAT_VERSION:
                raise DataError(f"format_version {prov.get('format_version')!r} != {PLAN_FORMAT_VERSION}")
            plan_id = strong_digest(canonical_json(prov["id_inputs"]))
            if plan_id != prov.get("plan_id") or plan_id != plan_dir.name:
                raise DataError(f"plan_id mismatch: computed {plan_id}, plan.json {prov.get('plan_id')}, "
                                f"directory {plan_dir.name}")
            ids, mask, offsets = tensors["input_ids"], tensors["loss_mask"], tensors["offsets"]
            if (ids.dtype, mask.dtype, offsets.dtype) != (torch.int32, torch.uint8, torch.int64):
                raise DataError(f"dtypes {ids.dtype}/{mask.dtype}/{offsets.dtype} != int32/uint8/int64")
            n = prov["counts"]["kept"]
            if ids.dim() != 1 or mask.shape != ids.shape or offsets.shape != (n + 1,):
                raise DataError(f"shapes {tuple(ids.shape)}/{tuple(mask.shape)}/{tuple(offsets.shape)} "
                                f"inconsistent with {n} samples")
            if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets.diff() <= 0).any()):
                raise DataError("offsets are not strictly increasing from 0 to len(input_ids)")
        except DataError as exc:
            raise DataError(f"plan {str(plan_dir)!r}: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise DataError(f"plan {str(plan_dir)!r}: plan.json or tensors incomplete ({exc!r})") from exc
        return cls(plan_id, ids, mask, offsets, prov)


class EpochOrder:
    """Run position → plan sample index, epoch after epoch over the training part of a plan.

    A consumer training on the first ``epoch_len`` samples of a plan of ``plan_len`` (the last
    ``plan_len - epoch_len`` are its held-out split, never returned here) reads position ``p`` in epoch
    ``p // epoch_len``. Epoch 0 is plan order (position ``p`` is sample ``p``); epoch ``e >= 1`` is
    ``numpy.random.default_rng([seed, e]).permutation(plan_len)`` with the held-out samples removed, so
    two consumers with different held-out splits still see the same relative order. Deterministic:
    every consumer of a root and every resume maps a position to the same sample.

    Raises:
        ValueError: ``epoch_len`` outside ``[1, plan_len]``.
    """

    _KEEP = 4  # epochs whose permutations stay cached

    def __init__(self, plan_len: int, epoch_len: int, seed: int) -> None:
        if not 1 <= epoch_len <= plan_len:
            raise ValueError(f"epoch_len {epoch_len} must be in [1, {plan_len}]")
        self.plan_len, self.epoch_len, self.seed = int(plan_len), int(epoch_len), int(seed)
        self._perms: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last: tuple[int, tuple[np.ndarray, np.ndarray] | None] = (-1, None)

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(order int64 [epoch_len]: the samples of epoch e in reading order, inverse int64 [plan_len]:
        the offset of each sample within epoch e, -1 for held-out samples)."""
        if self._last[0] == e:
            return self._last[1]
        got = self._perms.get(e)
        if got is None:
            n, m = self.plan_len, self.epoch_len
            if e == 0:
                order = np.arange(m, dtype=np.int64)
            else:
                perm = np.random.default_rng([self.seed, e]).permutation(n)
                order = perm[perm < m].astype(np.int64) if m < n else perm.astype(np.int64)
            inv = np.full(n, -1, dtype=np.int64)
            inv[order] = np.arange(m, dtype=np.int64)
            if len(self._perms) >= self._KEEP:
                self._perms.pop(next(iter(self._perms)))
            self._perms[e] = got = (order, inv)
        self._last = (e, got)
        return got

    def epoch(self, p: int) -> int:
        """The epoch of position ``p`` (>= 0)."""
        return p // self.epoch_len

    def sample(self, p: int) -> int:
        """The plan sample index read at position ``p``. Raises IndexError for ``p < 0``."""
        if p < self.epoch_len:
            if p < 0:
                raise IndexError(f"plan position must be >= 0, got {p}")
            return p
        e, i = divmod(p, self.epoch_len)
        return int(self._epoch(e)[0][i])

    def samples(self, lo: int, hi: int) -> np.ndarray:
        """int64 [max(0, hi - lo)]: the samples read at positions ``lo .. hi - 1`` (lo >= 0)."""
        if hi <= lo:
            return np.empty(0, dtype=np.int64)
        out = np.empty(hi - lo, dtype=np.int64)
        m = self.epoch_len
        p = lo
        while p < hi:
            e, i = divmod(p, m)
            k = min(hi - p, m - i)
            out[p - lo:p - lo + k] = self._epoch(e)[0][i:i + k]
            p += k
        return out

    def next_positions(self, samples: np.ndarray, cursor: int, end: float) -> np.ndarray:
        """float64 [len(samples)]: for each sample the first position ``p`` with ``cursor <= p < end`` that
        reads it, ``inf`` where there is none (held-out samples, or the run ends first). Every training
        sample occurs once per epoch, so it lies in the cursor's epoch or the next."""
        samples = np.asarray(samples, dtype=np.int64)
        e0 = cursor // self.epoch_len
        base0 = e0 * self.epoch_len
        off0 = self._epoch(e0)[1][samples]
        out = np.where((off0 >= 0) & (base0 + off0 >= cursor), base0 + off0, np.inf).astype(np.float64)
        late = np.isinf(out) & (off0 >= 0)
        if late.any() and base0 + self.epoch_len < end:
            off1 = self._epoch(e0 + 1)[1][samples[late]]
            out[late] = base0 + self.epoch_len + off1
        out[out >= end] = np.inf
        return out


def build_synthetic_plan(spec: PlanSpec, *, target_vocab_size: int) -> Plan:
    """``dataset="synthetic"``: ``max_samples`` samples of exactly ``max_length`` uniform random ids in
    [0, vocab - 64), seeded; the first max(1, T // 8) positions are an unsupervised "prompt", the rest
    supervised. For throughput benchmarks (random targets have no tokenizer)."""
    if target_vocab_size <= SYNTHETIC_RESERVED + 1:
        raise ConfigError(f"synthetic data needs a vocab larger than {SYNTHETIC_RESERVED + 1}")
    plan_id, id_inputs = compute_plan_id(spec, "synthetic-v1", "none", "none")
    rng = np.random.default_rng(spec.seed)
    n, t = spec.max_samples, spec.max_length
    ids = rng.integers(0, target_vocab_size - SYNTHETIC_RESERVED, size=n * t, dtype=np.int64).astype(np.int32)
    mask = np.ones((n, t), dtype=np.uint8)
    mask[:, : max(1, t // 8)] = 0
    offsets = np.arange(0, n * t + 1, t, dtype=np.int64)
    provenance = {
        "format_version": PLAN_FORMAT_VERSION, "plan_id": plan_id, "id_inputs": id_inputs,
        "spec": msgspec.to_builtins(spec), "dataset_path": "synthetic", "dataset_digest": "synthetic-v1",
        "tokenizer_digest": "none", "template_digest": "none", "target_vocab_size": target_vocab_size,
        "counts": {"records": n, "visited": n, "kept": n, "truncated": 0, "skipped": {}},
        "read": {"bytes_total": 0, "bytes_dropped": 0, "records_dropped": 0},
        "tokens": _stats([t] * n), "loss_tokens": _stats([t - max(1, t // 8)] * n),
        "epoch_order": {"version": EPOCH_ORDER_VERSION, "seed": spec.seed},
    }
    return Plan(plan_id, torch.from_numpy(ids), torch.from_numpy(mask.reshape(-1)), torch.from_numpy(offsets),
                provenance)


@dataclass
class _Tally:
    """What :func:`_tokenized` visited: conversations, truncated samples, skipped ones by reason."""

    visited: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def as_dict(self, records: int, kept: int) -> dict[str, Any]:
        return {"records": records, "visited": self.visited, "kept": kept, "truncated": self.truncated,
                "skipped": dict(sorted(self.skipped.items()))}


def _legacy_messages(record) -> list[dict[str, str]] | str:
    messages, reason = to_messages(record)
    return messages if messages is not None else reason or "invalid"


def _tokenized(items, tokenizer, spec: PlanSpec, eot: str, verbatim: bool, tally: _Tally,
               target_vocab_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Render and tokenize conversations lazily, ``_BATCH`` at a time, yielding the samples that qualify.

    Args:
        items: ``(messages or a skip reason, where)`` per conversation, in visiting order; ``where`` names the
            record in errors (``""``: a ShareGPT dataset read tolerantly, whose template mismatches are skipped).
        tally: counts visited, truncated and skipped conversations (a conversation counts as visited once
            the caller pulls past it, so stopping after the last wanted sample visits no more).

    Yields:
        (input_ids int32 [T], loss_mask uint8 [T]) per kept sample, T <= ``spec.max_length``.

    Raises:
        ConfigError: a token id >= ``target_vocab_size`` (the tokenizer is not the target's).
        DataError: a record with tool calls the chat template does not render (named by ``where``).
    """
    items = iter(items)
    while True:
        chunk = list(itertools.islice(items, _BATCH))
        if not chunk:
            return
        prepared: list[tuple[str, list[tuple[int, int]]] | str] = []
        for messages, where in chunk:
            if isinstance(messages, str):
                prepared.append(messages)
                continue
            tools = tool_call_texts(messages)
            try:
                text, spans, _ = render_with_spans(messages, tokenizer, eot, verbatim=verbatim and not tools,
                                                   options=spec.template_options)
            except DataError:
                prepared.append("template_mismatch")
                continue
            except Exception as exc:  # a jinja template error on an unusual turn (a tool turn, a missing key)
                if not where:
                    raise
                raise DataError(f"data source {where}: the target's chat template cannot render this "
                                f"conversation ({type(exc).__name__}: {str(exc)[:120]}); accepted: turns the "
                                "chat template renders") from None
            missing = [t for t in tools if t not in text]
            if missing:
                raise DataError(f"data source {where}: the target's chat template drops tool calls (no {missing[0]!r} "
                                "in its rendering); accepted: records without tool calls, or a target whose chat "
                                "template renders tool_calls")
            prepared.append((text, spans))
        encoded = encode_truncated(tokenizer, [p[0] for p in prepared if not isinstance(p, str)], spec.max_length)
        j = 0
        for p in prepared:
            tally.visited += 1
            if isinstance(p, str):
                tally.skipped[p] += 1
                continue
            ids_list, offs, was_cut = encoded[j]
            j += 1
            ids = np.asarray(ids_list, dtype=np.int64)
            mask = _mask_from_offsets(offs, p[1])
            tally.truncated += int(was_cut)
            if int(mask.sum()) < spec.min_loss_tokens:
                tally.skipped["too_few_loss_tokens"] += 1
                continue
            if not bool((mask[:-1] & mask[1:]).any()):
                tally.skipped["no_anchor"] += 1
                continue
            if ids.size and int(ids.max()) >= target_vocab_size:
                raise ConfigError(f"token id {int(ids.max())} >= target vocab size {target_vocab_size}: the "
                                  f"tokenizer does not belong to this target")
            yield ids.astype(np.int32), mask


def build_plan(spec: PlanSpec, tokenizer, *, target_vocab_size: int) -> Plan:
    """Build the plan in memory (see module docstring).

    Records are visited in a ``numpy.random.default_rng(seed)`` permutation and rendered with the
    tokenizer's chat template until ``max_samples`` samples are kept. Loss mask = 1 on assistant content
    tokens (any token overlapping the content) and the assistant's end-of-turn token. Samples are truncated
    to ``max_length`` tokens and dropped if they have < ``min_loss_tokens`` masked tokens or no anchor (p with
    mask[p] and mask[p+1]).
    Raises DataError if no sample qualifies, ConfigError if a token id is >= ``target_vocab_size``.
    """
    spec = as_sources(spec)
    if spec.sources or spec.eval is not None:
        return build_mixed_plan(spec, tokenizer, target_vocab_size=target_vocab_size)
    if spec.dataset == "synthetic":
        return build_synthetic_plan(spec, target_vocab_size=target_vocab_size)
    if tokenizer is None:
        raise ConfigError(f"dataset {spec.dataset!r} needs a tokenizer; this target has none (use --data synthetic)")
    dataset_path = resolve_dataset(spec.dataset)
    read = read_sharegpt(dataset_path)
    if read.records_dropped or read.bytes_dropped:  # the embedded file is cut upstream: say so, keep going
        log.warning("dataset %s: kept %d complete records; dropped %d undecodable record(s) / %d byte(s) "
                    "(recorded in plan.json 'read')", dataset_path, len(read.records), read.records_dropped,
                    read.bytes_dropped)
    dataset_digest = digest_file(dataset_path)
    plan_id, id_inputs = compute_plan_id(spec, dataset_digest, tokenizer_digest(tokenizer),
                                         template_digest(tokenizer, spec.template_options))
    eot = _end_of_turn(tokenizer)
    verbatim = template_is_verbatim(tokenizer, spec.template_options)
    order = np.random.default_rng(spec.seed).permutation(len(read.records))
    tally = _Tally()
    kept_ids: list[np.ndarray] = []
    kept_masks: list[np.ndarray] = []
    items = ((_legacy_messages(read.records[int(i)]), "") for i in order)
    for ids, mask in _tokenized(items, tokenizer, spec, eot, verbatim, tally, target_vocab_size):
        kept_ids.append(ids)
        kept_masks.append(mask)
        if len(kept_ids) >= spec.max_samples:
            break
    visited, truncated, skipped = tally.visited, tally.truncated, tally.skipped
    if not kept_ids:
        raise DataError(
            f"dataset {str(dataset_path)!r}: 0 of {visited} conversations produced a sample with >= "
            f"{spec.min_loss_tokens} assistant tokens and an anchor within {spec.max_length} tokens "
            f"(skipped: {dict(skipped)})")
    lengths = [len(x) for x in kept_ids]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    provenance = {
        "format_version": PLAN_FORMAT_VERSION, "plan_id": plan_id, "id_inputs": id_inputs,
        "spec": msgspec.to_builtins(spec), "dataset_path": str(dataset_path), "dataset_digest": dataset_digest,
        "tokenizer_digest": id_inputs["tokenizer_digest"], "template_digest": id_inputs["template_digest"],
        "target_vocab_size": target_vocab_size,
        "counts": {"records": len(read.records), "visited": visited, "kept": len(kept_ids),
                   "truncated": truncated, "skipped": dict(sorted(skipped.items()))},
        "read": {"bytes_total": read.bytes_total, "bytes_dropped": read.bytes_dropped,
                 "records_dropped": read.records_dropped},
        "tokens": _stats(lengths),
        "loss_tokens": _stats([int(m.sum()) for m in kept_masks]),
        "epoch_order": {"version": EPOCH_ORDER_VERSION, "seed": spec.seed},
    }
    return Plan(plan_id, torch.from_numpy(np.concatenate(kept_ids)),
                torch.from_numpy(np.concatenate(kept_masks)), torch.from_numpy(offsets), provenance)


def training_sources(spec: PlanSpec) -> list[DataSource]:
    """The training sources of a mixed plan: ``spec.sources``, or ``spec.dataset`` as the one source when only
    an eval source was given."""
    return list(spec.sources) or [DataSource(path=spec.dataset)]


def mix_digests(spec: PlanSpec) -> dict[str, Any]:
    """``{"sources": [content digest per training source], "eval": digest | None}``
    (:func:`artcache.data.sources.source_digest`). Raises ConfigError for a missing source path, when two training
    sources hold the same data (the same digest and split: its samples would be planned twice), and when the eval
    source holds the same data as a training source (a held-out split must be data never trained on)."""
    sources = training_sources(spec)
    digests = [source_digest(Path(resolve_source(s))) for s in sources]
    keys = list(zip(digests, (s.split for s in sources), strict=True))
    for i, key in enumerate(keys):
        if key in keys[:i]:
            raise ConfigError(f"data sources {sources[keys.index(key)].path!r} and {sources[i].path!r} hold the same "
                              "data; accepted: each source once (its weight sets its share)")
    eval_digest = source_digest(Path(resolve_source(spec.eval))) if spec.eval is not None else None
    if eval_digest is not None and (eval_digest, spec.eval.split) in keys:
        same = sources[keys.index((eval_digest, spec.eval.split))].path
        raise ConfigError(f"data.eval {spec.eval.path!r} holds the same data as the training source {same!r}; "
                          "accepted: an evaluation source never trained on")
    return {"sources": digests, "eval": eval_digest}


def apportion(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of ``total`` samples by ``weights``: counts summing to ``total``, each within
    one of ``total * w / sum(w)`` (ties to the earlier source)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    if rest:
        frac = exact - counts
        for i in sorted(range(len(w)), key=lambda k: (-frac[k], k))[:rest]:
            counts[i] += 1
    return [int(c) for c in counts]


def _feasible_total(total: int, weights: list[float], limits: list[float]) -> int:
    """The largest n <= ``total`` whose :func:`apportion` gives no source more than its limit (0 when none)."""
    wsum = sum(weights)
    for w, lim in zip(weights, limits, strict=True):  # apportion(n)[i] >= floor(n * w / wsum): a first bound
        if math.isfinite(lim):
            total = min(total, int((lim + 1) * wsum / w))
    while total > 0 and any(c > lim for c, lim in zip(apportion(total, weights), limits, strict=True)):
        total -= 1
    return total


def _source_items(records, seed: int, index: int):
    order = np.random.default_rng([seed, index]).permutation(len(records))
    for i in order:
        where = records.where(int(i))
        messages, reason = record_messages(records[int(i)], where)
        yield (messages if messages is not None else reason), where


def build_mixed_plan(spec: PlanSpec, tokenizer, *, target_vocab_size: int) -> Plan:
    """A plan mixing ``spec.sources`` by weight, then ``spec.eval``'s samples as its held-out tail.

    Each source's records are visited in a ``numpy.random.default_rng([seed, i])`` permutation (``i``: the
    source's index) and rendered as :func:`build_plan` does, until the source has its share of
    ``max_samples``: :func:`apportion` by weight, so each source's count is within one sample of
    ``max_samples × weight / Σ weights``. When a source runs out or reaches its own ``max_samples`` first,
    the training total shrinks to the largest one every source can fill at those weights (logged, and recorded
    in ``plan.json`` ``sources``), so the mix keeps its weights. The training samples are then shuffled together
    (``default_rng(seed)``); the eval source's samples (its ``max_samples``, or every usable record) follow
    them in visiting order. ``plan.json`` records ``heldout`` (the eval samples' count: the held-out split
    every consumer of the root evaluates on and never trains on) and per source its path, digest, weight,
    split, cap and counts.

    Raises:
        ConfigError: a missing source, an unknown split, an eval source equal to a training source, no tokenizer.
        DataError: a bad file or record (one line naming it and what is accepted), a source or the eval
            source yielding no usable sample.
    """
    if tokenizer is None:
        raise ConfigError("data sources need a tokenizer; this target has none (use --data synthetic)")
    sources = training_sources(spec)
    digests = mix_digests(spec)
    plan_id, id_inputs = compute_plan_id(spec, "sources" if spec.sources else digests["sources"][0],
                                         tokenizer_digest(tokenizer), template_digest(tokenizer, spec.template_options),
                                         source_digests=digests)
    eot = _end_of_turn(tokenizer)
    verbatim = template_is_verbatim(tokenizer, spec.template_options)
    weights = [float(s.weight) for s in sources]
    reads = [read_source(s) for s in sources]
    eval_read = read_source(spec.eval) if spec.eval is not None else None
    tallies = [_Tally() for _ in sources]
    gens = [_tokenized(_source_items(r, spec.seed, i), tokenizer, spec, eot, verbatim, t, target_vocab_size)
            for i, (r, t) in enumerate(zip(reads, tallies, strict=True))]
    kept: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in sources]
    limits = [float(s.max_samples) if s.max_samples is not None else math.inf for s in sources]
    total = spec.max_samples
    while True:
        quota = apportion(total, weights)
        for i, gen in enumerate(gens):
            while len(kept[i]) < min(quota[i], limits[i]):
                got = next(gen, None)
                if got is None:  # exhausted: what it kept is all it has
                    limits[i] = float(len(kept[i]))
                    break
                kept[i].append(got)
        if all(q <= lim for q, lim in zip(quota, limits, strict=True)):
            break
        total = _feasible_total(total, weights, limits)
        if total == 0:
            empty = next(i for i, lim in enumerate(limits) if lim == 0)
            raise DataError(f"data source {sources[empty].path!r}: 0 of {tallies[empty].visited} conversations "
                            f"produced a sample with >= {spec.min_loss_tokens} assistant tokens and an anchor within "
                            f"{spec.max_length} tokens (skipped: {dict(tallies[empty].skipped)})")
    quota = apportion(total, weights)
    if total < spec.max_samples:
        short = [f"{s.path} ({int(lim)})" for s, lim, q in zip(sources, limits, quota, strict=True) if lim < math.inf]
        log.warning("data sources: the plan holds %d training samples, not max_samples %d: at weights %s the "
                    "source(s) %s have no more", total, spec.max_samples, weights, ", ".join(short))
    train = [(i, kept[i][k]) for i in range(len(sources)) for k in range(quota[i])]
    train = [train[int(k)] for k in np.random.default_rng(spec.seed).permutation(len(train))]
    held: list[tuple[np.ndarray, np.ndarray]] = []
    eval_tally = _Tally()
    if eval_read is not None:
        want = spec.eval.max_samples or math.inf
        for got in _tokenized(_source_items(eval_read, spec.seed, len(sources)), tokenizer, spec, eot, verbatim,
                              eval_tally, target_vocab_size):
            held.append(got)
            if len(held) >= want:
                break
        if not held:
            raise DataError(f"data.eval {spec.eval.path!r}: 0 of {eval_tally.visited} conversations produced a "
                            f"sample with >= {spec.min_loss_tokens} assistant tokens and an anchor within "
                            f"{spec.max_length} tokens (skipped: {dict(eval_tally.skipped)})")
        if spec.eval.max_samples is None and len(held) > max(len(train), 1):  # max_samples caps training only
            log.warning("data.eval %r: %d held-out samples (every usable record), more than the %d training "
                        "samples: each is captured and every consumer's held-out evaluation reads them all; cap "
                        "them with data.eval.max_samples", spec.eval.path, len(held), len(train))
    samples = [s for _, s in train] + held
    lengths = [len(ids) for ids, _ in samples]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def entry(src: DataSource, digest: str, records, tally: _Tally, n: int) -> dict[str, Any]:
        return {"path": str(resolve_source(src)), "digest": digest, "weight": src.weight, "split": src.split,
                "max_samples": src.max_samples, "records_dropped": records.dropped,
                **tally.as_dict(len(records), n)}

    source_entries = [entry(s, d, r, t, quota[i]) for i, (s, d, r, t) in
                      enumerate(zip(sources, digests["sources"], reads, tallies, strict=True))]
    eval_entry = entry(spec.eval, digests["eval"], eval_read, eval_tally, len(held)) if eval_read is not None \
        else None
    tally = _Tally(visited=sum(t.visited for t in (*tallies, eval_tally)),
                   truncated=sum(t.truncated for t in (*tallies, eval_tally)),
                   skipped=sum((t.skipped for t in (*tallies, eval_tally)), Counter()))
    provenance = {
        "format_version": PLAN_FORMAT_VERSION, "plan_id": plan_id, "id_inputs": id_inputs,
        "spec": msgspec.to_builtins(spec),
        "dataset_path": source_entries[0]["path"] if len(sources) == 1 else "sources",
        "dataset_digest": id_inputs["dataset_digest"],
        "tokenizer_digest": id_inputs["tokenizer_digest"], "template_digest": id_inputs["template_digest"],
        "target_vocab_size": target_vocab_size,
        "counts": tally.as_dict(sum(len(r) for r in reads) + (len(eval_read) if eval_read is not None else 0),
                                len(samples)),
        "read": {"bytes_total": 0, "bytes_dropped": 0, "records_dropped": sum(r.dropped for r in reads)},
        "sources": source_entries, "eval": eval_entry, "heldout": len(held),
        "tokens": _stats(lengths),
        "loss_tokens": _stats([int(m.sum()) for _, m in samples]),
        "epoch_order": {"version": EPOCH_ORDER_VERSION, "seed": spec.seed},
    }
    return Plan(plan_id, torch.from_numpy(np.concatenate([ids for ids, _ in samples])),
                torch.from_numpy(np.concatenate([m for _, m in samples])), torch.from_numpy(offsets), provenance)


def plan_id_for(spec: PlanSpec, tokenizer) -> str:
    """The id :func:`build_plan` would give, computed without building (hashes the dataset file)."""
    spec = as_sources(spec)
    if spec.sources or spec.eval is not None:
        digests = mix_digests(spec)
        return compute_plan_id(spec, "sources" if spec.sources else digests["sources"][0], tokenizer_digest(tokenizer),
                               template_digest(tokenizer, spec.template_options), source_digests=digests)[0]
    if spec.dataset == "synthetic":
        return compute_plan_id(spec, "synthetic-v1", "none", "none")[0]
    return compute_plan_id(spec, digest_file(resolve_dataset(spec.dataset)), tokenizer_digest(tokenizer),
                           template_digest(tokenizer, spec.template_options))[0]


def ensure_plan(spec: PlanSpec, tokenizer, plans_dir: str | Path, target_vocab_size: int) -> Plan:
    """Load ``plans_dir/<plan_id>`` if published, else build and save it under a file lock (so concurrent
    callers build it once). Raises as :func:`build_plan` and :meth:`Plan.load`."""
    plans_dir = Path(plans_dir)
    plan_id = plan_id_for(spec, tokenizer)
    final = plans_dir / plan_id
    if (final / "plan.json").is_file():
        return Plan.load(final)
    plans_dir.mkdir(parents=True, exist_ok=True)
    with cache_lock(plans_dir / f".{plan_id}.lock"):
        if (final / "plan.json").is_file():
            return Plan.load(final)
        plan = build_plan(spec, tokenizer, target_vocab_size=target_vocab_size)
        if plan.plan_id != plan_id:  # the dataset file changed between hashing and building
            raise DataError(f"dataset {spec.dataset!r} changed while the plan was built; retry")
        plan.save(plans_dir)
    return Plan.load(final)


def _forbidden_ids(tokenizer) -> set[int]:
    ids = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    vocab = tokenizer.get_vocab()
    ids |= {vocab.get(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    return {int(i) for i in ids if i is not None}


def choose_mask_token(tokenizer, vocab_size: int, plan: Plan | None = None) -> int:
    """The DFlash MASK id: the highest-id special (added) token with an embedding row (< vocab_size) that is
    not bos/eos/pad/unk/<|im_start|>/<|im_end|>/<|endoftext|> and never occurs in ``plan``'s input_ids.

    For SmolLM2 this is 16 ``<empty_output>`` (a Jupyter-notebook marker from pretraining, never emitted by
    the ChatML template). Without a tokenizer (random target, synthetic data) it is the highest id absent
    from the plan (synthetic data never uses the top 64 ids). Raises ConfigError if no token qualifies.
    """
    present = set(torch.unique(plan.input_ids).tolist()) if plan is not None else set()
    if tokenizer is None:
        for i in range(vocab_size - 1, max(-1, vocab_size - 1 - SYNTHETIC_RESERVED), -1):
            if i not in present:
                return i
        raise ConfigError(f"no mask token: the top {SYNTHETIC_RESERVED} ids of the vocab all occur in the plan")
    forbidden = _forbidden_ids(tokenizer)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = sorted((i for i, t in decoder.items() if getattr(t, "special", True)), reverse=True)
    for i in candidates:
        if 0 <= i < vocab_size and i not in forbidden and i not in present:
            return int(i)
    raise ConfigError(f"no mask token: none of the special tokens {candidates} is < vocab size {vocab_size}, "
                      f"distinct from bos/eos/pad/unk/chat markers and absent from the plan")


def validate_mask_token(token_id: int, vocab_size: int, plan: Plan | None, tokenizer) -> None:
    """Raise ConfigError naming ``token_id`` if it is outside [0, vocab_size), equals pad/eos/bos/unk or a
    chat marker, or occurs in ``plan``'s input_ids."""
    if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
        raise ConfigError(f"mask token id {token_id!r} is outside the target embedding [0, {vocab_size})")
    if token_id in _forbidden_ids(tokenizer):
        raise ConfigError(f"mask token id {token_id} is a bos/eos/pad/unk or chat-marker token; choose an unused one")
    if plan is not None and bool((plan.input_ids == token_id).any()):
        raise ConfigError(f"mask token id {token_id} occurs in the plan's input_ids; choose one absent from the data")
