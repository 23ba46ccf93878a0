"""speculators' trainer on an artcache root: the ``artcache`` hidden-states backend of ``speculators train``.

vllm-project/speculators 0.9.0 reads hidden states through ``hs_connectors`` backends (a class registered in
``HiddenStatesBackend.registry``; its ``from_train_args`` returns a ``HiddenStatesTransfer`` whose
``get_cached(file_idx)`` the trainer's dataset calls once per sample). :class:`ArtcacheBackend` registers as
``artcache``; run speculators' trainer through this module so the registration happens before speculators reads
its registry (speculators has no plugin discovery)::

    python -m artcache.trainers.speculators_backend train --hidden-states-backend artcache \\
        --artcache-root ROOT --artcache-id ID --data-path RUN/data --epochs 1 --num-workers 0 ...

(every other argument is speculators' own). ``from_train_args`` (in speculators' main process, before its data
loaders are built):

1. opens the root (``artcache producer`` made and feeds it) and writes ``--data-path``: a ``datasets`` folder
   (``input_ids``, ``loss_mask``, ``seq_len``) of the plan's samples, laid out so that speculators' packing sampler
   (``MultipackDistributedBatchSamplerV2``, its ``--seed``) visits the training rows in artcache's position
   order: row ``perm[k]`` holds the sample of run position ``k``, ``perm`` the sampler's shuffle
   (``numpy.random.default_rng(seed).permutation``). Each optimizer step then reads a contiguous range of
   positions ``[a_k, b_k)``, so a window over positions is the trainer's read-ahead. The held-out split (the
   plan's ``data.eval`` samples, or ``--artcache-eval-samples`` at the plan's end) follows as speculators'
   validation rows (``--train-data-ratio`` is set so that its split falls exactly there).
2. checks the layout against speculators' own sampler (its batches are rebuilt with speculators' class from
   the written lengths; every batch must be a contiguous position range, else a one-line ConfigError).
3. registers the consumer: window ``[cursor, cursor + --artcache-lookahead]``, ``end`` the last position the run
   reads (``--max-steps`` honoured), the held-out split pinned, the plan's epoch length.

Each ``get_cached(row)`` leases the artifact through :class:`artcache.client.CacheClient` (waiting as demand
while the producer captures it), reads it verified (checksums and token ids), copies the layers speculators
asks for and releases the lease. The sample it returns is speculators' file layout: ``hidden_states``
[T, n + 1, H] (the ``n`` auxiliary layers of ``--target-layer-ids``, vLLM ids, then the last layer's output
before the final norm) in the contract dtype, ``token_ids`` [T] int64.

Cursor and optimizer steps: speculators steps once per batch and fetches batch ``k`` only after step
``k - 1`` returned (``--num-workers 0``: the loader reads in the training loop's own thread; other values are
refused, since worker processes read ahead of the steps). So the first read of batch ``k`` commits cursor
``a_k``: every position below it was consumed by an optimizer step. The first validation read commits the end
of the last batch read (validation starts after the training loop's last step). A checkpoint speculators wrote
(``SAVE_PATH/0/training_state.json``, its ``global_step`` g) is recorded as the registration's
``checkpoint_cursor`` ``a_g`` once the cursor has passed it.

Resume: with speculators' resume on (its default), a restart finds the same ``training_state.json``,
speculators skips the ``g`` batches its checkpoint holds, and the backend registers at cursor ``a_g``: the
positions it reads next are exactly those the restored weights never trained on, and positions before ``a_g``
are not read again (the producer may have evicted them). Without a checkpoint the run starts at 0.

Several trainers on one root: each is its own consumer (``--artcache-id``); with the same ``--seed``,
``--total-seq-len`` and plan they read the same positions in the same order, so the producer captures each
position once while the windows overlap (speculators' ``--epochs`` must be 1; ``--artcache-epochs`` passes over
the plan, in artcache's own epoch order). Limits: one rank (world size 1); ``--num-workers 0``.

Errors: :class:`~artcache.errors.ConfigError` (one line) for a refused setting or a layer the root did not
capture; the client's CaptureTimeout / CaptureFailed / ConsumerFenced from a read.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from artcache import journal as J
from artcache import registry
from artcache.client import CacheClient, open_root
from artcache.errors import ArtcacheError, ConfigError, ConsumerFenced
from artcache.fsio import publish_dir
from artcache.layer_ids import vllm_id_to_output_of_layer
from artcache.layout import host_id
from artcache.trainers.evaluation import eval_split, heldout_samples

log = logging.getLogger("artcache.speculators")

#: the name ``--hidden-states-backend`` takes
BACKEND_NAME = "artcache"
#: written into ``--data-path`` beside the dataset: what it was laid out for
MANIFEST = "artcache-speculators.json"
#: seconds between registration heartbeats
HEARTBEAT_S = 2.0


def sampler_permutation(rows: int, seed: int) -> np.ndarray:
    """int64 [rows]: the order in which speculators 0.9.0's ``MultipackDistributedBatchSamplerV2`` (one rank,
    epoch 0, seed ``seed``) takes the training rows before packing them into consecutive batches:
    ``numpy.random.default_rng(seed).permutation(rows)`` (its ``_generate_batches``)."""
    return np.random.default_rng(seed).permutation(rows).astype(np.int64)


def row_layout(end: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(row_of int64 [end]: the data row that holds run position k, position_of int64 [end]: its inverse):
    row ``sampler_permutation(end, seed)[k]`` holds position ``k``."""
    row_of = sampler_permutation(end, seed)
    position_of = np.empty_like(row_of)
    position_of[row_of] = np.arange(end, dtype=np.int64)
    return row_of, position_of


def train_ratio(train_rows: int, rows: int) -> float:
    """speculators' ``--train-data-ratio`` that splits ``rows`` after exactly ``train_rows`` (its split index is
    ``int(rows * ratio)``): the midpoint ``(train_rows + 0.5) / rows``, which float rounding cannot move across
    an integer. Needs ``0 < train_rows < rows``."""
    return (train_rows + 0.5) / rows


def layer_indices(contract_layers: tuple[int, ...] | list[int], target_layer_ids: list[int],
                  num_target_layers: int) -> list[int]:
    """Indices into an artifact's layers ([T, m, H], ``contract_layers`` output-of-layer ids) of speculators'
    sample layout: its ``target_layer_ids`` (vLLM ids: id k is the output of layer k - 1) in order, then the
    last layer's output (output-of-layer ``num_target_layers - 1``, before the final norm).

    Raises:
        ConfigError: a layer the root did not capture (one line naming it and the captured ones).
    """
    want = [vllm_id_to_output_of_layer(k) for k in target_layer_ids] + [num_target_layers - 1]
    have = list(contract_layers)
    missing = [w for w in want if w not in have]
    if missing:
        raise ConfigError(f"the root did not capture output-of-layer {missing} (speculators --target-layer-ids "
                          f"{list(target_layer_ids)} plus the last layer {num_target_layers - 1}); it captured "
                          f"{have}: capture a root whose layer_ids include them, or pass --target-layer-ids among "
                          f"{[h + 1 for h in have if h != num_target_layers - 1]}")
    return [have.index(w) for w in want]


def write_data_dir(path: Path, plan, order, end: int, heldout: tuple[int, int], seed: int,
                   identity: dict[str, Any]) -> None:
    """Write speculators' data folder at ``path`` (replaced whole if it is one this function wrote; refused if it
    holds anything else): rows ``row_layout(end, seed)`` of the training positions ``[0, end)``
    (``order``: the plan's :class:`~artcache.plan.EpochOrder`), then the held-out samples ``[lo, hi)``; columns
    ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``seq_len`` int, torch format, and :data:`MANIFEST`
    (``identity``).

    Raises:
        ConfigError: ``path`` exists and is not such a folder.
    """
    from datasets import Dataset

    if path.exists() and not (path / MANIFEST).is_file():
        raise ConfigError(f"--data-path {path} exists and was not written by the artcache backend; accepted: "
                          "a new path (the backend writes speculators' data folder there from the root's plan)")
    row_of, _ = row_layout(end, seed)
    samples = np.empty(end, dtype=np.int64)
    samples[row_of] = order.samples(0, end)
    samples = [*samples.tolist(), *range(*heldout)]
    ids, masks = [], []
    for s in samples:
        sample = plan.sample(int(s))
        ids.append(sample.input_ids.to(torch.int64).tolist())
        masks.append(sample.loss_mask.to(torch.int64).tolist())
    data = Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": [len(x) for x in ids]})
    data.set_format(type="torch")
    path.parent.mkdir(parents=True, exist_ok=True)
    with publish_dir(path, existing="replace", durable=False) as tmp:
        data.save_to_disk(str(tmp))
        (tmp / MANIFEST).write_text(json.dumps(identity, indent=1, sort_keys=True))


def contiguous_batches(batches: list[np.ndarray], position_of: np.ndarray) -> list[tuple[int, int]]:
    """[a_k, b_k) of each batch of speculators' sampler (arrays of row indices), checked to be consecutive
    contiguous position ranges from 0.

    Raises:
        ConfigError: a batch is not (the sampler shuffles otherwise than :func:`sampler_permutation` assumes).
    """
    out, a = [], 0
    for k, rows in enumerate(batches):
        pos = np.sort(position_of[np.asarray(rows, dtype=np.int64)])
        b = a + len(pos)
        if len(pos) == 0 or not np.array_equal(pos, np.arange(a, b)):
            raise ConfigError(f"speculators' sampler batch {k} reads positions {pos[:8].tolist()}..., not the range "
                              f"[{a}, {b}): this speculators version shuffles otherwise; accepted: speculators 0.9.0")
        out.append((a, b))
        a = b
    return out


def _sample_of(art, layers: list[int]) -> dict[str, torch.Tensor]:
    """speculators' file sample from an artifact: ``hidden_states`` [T, len(layers), H] (stored dtype; fp8
    artifacts dequantised to bfloat16), ``token_ids`` [T] int64."""
    hidden = art.hidden(torch.bfloat16) if art.hidden_scales is not None else art.hidden_states
    return {"hidden_states": hidden[:, layers].contiguous(), "token_ids": art.input_ids.to(torch.int64)}


def _training_state(save_path: str | Path) -> dict | None:
    """speculators' ``SAVE_PATH/0/training_state.json`` (epoch 0's last checkpoint), or None."""
    try:
        state = json.loads((Path(save_path) / "0" / "training_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


class ArtcacheTransfer:
    """speculators' ``HiddenStatesTransfer`` over an artcache root, for one registered consumer (see the module
    docstring). ``get_cached(row)`` returns speculators' file sample of data row ``row``; it never returns None
    (a position not yet captured is waited for as demand)."""

    def __init__(self, root: str | Path, consumer_id: str, *, layers: list[int], spans: list[tuple[int, int]],
                 position_of: np.ndarray, heldout: tuple[int, int], end: int, lookahead: int,
                 demand_timeout_s: float, save_path: str | Path, draft: str) -> None:
        self.layout, self.settings, self.plan = open_root(root)
        self.consumer_id, self.layers, self.spans = consumer_id, layers, spans
        self.position_of, self.heldout, self.end = position_of, heldout, end
        self.lookahead, self.demand_timeout_s = lookahead, demand_timeout_s
        self.save_path, self.draft = save_path, draft
        self.epoch_len = heldout[0] or len(self.plan)
        self.batch_of = np.empty(len(position_of), dtype=np.int64)
        for k, (a, b) in enumerate(spans):
            self.batch_of[a:b] = k
        self.batch, self.cursor, self.recorded, self.training_done = -1, 0, -1, False
        self.client: CacheClient | None = None
        self._beat_stop = threading.Event()
        self._lock = threading.Lock()

    def start(self, start_step: int) -> None:
        """Register the consumer at the cursor of ``start_step`` optimizer steps (a resumed checkpoint's
        ``global_step``; 0: a fresh run) and start its heartbeat.

        Raises:
            ConfigError: the id is held by a live process (:func:`artcache.registry.register`).
        """
        cursor = self.cursor_after(start_step)
        journal = J.JournalWriter(self.layout.journal_path("consumer", self.consumer_id))
        batch = max(b - a for a, b in self.spans)
        try:
            reg = registry.register(self.layout, registry.Registration(
                consumer_id=self.consumer_id, draft=self.draft, cursor=cursor, lookbehind=0, lookahead=self.lookahead,
                batch_size=batch, end=self.end, pid=os.getpid(), host=host_id(), pinned=self.heldout,
                checkpoint_cursor=cursor if start_step else -1, epoch_len=self.epoch_len,
                out_dir=str(Path(self.save_path).absolute())), live_timeout_s=self.settings.heartbeat_timeout_s)
        except BaseException:
            journal.close(remove_if_empty=True)
            raise
        self.client = CacheClient.for_consumer(self.layout, self.settings, self.plan, reg, journal,
                                               self.demand_timeout_s, epoch_len=self.epoch_len)
        self.cursor = self.recorded = cursor if start_step else 0
        self.batch = start_step - 1
        journal.emit(J.ConsumerStart(consumer=self.consumer_id, pid=os.getpid(), draft=self.draft, block_size=0,
                                     batch_size=batch, lookbehind=0, lookahead=self.lookahead, cursor=cursor,
                                     step=start_step, pinned=self.heldout[1] - self.heldout[0],
                                     epoch_len=self.epoch_len))
        threading.Thread(target=self._heartbeat, daemon=True, name="artcache-heartbeat").start()
        atexit.register(self.close)
        log.info("[%s] registered on %s at cursor %d (step %d), end %d, window +%d", self.consumer_id,
                 self.layout.root, cursor, start_step, self.end, self.lookahead)

    def cursor_after(self, steps: int) -> int:
        """The cursor once ``steps`` optimizer steps (batches) are done: ``a_steps`` (``end`` past the last)."""
        return self.spans[steps][0] if steps < len(self.spans) else self.spans[-1][1]

    def _heartbeat(self) -> None:
        while not self._beat_stop.wait(HEARTBEAT_S):
            try:
                self.client.handle.heartbeat()
            except ConsumerFenced as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # a transient filesystem error: try again next beat
                log.warning("heartbeat failed: %s", exc)

    # ---- speculators' HiddenStatesTransfer -------------------------------------------------------------------

    def setup(self) -> None:
        """Nothing to set up lazily (the consumer registered in ``from_train_args``)."""

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        """The sample of data row ``file_idx``: a training row reads its run position (committing the cursor when
        it starts a new batch), a validation row its held-out sample. Shapes and dtypes: the module docstring.

        Raises:
            CaptureTimeout, CaptureFailed, ConsumerFenced: from :meth:`artcache.client.CacheClient.acquire`.
            IndexError: ``file_idx`` past the data rows.
        """
        file_idx, train_rows = int(file_idx), len(self.position_of)  # speculators passes numpy ints
        with self._lock:
            if file_idx < train_rows:
                p = int(self.position_of[file_idx])
                self._enter_batch(int(self.batch_of[p]))
                item = self.client.acquire(p)
            else:
                sample = self.heldout[0] + file_idx - train_rows
                if not self.heldout[0] <= sample < self.heldout[1]:
                    raise IndexError(f"data row {file_idx} is past the {train_rows} training and "
                                     f"{self.heldout[1] - self.heldout[0]} held-out rows")
                self._end_training()
                item = self.client.acquire_sample(sample)
        try:
            return _sample_of(item.artifact, self.layers)
        finally:
            self.client.release(item)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> None:
        """Never used: :meth:`get_cached` serves every row (speculators asks only when it returned None)."""
        return None

    def delete(self, handle: str) -> None:
        """Nothing to delete: artifacts are retained and evicted by the root's producer."""

    # ---- cursor ----------------------------------------------------------------------------------------------

    def _enter_batch(self, k: int) -> None:
        """The first read of batch ``k``: steps ``0 .. k - 1`` are done, commit ``a_k``."""
        if k == self.batch:
            return
        if k < self.batch:
            raise ConfigError(f"speculators read batch {k} after batch {self.batch}: a second epoch; accepted: "
                              "--epochs 1 (--artcache-epochs passes over the plan)")
        self.batch = k
        self._commit(self.spans[k][0])

    def _end_training(self) -> None:
        """The first validation read: the training loop's last step (of the last batch read) is done."""
        if not self.training_done and self.batch >= 0:
            self.training_done = True
            self._commit(self.spans[self.batch][1])

    def _commit(self, cursor: int) -> None:
        if cursor > self.cursor:
            self.client.handle.commit_cursor(cursor)
            self.cursor = cursor
        state = _training_state(self.save_path)
        if state is not None and state.get("epoch") == 0:
            ckpt = self.cursor_after(int(state.get("global_step", 0)))
            if self.recorded < ckpt <= self.cursor:
                self.client.handle.record_checkpoint(ckpt)
                self.recorded = ckpt

    def close(self) -> None:
        """Finish the registration (``completed`` when the cursor reached ``end``, else ``cancelled``), journal the
        end, stop the heartbeat. Idempotent (runs at exit)."""
        if self.client is None or self._beat_stop.is_set():
            return
        self._beat_stop.set()
        state = registry.COMPLETED if self.cursor >= self.end else "cancelled"
        try:
            self.client.handle.finish(state)
        except (ConsumerFenced, OSError) as exc:
            log.warning("[%s] finishing the registration: %s", self.consumer_id, exc)
        self.client.journal.emit(J.ConsumerEnd(consumer=self.consumer_id, state=state,
                                               steps=sum(b <= self.cursor for _, b in self.spans),
                                               cursor=self.cursor))
        self.client.journal.close()


class ArtcacheBackend:
    """The ``artcache`` entry of ``hs_connectors.HiddenStatesBackend.registry`` (:func:`register` adds it): its
    train arguments and :meth:`from_train_args`. It launches no vLLM (the root's producer captures)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument
        g("--artcache-root", type=str, default=None, help="artcache root that `artcache producer` fills (required)")
        g("--artcache-id", type=str, default="speculators", help="this trainer's consumer id on the root")
        g("--artcache-lookahead", type=int, default=64, help="positions past the cursor the producer captures ahead")
        g("--artcache-demand-timeout", type=float, default=600.0, help="seconds to wait for one capture")
        g("--artcache-eval-samples", type=int, default=0,
          help="held-out samples at the plan's end (speculators' validation rows; the plan's data.eval split if it "
               "has one)")
        g("--artcache-epochs", type=int, default=1, help="passes over the plan (artcache's epoch order)")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """No vLLM launch arguments: `artcache producer` captures."""

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise ConfigError("--hidden-states-backend artcache launches no vLLM: run `artcache producer` on the root")

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> ArtcacheTransfer:
        """Check the settings, write ``data_path``, register the consumer (module docstring). Sets
        ``args.train_data_ratio`` (speculators reads it after this returns).

        Raises:
            ConfigError: a refused setting (one line each), a layer the root lacks, a foreign ``data_path``.
            CacheRootError, DataError: no root, or a damaged plan (:func:`artcache.client.open_root`).
        """
        _check_args(args)
        layout, settings, plan = open_root(args.artcache_root)
        held = heldout_samples(plan, args.artcache_eval_samples, "--artcache-eval-samples")
        if held <= 0:
            raise ConfigError("--artcache-eval-samples 0: speculators' trainer needs a validation split and the plan "
                              f"has no data.eval one; accepted: 1 .. {len(plan) - 1}")
        heldout = eval_split(len(plan), held, "--artcache-eval-samples", need_split=True)
        order = plan.order(heldout[0])
        rows = args.artcache_epochs * heldout[0]
        identity = {"root": str(layout.root), "plan_id": settings.plan_id, "seed": int(args.seed),
                    "positions": rows, "heldout": list(heldout)}
        write_data_dir(Path(data_path), plan, order, rows, heldout, int(args.seed), identity)
        args.train_data_ratio = train_ratio(rows, rows + heldout[1] - heldout[0])
        _, position_of = row_layout(rows, int(args.seed))
        spans = contiguous_batches(_sampler_batches(plan, order, rows, args), position_of)
        steps = len(spans) if args.max_steps is None else min(int(args.max_steps), len(spans))
        layers = layer_indices(settings.contract.layer_ids, *_target_layers(args))
        transfer = ArtcacheTransfer(
            args.artcache_root, args.artcache_id, layers=layers, spans=spans, position_of=position_of,
            heldout=heldout, end=spans[steps - 1][1], lookahead=args.artcache_lookahead,
            demand_timeout_s=args.artcache_demand_timeout, save_path=args.save_path,
            draft=f"speculators-{args.speculator_type}")
        state = None if args.no_resume_from_checkpoint else _training_state(args.save_path)
        transfer.start(int(state.get("global_step", 0)) if state and state.get("epoch") == 0 else 0)
        return transfer


def _check_args(args: argparse.Namespace) -> None:
    """Refuse the settings the backend cannot serve (one line each)."""
    if not args.artcache_root:
        raise ConfigError("--hidden-states-backend artcache needs --artcache-root (a root `artcache producer` fills)")
    if int(args.num_workers) != 0:
        raise ConfigError(f"--num-workers {args.num_workers}: the artcache backend commits its cursor from the "
                          "training loop's own reads; accepted: 0")
    if int(args.epochs) != 1:
        raise ConfigError(f"--epochs {args.epochs} with --hidden-states-backend artcache; accepted: 1 "
                          "(--artcache-epochs N passes over the plan)")
    if int(args.artcache_epochs) < 1:
        raise ConfigError(f"--artcache-epochs {args.artcache_epochs}; accepted: 1 or more")
    if int(args.artcache_lookahead) < 0:
        raise ConfigError(f"--artcache-lookahead {args.artcache_lookahead}; accepted: 0 or more")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ConfigError(f"world size {world} with --hidden-states-backend artcache; accepted: 1 (one rank)")


def _sampler_batches(plan, order, rows: int, args: argparse.Namespace) -> list:
    """speculators' own sampler's epoch-0 batches (row indices) over the written training rows."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    row_of, _ = row_layout(rows, int(args.seed))
    lengths = np.empty(rows, dtype=np.int64)
    lengths[row_of] = [plan.sample(int(s)).input_ids.shape[0] for s in order.samples(0, rows)]
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=int(args.total_seq_len), lengths=lengths,
                                                 num_replicas=1, rank=0, seed=int(args.seed))
    return list(sampler._generate_batches(0))


def _target_layers(args: argparse.Namespace) -> tuple[list[int], int]:
    """(speculators' target layer ids, vLLM ids, as its draft resolves them; the verifier's layer count)."""
    from speculators.models.utils import get_verifier_config, resolve_target_layer_ids

    trust = bool(getattr(args, "trust_remote_code", False))
    ids = resolve_target_layer_ids(args.target_layer_ids, args.verifier_name_or_path, trust_remote_code=trust)
    return list(ids), int(get_verifier_config(args.verifier_name_or_path, trust_remote_code=trust).num_hidden_layers)


def register() -> None:
    """Add :class:`ArtcacheBackend` to ``hs_connectors``' registry as ``artcache`` (once; before speculators'
    ``speculators.train.config`` is imported, which reads the registry's train arguments at import)."""
    from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

    if HiddenStatesBackend.registry.get(BACKEND_NAME) is not ArtcacheBackend:
        HiddenStatesBackend.register(BACKEND_NAME)(ArtcacheBackend)
        HiddenStatesTransfer.register(ArtcacheTransfer)


def main(argv: list[str] | None = None) -> None:
    """``python -m artcache.trainers.speculators_backend <speculators command> ...``: speculators' CLI with the
    ``artcache`` backend registered. An :class:`~artcache.errors.ArtcacheError` (a refused setting, no root, a
    capture timeout) ends it with one ``artcache: error:`` line and the error's exit code."""
    register()
    from speculators.cli import app

    try:
        app(args=argv, prog_name="speculators")
    except ArtcacheError as exc:
        prefix = "" if exc.exit_code == 2 else f"{type(exc).__name__}: "
        print(f"artcache: error: {prefix}{exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
