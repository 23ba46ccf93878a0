"""Packing: several whole plan positions back to back in one row, each a separate document to the drafts.

With ``--pack-tokens T`` a training step is ``--batch-size`` rows holding a contiguous range of plan positions
(documents), each row documents whose lengths sum to at most T tokens (first fit in position order,
:func:`pack_rows`). Which positions share a row is decided from the plan alone (each position's length,
:class:`Packer`), so every run and every resume of a run packs the same rows.
T must be at least the root's max length, so every position fits a row whole (nothing is truncated).

Inside a row the drafts see each document as if it were alone (:class:`~artcache.trainers.draft.DraftBatch`
``doc_ids`` and ``position_ids``):

- attention is block-diagonal per document (a query never sees another document's key);
- position ids restart at 0 at each document (RoPE angles are those of the unpacked sample);
- anchors (DFlash, DSpark) are drawn per document: each document draws up to ``--anchors`` N of its own
  eligible positions, uniformly without replacement, as it would alone in an unpacked row
  (:func:`sample_packed_anchors`; the contract of SpecForge, TorchSpec and speculators' per-document
  anchors); no block is supervised past its document's end;
- EAGLE-3's test-time-training shifts read the next document's tokens nowhere (a shifted token from another
  document is replaced by the pad id 0, as past the end of an unpacked row), and DSpark's Markov and
  confidence heads see only supervised slots of the anchor's own document.

A packed row draws up to N anchors per document, so a row of many short documents holds many more anchor slots
than a row of one. The host step (a CPU) computes only the valid blocks, per document. The sync-free step (CUDA)
computes every slot of the ``[rows, M]`` anchor tensor, M = the most any row drew, so DFlash and DSpark first
spread a packed batch's anchors over rows of at most N slots each (:func:`spread_anchor_rows`): a row that drew
more is repeated, each copy holding the next N of its anchors. A block's context is its own row's, so the
blocks, their loss and their gradients are unchanged; the slots computed fall from ``rows × M`` to about the
anchors drawn.

So a packed batch's loss equals the unpacked batch of the same documents with the same anchors (the losses
are normalised over the whole batch, Σ w·CE / Σ w, so a packed row is the weighted combination of its
documents' losses with weights Σ w per document; tests/unit/test_packing.py pins loss and gradients).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from artcache.errors import ConfigError

__all__ = ["Packer", "collate_packed", "doc_eligible_anchors", "draw_anchors", "pack_rows", "packed_layout",
           "packed_on", "packer_of", "sample_packed_anchors", "same_doc", "spread_anchor_rows",
           "spread_row_step"]


def pack_rows(lengths: Sequence[int], rows: int, pack_tokens: int, max_positions: int) -> tuple[int, ...]:
    """The row each of the consecutive positions with ``lengths`` (in order) takes in one step.

    First fit, in position order: a position goes to the first row it fits (its tokens and the row's at most
    ``pack_tokens``); when it fits none, a new row opens; the step ends before the position that fits no row once
    ``rows`` rows are open, or that would make the step hold more than ``max_positions`` positions (the reader's
    lookahead: a step never needs a position beyond the window), or when ``lengths`` runs out. The step so consumes
    a contiguous range of positions; a row's documents lie in it in position order, though not necessarily next to
    each other in the plan (a short position fills the room a long one left in an earlier row: "next fit", one row
    at a time, leaves that room empty).

    Args:
        lengths: token counts of the positions from the step's first one (as many as may be needed).
        rows: rows per step (>= 1). pack_tokens: tokens per row (>= each length). max_positions: >= 1.

    Returns:
        The row index of each position the step takes, in position order (its length: the positions the step
        consumes; rows numbered in the order they opened, each non-empty).

    Raises:
        ConfigError: a length above ``pack_tokens`` (it would never fit a row).
    """
    used: list[int] = []
    out: list[int] = []
    for total, n in enumerate(int(x) for x in lengths):
        if n > pack_tokens:
            raise ConfigError(f"a plan position of {n} tokens does not fit --pack-tokens {pack_tokens}; accepted: "
                              "--pack-tokens >= the root's max length")
        if total >= max_positions:
            break
        row = next((r for r, u in enumerate(used) if u + n <= pack_tokens), None)
        if row is None:
            if len(used) == rows:
                break
            row = len(used)
            used.append(0)
        used[row] += n
        out.append(row)
    return tuple(out)


class Packer:
    """The packed steps of a run, decided from the plan alone (deterministic: a resumed run packs the same rows).

    Args:
        sample_lengths: int [plan_len], the tokens of each plan sample (``plan.offsets`` differences).
        order: the run's :class:`~artcache.plan.EpochOrder` (run position -> plan sample).
        rows: rows per step (``--batch-size``). pack_tokens: tokens per row (``--pack-tokens``).
        max_positions: most positions one step may consume (the window's lookahead).

    Raises:
        ConfigError: ``pack_tokens`` below the longest sample, or a bad size.
    """

    def __init__(self, sample_lengths: np.ndarray | Tensor, order, rows: int, pack_tokens: int,
                 max_positions: int) -> None:
        self.lengths = np.asarray(sample_lengths, dtype=np.int64)
        if rows < 1 or max_positions < 1:
            raise ConfigError(f"packing needs rows >= 1 and max_positions >= 1, got {rows}, {max_positions}")
        longest = int(self.lengths.max()) if self.lengths.size else 0
        if pack_tokens < longest:
            raise ConfigError(f"--pack-tokens {pack_tokens} is below the plan's longest sample ({longest} tokens): "
                              f"accepted: --pack-tokens >= {longest} (a sample is never truncated or split)")
        self.order, self.rows, self.pack_tokens, self.max_positions = order, rows, pack_tokens, max_positions
        self._cache: dict[int, tuple[int, ...]] = {}

    @classmethod
    def for_plan(cls, plan, order, rows: int, pack_tokens: int, max_positions: int) -> Packer:
        """The packer of a :class:`~artcache.plan.Plan` (its samples' lengths from its offsets)."""
        lengths = (plan.offsets[1:] - plan.offsets[:-1]).numpy()
        return cls(lengths, order, rows, pack_tokens, max_positions)

    def position_lengths(self, lo: int, hi: int) -> np.ndarray:
        """Tokens of run positions ``lo .. hi - 1``."""
        return self.lengths[self.order.samples(lo, hi)]

    def step(self, start: int) -> tuple[int, ...]:
        """The row of each position of the step whose first position is ``start`` (:func:`pack_rows`)."""
        got = self._cache.get(start)
        if got is None:
            # a row holds at most pack_tokens positions (each at least one token)
            need = min(self.max_positions, self.rows * self.pack_tokens)
            got = pack_rows(self.position_lengths(start, start + need), self.rows, self.pack_tokens,
                            self.max_positions)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[start] = got
        return got

    def step_positions(self, start: int) -> int:
        """Positions the step starting at ``start`` consumes."""
        return len(self.step(start))

    def end_after(self, steps: int, start: int = 0) -> int:
        """The position after ``steps`` packed steps from ``start`` (a run's end)."""
        p = start
        for _ in range(steps):
            p += self.step_positions(p)
        return p

    def epoch_steps(self, epochs: int, epoch_len: int) -> int:
        """Packed steps of ``epochs`` passes over ``epoch_len`` training samples (a last partial step is not taken).

        Raises:
            ConfigError: not even one step.
        """
        steps = self.steps_within(epochs * epoch_len)
        if steps < 1:
            raise ConfigError(f"--epochs {epochs} over {epoch_len} training samples is not one packed step of "
                              f"{self.rows} rows of {self.pack_tokens} tokens; raise --epochs or lower --batch-size")
        return steps

    def steps_within(self, end: int) -> int:
        """Packed steps from position 0 whose positions all lie below ``end`` (``--epochs``: the last step that
        does not fit is not taken)."""
        p = steps = 0
        while True:
            n = self.step_positions(p)
            # a step cut short by the end of the positions looked at is not a whole step
            if p + n > end or not n:
                return steps
            p, steps = p + n, steps + 1


def packed_layout(lengths: Sequence[int], row_of: Sequence[int], pad_to: int | None = None
                  ) -> tuple[Tensor, Tensor, list[tuple[int, int, int]]]:
    """The layout of a packed batch whose document ``d`` (batch order: position order) has ``lengths[d]`` tokens and
    goes to row ``row_of[d]`` (:func:`pack_rows`), after the row's earlier documents: ``doc_ids`` [rows, T] long
    (the document's index in the batch, -1 on padding), ``position_ids`` [rows, T] long (restarting at 0 per
    document, 0 on padding) and the placement of each document, ``(row, offset, length)`` in batch order.
    T = the longest row (or ``pad_to``)."""
    place: list[tuple[int, int, int]] = []
    row_len = [0] * (max(row_of) + 1 if len(row_of) else 0)
    for n, r in zip(lengths, row_of, strict=True):
        place.append((int(r), row_len[r], int(n)))
        row_len[r] += int(n)
    t = max(row_len) if pad_to is None else pad_to
    doc = torch.full((len(row_len), t), -1, dtype=torch.long)
    pos = torch.zeros((len(row_len), t), dtype=torch.long)
    for d, (r, off, n) in enumerate(place):
        doc[r, off:off + n] = d
        pos[r, off:off + n] = torch.arange(n)
    return doc, pos, place


def same_doc(doc_ids: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Whether positions ``a`` and ``b`` (long, same shape [rows, ...], clamped into the row) hold the same
    document: ``doc_ids`` [rows, T]. Padding (-1) is never the same document as anything."""
    rows, T = doc_ids.shape
    flat_a, flat_b = a.clamp(0, T - 1).reshape(rows, -1), b.clamp(0, T - 1).reshape(rows, -1)
    da, db = doc_ids.gather(1, flat_a), doc_ids.gather(1, flat_b)
    return ((da == db) & (da >= 0)).reshape(a.shape)


def doc_eligible_anchors(supervised: Tensor, doc_ids: Tensor) -> Tensor:
    """Anchor eligibility of a packed batch, [rows, T] bool: ``supervised[p]``, ``supervised[p+1]`` and p, p+1
    in the same document (DFlash's rule, :func:`~artcache.trainers.dflash.anchors.eligible_anchors`, per
    document)."""
    lm = supervised.bool()
    out = torch.zeros_like(lm)
    out[:, :-1] = lm[:, :-1] & lm[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return out


def sample_packed_anchors(supervised: Tensor, doc_ids: Tensor, num_anchors: int, generator: torch.Generator
                          ) -> tuple[Tensor, Tensor]:
    """Per-document anchors of a packed batch: each document draws up to ``num_anchors`` of its eligible
    positions (:func:`doc_eligible_anchors`) uniformly without replacement, as an unpacked row of it alone does
    (:func:`~artcache.trainers.dflash.anchors.sample_anchors`: independent uniform float64 keys, the smallest
    ones chosen); a row's anchors are its documents' anchors in ascending position order.

    Args:
        supervised: [rows, T] bool (``loss_mask & valid``), on the host. doc_ids: [rows, T] long (-1 padding).
        num_anchors: N >= 1, per document. generator: the draft's anchor generator (keys drawn on its device).

    Returns:
        anchors [rows, M] long, valid [rows, M] bool; M = the most anchors any row drew (>= 1), padded with
        ``valid=False`` and anchor 0.

    Raises:
        ConfigError: ``num_anchors < 1``.
    """
    if isinstance(num_anchors, bool) or not isinstance(num_anchors, int) or num_anchors < 1:
        raise ConfigError(f"num_anchors must be an int >= 1, got {num_anchors!r}")
    doc_ids = doc_ids.to(supervised.device)
    elig = doc_eligible_anchors(supervised, doc_ids)
    rows, T = elig.shape
    keys = torch.rand((rows, T), generator=generator, dtype=torch.float64, device=generator.device).to(elig.device)
    keys = keys.masked_fill(~elig, 2.0)
    # rank each eligible position among its document's by key: sort by (document, key)
    order = torch.argsort(doc_ids.clamp_min(0).double() * 4.0 + keys, dim=1, stable=True)
    sdoc = doc_ids.gather(1, order)
    skey = keys.gather(1, order)
    idx = torch.arange(T, device=elig.device).expand(rows, T)
    new = torch.ones_like(sdoc, dtype=torch.bool)
    new[:, 1:] = sdoc[:, 1:] != sdoc[:, :-1]
    first = torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=1).values
    chosen_sorted = (idx - first < num_anchors) & (skey < 2.0)
    chosen = torch.zeros_like(elig)
    chosen.scatter_(1, order, chosen_sorted)
    counts = chosen.sum(dim=1)
    m = max(1, int(counts.max()) if rows else 1)
    pos = torch.where(chosen, idx, torch.full_like(idx, T))
    pos = torch.sort(pos, dim=1).values[:, :m]
    valid = pos < T
    return torch.where(valid, pos, torch.zeros_like(pos)), valid


def draw_anchors(batch, num_anchors: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A training batch's anchors (DFlash, DSpark), drawn on the host: per document for a packed
    :class:`~artcache.trainers.draft.DraftBatch` (:func:`sample_packed_anchors`), per row otherwise
    (:func:`~artcache.trainers.dflash.anchors.sample_anchors`). Returns anchors [b, M] long, valid [b, M] bool."""
    if batch.doc_ids is None:
        from artcache.trainers.dflash.anchors import sample_anchors

        return sample_anchors(batch.supervised_on_host(), num_anchors, generator, batch.positions,
                              generator.initial_seed())
    return sample_packed_anchors(batch.supervised_on_host(), batch.doc_ids.cpu(), num_anchors, generator)


def spread_anchor_rows(batch, anchors: Tensor, valid: Tensor, slots: int, row_step: int = 1):
    """A packed batch's anchors laid out over rows of at most ``slots`` anchor slots (for a step that computes every
    slot, the sync-free one; see the module docstring).

    Args:
        batch: a :class:`~artcache.trainers.draft.DraftBatch`. anchors, valid: [b, M] long / bool on the host, the
            batch's draws (:func:`draw_anchors`: each row's valid anchors first, ascending). slots: S >= 1, the
            anchor slots a row may hold (the draft's ``num_anchors``). row_step: the row count is rounded up to a
            multiple of it with rows that hold no anchor (copies of the first row): fewer distinct shapes, each a
            kernel plan built once (cuDNN's attention builds a plan per shape: about 90 ms of host time per new
            shape, measured on an H100); :func:`spread_row_step` gives the drafts' step.

    Returns:
        ``(batch, anchors, valid)`` unchanged when the batch is not packed or ``M <= S``; else a batch of b' rows
        and anchors / valid [b', S]: row r of the input appears ``ceil(k_r / S)`` times (k_r its valid anchors), copy
        i holding anchors ``i·S .. i·S + S - 1`` of its k_r; rows that drew no anchor are left out (one row is kept
        when none drew any), then rows without anchors are added up to a multiple of ``row_step``. The hidden
        states, ids and masks are gathered on their device (no host read-back); ``doc_ids`` / ``position_ids`` /
        ``supervised_host`` on the host; ``positions`` and ``samples`` are dropped (the rows are no longer plan
        positions).

    Raises:
        ConfigError: ``slots < 1`` or ``row_step < 1``.
    """
    from dataclasses import replace

    for name, v in (("slots", slots), ("row_step", row_step)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
    if batch.doc_ids is None or anchors.shape[1] <= slots:
        return batch, anchors, valid
    anchors, valid = anchors.cpu(), valid.cpu()
    rows, chunks = [], []
    for r in range(anchors.shape[0]):
        mine = anchors[r][valid[r]]
        for i in range(0, mine.numel(), slots):
            rows.append(r)
            chunks.append(mine[i:i + slots])
    if not rows:
        rows, chunks = [0], [anchors.new_zeros(0)]
    while len(rows) % row_step:
        rows.append(rows[0])
        chunks.append(anchors.new_zeros(0))
    out_a = torch.zeros((len(rows), slots), dtype=anchors.dtype)
    out_v = torch.zeros((len(rows), slots), dtype=torch.bool)
    for i, c in enumerate(chunks):
        out_a[i, :c.numel()], out_v[i, :c.numel()] = c, True
    from artcache.trainers.speed import to_device

    host = torch.tensor(rows, dtype=torch.long)
    idx = to_device(host, batch.hidden.device)

    def take(t):
        if t is None:
            return None
        return t.index_select(0, host if t.device.type == "cpu" else idx)

    spread = replace(batch, hidden=take(batch.hidden), input_ids=take(batch.input_ids),
                     loss_mask=take(batch.loss_mask), valid=take(batch.valid), positions=(), samples=(),
                     last_layer=take(batch.last_layer), supervised_host=take(batch.supervised_host),
                     doc_ids=take(batch.doc_ids), position_ids=take(batch.position_ids))
    return spread, out_a, out_v


def spread_row_step(rows: int) -> int:
    """The ``row_step`` of :func:`spread_anchor_rows` for a batch of ``rows`` rows: ``ceil(rows / 4)``, so a step's
    row count takes one of a few values (8 rows: 8, 10, 12, ...) for at most ``ceil(rows / 4) - 1`` rows without
    anchors."""
    return max(1, -(-int(rows) // 4))


def packed_on(batch, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """``(doc_ids, position_ids)`` of ``batch`` on ``device`` ((None, None) when it is not packed), copied from the
    host without a synchronisation (:func:`~artcache.trainers.speed.to_device`: through pinned memory; a copy from
    pageable memory waits for the device to drain its stream)."""
    from artcache.trainers.speed import to_device

    if batch.doc_ids is None:
        return None, None
    return to_device(batch.doc_ids, device), to_device(batch.position_ids, device)


def collate_packed(items, device: torch.device, rows: int, pack_tokens: int,
                   layers: slice | Tensor | None = None, hidden_dtype: torch.dtype | None = None):
    """A packed :class:`~artcache.trainers.draft.DraftBatch` of one step's leased artifacts (in position order).

    The rows are :func:`pack_rows` of the artifacts' lengths (the :class:`Packer`'s split of the plan's lengths:
    the same, since an artifact holds its plan position's tokens). ``hidden`` [rows, T, m, H] (the draft's
    ``layers`` view, zeros on padding; fp8 codes dequantised into ``hidden_dtype``, default float32 on a CPU and
    bfloat16 on CUDA), ``input_ids`` [rows, T] long, ``loss_mask`` / ``valid`` [rows, T] bool, ``doc_ids`` and
    ``position_ids`` [rows, T] long on the host (:func:`packed_layout`); T = the longest row (<= ``pack_tokens``).

    Raises:
        DataError: the artifacts do not fill whole rows of this step (the reader read another split).
    """
    from artcache.errors import DataError
    from artcache.fp8 import dequantize_rows
    from artcache.layer_ids import select_layers
    from artcache.trainers.draft import DraftBatch

    arts = [it.artifact for it in items]
    lengths = [a.input_ids.shape[0] for a in arts]
    row_of = pack_rows(lengths, rows, pack_tokens, len(items))
    if len(row_of) != len(items):
        raise DataError(f"positions {items[0].position}..{items[-1].position} do not pack into {rows} rows of "
                        f"{pack_tokens} tokens as the plan's lengths did (their artifacts hold {lengths} tokens)")
    doc_ids, pos, place = packed_layout(lengths, row_of)
    R, t = doc_ids.shape

    def view(hs: Tensor) -> Tensor:
        return hs if layers is None else select_layers(hs, layers)

    gpu = device.type == "cuda"
    fp8 = arts[0].hidden_scales is not None
    first = view(arts[0].hidden_states)
    dtype = (hidden_dtype or (torch.bfloat16 if gpu else torch.float32)) if fp8 else first.dtype
    hidden = torch.zeros(R, t, first.shape[1], first.shape[2], dtype=dtype, pin_memory=gpu)
    ids = torch.zeros(R, t, dtype=torch.long)
    mask = torch.zeros(R, t, dtype=torch.bool)
    for a, (r, off, n) in zip(arts, place, strict=True):
        hs = view(a.hidden_states)
        if fp8:
            hs = dequantize_rows(hs, view(a.hidden_scales[..., None])[..., 0], dtype)
        hidden[r, off:off + n] = hs
        ids[r, off:off + n] = a.input_ids.long()
        mask[r, off:off + n] = a.loss_mask.bool()
    valid = doc_ids >= 0
    return DraftBatch(hidden.to(device, non_blocking=gpu), ids.to(device), mask.to(device), valid.to(device),
                      positions=tuple(it.position for it in items), supervised_host=mask & valid, doc_ids=doc_ids,
                      position_ids=pos)


def check_pack_tokens(pack_tokens: int, max_length: int, key: str = "--pack-tokens",
                      length: str = "the root's max length") -> None:
    """Refuse a row of ``pack_tokens`` tokens (0: packing off) shorter than a sample's ``max_length`` tokens.

    Raises:
        ConfigError: one line naming ``key`` (the flag or run-config key), both values and what is accepted.
    """
    if pack_tokens and pack_tokens < max_length:
        raise ConfigError(f"{key} {pack_tokens} is below {length} {max_length}: a sample is never truncated or "
                          f"split; accepted: 0 (off) or >= {max_length}")


def packer_of(cfg, plan, order, max_length: int) -> Packer | None:
    """The :class:`Packer` of a consumer config (``pack_tokens``, ``batch_size`` rows, at most ``lookahead``
    positions a step) on a root whose samples hold at most ``max_length`` tokens; None when packing is off.

    Raises:
        ConfigError: ``--pack-tokens`` below ``max_length`` (one line naming both).
    """
    if not cfg.pack_tokens:
        return None
    check_pack_tokens(cfg.pack_tokens, max_length)
    return Packer.for_plan(plan, order, cfg.batch_size, cfg.pack_tokens, cfg.lookahead)
