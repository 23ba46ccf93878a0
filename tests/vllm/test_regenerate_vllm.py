"""``artcache regenerate`` with the vLLM backend against the hf backend (lane ``-m vllm``; needs the
``artcache[vllm]`` extra, see docs/vllm.md).

The first 4 usable ShareGPT records, SmolLM2-135M-Instruct, float32, greedy, 32 new tokens: how many of
the 4 answers agree token for token between transformers ``generate`` and vLLM (printed; at least 3
must). Run: ``python -m pytest -m vllm -s tests/vllm/test_regenerate_vllm.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the vllm lane needs the artcache[vllm] extra")

from tests.support import REPO  # noqa: E402

SAMPLES, MAX_NEW = 4, 32
#: one backend per process: vLLM replaces ``torch.set_num_threads`` in the process it runs in, and an
#: in-process engine after an hf run (or the reverse) runs with the other's thread settings
CHILD = f"""
import json, sys
from artcache.data.regenerate import RegenerateConfig, regenerate
backend, target, out, ids = sys.argv[1:5]
res = regenerate(RegenerateConfig(out=out, target=target, dataset="sharegpt", max_samples={SAMPLES},
    max_new_tokens={MAX_NEW}, max_prompt_tokens=512, backend=backend, batch_size={SAMPLES}, dtype="float32",
    threads=1, progress=False))
json.dump({{"summary": res.summary, "prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids}},
          open(ids, "w"))
"""


def test_hf_and_vllm_greedy_agree(tmp_path, smollm2_target):
    runs = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for backend in ("hf", "vllm"):
        out, ids = tmp_path / f"{backend}.jsonl", tmp_path / f"{backend}.ids.json"
        # one thread each (threads=1): two OpenMP threads on a shared 2-core machine make decoding crawl
        proc = subprocess.run([sys.executable, "-c", CHILD, backend, smollm2_target.path, str(out), str(ids)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[backend] = json.loads(ids.read_text())
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == SAMPLES and all(r["regenerated"]["backend"] == backend for r in records)
        print(f"\n{backend}: " + json.dumps({k: runs[backend]["summary"][k] for k in (
            "samples", "prompt_tokens", "generated_tokens", "finished", "load_s", "generation_s",
            "generated_tokens_per_s", "roundtrip_exact")}))
    hf, vl = runs["hf"], runs["vllm"]
    assert hf["prompt_ids"] == vl["prompt_ids"]  # the same prompts, token for token
    pairs = list(zip(hf["generated_ids"], vl["generated_ids"], strict=True))
    agree = sum(a == b for a, b in pairs)
    for i, (a, b) in enumerate(pairs):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            print(f"sample {i}: first difference at generated token {j} of {len(a)} (hf) / {len(b)} (vllm)")
    print(f"greedy agreement hf vs vllm: {agree}/{SAMPLES} samples identical over {MAX_NEW} new tokens")
    assert agree >= SAMPLES - 1
