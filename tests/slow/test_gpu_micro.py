"""bench.gpu_micro's CPU-runnable parts at a toy size: the machine-readable result carries the command, the
commit and the hardware, every I/O version and ratio, the fp8 byte ratio, and the producer part runs its
GPU code path's CPU twin (capture batches with ready(), steady-state capture + publish), the consumer
part feeds a DFlash step from a bf16 and an fp8 root and removes them. No figure is checked for speed: only
that the harness measures what it says."""

from __future__ import annotations

import json

from artcache.bench import gpu_micro


# a minute on an idle 2-core machine (two roots, five I/O versions, two dtypes)
def test_io_producer_and_consumer_parts_write_a_complete_result(tmp_path):
    out = tmp_path / "out"
    dest = tmp_path / "results" / "micro.json"
    gpu_micro.main(["--out", str(out), "--json", str(dest), "--roots", f"{tmp_path / 'a'},{tmp_path / 'b'}",
                    "--parts", "io,producer,consumer", "--device", "cpu", "--seq", "64", "--io-layers", "2",
                    "--io-hidden", "256", "--reps", "1", "--raw-bytes", str(4 << 20),
                    "--io-variants", "legacy,default,default+fallocate", "--arch", "tiny-llama", "--batch", "2",
                    "--batches", "3", "--publishers", "1,2",
                    "--anchors", "4", "--blocks", "4", "--steps", "2"])
    r = json.loads(dest.read_text())
    assert r["parts_done"] == ["io", "producer", "consumer"] and set(r["part_wall_s"]) == set(r["parts_done"])
    b4 = r["consumer"]["blocks"]["B4"]
    assert b4["in_memory_steps_per_s"] > 0 and b4["from_cache_bfloat16_steps_per_s"] > 0
    assert b4["from_cache_float8_e4m3fn_steps_per_s"] > 0
    assert not list((tmp_path / "a").glob("consumer-cache-*"))  # the consumer part removes its roots
    assert not dest.with_name(dest.name + ".tmp").exists()  # saved after each part by rename
    assert r["command"][1:3] == ["-m", "artcache.bench.gpu_micro"] and "--parts" in r["command"]
    assert r["commit"] and r["hardware"]["cpu_count"] >= 1 and set(r["hardware"]["roots"]) == {
        str(tmp_path / "a"), str(tmp_path / "b")}
    for io, want in ((r["io"], ["legacy", "default", "default+fallocate"]), (r["io_fp8"], ["default"])):
        assert list(io["variants"]) == want
        for row in io["roots"].values():
            assert row["raw_write_fsync_Bps"] > 0 and row["raw_read_pagecache_Bps"] > 0
            for v in want:
                assert row[v]["publish_over_raw"] > 0 and row[v]["read_verify_over_pagecache"] > 0
                assert len(row["series"][v]["publish_Bps"]) == 1  # the warm-up repetition is left out
            assert {"finite_scan", "hash", "write_cache", "fsync", "rename_dirsync"} <= set(row["components_s"])
    # fp8: 2·64·256 codes + 2·64 scales + 5·64 against 2·2·64·256 + 5·64 bytes, plus a header each
    for ratio in r["fp8_bytes_over_bf16"].values():
        assert 0.5 < ratio < 0.56
    p = r["producer"]
    assert set(p["dtypes"]) == {"bfloat16", "float8_e4m3fn"}
    for d in p["dtypes"].values():
        for row in d["roots"].values():
            assert row["capture_publish_1pub_samples_per_s"] > 0 and row["capture_publish_2pub_samples_per_s"] > 0
            assert row["limit_is"] in ("disk", "prefill") and row["read_verify_Bps"] > 0
    assert p["dtypes"]["float8_e4m3fn"]["roots"][str(tmp_path / "a")]["artifact_bytes"] < \
        0.6 * p["dtypes"]["bfloat16"]["roots"][str(tmp_path / "a")]["artifact_bytes"]
    assert not (tmp_path / "a" / "io-bench").exists()  # the io part removes what it wrote
