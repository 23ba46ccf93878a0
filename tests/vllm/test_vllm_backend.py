"""The vLLM capture backend on the real SmolLM2-135M target and ShareGPT (lane ``-m vllm``; needs the
``artcache[vllm]`` extra, see docs/vllm.md and .ci/vllm-lane).

- parity: the same plan samples captured with ``hf`` and ``vllm`` agree per layer (cosine, relative
  error, printed as a table), token ids are identical, and a short capture is rejected;
- a producer-with-vLLM 1p1c run (``artcache producer --backend vllm`` + ``artcache consume``);
- a crash test: the vLLM producer SIGKILLed mid-publish leaves no partial artifact and no engine
  process; a restarted producer resumes and the consumer completes.

Skipped as a whole when ``import vllm`` fails. Run: ``python -m pytest -m vllm tests/vllm/test_vllm_backend.py -s``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm lane needs the artcache[vllm] extra")

import torch  # noqa: E402

from artcache import journal as J  # noqa: E402
from artcache import store  # noqa: E402
from artcache.errors import CaptureMismatch  # noqa: E402
from artcache.layout import CacheLayout, parse_journal_name, parse_temp_name  # noqa: E402
from artcache.settings import load_settings  # noqa: E402
from tests.support.procs import Proc as BaseProc  # noqa: E402
from tests.support.procs import child_env, verify_all_published, wait_until  # noqa: E402

# 1 GiB of KV cache is plenty for these plans (the producer's default is 4); subprocesses inherit it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_LENGTH = 256
#: unsorted on purpose (the backend reorders vLLM's increasing-id rows) and with the last layer
#: (vLLM id 30: the last decoder layer's output before the final norm)
PARITY_LAYERS = (27, 1, 14, 8, 29)
PARITY_SAMPLES = 4
DEADLINE_S = 600.0
STEPS, BATCH = 3, 2
#: the producer/consumer plan of the process tests
PLAN = ["--max-length", str(MAX_LENGTH), "--max-samples", "16", "--draft-layers", "3"]


# ---- parity ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parity_root(tmp_path_factory, smollm2_target):
    """A vllm root (float32 states, so the comparison sees the backends' own error, not bf16 rounding)."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path_factory.mktemp("vllm-parity") / "cache"
    layout, settings, plan, info, _tok = prepare_root(ProducerConfig(
        cache=str(cache), backend="vllm", max_length=MAX_LENGTH, max_samples=16, layer_ids=list(PARITY_LAYERS),
        dtype="float32"))
    return settings.contract, plan, info


@pytest.fixture(scope="module")
def vllm_backend(parity_root):
    from artcache.backends.vllm import VLLMCaptureBackend

    contract, _plan, info = parity_root
    backend = VLLMCaptureBackend(info.path, contract)
    yield backend
    backend.close()


def _layer_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """a, b: [T, H] float32 (reference, other). Per-token cosine (mean, min) and relative error
    ||a - b|| / ||a|| over the whole layer (Frobenius norms)."""
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
            "rel_err": float((a - b).norm() / a.norm())}


def test_parity_hf_vs_vllm(parity_root, vllm_backend):
    import msgspec

    from artcache.backends.hf import HFCaptureBackend
    from artcache.target import load_target_model

    contract, plan, info = parity_root
    samples = [plan.sample(i) for i in range(PARITY_SAMPLES)]
    got_v = vllm_backend.capture(samples)
    model = load_target_model(info, device="cpu", dtype=torch.float32)
    hf = HFCaptureBackend(model, msgspec.structs.replace(contract, backend="hf"))
    try:
        got_h = hf.capture(samples)
    finally:
        hf.close()  # one backend's hooks at a time: each cuts the pass after its deepest layer
    # control: the same layers shifted by one (what an off-by-one convention mapping would store)
    shifted = HFCaptureBackend(model, msgspec.structs.replace(contract, backend="hf",
                                                              layer_ids=tuple(i - 1 for i in PARITY_LAYERS)))
    try:
        got_shifted = shifted.capture(samples)
    finally:
        shifted.close()
    rows = []
    for s, h, v in zip(samples, got_h, got_v, strict=True):
        assert torch.equal(v["input_ids"], s.input_ids.to(torch.int32))  # token ids identical to the request
        assert torch.equal(v["input_ids"], h["input_ids"]) and torch.equal(v["loss_mask"], h["loss_mask"])
        assert v["hidden_states"].shape == h["hidden_states"].shape == (s.input_ids.shape[0], len(PARITY_LAYERS), 576)
    print(f"\nhf (float32) vs vllm (float32) on {PARITY_SAMPLES} ShareGPT samples "
          f"({sum(int(s.input_ids.shape[0]) for s in samples)} tokens, max length {MAX_LENGTH})")
    print(f"{'layer':>5} {'cos mean':>9} {'cos min':>9} {'rel err':>9}   bf16: {'cos mean':>9} {'rel err':>9}")
    for j, layer in enumerate(PARITY_LAYERS):
        a = torch.cat([h["hidden_states"][:, j] for h in got_h]).float()
        b = torch.cat([v["hidden_states"][:, j] for v in got_v]).float()
        st = _layer_stats(a, b)
        bf = _layer_stats(a.bfloat16().float(), b.bfloat16().float())  # what a bf16 contract would store
        rows.append((layer, st))
        print(f"{layer:>5} {st['cos_mean']:>9.6f} {st['cos_min']:>9.6f} {st['rel_err']:>9.2e}   "
              f"      {bf['cos_mean']:>9.6f} {bf['rel_err']:>9.2e}")
    for layer, st in rows:
        assert st["cos_mean"] >= 0.99, (layer, st)
        assert st["cos_min"] >= 0.99, (layer, st)
    # the tolerance tells neighbouring layers apart: an off-by-one mapping would fail it
    off = [_layer_stats(torch.cat([h["hidden_states"][:, j] for h in got_shifted]).float(),
                        torch.cat([v["hidden_states"][:, j] for v in got_v]).float())
           for j in range(len(PARITY_LAYERS))]
    print("off-by-one control (hf layer i-1 vs vllm layer i): cos min "
          + " ".join(f"{o['cos_min']:.3f}" for o in off))
    assert min(o["cos_min"] for o in off) < 0.99


def test_short_capture_is_rejected(parity_root, vllm_backend, monkeypatch):
    """A capture whose rows cover fewer tokens than requested (what a prefix-cache hit does to other
    tools) is rejected as a whole; so is one with a different token id."""
    _contract, plan, _info = parity_root
    samples = [plan.sample(i) for i in range(2)]
    real_take = vllm_backend._connector.take

    def truncating(key):
        rows = real_take(key)
        if isinstance(rows, dict) and key.endswith("-1"):
            rows = {"hidden_states": rows["hidden_states"][:-3], "token_ids": rows["token_ids"][:-3]}
        return rows

    monkeypatch.setattr(vllm_backend._connector, "take", truncating)
    with pytest.raises(CaptureMismatch, match=r"sample 1 .* captured \d+ tokens, \d+ were requested"):
        vllm_backend.capture(samples)

    def altering(key):
        rows = real_take(key)
        if isinstance(rows, dict) and key.endswith("-0"):
            ids = rows["token_ids"].clone()
            ids[5] += 1
            rows = {"hidden_states": rows["hidden_states"], "token_ids": ids}
        return rows

    monkeypatch.setattr(vllm_backend._connector, "take", altering)
    with pytest.raises(CaptureMismatch, match=r"sample 0 .* at position 5"):
        vllm_backend.capture(samples)
    monkeypatch.setattr(vllm_backend._connector, "take", real_take)
    # the engine is still usable and the mailbox kept nothing of the rejected batches
    assert len(vllm_backend.capture(samples[:1])) == 1
    assert vllm_backend._connector._mailbox == {}


# ---- processes -------------------------------------------------------------------------------------------

class Proc(BaseProc):
    deadline = DEADLINE_S
    single_thread = False  # no OMP_NUM_THREADS=1: the vLLM CPU engine keeps its own thread count


def start_producer(cwd: Path, cache: Path, *extra: str, **env: str) -> Proc:
    return Proc("producer", ["producer", "--cache", str(cache), "--backend", "vllm", *PLAN, "--batch-samples", "2",
                             "--heartbeat-timeout", "120", *extra], cwd, env=env)


def start_consumer(cwd: Path, cache: Path, cid: str = "c") -> Proc:
    return Proc(cid, ["consume", "--cache", str(cache), "--id", cid, "--block-size", "4", "--window", "0:2",
                      "--anchors", "4", "--steps", str(STEPS), "--batch-size", str(BATCH), "--threads", "1",
                      "--demand-timeout", str(DEADLINE_S), "--log-every", "1", "--json",
                      "--out", str(cwd / "runs" / cid)],
                cwd)


def inspect_json(cache: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "artcache", "inspect", "--cache", str(cache), "--json"],
                          capture_output=True, text=True, timeout=300,
                          env=child_env(single_thread=False))
    assert proc.returncode in (0, 3), proc.stderr
    return json.loads(proc.stdout)


def stray_locks(cache: Path) -> list[str]:
    """Lock files beside artifacts (vLLM's own connector leaves ``<file>.safetensors.lock``): any
    ``*.safetensors.lock`` in the root, any ``*.lock`` in ``objects/`` or ``tmp/``. (artcache's striped
    ``locks/`` and the plan build lock are flock files kept by design, see docs/protocol.md.)"""
    found = set(cache.rglob("*.safetensors.lock"))
    for sub in ("objects", "tmp"):
        found.update((cache / sub).rglob("*.lock"))
    return sorted(str(p.relative_to(cache)) for p in found)


def processes_tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ARTCACHE_TEST_TAG=tag (engine children included)."""
    out = []
    needle = f"ARTCACHE_TEST_TAG={tag}".encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def test_producer_vllm_1p1c(tmp_path):
    cache = tmp_path / "cache"
    prod = start_producer(tmp_path, cache, "--exit-when-done", "--done-grace", "3")
    cons = None
    try:
        wait_until(lambda: (cache / "artcache.json").is_file(), "the producer to initialise the root", [prod],
                   poll=0.5)
        cons = start_consumer(tmp_path, cache)
        cons.expect(0)
        prod.expect(0)
    finally:
        for p in (prod, cons):
            if p is not None:
                p.kill()
    settings = load_settings(CacheLayout(cache))
    assert settings.contract.backend == "vllm" and settings.contract.layer_convention == "output-of-layer"
    evs = J.read_events(CacheLayout(cache).journal).events
    published = [e for e in evs if isinstance(e, J.Publish)]
    assert len(published) >= STEPS * BATCH
    assert not [e for e in evs if isinstance(e, J.CaptureFailure)]
    acc = inspect_json(cache)
    assert acc["violations"] == []
    assert acc["cache"]["captures"] == acc["cache"]["publications"] >= STEPS * BATCH
    assert stray_locks(cache) == [] and not os.listdir(cache / "tmp")
    summary = json.loads(cons.text().strip().splitlines()[-1])
    assert summary["steps"] == STEPS and summary["final_loss"] > 0


def _journal(cache: Path, proc: Proc) -> Path:
    """The journal file of the producer process ``proc`` (named by its identity token)."""
    for path in CacheLayout(cache).journal.glob("producer-producer-*.jsonl"):
        parsed = parse_journal_name(path.name)
        if parsed is not None and parsed[2].identity is not None and parsed[2].identity.pid == proc.popen.pid:
            return path
    raise AssertionError(f"no journal of producer pid {proc.popen.pid} in {CacheLayout(cache).journal}")


def test_vllm_producer_killed_mid_publish_resumes(tmp_path):
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), backend="vllm", max_length=MAX_LENGTH, max_samples=16,
                                draft_layers=3))
    tag = uuid.uuid4().hex
    cons = start_consumer(tmp_path, cache)
    # the second artifact's temp file is written and fsync-ed, not yet renamed: SIGKILL
    prod = start_producer(tmp_path, cache, ARTCACHE_CRASH_AT="publish.after-fsync:2", ARTCACHE_TEST_TAG=tag)
    again = None
    try:
        prod.expect(-signal.SIGKILL)
        # the engine ran inside the producer: nothing of it outlives the kill
        assert processes_tagged(tag) == []
        verify_all_published(cache)  # no partial artifact is readable
        # temp and journal names carry the writer's identity token since issue 18 (parse_*_name read them)
        orphans = [p.name for p in (cache / "tmp").iterdir()
                   if (w := parse_temp_name(p.name)) is not None and w.identity is not None
                   and w.identity.pid == prod.popen.pid]
        assert len(orphans) == 1 and orphans[0].endswith(".part"), orphans
        killed = [e for e in J.iter_file(_journal(cache, prod))
                  if e is not None]
        lost = {e.fp for e in killed if isinstance(e, J.Capture)} - {e.fp for e in killed if isinstance(e, J.Publish)}
        assert lost and not any(store.exists(CacheLayout(cache), fp) for fp in lost)

        again = start_producer(tmp_path, cache)
        cons.expect(0)  # the consumer waited through the kill and completed on the restarted producer
        again.terminate_ready_producer()
    finally:
        for p in (cons, prod, again):
            if p is not None:
                p.kill()
    verify_all_published(cache)
    republished = [e for e in J.iter_file(_journal(cache, again))
                   if isinstance(e, J.Publish)]
    assert lost <= {e.fp for e in republished}  # the killed capture was captured and published again
    acc = inspect_json(cache)
    # the one violation a killed producer explains: captures it journaled and never published
    assert [v for v in acc["violations"] if not v.startswith("captures ")] == [], acc["violations"]
    assert acc["cache"]["quarantined"] == 0 and acc["cache"]["leases_held"] == 0
    assert stray_locks(cache) == [] and not os.listdir(cache / "tmp")  # the orphan was cleaned up
