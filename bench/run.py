"""Run bench scenarios: fresh cache root, one producer process, N consumer processes, a report.

Each scenario gets ``<out>/<scenario>/`` holding ``cache/`` (a fresh root), ``logs/``, ``runs/``
(consumer checkpoints), ``report.json``, ``report.md`` and ``progress.png``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from artcache import journal as J
from artcache.accounting import account
from artcache.errors import ConfigError
from artcache.layout import CacheLayout
from artcache.report import table
from artcache.telemetry import make_sampler
from bench.metrics import scenario_figures
from bench.plots import gpu_plot, progress_plot
from bench.scenarios import Scenario, resolve

LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


@dataclass
class BenchConfig:
    scenario: str = "1p3c"
    device: str = "cpu"
    out_dir: str = "bench-out"
    warmup: int = 5
    steps: int = 40
    target: str = "smollm2-135m-instruct"
    dataset: str = "sharegpt"
    max_length: int = 512
    max_samples: int = 2000
    anchors: int = 32
    batch_size: int = 1
    window: str = "64:256"
    allow_shared_gpu: bool = False
    draft_layers: int = 5
    timeout_s: float = 1800.0


def _check_environment(cfg: BenchConfig, n_roles: int) -> list[int]:
    """Refuse distributed launchers and shared GPUs; return the GPU index per role (producer first)."""
    found = [v for v in LAUNCHER_VARS if v in os.environ]
    if found:
        raise ConfigError(f"artcache bench must not run under a distributed launcher ({', '.join(found)} set): "
                          "consumers are independent processes, started by the bench itself")
    if cfg.device == "cpu":
        return []
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu")
    if n < n_roles and not cfg.allow_shared_gpu:
        raise ConfigError(f"{n_roles} roles need {n_roles} GPUs but {n} are visible; pass --allow-shared-gpu "
                          "to put several roles on one GPU (reported on every line)")
    return [i % n for i in range(n_roles)]


def _fresh_dir(path: Path) -> None:
    if path.exists():
        if any(path.iterdir()) and not (path / "report.json").exists() and not (path / "cache").exists():
            raise ConfigError(f"{path} exists and is not a previous bench output; choose another --out")
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "artcache.cli", *args]


def run_scenario(cfg: BenchConfig, sc: Scenario) -> dict:
    """Run one scenario end to end and return its report dict (also written to disk)."""
    gpus = _check_environment(cfg, 1 + len(sc.consumers))
    base = Path(cfg.out_dir).absolute() / sc.name
    _fresh_dir(base)
    cache, logs = base / "cache", base / "logs"
    logs.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cpu = cfg.device == "cpu"
    threads = ["--threads", "1"] if cpu else []
    dev = (lambda i: "cpu") if cpu else (lambda i: f"cuda:{gpus[i]}")
    procs: dict[str, subprocess.Popen] = {}
    sampler = make_sampler(sorted(set(gpus)))
    roles = {}
    if gpus:
        roles[gpus[0]] = "producer"
        for i, c in enumerate(sc.consumers, start=1):
            roles[gpus[i]] = (roles[gpus[i]] + "+" if gpus[i] in roles else "") + c.consumer_id
    sampler.start()
    t_start = time.time()
    try:
        with open(logs / "producer.log", "wb") as log:
            procs["producer"] = subprocess.Popen(_cli(
                "producer", "--cache", str(cache), "--target", cfg.target, "--data", cfg.dataset,
                "--max-length", str(cfg.max_length),
                "--max-samples", str(cfg.max_samples), "--draft-layers", str(cfg.draft_layers),
                "--device", dev(0), "--exit-when-done", "--done-grace", "5",
                "--expect-consumers", str(len(sc.consumers)), *threads), stdout=log, stderr=subprocess.STDOUT, env=env)
        _wait_ready(cache, procs["producer"], logs / "producer.log", cfg.timeout_s)
        for i, c in enumerate(sc.consumers, start=1):
            with open(logs / f"{c.consumer_id}.log", "wb") as log:
                procs[c.consumer_id] = subprocess.Popen(_cli(
                    "consume", "--cache", str(cache), "--draft", c.draft, "--id", c.consumer_id,
                    "--window", cfg.window, "--block-size", str(c.block_size), "--anchors", str(cfg.anchors),
                    "--batch-size", str(cfg.batch_size), "--steps", str(cfg.warmup + cfg.steps),
                    "--device", dev(i), "--out", str(base / "runs" / c.consumer_id), "--log-every", "10",
                    *threads), stdout=log, stderr=subprocess.STDOUT, env=env)
        codes = {}
        deadline = time.time() + cfg.timeout_s
        for c in sc.consumers:
            codes[c.consumer_id] = procs[c.consumer_id].wait(timeout=max(1, deadline - time.time()))
        try:
            codes["producer"] = procs["producer"].wait(timeout=60)
        except subprocess.TimeoutExpired:
            procs["producer"].send_signal(signal.SIGTERM)
            codes["producer"] = procs["producer"].wait(timeout=60)
    finally:
        sampler.stop()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.time() - t_start
    layout = CacheLayout(cache)
    events = J.read_events(layout.journal).events
    figures = scenario_figures(events, cfg.warmup)
    acc = account(layout)
    report = _report(cfg, sc, figures, acc, codes, wall, sampler, roles)
    _write(base, report, figures, sampler, roles)
    return report


def _wait_ready(cache: Path, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    t0 = time.time()
    while not (cache / "artcache.json").is_file():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"producer exited with {proc.returncode} before initialising the root:\n{tail}")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"producer did not initialise {cache} within {timeout:.0f}s")
        time.sleep(0.2)


def _report(cfg, sc, figures, acc, codes, wall, sampler, roles) -> dict:
    c = acc.cache
    consumers = []
    for spec in sc.consumers:
        f = figures["consumers"].get(spec.consumer_id, {})
        k = next((k for k in acc.consumers if k.consumer == spec.consumer_id), None)
        consumers.append({
            "id": spec.consumer_id, "draft": spec.draft, "block_size": spec.block_size,
            "steps": f.get("steps", 0), "steps_per_s": f.get("steps_per_s", 0.0),
            "wait_s": f.get("wait_s", 0.0), "fetch_fraction": f.get("fetch_fraction", 0.0),
            "first_loss": f.get("first_loss"), "final_loss": f.get("final_loss"),
            "tau": f.get("tau"), "tau_includes_bonus": True,
            "exit_code": codes.get(spec.consumer_id), "state": k.state if k else "missing",
            "requests": k.logical_requests if k else 0, "hits": k.hits if k else 0, "misses": k.misses if k else 0,
        })
    t0, t1 = figures["interval"]
    checks = {
        "all_consumers_finished": all(x["exit_code"] == 0 and x["steps"] == cfg.warmup + cfg.steps for x in consumers),
        "captures_per_consumed_position_le_1.1": c.captures <= 1.1 * max(1, c.distinct_positions_consumed),
        "max_retained_within_window_bound": c.max_retained_artifacts <= c.window_bound_artifacts,
        "every_loss_went_down": all(x["final_loss"] is not None and x["final_loss"] < x["first_loss"]
                                    for x in consumers),
        "accounting_invariants": not acc.violations,
        "producer_exit_ok": codes.get("producer") == 0,
    }
    import torch

    return {
        "scenario": sc.name, "device": cfg.device,
        "shared_gpu": bool(cfg.allow_shared_gpu and cfg.device == "cuda"),
        "warmup_steps": cfg.warmup, "measured_steps": cfg.steps,
        "interval_s": figures["interval_s"], "interval": [t0, t1], "wall_s": wall,
        "aggregate_steps_per_s": figures["aggregate_steps_per_s"],
        "median_consumer_steps_per_s": figures["median_consumer_steps_per_s"],
        "consumers": consumers,
        "producer": {"captures": c.captures, "busy_s": figures["producer_busy_s"],
                     "busy_in_interval_s": figures["producer_busy_in_interval_s"],
                     "utilization": figures["producer_utilization"], "exit_code": codes.get("producer")},
        "cache": {"logical_requests": c.logical_requests, "hits": c.hits, "misses": c.misses,
                  "coalesced": c.coalesced, "captures": c.captures, "publications": c.publications,
                  "failures": c.failures, "evictions": c.evictions, "recaptures": c.recaptures,
                  "distinct_positions_consumed": c.distinct_positions_consumed,
                  "captures_per_consumed_position": c.captures_per_consumed_position,
                  "max_retained_artifacts": c.max_retained_artifacts,
                  "max_retained_bytes": c.max_retained_bytes,
                  "window_bound_artifacts": c.window_bound_artifacts,
                  "leases_acquired": c.leases_acquired, "leases_released": c.leases_released,
                  "leases_expired": c.leases_expired},
        "accounting_violations": acc.violations,
        "checks": checks,
        "telemetry": sampler.summary(roles, t0, t1),
        "environment": {"python": platform.python_version(), "torch": str(torch.__version__),
                        "platform": platform.platform(), "cpus": os.cpu_count(), **sampler.environment(),
                        "settings": {"target": cfg.target, "dataset": cfg.dataset, "max_length": cfg.max_length, "anchors": cfg.anchors,
                                     "batch_size": cfg.batch_size, "window": cfg.window}},
    }


def _write(base: Path, report: dict, figures: dict, sampler, roles) -> None:
    (base / "report.json").write_text(json.dumps(report, indent=2))
    progress_plot(figures, base / "progress.png", f"{report['scenario']} on {report['device']}")
    if sampler.samples:
        gpu_plot(sampler.samples, roles, base / "gpu_util.png", figures["interval"][0])
    (base / "report.md").write_text(format_report(report))


def format_report(r: dict) -> str:
    shared = " (SHARED GPU: several roles on one device)" if r["shared_gpu"] else ""
    target = r["environment"]["settings"]["target"]
    weights = (f"target {target}: random weights (throughput does not depend on weight values)"
               if target.startswith("random:") else f"target {target}")
    rows = [[c["id"], c["block_size"], c["steps"], round(c["steps_per_s"], 3), round(c["wait_s"], 2),
             round(c["fetch_fraction"], 3), round(c["first_loss"] or 0, 3), round(c["final_loss"] or 0, 3),
             round(c["tau"] or 0, 3), c["hits"], c["misses"], c["state"]] for c in r["consumers"]]
    cache = r["cache"]
    lines = [
        f"## {r['scenario']} on {r['device']}{shared}", "",
        f"common post-warm-up interval {r['interval_s']:.1f} s; aggregate steady throughput "
        f"{r['aggregate_steps_per_s']:.3f} steps/s; median per-consumer {r['median_consumer_steps_per_s']:.3f} "
        f"steps/s; producer utilisation {100 * r['producer']['utilization']:.1f} %{shared}", "",
        f"{weights}; {r['environment'].get('gpu', 'CPU')}; torch {r['environment']['torch']}", "",
        "```", table(["consumer", "B", "steps", "steps/s", "wait_s", "fetch_frac", "loss first5", "loss last5",
                      "tau(+1)", "hits", "misses", "state"], rows), "```", "",
        f"captures {cache['captures']} for {cache['distinct_positions_consumed']} distinct positions consumed "
        f"({cache['captures_per_consumed_position']:.3f} per position; {cache['recaptures']} recaptures); "
        f"max retained {cache['max_retained_artifacts']} artifacts (window bound {cache['window_bound_artifacts']}); "
        f"evictions {cache['evictions']}; logical requests {cache['logical_requests']} = hits {cache['hits']} + "
        f"misses {cache['misses']}.", "",
        "tau(+1) = mean acceptance length per block over the last 10 steps, including the +1 bonus token.", "",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()), "",
    ]
    return "\n".join(lines)


def run_bench(cfg: BenchConfig) -> bool:
    """Run the scenarios serially; print each report; True when every check passed."""
    ok = True
    reports = []
    for sc in resolve(cfg.scenario):
        print(f"== scenario {sc.name}: 1 producer, {len(sc.consumers)} consumer(s), {cfg.device}, "
              f"{cfg.warmup}+{cfg.steps} steps each ...", flush=True)
        r = run_scenario(cfg, sc)
        reports.append(r)
        print(format_report(r), flush=True)
        print(f"report: {Path(cfg.out_dir).absolute() / sc.name / 'report.json'}", flush=True)
        ok &= all(r["checks"].values())
    (Path(cfg.out_dir) / "summary.json").write_text(msgspec.json.format(msgspec.json.encode(reports)).decode())
    return ok
