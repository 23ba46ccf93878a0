"""The consumer: one DFlash draft trainer reading target hidden states from an artcache root.

Read it top to bottom: :func:`run_consumer` registers, builds the draft around the target's frozen
embedding and lm_head, starts a reader thread that leases positions inside
``[cursor, cursor + lookahead]``, and runs the training loop. The cursor is committed only after the
optimizer step that consumed its positions; leases are released once the batch is no longer used.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import signal
import threading
import time
from pathlib import Path
from typing import Literal

import msgspec
import torch

from artcache import journal as J
from artcache import registry
from artcache.client import CacheClient, Leased
from artcache.crashpoints import crash_point
from artcache.errors import ConfigError, ConsumerFenced, ContractMismatch
from artcache.layout import CacheLayout, check_id, host_id
from artcache.settings import load_settings

log = logging.getLogger("artcache.consumer")


class ConsumerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One consumer's settings (CLI flags map onto these fields).

    Attributes:
        cache: the cache root (made by ``artcache producer``). consumer_id: unique per root.
        draft: draft algorithm (``dflash``).
        lookbehind, lookahead: window in positions; lookahead must be >= batch_size.
        block_size (B), num_anchors (N per sequence), draft_layers (default: one per captured layer).
        batch_size: sequences (= positions) per optimizer step. steps: optimizer steps to run.
        lr, warmup_frac, min_lr_frac, weight_decay, grad_clip: AdamW with linear warmup and cosine
            decay to ``min_lr_frac × lr`` (DFlash recipe: lr 6e-4, warmup 4 %, clip 1.0).
        seed: draft init and anchor sampling. device: ``cpu`` or ``cuda[:i]``.
        threads: torch CPU threads (0 = torch default). out_dir: run directory (checkpoints).
        demand_timeout_s: give up waiting for one position after this long.
        heartbeat_s: heartbeat period. prefetch_batches: batches read ahead (inside the lookahead).
        log_every: print a metrics line every this many steps.
    """

    cache: str
    consumer_id: str = "dflash-0"
    draft: Literal["dflash"] = "dflash"
    lookbehind: int = 64
    lookahead: int = 256
    block_size: int = 16
    num_anchors: int = 64
    draft_layers: int | None = None
    batch_size: int = 2
    steps: int = 100
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    threads: int = 0
    out_dir: str = ""
    demand_timeout_s: float = 600.0
    heartbeat_s: float = 2.0
    prefetch_batches: int = 2
    log_every: int = 10

    def validate(self) -> None:
        check_id(self.consumer_id, "consumer id")
        flags = {"num_anchors": "--anchors"}  # fields whose CLI flag has another name
        for name in ("batch_size", "steps", "block_size", "num_anchors", "prefetch_batches", "log_every"):
            if getattr(self, name) < 1:
                flag = flags.get(name, "--" + name.replace("_", "-"))
                raise ConfigError(f"{flag} {getattr(self, name)} is invalid: it must be >= 1")
        if self.lookbehind < 0 or self.lookahead < 0:
            raise ConfigError(f"window {self.lookbehind}:{self.lookahead}: both sides must be >= 0")
        if self.lookahead < self.batch_size:
            raise ConfigError(
                f"lookahead {self.lookahead} is smaller than one batch ({self.batch_size} positions): the "
                f"consumer could never read a whole batch; use --window {self.lookbehind}:{self.batch_size} "
                "or larger, or a smaller --batch-size")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be >= 2, got {self.block_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a finite number > 0, got {self.lr}")


def parse_window(text: str) -> tuple[int, int]:
    """``"64:256"`` → (lookbehind 64, lookahead 256). Raises ConfigError naming the bad value."""
    m = re.fullmatch(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*", text)
    if m is None:
        raise ConfigError(f"--window {text!r} is not LOOKBEHIND:LOOKAHEAD with two non-negative integers, e.g. 64:256")
    return int(m.group(1)), int(m.group(2))


def lr_at(step: int, total: int, base: float, warmup_frac: float, min_frac: float) -> float:
    """Linear warmup over ceil(warmup_frac·total) steps, then cosine decay to min_frac·base."""
    warm = max(1, math.ceil(warmup_frac * total))
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class _Reader(threading.Thread):
    """Leases and reads batches of consecutive positions, never beyond ``cursor + lookahead``.

    It cannot move the window: the trainer commits the cursor and calls :meth:`authorize`.
    Results (lists of :class:`Leased`, or the exception that stopped it) go to ``out``.
    """

    def __init__(self, client: CacheClient, start_pos: int, batch: int, lookahead: int, depth: int,
                 end: int) -> None:
        super().__init__(daemon=True, name="artcache-reader")
        self.client, self.next_pos, self.batch, self.lookahead = client, start_pos, batch, lookahead
        self.end = end  # exclusive: the consumer never reads at or past its announced end
        self.out: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self._cond = threading.Condition()
        self._cursor = start_pos

    def authorize(self, cursor: int) -> None:
        with self._cond:
            self._cursor = cursor
            self._cond.notify_all()

    def run(self) -> None:
        try:
            while not self.stop.is_set() and self.next_pos + self.batch <= self.end:
                items = []
                for p in range(self.next_pos, self.next_pos + self.batch):
                    with self._cond:
                        while p > self._cursor + self.lookahead and not self.stop.is_set():
                            self._cond.wait(0.1)
                    if self.stop.is_set():
                        break
                    items.append(self.client.acquire(p, self.stop))
                if self.stop.is_set():
                    for it in items:
                        self.client.release(it)
                    return
                self.next_pos += self.batch
                while not self.stop.is_set():
                    try:
                        self.out.put(items, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                else:
                    for it in items:
                        self.client.release(it)
        except InterruptedError:
            return
        except BaseException as exc:  # handed to the trainer, which re-raises it
            self.out.put(exc)


def collate(items: list[Leased], device: torch.device):
    """Pad a batch: hidden [b, T, m, H] (zeros), input_ids [b, T] long, loss_mask [b, T] bool,
    context_valid [b, T] bool, on ``device``. A batch of one is not copied on the host: its
    tensors are views of the (pinned, on a GPU) read buffer and go to the device directly."""
    lengths = [it.artifact.input_ids.shape[0] for it in items]
    t = max(lengths)
    first = items[0].artifact.hidden_states
    b, m, h = len(items), first.shape[1], first.shape[2]
    gpu = device.type == "cuda"
    if b == 1:
        hidden = first[None]
    else:
        hidden = torch.zeros(b, t, m, h, dtype=first.dtype, pin_memory=gpu)
        for i, it in enumerate(items):
            hidden[i, : lengths[i]] = it.artifact.hidden_states
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, it in enumerate(items):
        n = lengths[i]
        ids[i, :n] = it.artifact.input_ids.long()
        mask[i, :n] = it.artifact.loss_mask.bool()
        valid[i, :n] = True
    return (hidden.to(device, non_blocking=gpu), ids.to(device), mask.to(device), valid.to(device))


def build_draft(cfg: ConsumerConfig, settings, plan, device: torch.device):
    """Build the DFlash draft around the target's frozen embedding and lm_head.

    Raises:
        ContractMismatch: the root's captured layers are not the ones this draft needs, or the
            target's weights changed since capture.
        ConfigError: no valid MASK token.
    """
    from transformers import AutoConfig

    from artcache.plan import choose_mask_token
    from artcache.target import load_embedding_and_lm_head, load_tokenizer, resolve_target
    from trainers.dflash import DFlashConfig, DFlashDraft, dflash_layer_ids

    contract = settings.contract
    info = resolve_target(settings.target_path)
    if info.weights_digest != contract.target_weights_digest:
        raise ContractMismatch(
            f"target at {settings.target_path} has weights digest {info.weights_digest}, but the cache "
            f"root was captured from {contract.target_weights_digest}")
    n = cfg.draft_layers or len(contract.layer_ids)
    need = dflash_layer_ids(info.num_layers, n)
    if list(contract.layer_ids) != need:
        raise ContractMismatch(
            f"a {n}-layer DFlash draft needs output-of-layer ids {need}; this cache root captures "
            f"{list(contract.layer_ids)} (start the producer with --draft-layers {n})")
    tok = load_tokenizer(info)
    mask_id = choose_mask_token(tok, info.vocab_size, plan)
    embed, lm_head = load_embedding_and_lm_head(info)
    dcfg = DFlashConfig.from_target(AutoConfig.from_pretrained(info.path), num_layers=n,
                                    block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                                    mask_token_id=mask_id, num_context_layers=len(contract.layer_ids))
    torch.manual_seed(cfg.seed)
    model = DFlashDraft(dcfg, embed.to(device), lm_head.to(device))
    return model, dcfg


def run_consumer(cfg: ConsumerConfig) -> dict:
    """Train one draft on the cache root; returns a summary dict. Raises on failure (after fencing)."""
    from artcache.plan import Plan
    from trainers.checkpoint import save_checkpoint
    from trainers.dflash import dflash_loss, sample_anchors

    cfg.validate()
    from artcache.producer import quiet_transformers

    quiet_transformers()
    layout = CacheLayout(Path(cfg.cache).expanduser().absolute())
    settings = load_settings(layout)  # raises CacheRootError for a missing/uninitialised root
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    plan = Plan.load(layout.plan_dir(settings.plan_id))
    model, dcfg = build_draft(cfg, settings, plan, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                  fused=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    run_dir = Path(cfg.out_dir or Path("runs") / cfg.consumer_id).absolute()

    journal = J.JournalWriter(layout.journal_path("consumer", cfg.consumer_id))
    reg = registry.register(layout, registry.Registration(
        consumer_id=cfg.consumer_id, draft=cfg.draft, cursor=0, lookbehind=cfg.lookbehind,
        lookahead=cfg.lookahead, batch_size=cfg.batch_size, end=cfg.steps * cfg.batch_size, pid=os.getpid(),
        host=host_id()))
    handle = registry.ConsumerHandle(layout, reg)
    journal.emit(J.ConsumerStart(consumer=cfg.consumer_id, pid=os.getpid(), draft=cfg.draft,
                                 block_size=cfg.block_size, batch_size=cfg.batch_size,
                                 lookbehind=cfg.lookbehind, lookahead=cfg.lookahead, cursor=reg.cursor))
    client = CacheClient(layout, settings, plan, handle, journal, cfg.demand_timeout_s, pin=device.type == "cuda")
    reader = _Reader(client, reg.cursor, cfg.batch_size, cfg.lookahead, cfg.prefetch_batches,
                     end=cfg.steps * cfg.batch_size)
    fenced = threading.Event()
    beat_stop = threading.Event()

    def heartbeat():
        while not beat_stop.wait(cfg.heartbeat_s):
            try:
                handle.heartbeat()
            except ConsumerFenced as exc:
                log.error("%s", exc)
                fenced.set()
                reader.stop.set()
                return
            except Exception as exc:  # a transient filesystem error: try again next beat
                log.warning("heartbeat failed: %s", exc)

    if threading.current_thread() is threading.main_thread():
        # SIGTERM ends the run like Ctrl-C: fenced as "cancelled", leases released, journal closed.
        signal.signal(signal.SIGTERM, _raise_interrupt)
    beater = threading.Thread(target=heartbeat, daemon=True, name="artcache-heartbeat")
    beater.start()
    reader.start()
    cursor, step, state, error = reg.cursor, 0, "failed", ""
    first_losses, last_losses = [], []
    total = None
    t_start = time.time()
    try:
        for step in range(cfg.steps):
            t0 = time.monotonic()
            got = reader.out.get()
            if isinstance(got, BaseException):
                raise got
            if fenced.is_set():
                raise ConsumerFenced(f"consumer {cfg.consumer_id} was fenced")
            wait_s = time.monotonic() - t0
            hidden, ids, mask, valid = collate(got, device)
            anchors, avalid = sample_anchors((mask & valid).cpu(), cfg.num_anchors, gen)  # CPU generator
            lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup_frac, cfg.min_lr_frac)
            for g in optimizer.param_groups:
                g["lr"] = lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(hidden, ids, anchors.to(device), avalid.to(device), context_valid=valid)
                loss, stats = dflash_loss(model, out, ids, mask, anchors.to(device), avalid.to(device),
                                          context_valid=valid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            cursor = got[-1].position + 1
            # the step no longer needs the batch's bytes: release its leases while its positions are
            # still inside the window, then commit (a crash in between leaves nothing outside it)
            for it in got:
                client.release(it)
            crash_point("cursor.before-commit")
            handle.commit_cursor(cursor)  # only after the step that consumed the positions
            crash_point("cursor.after-commit")
            reader.authorize(cursor)
            total = stats if total is None else total + stats
            s = stats.summary()
            if step < 5:
                first_losses.append(s["loss"])
            last_losses.append(s["loss"])
            del last_losses[:-5]
            journal.emit(J.Step(consumer=cfg.consumer_id, step=step + 1, cursor=cursor, loss=s["loss"],
                                tau_sum=float(stats.tau_sum), blocks=int(stats.num_blocks),
                                acc_correct=stats.correct.tolist(), acc_total=stats.total.tolist(),
                                wait_s=wait_s, step_s=time.monotonic() - t0, lr=lr))
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                shown = s["acc"][:4]
                acc = " ".join(f"{a:.2f}" for a in shown)
                log.info("[%s] step %d/%d loss %.3f tau %.2f (incl. +1 bonus) acc_1..%d %s trainer wait for "
                         "batch %.2fs", cfg.consumer_id, step + 1, cfg.steps, s["loss"], s["tau"], len(shown), acc,
                         wait_s)
        step = cfg.steps
        state = "completed"
    except KeyboardInterrupt:
        state, error = "cancelled", "interrupted"
        raise
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        reader.stop.set()
        beat_stop.set()
        reader.join(timeout=5)
        _drain(reader, client)
        ckpt = None
        if state == "completed":
            ckpt = save_checkpoint(run_dir, step=step, cursor=cursor, model=model, optimizer=optimizer,
                                   scheduler=None, extra={
                                       "consumer_id": cfg.consumer_id, "draft": cfg.draft,
                                       "draft_config": msgspec.to_builtins(dcfg),
                                       "plan_id": settings.plan_id,
                                       "contract_id": settings.contract.contract_id})
        handle.finish(state, error)
        journal.emit(J.ConsumerEnd(consumer=cfg.consumer_id, state=state, steps=step, cursor=cursor,
                                   error=error))
        journal.close()
    summary = total.summary() if total is not None else {}
    return {"consumer_id": cfg.consumer_id, "steps": step, "cursor": cursor, "seconds": time.time() - t_start,
            "first_loss": sum(first_losses) / max(1, len(first_losses)),
            "final_loss": sum(last_losses) / max(1, len(last_losses)),
            "tau": summary.get("tau"), "checkpoint": str(ckpt) if ckpt else None}


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _drain(reader: _Reader, client: CacheClient) -> None:
    """Release leases of batches the reader fetched but the trainer never used."""
    while True:
        try:
            got = reader.out.get_nowait()
        except queue.Empty:
            return
        if isinstance(got, list):
            for it in got:
                client.release(it)
