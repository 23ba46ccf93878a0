"""speculators 0.9.0's own trainer reading an artcache root through the ``artcache`` hidden-states backend
(:mod:`artcache.trainers.speculators_backend`; the ``speculators`` lane: ``.ci/speculators-lane``).

One root of a tiny Llama target (vocab 49152 with SmolLM2's tokenizer, hidden 32, 8 layers; synthetic 32-token
samples; captured layers output-of-layer 1, 3, 4 and 7, i.e. speculators' ``--target-layer-ids 2 4 5`` plus the
last layer) is filled live by ``artcache producer`` (retention by need inside a disk budget: DFlash steps slower
than EAGLE-3 here, and what it will still read is kept after EAGLE-3's window passed it) while two speculators
trainers read it at once: EAGLE-3 and DFlash, same ``--seed`` and
``--total-seq-len`` (so the same positions in the same order), 20 optimizer steps each. Asserted:

- the two trainers made at most 1.05 captures of a training position per consumed position (training captures:
  the held-out samples, pinned for validation, are captured once each and counted apart), none a recapture;
- each registration ends ``completed`` at its cursor ``end`` (20 batches), its checkpoint cursor recorded there;
- each trainer read its training positions batch after batch (the position of every request is at least the
  start of the batch before it: the cursor follows speculators' sampler);
- speculators' own file backend (``hs_<row>.safetensors``, written by this test from the root's artifacts with
  its own layer selection, rows matched by token ids), run with the same trainer arguments on the same data rows,
  gives the same 20 losses (relative difference at most 1e-6) for each draft.

Every capture runs one sample at a time on one thread (``--batch-samples 1 --threads 1``): the file backend's
copy is written from the artifacts the trainers read (still retained under the budget; the ``--fill`` after
them captures the training positions past ``end`` and would recapture an evicted one with the same bytes).

The trainer runs on this machine's CPU through tests/support/speculators_train.py (its changes to speculators: the
device of the model, the batches and checkpoint loading is ``"cpu"``; the step timer's accelerator synchronize a no-op).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import safetensors.torch
import torch

from artcache import journal as J
from artcache import registry
from artcache.client import open_root
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout
from artcache.store import read
from tests.support import SUPPORT

SCRIPT = SUPPORT / "speculators_train.py"
SAMPLES, HELD, SEQ, PACK, STEPS = 90, 6, 32, 128, 20
CAPTURED = (1, 3, 4, 7)  # output-of-layer ids: vLLM ids 2, 4, 5 and the last layer (7 of 8)
TARGET_IDS = ("2", "4", "5")
DRAFTS = {"eagle3": ["--draft-arch", "llama"], "dflash": ["--block-size", "4", "--max-anchors", "16"]}
#: retention by need: what the slower trainer will read again stays while it fits (the whole capture is 1.5 MiB;
#: the budget still evicts what no live trainer needs again)
BUDGET = "64M"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="module")
def speculators_python() -> str:
    py = os.environ.get("ARTCACHE_SPECULATORS_PYTHON")
    if not py:
        pytest.skip("ARTCACHE_SPECULATORS_PYTHON is not set (a Python that imports speculators==0.9.0 and this "
                    "checkout's artcache; .ci/speculators-lane makes one)")
    proc = subprocess.run([py, "-c", "import speculators, artcache.trainers.speculators_backend"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"ARTCACHE_SPECULATORS_PYTHON={py!r} cannot import speculators and the backend: "
                    f"{proc.stderr.strip()[-300:]}")
    return py


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_target) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, weights on disk (speculators reads its verifier from them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("spec-target")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    for name in _TOKENIZER_FILES:
        if (Path(smollm2_target.path) / name).is_file():
            shutil.copy(Path(smollm2_target.path) / name, out / name)
    return out


def producer_args(root: Path, target: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "artcache", "producer", "--cache", str(root), "--target", str(target),
            "--data", "synthetic", "--max-length", str(SEQ), "--max-samples", str(SAMPLES),
            "--layer-ids", ",".join(map(str, CAPTURED)), "--batch-samples", "1", "--threads", "1", *extra]


def trainer_args(draft: str, target: Path, run: Path, data: Path, *backend: str) -> list[str]:
    return ["--verifier-name-or-path", str(target), "--speculator-type", draft, *DRAFTS[draft],
            "--target-layer-ids", *TARGET_IDS, "--data-path", str(data), "--save-path", str(run / "ckpt"),
            "--log-dir", str(run / "logs"), "--logger", "", "--epochs", "1", "--num-workers", "0",
            "--total-seq-len", str(PACK), "--max-steps", str(STEPS), "--log-freq", "1", "--seed", "7",
            "--hidden-states-dtype", "float32", "--draft-attn-impl", "eager", "--loss-implementation", "eager",
            "--num-layers", "1", *backend]


def start_trainer(py: str, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([py, str(SCRIPT), *args], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def losses_of(proc: subprocess.Popen, log: Path, timeout: float = 900, steps=range(STEPS)) -> list[float]:
    proc.wait(timeout=timeout)
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    lines = [ln.split(" ", 1)[1] for ln in text.splitlines() if ln.startswith("SPECULATORS_LOSSES ")]
    assert lines, text[-3000:]
    got = json.loads(lines[-1])
    assert [s for s, _ in got] == list(steps), got
    return [loss for _, loss in got]


def file_backend_copy(root: Path, data: Path, out: Path) -> None:
    """speculators' file layout of the root's artifacts for the data rows of ``data``: ``hs_<row>.safetensors``
    with ``hidden_states`` [T, 4, H] (the captured layers in order: aux 1, 3, 4, then the last layer 7) and
    ``token_ids`` [T] int64; the row's plan sample found by its token ids."""
    from datasets import load_from_disk

    layout, settings, plan = open_root(root)
    fps = PlanFingerprints(settings.contract, plan)
    by_tokens: dict[tuple, int] = {}
    for s in range(len(plan)):
        by_tokens.setdefault(tuple(plan.sample(s).input_ids.tolist()), s)
    out.mkdir()
    rows = load_from_disk(str(data)).with_format(None)["input_ids"]
    for r, ids in enumerate(rows):
        art = read(layout, fps.of_sample(by_tokens[tuple(ids)]), settings.contract, verify_tokens=True)
        assert art.input_ids.tolist() == list(ids)
        safetensors.torch.save_file({"hidden_states": art.hidden_states.contiguous(),
                                     "token_ids": art.input_ids.to(torch.int64)}, str(out / f"hs_{r}.safetensors"))


def requests_follow_batches(root: Path, cid: str) -> None:
    """Every training request of ``cid`` is at or after the previous batch's start: no read jumps back."""
    reqs = [e.position for path in CacheLayout(root).journal.glob(f"consumer-{cid}-*.jsonl")
            for e in J.iter_file(path) if isinstance(e, J.Request) and not e.held_out]
    assert len(reqs) == STEPS * PACK // SEQ, len(reqs)
    per_batch = PACK // SEQ
    for i, p in enumerate(reqs):
        assert i // per_batch * per_batch <= p < (i // per_batch + 1) * per_batch, (i, p, reqs)


def test_two_speculators_trainers_share_one_capture_and_match_the_file_backend(tmp_path, speculators_python,
                                                                                target):
    root = tmp_path / "root"
    prod_log = tmp_path / "producer.log"
    producer = subprocess.Popen(producer_args(root, target, "--expect-consumers", "2", "--exit-when-done",
                                              "--done-grace", "2", "--disk-budget", BUDGET),
                                stdout=prod_log.open("w"),
                                stderr=subprocess.STDOUT)
    try:
        procs = {}
        for draft in DRAFTS:
            run = tmp_path / f"a-{draft}"
            run.mkdir()
            args = trainer_args(draft, target, run, run / "data", "--hidden-states-backend", "artcache",
                                "--artcache-root", str(root), "--artcache-id", draft, "--artcache-eval-samples",
                                str(HELD), "--artcache-lookahead", "16")
            procs[draft] = (start_trainer(speculators_python, args, run / "log"), run / "log")
        got = {draft: losses_of(*procs[draft]) for draft in DRAFTS}
        assert producer.wait(timeout=300) == 0, prod_log.read_text()[-3000:]
    finally:
        if producer.poll() is None:
            producer.kill()
    layout, settings, plan = open_root(root)
    fps = PlanFingerprints(settings.contract, plan)
    held_fps = {fps.of_sample(s) for s in range(SAMPLES - HELD, SAMPLES)}
    events = [e for path in layout.journal.glob("producer-*.jsonl") for e in J.iter_file(path)]
    captures = [e for e in events if isinstance(e, J.Capture)]
    evictions = Counter(e.reason for e in events if isinstance(e, J.Evict))
    consumed = STEPS * PACK // SEQ
    training = [e for e in captures if e.fp not in held_fps]
    print(f"\n[speculators on artcache] {len(training)} training captures for {consumed} consumed positions "
          f"({len(training) / consumed:.3f} per position), {len(captures) - len(training)} held-out captures, "
          f"{sum(e.recapture for e in captures)} recaptures, evictions {dict(evictions)}")
    assert len(training) / consumed <= 1.05 and not any(e.recapture for e in captures)
    for draft in DRAFTS:
        reg = registry.read(layout, draft)
        assert (reg.state, reg.cursor, reg.end, reg.checkpoint_cursor) == ("completed", consumed, consumed, consumed)
        requests_follow_batches(root, draft)

    subprocess.run(producer_args(root, target, "--fill"), check=True, capture_output=True, timeout=600)
    ratio = str((SAMPLES - HELD + 0.5) / SAMPLES)  # the backend's split: training rows, then the held-out ones
    procs = {}
    for draft in DRAFTS:
        run = tmp_path / f"f-{draft}"
        run.mkdir()
        shutil.copytree(tmp_path / f"a-{draft}" / "data", run / "data")
        file_backend_copy(root, run / "data", run / "hs")
        args = trainer_args(draft, target, run, run / "data", "--hidden-states-backend", "file",
                            "--hidden-states-path", str(run / "hs"), "--train-data-ratio", ratio)
        procs[draft] = (start_trainer(speculators_python, args, run / "log"), run / "log")
    for draft in DRAFTS:
        want = torch.tensor(losses_of(*procs[draft]), dtype=torch.float64)
        have = torch.tensor(got[draft], dtype=torch.float64)
        rel = ((have - want).abs() / want.abs()).max().item()
        print(f"[{draft}] artcache backend vs file backend over {STEPS} steps: max relative loss difference "
              f"{rel:.3g} (losses {want[0]:.5g} .. {want[-1]:.5g})")
        assert rel <= 1e-6, (got[draft], want.tolist())


def test_a_killed_speculators_trainer_resumes_after_its_checkpoint(tmp_path, speculators_python, target):
    """SIGKILL an EAGLE-3 trainer once a mid-run checkpoint is recorded (``--checkpoint-freq 0.25``: every 5 of
    its 21 batches), then start it again with the same arguments: speculators resumes from its last
    ``training_state.json`` (global step g), the backend registers at cursor ``4 g`` (batches of 4 positions),
    and the restarted trainer reads exactly the positions ``[4 g, 80)``, batch after batch, and ends completed.
    The root is filled first (``--fill``), so no producer runs while the trainers read."""
    root = tmp_path / "root"
    subprocess.run(producer_args(root, target, "--fill"), check=True, capture_output=True, timeout=600)
    layout = CacheLayout(root)
    run = tmp_path / "run"
    run.mkdir()
    args = trainer_args("eagle3", target, run, run / "data", "--hidden-states-backend", "artcache",
                        "--artcache-root", str(root), "--artcache-id", "e3", "--artcache-eval-samples", str(HELD),
                        "--checkpoint-freq", "0.25")
    first = start_trainer(speculators_python, args, run / "log1")
    try:
        deadline = time.monotonic() + 600
        while (reg := registry.read(layout, "e3")) is None or reg.checkpoint_cursor < 40:
            assert first.poll() is None and time.monotonic() < deadline, (run / "log1").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        first.kill()
        first.wait()
    g = json.loads((run / "ckpt" / "0" / "training_state.json").read_text())["global_step"]
    assert g in (10, 15), g
    second = start_trainer(speculators_python, args, run / "log2")
    losses = losses_of(second, run / "log2", steps=range(g, STEPS))
    assert len(losses) == STEPS - g
    reg = registry.read(layout, "e3")
    consumed = STEPS * PACK // SEQ
    assert (reg.state, reg.cursor, reg.checkpoint_cursor) == ("completed", consumed, consumed)
    journals = sorted(layout.journal.glob("consumer-e3-*.jsonl"), key=lambda p: p.stat().st_mtime)
    assert len(journals) == 2
    events = list(J.iter_file(journals[-1]))
    assert [e.cursor for e in events if isinstance(e, J.ConsumerStart)] == [4 * g]
    reads = [e.position for e in events if isinstance(e, J.Request) and not e.held_out]
    assert sorted(reads) == list(range(4 * g, consumed))
    for i, p in enumerate(reads):
        assert 4 * g + i // 4 * 4 <= p < 4 * g + (i // 4 + 1) * 4, (i, p, reads)
    print(f"\n[speculators resume] killed after checkpoint step {g}; the restart read positions {4 * g}.."
          f"{consumed - 1}")


def test_the_launcher_refuses_a_bad_setting_in_one_line(tmp_path, speculators_python, target):
    """``python -m artcache.trainers.speculators_backend train`` with ``--num-workers 2``: one ``artcache: error:``
    line naming the value and what is accepted, exit 2, nothing registered on the root."""
    root = tmp_path / "root"
    subprocess.run(producer_args(root, target, "--max-samples", "8", "--fill"), check=True, capture_output=True,
                   timeout=600)
    args = trainer_args("eagle3", target, tmp_path / "run", tmp_path / "run" / "data", "--hidden-states-backend",
                        "artcache", "--artcache-root", str(root), "--artcache-eval-samples", "2")
    args[args.index("--num-workers") + 1] = "2"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([speculators_python, "-m", "artcache.trainers.speculators_backend", "train", *args],
                          capture_output=True, text=True, timeout=600, env=env)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("artcache: error:")]
    assert proc.returncode == 2 and errors == ["artcache: error: --num-workers 2: the artcache backend commits its "
                                               "cursor from the training loop's own reads; accepted: 0"], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and registry.read_all(CacheLayout(root)) == []
