"""Measurement suites: ``artcache bench --suite NAME``, run in bounded pieces that resume.

A suite is an ordered list of named pieces (:class:`Piece`); each piece measures one thing and returns a
JSON-able dict. The runner (:func:`run_suite`) works in one directory (``--resume DIR``, or ``--out``'s
``<suite>/`` for a fresh run):

- ``DIR/suite.json``: the suite, its scale and device type (a resume with other settings is refused);
- ``DIR/pieces/<piece>.json``: one finished piece, written atomically once it returned: ``piece``, ``wall_s``,
  its provenance (:func:`artcache.bench.provenance.record`: command, commit, dirty, date, hardware; pieces of one
  suite may run on different calls or machines, so each carries its own) and ``result``;
- ``DIR/work/<piece>/``: the piece's scratch (emptied before it starts; a piece killed mid-way leaves only this);
- ``DIR/<suite>.json``: once every piece is done, the suite's result: this call's provenance, the settings and
  every piece's file (the ``bench/results`` form).

A rerun with ``--resume DIR`` skips the finished pieces. ``--time-budget S`` stops *starting* pieces once ``S``
seconds have passed since the call began (a running piece is never cut: pick ``S`` below the machine's limit by
the longest piece's time; the first piece of a call always starts, so every call makes progress); the call then
exits :data:`EXIT_PIECES_LEFT` and names the pieces left. SIGTERM or Ctrl-C stop the running piece at once (it is not
recorded and runs again on the next call) and exit 143 / 130. Exit 0: every
piece finished; 1: a piece failed (its error named; the finished ones stay); 2: bad input (an unknown suite or
piece, settings that differ from ``DIR/suite.json``, pieces that need CUDA on a machine without one), before any
piece runs.

Scales: ``full`` measures at the sizes the figures in docs/ were taken at (GPU pieces need CUDA: on a CPU they are
refused in one line); ``tiny`` runs every piece at toy sizes on any device, to check a machine or the suite itself
(its figures measure nothing).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from artcache.bench.provenance import record
from artcache.errors import ArtcacheError, ConfigError
from artcache.fsio import atomic_write

#: exit status of a call that stopped at its ``--time-budget`` with pieces left (EX_TEMPFAIL: run it again)
EXIT_PIECES_LEFT = 75
SCALES = ("full", "tiny")


@dataclass
class PieceContext:
    """What a piece gets: the device (``"cpu"``/``"cuda"``), the scale, its scratch directory ``work``
    (empty at start), the suite's directory, and the results of the pieces finished before it (by name)."""

    device: str
    scale: str
    work: Path
    suite_dir: Path
    done: dict[str, dict] = field(default_factory=dict)

    @property
    def tiny(self) -> bool:
        return self.scale == "tiny"

    def result(self, piece: str) -> dict | None:
        """The ``result`` of a finished piece, or None."""
        got = self.done.get(piece)
        return None if got is None else got["result"]


@dataclass(frozen=True)
class Piece:
    """One measurement: ``run(ctx) -> dict``. ``cuda``: at scale ``full`` it needs a CUDA device. ``tiny_cpu``:
    at scale ``tiny`` it runs on a CPU too (False: CUDA-only code such as CUDA graphs or liger, or minutes of
    CPU compilation; left out of a tiny run on a CPU, and said so)."""

    name: str
    run: Callable[[PieceContext], dict]
    about: str
    cuda: bool = False
    tiny_cpu: bool = True


@dataclass(frozen=True)
class Suite:
    """``pieces`` in order; ``tiny_pieces``: the pieces at ``--scale tiny`` when they differ (a run of fewer
    pieces' worth of work)."""

    name: str
    about: str
    pieces: tuple[Piece, ...]
    tiny_pieces: tuple[Piece, ...] | None = None

    def at(self, scale: str) -> tuple[Piece, ...]:
        """The pieces at ``scale``."""
        return self.tiny_pieces if scale == "tiny" and self.tiny_pieces is not None else self.pieces


class PieceFailed(ArtcacheError, RuntimeError):
    """A piece raised: the suite stops there (exit 1); the pieces finished before it are kept."""


def _file_name(piece: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", piece) + ".json"


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, [json.dumps(doc, indent=1, allow_nan=True).encode()], path.parent, durable=True)


def _read_done(suite_dir: Path, pieces: list[Piece]) -> dict[str, dict]:
    done = {}
    for p in pieces:
        path = suite_dir / "pieces" / _file_name(p.name)
        if path.is_file():
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{path}: not a finished piece's JSON ({exc}); remove it to run the piece again") \
                    from None
            done[p.name] = doc
    return done


def select(suite: Suite, names: str, scale: str = "full") -> list[Piece]:
    """The pieces named in ``names`` (comma list; empty: all) of the suite at ``scale``, in the suite's order;
    ConfigError names an unknown one and what is accepted."""
    pieces = suite.at(scale)
    if not names:
        return list(pieces)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if not wanted:  # ", " named nothing: it ran no piece and reported the suite done
        raise ConfigError(f"--pieces {names!r} names no piece; accepted: a comma list of "
                          f"{', '.join(p.name for p in pieces)} (or leave it out: all)")
    known = {p.name for p in pieces}
    bad = [n for n in wanted if n not in known]
    if bad:
        raise ConfigError(f"--pieces {','.join(bad)}: not a piece of suite {suite.name}; accepted: "
                          f"{', '.join(p.name for p in pieces)}")
    return [p for p in pieces if p.name in wanted]


def _settings(suite: Suite, scale: str, device: str, pieces: list[Piece]) -> dict:
    return {"suite": suite.name, "scale": scale, "device": device, "pieces": [p.name for p in pieces]}


def _check_settings(suite_dir: Path, want: dict, resume: bool) -> None:
    path = suite_dir / "suite.json"
    if suite_dir.exists() and not suite_dir.is_dir():
        raise ConfigError(f"{suite_dir} is not a directory; give the suite's directory (created if missing)")
    if not path.is_file():
        if suite_dir.exists() and any(suite_dir.iterdir()):
            raise ConfigError(f"{suite_dir} is not empty and holds no suite.json: give a new directory (or the "
                              "directory of an earlier run of this suite with --resume)")
        return
    if not resume:
        raise ConfigError(f"{suite_dir} holds an earlier run of suite {json.loads(path.read_text()).get('suite')}: "
                          f"continue it with --resume {suite_dir}, or give another --out")
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc}); accepted: the suite.json an earlier run wrote") from None
    diff = [f"{k} {have.get(k)!r} (now {want[k]!r})" for k in ("suite", "scale", "device", "pieces")
            if have.get(k) != want[k]]
    if diff:
        raise ConfigError(f"--resume {suite_dir}: that run has {', '.join(diff)}; resume it with the same "
                          "--suite, --scale, --device and --pieces, or give a new directory")


def run_suite(suite: Suite, suite_dir: Path, *, device: str, scale: str = "full", pieces: str = "",
              time_budget_s: float = math.inf, resume: bool = False, argv: list[str] | None = None,
              echo: Callable[[str], None] = print) -> int:
    """Run ``suite``'s pieces not finished yet in ``suite_dir``; the exit status (module docstring).

    Raises:
        ConfigError: bad settings (before any piece runs).
        PieceFailed: a piece raised (its message and the piece named).
    """
    if scale not in SCALES:
        raise ConfigError(f"--scale {scale!r} is not accepted: use {' or '.join(SCALES)}")
    if not time_budget_s > 0:
        raise ConfigError(f"--time-budget {time_budget_s}: accepted seconds > 0")
    chosen = select(suite, pieces, scale)
    if device == "cpu" and scale == "tiny":
        left_out = [p.name for p in chosen if not p.tiny_cpu]
        if left_out:
            echo(f"suite {suite.name}: not run on a CPU at --scale tiny (CUDA-only or compiled code): "
                 f"{', '.join(left_out)}")
            chosen = [p for p in chosen if p.tiny_cpu]
    if device == "cpu" and scale == "full":
        gpu = [p.name for p in chosen if p.cuda]
        if gpu:
            cpu_ok = [p.name for p in chosen if not p.cuda]
            raise ConfigError(f"--suite {suite.name}: piece(s) {', '.join(gpu)} need a CUDA device at --scale full "
                              "and none is visible; " + (f"--pieces {','.join(cpu_ok)} run on a CPU, " if cpu_ok
                                                         else "") + "--scale tiny checks the suite on a CPU")
    want = _settings(suite, scale, device, chosen)
    _check_settings(suite_dir, want, resume)
    suite_dir.mkdir(parents=True, exist_ok=True)
    if not (suite_dir / "suite.json").is_file():
        _write_json(suite_dir / "suite.json", want)
    done = _read_done(suite_dir, chosen)
    t0 = time.monotonic()
    todo = [p for p in chosen if p.name not in done]
    if done:
        echo(f"suite {suite.name}: {len(chosen) - len(todo)} of {len(chosen)} pieces done earlier "
             f"({', '.join(p.name for p in chosen if p.name in done)}); skipped")
    for k, p in enumerate(todo):
        spent = time.monotonic() - t0
        if k and spent >= time_budget_s:  # the first piece always starts: every call makes progress
            left = [q.name for q in todo[k:]]
            echo(f"suite {suite.name}: --time-budget {time_budget_s:g} s reached after {spent:.0f} s; "
                 f"{len(left)} piece(s) left: {', '.join(left)}; run the same command with --resume {suite_dir}")
            return EXIT_PIECES_LEFT
        work = suite_dir / "work" / re.sub(r"[^A-Za-z0-9._+-]", "_", p.name)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        echo(f"suite {suite.name}: piece {p.name} ({p.about}) ...")
        ctx = PieceContext(device=device, scale=scale, work=work, suite_dir=suite_dir, done=dict(done))
        t_piece = time.monotonic()
        try:
            result = p.run(ctx)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM under main_suite: the piece is not recorded
            signum = getattr(exc, "signum", 0) or signal.SIGINT
            echo(f"suite {suite.name}: stopped by {signal.Signals(signum).name} in piece {p.name} (not recorded: it "
                 f"runs again); {len(done)} of {len(chosen)} pieces done; continue with --resume {suite_dir}")
            return 128 + signum
        except ArtcacheError as exc:
            raise PieceFailed(f"suite {suite.name}, piece {p.name}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            raise PieceFailed(f"suite {suite.name}, piece {p.name}: {type(exc).__name__}: {exc}") from exc
        wall = time.monotonic() - t_piece
        doc = {"piece": p.name, "wall_s": wall, **record(None, argv, device, [suite_dir]), "result": result}
        _write_json(suite_dir / "pieces" / _file_name(p.name), doc)
        shutil.rmtree(work, ignore_errors=True)
        done[p.name] = doc
        echo(f"suite {suite.name}: piece {p.name} done in {wall:.0f} s")
    final = suite_dir / f"{suite.name}.json"
    _write_json(final, {**record(None, argv, device, [suite_dir]), **want,
                        "pieces": {p.name: done[p.name] for p in chosen}})
    echo(f"suite {suite.name}: every piece done; result {final}")
    return 0


# ---- the suites -----------------------------------------------------------------------------------------------

def _retention_piece(family: str) -> Piece:
    def run(ctx: PieceContext) -> dict:
        import os

        from artcache.bench import retention_gap

        streams, positions = (2, 2000) if ctx.tiny else (40, retention_gap.POSITIONS)
        return retention_gap.run_family(family, streams=streams, seed=0, workers=min(2, os.cpu_count() or 1),
                                        positions=positions)

    return Piece(f"{family}", run, f"policy vs Belady under the window pins, {family} streams")


def _gpu_micro_pieces() -> tuple[Piece, ...]:
    def sizes(ctx: PieceContext) -> dict:
        if ctx.tiny:
            return {"arch": "tiny-llama", "seq": 64, "batch": 2, "reps": 1, "anchors": 4, "blocks": [4], "steps": 2,
                    "io_layers": 2, "io_hidden": 256, "raw_bytes": 4 << 20, "batches": 3, "publishers": [1, 2],
                    "matmul_n": 256}
        return {"arch": "qwen3-8b", "seq": 3072, "batch": 2, "reps": 5, "anchors": 256, "blocks": [4, 8, 16],
                "steps": 10, "io_layers": 5, "io_hidden": 4096, "raw_bytes": 2 << 30, "batches": 8,
                "publishers": [1, 2], "matmul_n": 8192}

    def dev(ctx: PieceContext):
        import torch

        return torch.device(ctx.device)

    def raw_write(ctx: PieceContext) -> dict:  # the io piece's raw write+fsync rate, keyed by this piece's root
        return {str(ctx.work): row["raw_write_fsync_Bps"]
                for row in ((ctx.result("io") or {}).get("io", {}).get("roots", {}) or {}).values()}

    def peak(ctx: PieceContext) -> float:
        got = ctx.result("matmul")
        return float("nan") if got is None else got["matmul_peak_flops"]

    def matmul(ctx: PieceContext) -> dict:
        from artcache.bench import gpu_micro

        return {"matmul_peak_flops": gpu_micro.matmul_peak(dev(ctx), sizes(ctx)["matmul_n"])}

    def io(ctx: PieceContext) -> dict:
        from artcache.bench import gpu_micro

        s = sizes(ctx)
        args = ([ctx.work], dev(ctx), s["seq"], s["io_layers"], s["io_hidden"], s["reps"], s["raw_bytes"])
        out = {"io": gpu_micro.io_bench(*args, ["legacy", "default"]),
               "io_fp8": gpu_micro.io_bench(*args, ["default"], dtype="float8_e4m3fn")}
        out["fp8_bytes_over_bf16"] = {r: out["io_fp8"]["roots"][r]["artifact_bytes"] /
                                      out["io"]["roots"][r]["artifact_bytes"] for r in out["io"]["roots"]}
        return out

    def producer(ctx: PieceContext) -> dict:
        from artcache.bench import gpu_micro
        from artcache.contract import stored_dtype

        s = sizes(ctx)
        raw = raw_write(ctx)
        return gpu_micro.producer_bench(s["arch"], dev(ctx), s["seq"], s["batch"], s["reps"], [ctx.work], peak(ctx),
                                        [stored_dtype("bfloat16"), stored_dtype("fp8")], s["batches"],
                                        s["publishers"], raw)

    def consumer(ctx: PieceContext) -> dict:
        from artcache.bench import gpu_micro
        from artcache.contract import stored_dtype

        s = sizes(ctx)
        return gpu_micro.consumer_bench(s["arch"], dev(ctx), s["seq"], s["anchors"], s["blocks"], s["steps"],
                                        ctx.work, peak(ctx), [stored_dtype("bfloat16"), stored_dtype("fp8")])

    def long_producer(tokens: int) -> Piece:
        def run(ctx: PieceContext) -> dict:
            from artcache.bench import gpu_micro
            from artcache.contract import stored_dtype

            s = sizes(ctx)
            seq = 4 * s["seq"] if ctx.tiny else tokens  # tiny: a length that differs from the producer piece's
            raw = raw_write(ctx)
            # 6 batches of one sample: the steady rate (batches 2..n) needs several publications to mean anything
            return gpu_micro.producer_bench(s["arch"], dev(ctx), seq, 1, 2 if ctx.tiny else 3, [ctx.work], peak(ctx),
                                            [stored_dtype("bfloat16"), stored_dtype("fp8")], 3 if ctx.tiny else 6,
                                            [1], raw)

        return Piece(f"producer-{tokens // 1024}k", run, f"prefill vs capture + publish of one {tokens}-token sample, "
                     "Qwen3-8B shapes, bf16 and fp8 (against min(plain prefill, disk) of the same run)", cuda=True)

    return (Piece("matmul", matmul, "bf16 matmul rate, the MFU ceiling"),
            Piece("io", io, "disk bandwidth and the store's publish/read against it, bf16 and fp8"),
            Piece("producer", producer, "prefill vs capture vs capture + publish, Qwen3-8B shapes", cuda=True),
            Piece("consumer", consumer, "DFlash steps/s in memory vs from the cache, Qwen3-8B shapes", cuda=True),
            long_producer(16384), long_producer(32768))


def _consumer_speed_pieces() -> tuple[Piece, ...]:
    from artcache.bench import consumer_speed as cs

    def matmul(ctx: PieceContext) -> dict:
        import torch

        from artcache.bench import gpu_micro

        return {"matmul_peak_flops": gpu_micro.matmul_peak(torch.device(ctx.device), 256 if ctx.tiny else 8192)}

    def row(part: str, variant: str) -> Piece:
        def run(ctx: PieceContext) -> dict:
            peak = (ctx.result("matmul") or {}).get("matmul_peak_flops", float("nan"))
            shutil.rmtree(ctx.suite_dir / "root" / "runs", ignore_errors=True)  # an earlier row's or a killed one's
            return cs.measure_row(part, variant, device=ctx.device, out=ctx.work, root=ctx.suite_dir / "root",
                                  peak=peak, tiny=ctx.tiny)

        where = "from the cache (run_consumer)" if part.startswith("cache-") else "in memory"
        return Piece(f"{part}:{variant}", run, f"{part} {variant} step {where}", cuda=True,
                     tiny_cpu=not any(k in variant for k in ("liger", "graphs", "compile")))

    return (Piece("matmul", matmul, "bf16 matmul rate, the MFU ceiling", cuda=True),
            *(row(part, variant) for part, variant in cs.parse_plan(cs.DEFAULT_PLAN)))


def _offline_piece(name: str, about: str, extra: list[str]) -> Piece:
    def run(ctx: PieceContext) -> dict:
        from artcache.bench import offline

        size = (["--max-samples", "40", "--steps", "12", "--warmup", "1", "--rounds", "1", "--blocks", "4,8"]
                if ctx.tiny else ["--max-samples", "160", "--steps", "150", "--warmup", "3", "--rounds", "2"])
        out = ctx.work / "out"
        argv = ["--out", str(out), "--target", "random:tiny-llama", "--data", "synthetic", "--max-length", "128",
                "--anchors", "8", *size, *extra]
        code = offline.main(argv)
        report = out / "report.json"
        if not report.is_file():
            raise PieceFailed(f"bench.offline {' '.join(argv)} exited {code} without a report; its logs: {out}/logs")
        doc = json.loads(report.read_text())
        doc["exit_code"] = code
        return {k: v for k, v in doc.items() if k not in ("command", "commit", "dirty", "date", "hardware")}

    return Piece(name, run, about)


#: the training-curve recipe per scale: target, data, device, each experiment's draft and settings, the steps in
#: all and per piece, the held-out split and interval
CURVE_RECIPES = {
    "full": {"target": "smollm2-135m-instruct", "dataset": "sharegpt", "max_length": 1024, "max_samples": 6000,
             "draft_layers": 5, "batch_samples": 16, "steps": 10000, "chunk": 1000,
             "eval_samples": 64, "eval_interval": 1000, "batch_size": 8, "window": "64:512", "threads": 0,
             "experiments": {"dflash": {"draft": "dflash", "block_size": 16, "anchors": 64},
                             "eagle3": {"draft": "eagle3"},
                             "dspark": {"draft": "dspark", "block_size": 7, "anchors": 512}}},
    "tiny": {"target": "random:tiny-llama", "dataset": "synthetic", "max_length": 64, "max_samples": 40,
             "draft_layers": 3, "batch_samples": 4, "steps": 6, "chunk": 3, "eval_samples": 4,
             "eval_interval": 3, "batch_size": 2, "window": "2:8", "threads": 1,
             "experiments": {"dflash": {"draft": "dflash", "block_size": 4, "anchors": 4},
                             "eagle3": {"draft": "eagle3", "ttt_steps": 2, "draft_vocab": 512}}},
}


def _toml_value(v) -> str:
    return json.dumps(v)  # strings, numbers and booleans are written alike in TOML and JSON


def curve_config(scale: str, device: str, out: Path) -> str:
    """The ``artcache run`` config of the training-curve suite (:data:`CURVE_RECIPES`) as TOML text: one target,
    one capture, an experiment per draft, each with ``lr_total_steps`` the whole run's steps (so a piece's
    ``steps`` override is only the stop) and the held-out split evaluated every ``eval_interval`` steps."""
    r = CURVE_RECIPES[scale]
    lines = [f"out = {_toml_value(str(out))}", "", "[target]", f"name = {_toml_value(r['target'])}",
             f"device = {_toml_value(device)}", *([f"threads = {r['threads']}"] if r["threads"] else []), "",
             "[data]", f"dataset = {_toml_value(r['dataset'])}", f"max_length = {r['max_length']}",
             f"max_samples = {r['max_samples']}", "", "[capture]", f"batch_samples = {r['batch_samples']}",
             f"draft_layers = {r['draft_layers']}"]
    for name, e in r["experiments"].items():
        lines += ["", "[[experiments]]", f"name = {_toml_value(name)}", f"draft = {_toml_value(e['draft'])}"]
        lines += [f"{k} = {_toml_value(e[k])}" for k in ("block_size", "anchors") if k in e]
        lines += [f"batch_size = {r['batch_size']}", f"steps = {r['chunk']}", f"lr_total_steps = {r['steps']}",
                  f"window = {_toml_value(r['window'])}", *([f"threads = {r['threads']}"] if r["threads"] else []),
                  f"log_every = {max(1, r['chunk'] // 10)}", "[experiments.consumer]",
                  *(f"{k} = {_toml_value(e[k])}" for k in ("ttt_steps", "draft_vocab") if k in e),
                  f"eval_samples = {r['eval_samples']}", f"eval_interval = {r['eval_interval']}",
                  f"save_every = {r['chunk']}", "progress = false"]
    return "\n".join(lines) + "\n"


def _curve_train_piece(k: int, pieces: int) -> Piece:
    def run(ctx: PieceContext) -> dict:
        import os
        import subprocess
        import sys

        from artcache.launch import role_env

        r = CURVE_RECIPES[ctx.scale]
        cfg = ctx.suite_dir / "run.toml"
        run_dir = ctx.suite_dir / "run"
        if not cfg.is_file():  # the first piece writes it; later pieces (other calls) read the same file
            atomic_write(cfg, [curve_config(ctx.scale, ctx.device, run_dir).encode()], cfg.parent)
        stop = min(r["steps"], k * r["chunk"])
        argv = [sys.executable, "-m", "artcache", "run", "--config", str(cfg),
                *(f"experiments.{name}.steps={stop}" for name in r["experiments"])]
        log = ctx.work / "run.log"
        with open(log, "wb") as f:
            code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **role_env()},
                                  cwd=ctx.suite_dir).returncode
        if code != 0:
            tail = log.read_text(errors="replace")[-1500:]
            raise PieceFailed(f"artcache run (steps {stop}) exited {code}; the run's output ends:\n{tail}")
        report = json.loads((run_dir / "report.json").read_text())
        keep = ("name", "draft", "state", "steps_run", "first_step", "last_step", "exit_code")
        return {"stop": stop, "wall_s": report.get("wall_s"),
                "experiments": [{k2: x.get(k2) for k2 in keep} for x in report["experiments"]]}

    return Piece(f"train-{k:02d}", run, f"artcache run to step {k}/{pieces} of the run's steps (resumed)",
                 cuda=True)


def _curve_pieces(scale: str) -> tuple[Piece, ...]:
    n = -(-CURVE_RECIPES[scale]["steps"] // CURVE_RECIPES[scale]["chunk"])

    def curves(ctx: PieceContext) -> dict:
        from artcache.bench import training_curves as tc

        r = CURVE_RECIPES[ctx.scale]
        run_dir = ctx.suite_dir / "run"
        figures = tc.curves({name: run_dir / "experiments" / name / "metrics.csv" for name in r["experiments"]})
        png = ctx.suite_dir / "curves.png"
        atomic_write(png, [tc.plot(figures, "held-out greedy-replay τ (incl. +1 bonus)")], png.parent)
        return {"png": str(png), "experiments": figures}

    return (*(_curve_train_piece(k, n) for k in range(1, n + 1)),
            Piece("curves", curves, "held-out τ and loss against steps and training seconds (training_curves)"))


def _fp8_pieces() -> tuple[Piece, ...]:
    def error(ctx: PieceContext) -> dict:
        from artcache.bench import fp8_error

        if ctx.tiny:
            return fp8_error.measure("random:tiny-llama", "synthetic", 4, 64, None, ctx.device)
        return fp8_error.measure("smollm2-135m-instruct", "sharegpt", 32, 512, None, ctx.device)

    def tau(ctx: PieceContext) -> dict:
        from artcache.bench import fp8_tau

        out = ctx.work / "out"
        size = (["--target", "random:tiny-llama", "--data", "synthetic", "--max-length", "64", "--max-samples", "40",
                 "--steps", "3", "--eval-samples", "4", "--dflash-anchors", "4", "--dflash-block", "4",
                 "--dflash-eval-anchors", "4", "--eagle3-vocab", "512", "--eagle3-ttt", "2", "--window", "2:8",
                 "--no-parallel"] if ctx.tiny else [])
        code = fp8_tau.main(["--out", str(out), "--device", ctx.device, *size])
        if code != 0:
            raise PieceFailed(f"bench.fp8_tau exited {code}; its runs: {out}")
        doc = json.loads((out / "fp8_tau.json").read_text())
        return {k: v for k, v in doc.items() if k not in ("command", "commit", "dirty", "date", "hardware")}

    return (Piece("error", error, "fp8 quantisation error per captured layer on a real capture (float32 reference)"),
            Piece("tau", tau, "held-out τ of drafts trained from a bf16 and an fp8 root, two bf16 seeds beside them",
                  cuda=True))


def _payload_piece() -> Piece:
    def run(ctx: PieceContext) -> dict:
        from artcache.bench import payload_micro

        size = dict(tokens=64, layers=2, hidden=64, reps=2) if ctx.tiny else dict(reps=5)  # full: Qwen3-8B's shape
        report = payload_micro.measure(ctx.work, **size)
        print(payload_micro.format_report(report), flush=True)
        return report

    return Piece("posix-vs-mooncake", run, "publish / read / evict MB/s of a POSIX root and of Mooncake payloads on "
                 "loopback, with the bare transports (one artifact, Qwen3-8B's shape)")


def _vllm_throughput_piece() -> Piece:
    def run(ctx: PieceContext) -> dict:
        from artcache.bench import vllm_throughput

        size = ["--max-length", "64", "--samples", "2", "--batch", "2", "--reps", "1"] if ctx.tiny else \
            ["--max-length", "512", "--samples", "8", "--batch", "4", "--reps", "5"]
        return vllm_throughput.main([*size, "--out", str(ctx.work / "vllm-throughput.json")])

    return Piece("capture", run, "capture tokens/s of the vllm backend against the hf backend and against vLLM "
                 "prefill without extraction, SmolLM2-135M-Instruct on ShareGPT (CPU; needs the vllm extra)")


#: the packing recipe per scale (:func:`artcache.bench.packing.run`): ``full`` at the documented figures' sizes
#: (SmolLM2-135M shapes, ShareGPT at 2,048 tokens), ``tiny`` a quick check of the same code on any CPU
PACKING_RECIPES = {
    "full": {"arch": "smollm2-135m", "max_length": 2048, "samples": 2000, "rows": 2, "steps": 4, "anchors": 64,
             "block": 16},
    "tiny": {"arch": "tiny-llama", "max_length": 1024, "samples": 48, "rows": 2, "steps": 1, "anchors": 8,
             "block": 4},
}


def _packing_piece(draft: str) -> Piece:
    def run(ctx: PieceContext) -> dict:
        from artcache.bench import packing

        return packing.run(draft, **PACKING_RECIPES[ctx.scale])

    return Piece(draft, run, f"{draft}: packed against unpacked steps at the same token budget (CPU, float32)")


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("retention-gap", "captures per consumed position of the retention policy over Belady's under the same "
          "window pins, four seeded stream families (a simulation: CPU)",
          tuple(_retention_piece(f) for f in ("together", "staggered", "near-floor", "near-floor-load"))),
    Suite("gpu-micro", "artcache's parts against the hardware's limits: matmul rate, disk and store I/O, producer "
          "capture + publish, DFlash consumer in memory vs from the cache (Qwen3-8B shapes, random weights)",
          _gpu_micro_pieces()),
    Suite("consumer-speed", "a consumer's step on a GPU: steps/s, MFU, bytes read per second and the binding limit "
          "per draft and speed option, in memory and from the cache (SmolLM2 and Qwen3-8B shapes)",
          _consumer_speed_pieces()),
    Suite("offline", "a --fill'ed root used offline: three DFlash consumers' steps/s from the root against the same "
          "steps from batches held in memory (random tiny target, CPU consumers), per reader",
          (_offline_piece("steps-thread", "root vs memory, arms interleaved every 12 steps, reader thread",
                          ["--pairing", "steps", "--chunk", "12", "--reader", "thread"]),
           _offline_piece("steps-process", "root vs memory, arms interleaved every 12 steps, reader process",
                          ["--pairing", "steps", "--chunk", "12", "--reader", "process"]))),
    Suite("fp8", "what storing captures as fp8 (e4m3fn, one fp32 scale per token row) costs: the error per layer "
          "and the held-out τ of drafts trained from it against bf16", _fp8_pieces()),
    Suite("training-curve", "DFlash, EAGLE-3 and DSpark trained from one capture of SmolLM2-135M-Instruct on the "
          "embedded ShareGPT (10,000 steps each, one artcache run resumed piece after piece), held-out greedy-replay "
          "τ every 1,000 steps; curves.png and the figures of training_curves", _curve_pieces("full"),
          _curve_pieces("tiny")),
    Suite("payload", "payload put/get bandwidth: a POSIX cache root against Mooncake Store payloads on loopback, one "
          "artifact of Qwen3-8B's shape (needs mooncake-transfer-engine-non-cuda)", (_payload_piece(),)),
    Suite("vllm-throughput", "capture throughput of the vllm backend against the hf backend and against plain vLLM "
          "prefill, on the same plan samples in one process (needs the vllm extra)", (_vllm_throughput_piece(),)),
    Suite("packing", "packed (--pack-tokens) against unpacked consumer steps at the same token budget on the SmolLM2 "
          "ShareGPT plan at 2,048 tokens, per draft: supervised tokens per step and per second, padding, anchors and "
          "anchor coverage (bench.packing; CPU)", tuple(_packing_piece(d) for d in ("dflash", "eagle3", "dspark"))),
)}


def get_suite(name: str) -> Suite:
    """The suite ``name``; ConfigError names the accepted ones."""
    if name not in SUITES:
        raise ConfigError(f"--suite {name!r} is not a suite; accepted: {', '.join(SUITES)}")
    return SUITES[name]


def main_suite(name: str, *, out_dir: str, resume: str | None, device: str | None, scale: str, pieces: str,
               time_budget_s: float | None, argv: list[str] | None = None) -> int:
    """``artcache bench --suite NAME``: the directory is ``--resume DIR`` (created on the first call, so one command
    serves every call) or ``--out``'s ``NAME/`` (refused if it holds an earlier run); ``device`` None: ``cuda``
    when one is visible, else ``cpu``. Returns :func:`run_suite`'s exit status.

    Raises:
        ConfigError: an unknown suite, scale or piece, a bad budget or directory, CUDA asked for and absent.
        PieceFailed: a piece failed."""
    import torch

    suite = get_suite(name)
    cuda = torch.cuda.is_available()
    if device is None:
        device = "cuda" if cuda else "cpu"
    elif device == "cuda" and not cuda:
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    suite_dir = Path(resume) if resume else Path(out_dir) / name
    from artcache.shutdown import Cancelled, GracefulShutdown

    def stop_now(signum: int) -> None:  # a measurement cannot finish early: unwind the piece at once
        raise Cancelled(signum)

    with GracefulShutdown(f"bench --suite {name}", asked="stopping the piece now", on_request=stop_now):
        return run_suite(suite, suite_dir.absolute(), device=device, scale=scale, pieces=pieces,
                         time_budget_s=math.inf if time_budget_s is None else time_budget_s, resume=bool(resume),
                         argv=argv)


def describe() -> str:
    """Every suite and its pieces, for ``--help``-like listings."""
    lines = []
    for s in SUITES.values():
        lines.append(f"{s.name}: {s.about}")
        lines += [f"  {p.name}{' (CUDA at --scale full)' if p.cuda else ''}: {p.about}" for p in s.at("full")]
    return "\n".join(lines)


__all__ = ["EXIT_PIECES_LEFT", "SCALES", "SUITES", "Piece", "PieceContext", "PieceFailed", "Suite", "describe",
           "get_suite", "main_suite", "run_suite", "select"]
