"""Packed against unpacked consumer steps at the same token budget, side by side in one process.

``python -m artcache.bench.packing --out FILE [--draft dflash] [--arch smollm2-135m] [--max-length 2048]
[--samples 2000] [--rows 2] [--steps 4] [--anchors 64] [--block-size 16] [--threads 0] [--walk 0]
[--device cpu] [--data sharegpt | --plan DIR]``
(``artcache bench --suite packing`` runs it per draft, :mod:`artcache.bench.suites`).

The plan is the real one (ShareGPT rendered by SmolLM2-135M-Instruct's tokenizer and chat template at
``--max-length``): every document's length and loss mask are those a consumer trains on, in the order a
consumer reads them (the plan's epoch order). The draft has SmolLM2-135M's shapes (H 576, V 49152, 5 captured
layers for DFlash / DSpark, 4 for EAGLE-3; ``--arch tiny-llama``: H 64, a quick check) with random frozen target
tensors and random hidden states: a step's cost depends on shapes, lengths, masks and anchors, not on the values (the
capture is not what is measured here; the consumer's step is).

``--device cpu`` (default) steps as ``artcache consume`` does on a CPU: float32, the reference loss, and the lm_head
losses computed only over the valid positions (gathered on the host), so padding costs little there. ``--device
cuda`` steps as it does on CUDA without ``--compile``: bfloat16 hidden states and frozen tensors, the sync-free step
(every position computed, padding included, nothing read back to the host) and the chunked lm_head loss
(``bench.consumer_speed``'s ``syncfree`` variant); each timed step ends with a device synchronisation.

Both arms walk the plan from position 0 with the same ``--rows`` rows per step (the token budget: at most
``rows × max_length`` tokens a step):

- **unpacked**: one plan position per row, padded to the batch's longest (``artcache consume`` without
  ``--pack-tokens``);
- **packed**: ``--pack-tokens max_length`` rows (:class:`~artcache.trainers.packing.Packer`).

Two measurements:

- the **walk** (:func:`walk`): both arms' steps over the plan's first ``--walk`` positions (default: all), without
  training: supervised tokens, positions, computed tokens (rows × T) and anchors per step, padding fraction and
  anchor coverage over a representative share of the plan (``walk_packed_over_unpacked``);
- the **timed steps** (:func:`measure`): each step is the consumer's (``Draft.loss``, backward, clip 1.0, AdamW),
  timed after one warm-up step; the two arms' steps alternate, so both see the same load on a shared machine (wall
  and process CPU seconds; on a loaded machine the CPU seconds are the steadier figure). Per arm: supervised
  tokens (``loss_mask`` of the step's documents) per step, per second and per CPU second, padding fraction (padded
  positions / ``rows × T`` of the collated batch), anchors per step and anchor coverage of supervised tokens (the
  share of the step's supervised tokens that some anchor's block trains: slot k >= 1 of a valid block, inside its
  document; DFlash / DSpark). ``packed_over_unpacked`` holds the ratios.

Both arms draw up to ``--anchors`` anchors per document (a row of the unpacked arm is one document; a packed row
draws them per document), so anchor coverage per supervised token is the same in expectation and a packed step
trains more blocks: DFlash's and DSpark's step cost grows with the blocks (their queries, MLPs and the lm_head
cross-entropy over ``anchors × block size`` slots), EAGLE-3's with the computed tokens. The JSON records the
command, the commit and the hardware (:func:`artcache.bench.provenance.record`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from artcache.bench.provenance import record
from artcache.errors import ArtcacheError, ConfigError
from artcache.fsio import atomic_write

__all__ = ["anchor_coverage", "main", "measure", "run", "walk"]

SMOL = "smollm2-135m"


def _draft(name: str, anchors: int, block: int, seed: int = 0, arch: str = SMOL):
    """A draft adapter of ``arch``'s shape (SmolLM2-135M by default) on the CPU in float32 (random frozen embedding /
    lm_head)."""
    from artcache.bench.consumer_speed import _arch_config
    from artcache.trainers.speed import SpeedOptions

    hf = _arch_config(arch)
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(hf.vocab_size, hf.hidden_size, generator=g) * 0.02
    head = torch.randn(hf.vocab_size, hf.hidden_size, generator=g) * 0.02
    speed = SpeedOptions(sync_free=False, ce_impl="reference", compile="off", attn="sdpa")
    torch.manual_seed(seed)
    if name == "dflash":
        from artcache.trainers.dflash import DFlashConfig, DFlashDraft
        from artcache.trainers.dflash.adapter import DFlashAdapter

        cfg = DFlashConfig.from_target(hf, num_layers=5, block_size=block, num_anchors=anchors,
                                       mask_token_id=hf.vocab_size - 1, num_context_layers=5)
        return DFlashAdapter(DFlashDraft(cfg, emb, head), cfg, list(range(5)), torch.Generator().manual_seed(seed),
                             speed=speed), 5
    if name == "dspark":
        from artcache.trainers.dspark import DSparkConfig, DSparkDraft
        from artcache.trainers.dspark.adapter import DSparkAdapter

        cfg = DSparkConfig.from_target(hf, num_layers=5, block_size=block, num_anchors=anchors,
                                       mask_token_id=hf.vocab_size - 1, num_context_layers=5)
        model = DSparkDraft(cfg, emb, head, torch.ones(hf.hidden_size))
        return DSparkAdapter(model, cfg, list(range(6)), torch.Generator().manual_seed(seed), speed=speed), 6
    from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft
    from artcache.trainers.eagle3.adapter import Eagle3Adapter
    from artcache.trainers.eagle3.vocab import build_vocab_map

    cfg = Eagle3Config.from_target(hf, draft_vocab_size=8192, ttt_steps=7)
    counts = torch.randint(0, 1000, (hf.vocab_size,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    return Eagle3Adapter(Eagle3Draft(cfg, emb, torch.ones(hf.hidden_size), head, d2t, t2d), cfg, list(range(4)),
                         speed=speed), 4


class _Art:
    """What the collators read of an artifact: hidden states [n, m, H], ids, loss mask (no fp8 scales)."""

    def __init__(self, hidden, ids, mask) -> None:
        self.hidden_states, self.input_ids, self.loss_mask, self.hidden_scales = hidden, ids, mask, None


class _Item:
    def __init__(self, position: int, artifact: _Art) -> None:
        self.position, self.artifact = position, artifact


def _items(plan, lo: int, hi: int, m: int, h: int, random: bool = True,
           dtype: torch.dtype = torch.float32) -> list[_Item]:
    """Run positions ``lo .. hi - 1`` (the plan's epoch order, as a consumer reads them) as collator items:
    random hidden states [n, m, H] in ``dtype`` (zeros with ``random=False``), the sample's ids and loss mask."""
    g = torch.Generator().manual_seed(lo)
    order = plan.order(len(plan))
    out = []
    for p in range(lo, hi):
        s = plan.sample(order.sample(p))
        n = s.input_ids.numel()
        hidden = (torch.randn(n, m, h, generator=g) if random else torch.zeros(n, m, h)).to(dtype)
        out.append(_Item(p, _Art(hidden, s.input_ids.long(), s.loss_mask.bool())))
    return out


def anchor_coverage(batch, anchors: torch.Tensor, valid: torch.Tensor, block: int) -> tuple[int, int]:
    """(supervised tokens a valid block trains — slot k = 1 … B-1 at ``p + k``, supervised, inside the anchor's
    document —, supervised tokens of the batch), counted once each."""
    sup = (batch.loss_mask & batch.valid).cpu()
    valid_tok = batch.valid.cpu()
    docs = batch.doc_ids if batch.doc_ids is not None else torch.where(valid_tok, 0, -1)
    rows, t = sup.shape
    covered = torch.zeros_like(sup)
    for k in range(1, block):
        pos = anchors + k
        ok = valid & (pos < t)
        pc = pos.clamp(max=t - 1)
        same = docs.gather(1, pc) == docs.gather(1, anchors)
        hit = ok & same & sup.gather(1, pc)
        for r in range(rows):
            covered[r, pc[r][hit[r]]] = True
    return int((covered & sup).sum()), int(sup.sum())


def _batch(plan, lo: int, n: int, m: int, h: int, rows: int, max_length: int, packed: bool, random: bool = True,
           device: torch.device | None = None):
    """The step's collated batch on ``device`` (default: the CPU), as the consumer collates it there (bfloat16
    hidden states on CUDA, float32 on a CPU)."""
    from artcache.trainers.consumer.reader import collate
    from artcache.trainers.packing import collate_packed

    device = device or torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    items = _items(plan, lo, lo + n, m, h, random, dtype)
    return collate_packed(items, device, rows, max_length) if packed else collate(items, device)


def _workload(batch, anchors: torch.Tensor, valid: torch.Tensor, block: int, draws: bool) -> dict:
    """One step's workload: supervised tokens, computed tokens (rows × T), padded tokens, anchors, covered."""
    cov = int(anchor_coverage(batch, anchors, valid, block)[0]) if draws else 0
    return {"supervised": int((batch.loss_mask & batch.valid).sum()), "tokens": int(batch.valid.numel()),
            "padded": int((~batch.valid).sum()), "anchors": int(valid.sum()) if draws else 0, "covered": cov}


def walk(plan, rows: int, max_length: int, anchors: int, block: int, positions: int, seed: int = 0,
         draws: bool = True) -> dict:
    """The workload of both arms over the plan's first ``positions`` run positions, without training (no step is
    timed: what a step computes depends on the rows it is given, not on the hidden states' values). Each arm walks
    as the consumer does (unpacked: ``rows`` positions a step; packed: :class:`~artcache.trainers.packing.Packer`
    steps) until its next step would pass ``positions``; anchors as the draft draws them (per position / per
    document, :func:`~artcache.trainers.packing.draw_anchors`, seed ``seed``; ``draws=False``: none, EAGLE-3).
    Returns ``{"unpacked": figures, "packed": figures}``: ``steps``, ``positions``, the sums of :func:`_workload`
    and the per-step means, padding fraction and anchor coverage."""
    from artcache.trainers.packing import Packer, draw_anchors

    out = {}
    for name, packed in (("unpacked", False), ("packed", True)):
        packer = Packer.for_plan(plan, plan.order(len(plan)), rows, max_length, 10 ** 9) if packed else None
        gen = torch.Generator().manual_seed(seed)
        fig = {"steps": 0, "positions": 0, "supervised": 0, "tokens": 0, "padded": 0, "anchors": 0, "covered": 0}
        p = 0
        while True:
            n = packer.step_positions(p) if packer is not None else rows
            if not n or p + n > positions:
                break
            batch = _batch(plan, p, n, 1, 1, rows, max_length, packed, random=False)
            a, ok = draw_anchors(batch, anchors, gen) if draws else (None, None)
            for k, v in _workload(batch, a, ok, block, draws).items():
                fig[k] += v
            fig["steps"] += 1
            fig["positions"] += n
            p += n
        out[name] = _per_step(fig, draws)
    return out


def _per_step(fig: dict, draws: bool) -> dict:
    s = max(1, fig["steps"])
    out = dict(fig)
    out.update({"supervised_tokens_per_step": fig["supervised"] / s, "positions_per_step": fig["positions"] / s,
                "tokens_per_step": fig["tokens"] / s, "padding_fraction": fig["padded"] / max(1, fig["tokens"]),
                "anchors_per_step": fig["anchors"] / s})
    if draws:
        out["anchor_coverage"] = fig["covered"] / max(1, fig["supervised"])
        out["covered_supervised_tokens_per_step"] = fig["covered"] / s
    return out


class _Arm:
    """One arm (packed or unpacked): its own draft, optimizer and plan walk from position 0."""

    def __init__(self, draft_name: str, plan, rows: int, max_length: int, anchors: int, block: int,
                 packed: bool, arch: str = SMOL, device: torch.device | None = None) -> None:
        from artcache.bench.consumer_speed import build, train_step_fn
        from artcache.trainers.packing import Packer

        self.device = device or torch.device("cpu")
        if self.device.type == "cuda":
            layers = 4 if draft_name == "eagle3" else 5
            self.draft = build(draft_name, arch, "syncfree", self.device, layers=layers, anchors=anchors,
                               block=block)[0]
            self.m = layers + (draft_name == "dspark")
        else:
            self.draft, self.m = _draft(draft_name, anchors, block, arch=arch)
        self.name, self.plan, self.rows, self.max_length, self.block = draft_name, plan, rows, max_length, block
        self.train = train_step_fn(self.draft)
        self.packer = Packer.for_plan(plan, plan.order(len(plan)), rows, max_length, 10 ** 9) if packed else None
        self.pos = 0
        self.fig = {"steps": 0, "positions": 0, "seconds": 0.0, "cpu_seconds": 0.0, "supervised": 0, "tokens": 0,
                    "padded": 0, "anchors": 0, "covered": 0}

    def step(self, timed: bool) -> None:
        from artcache.trainers.packing import draw_anchors

        n = self.packer.step_positions(self.pos) if self.packer is not None else self.rows
        if self.pos + n > len(self.plan):
            raise ConfigError(f"the plan's {len(self.plan)} samples ran out after {self.fig['steps']} timed steps of "
                              f"the {'packed' if self.packer is not None else 'unpacked'} arm (after its warm-up "
                              "step); accepted: fewer --steps or --rows, or a plan of more samples (--samples, or a "
                              "larger --plan)")
        batch = _batch(self.plan, self.pos, n, self.m, self.draft.model.cfg.hidden_size, self.rows, self.max_length,
                       self.packer is not None, device=self.device)
        cov = n_anchors = 0
        if self.name != "eagle3":
            gen = torch.Generator()
            gen.set_state(self.draft.generator.get_state())
            a, ok = draw_anchors(batch, self.draft.model.cfg.num_anchors, gen)  # the draws the step makes
            cov, _ = anchor_coverage(batch, a, ok, self.block)
            n_anchors = int(ok.sum())
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        self.train(batch)
        if cuda:
            torch.cuda.synchronize(self.device)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        self.pos += n
        if not timed:
            return
        f = self.fig
        f["steps"] += 1
        f["positions"] += n
        f["seconds"] += dt
        f["cpu_seconds"] += dc
        f["supervised"] += int((batch.loss_mask & batch.valid).sum())
        f["tokens"] += int(batch.valid.numel())
        f["padded"] += int((~batch.valid).sum())
        f["anchors"] += n_anchors
        f["covered"] += cov

    def figures(self) -> dict:
        fig, s = self.fig, self.fig["steps"]
        out = dict(fig)
        out.update({
            "supervised_tokens_per_s": fig["supervised"] / fig["seconds"],
            "supervised_tokens_per_cpu_s": fig["supervised"] / fig["cpu_seconds"],
            "supervised_tokens_per_step": fig["supervised"] / s,
            "positions_per_step": fig["positions"] / s,
            "tokens_per_step": fig["tokens"] / s,
            "seconds_per_step": fig["seconds"] / s,
            "cpu_seconds_per_step": fig["cpu_seconds"] / s,
            "padding_fraction": fig["padded"] / fig["tokens"],
            "anchors_per_step": fig["anchors"] / s,
        })
        if self.name != "eagle3":
            out["anchor_coverage"] = fig["covered"] / fig["supervised"]
            out["covered_supervised_tokens_per_step"] = fig["covered"] / s
        return out


def measure(draft_name: str, plan, rows: int, steps: int, max_length: int, anchors: int, block: int,
            arch: str = SMOL, device: torch.device | None = None) -> dict:
    """Both arms, their steps interleaved (unpacked, packed, unpacked, ...) so that both see the same machine load:
    one warm-up step each, then ``steps`` timed steps each. Returns ``{"unpacked": figures, "packed": figures}``
    (the module docstring's figures, plus ``cpu_seconds``: this process's CPU time in the steps). ``device``: where
    the steps run (default: the CPU; see the module docstring for what differs on CUDA)."""
    arms = {name: _Arm(draft_name, plan, rows, max_length, anchors, block, packed, arch, device)
            for name, packed in (("unpacked", False), ("packed", True))}
    for i in range(steps + 1):
        for arm in arms.values():
            arm.step(timed=i > 0)
    return {name: arm.figures() for name, arm in arms.items()}


def run(draft: str, *, arch: str = SMOL, max_length: int = 2048, samples: int = 2000, rows: int = 2,
        steps: int = 4, anchors: int = 64, block: int = 16, walk_positions: int = 0, log=None,
        device: str = "cpu", data: str = "sharegpt", plan_dir: str | None = None) -> dict:
    """The packing figures of one draft (what ``main`` writes, less the provenance): the plan of ``data``
    (``sharegpt``: the embedded ShareGPT; or a ShareGPT-schema JSON/JSONL file) rendered by SmolLM2-135M-Instruct's
    tokenizer at ``max_length`` (``samples`` samples), or the saved plan ``plan_dir`` (a cache root's
    ``plans/<id>``; ``data``, ``max_length`` and ``samples`` then come from it), the draft at ``arch``'s shapes
    (``smollm2-135m``; ``tiny-llama`` for a quick check), :func:`walk` over ``walk_positions`` (0: the whole
    plan) and :func:`measure` of ``steps`` timed steps per arm (0: none) on ``device`` (``cpu`` or ``cuda``).
    ``packed_over_unpacked`` holds the timed arms' ratios, ``walk_packed_over_unpacked`` the walk's. ``log``: called
    with a progress line (None: stderr)."""
    from artcache.plan import PlanSpec, build_plan
    from artcache.target import DEFAULT_TARGET, load_tokenizer, resolve_target

    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if plan_dir is not None:
        from artcache.plan import Plan

        plan = Plan.load(plan_dir)
        data, max_length = f"plan {plan.plan_id}", int(plan.provenance["spec"]["max_length"])
    else:
        info = resolve_target(DEFAULT_TARGET)
        plan = build_plan(PlanSpec(dataset=data, max_length=max_length, max_samples=samples),
                          load_tokenizer(info), target_vocab_size=info.vocab_size)
    lengths = (plan.offsets[1:] - plan.offsets[:-1]).numpy()
    draws = draft != "eagle3"
    report = {"draft": draft, "data": data, "arch": arch, "max_length": max_length, "rows": rows, "anchors": anchors,
              "block_size": block, "threads": torch.get_num_threads(), "device": device,
              "plan": {"samples": len(plan), "mean_tokens": float(np.mean(lengths)),
                       "median_tokens": float(np.median(lengths)), "max_tokens": int(lengths.max()),
                       "at_max_length": float(np.mean(lengths >= max_length))}}
    walked = walk(plan, rows, max_length, anchors, block, walk_positions or len(plan), draws=draws)
    report["walk"] = walked
    wkeys = ["supervised_tokens_per_step", "positions_per_step", "tokens_per_step", "anchors_per_step"]
    if draws:
        wkeys += ["anchor_coverage", "covered_supervised_tokens_per_step"]
    report["walk_packed_over_unpacked"] = {k: walked["packed"][k] / walked["unpacked"][k] for k in wkeys
                                           if walked["unpacked"][k]}
    say(json.dumps({"walk_packed_over_unpacked": report["walk_packed_over_unpacked"]}))
    if not steps:  # the walk only
        return report
    arms = measure(draft, plan, rows, steps, max_length, anchors, block, arch, torch.device(device))
    say(json.dumps(arms))
    report["arms"] = arms
    keys = ["supervised_tokens_per_s", "supervised_tokens_per_cpu_s", "supervised_tokens_per_step",
            "seconds_per_step", "cpu_seconds_per_step", "positions_per_step", "tokens_per_step", "anchors_per_step"]
    if draws:
        keys += ["anchor_coverage", "covered_supervised_tokens_per_step"]
    report["packed_over_unpacked"] = {k: arms["packed"][k] / arms["unpacked"][k] for k in keys if arms["unpacked"][k]}
    report["padding_fraction"] = {k: arms[k]["padding_fraction"] for k in arms}
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m artcache.bench.packing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--draft", default="dflash", choices=("dflash", "eagle3", "dspark"))
    ap.add_argument("--arch", default=SMOL, choices=(SMOL, "tiny-llama"), help="the draft's target shapes")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=2000, help="plan samples (ShareGPT) to build")
    ap.add_argument("--rows", type=int, default=2, help="rows per step in both arms (--batch-size)")
    ap.add_argument("--steps", type=int, default=4,
                    help="timed steps per arm (after one warm-up step); 0: the walk only, no step is trained")
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--walk", type=int, default=0,
                    help="walk both arms over the plan's first N positions without training (the workload figures "
                         "of a representative sample; 0: every sample of the plan)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the timed steps run (cuda: bfloat16, the sync-free step, as the consumer on CUDA)")
    ap.add_argument("--data", default="sharegpt",
                    help="sharegpt (the embedded ShareGPT) or a ShareGPT-schema JSON/JSONL file")
    ap.add_argument("--plan", default=None, metavar="DIR",
                    help="a saved plan directory (a cache root's plans/<id>) instead of building one from --data; "
                         "--max-length and --samples then come from it")
    args = ap.parse_args(argv)

    def refuse(message: str) -> None:  # bad input: one line (argparse's own errors print the usage too), exit 2
        print(f"{ap.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    if args.device == "cuda" and not torch.cuda.is_available():
        refuse("--device cuda: no CUDA device is available here; use --device cpu")
    for flag, least in (("max_length", 1), ("samples", 1), ("rows", 1), ("steps", 0), ("anchors", 1),
                        ("block_size", 2), ("threads", 0), ("walk", 0)):
        if getattr(args, flag) < least:
            refuse(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not accepted: an integer >= {least}")
    if args.plan is not None and not Path(args.plan).is_dir():
        refuse(f"--plan {args.plan!r} is not a directory: give a saved plan directory (a cache root's "
               "plans/<id>, holding plan.json and plan.safetensors)")
    out = Path(args.out)
    if out.is_dir():
        refuse(f"--out {args.out!r} is a directory: give the JSON file to write")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = {**record("artcache.bench.packing", argv, device=torch.device(args.device)),
                  **run(args.draft, arch=args.arch, max_length=args.max_length, samples=args.samples,
                        rows=args.rows, steps=args.steps, anchors=args.anchors, block=args.block_size,
                        walk_positions=args.walk, device=args.device, data=args.data, plan_dir=args.plan)}
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, [(json.dumps(report, indent=2) + "\n").encode()], out.parent, durable=False)
    except (ArtcacheError, OSError) as exc:  # bad input, a damaged plan, an unwritable --out: one line, no file
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(getattr(exc, "exit_code", 1)) from None
    print(json.dumps(report.get("packed_over_unpacked", report["walk_packed_over_unpacked"]), indent=2))


if __name__ == "__main__":
    main()
