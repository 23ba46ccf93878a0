"""artcache.telemetry: the GPU summary a bench report carries (no NVML needed: samples are plain records)."""

from artcache.telemetry import GpuSample, NullSampler, summarize


def _samples(times, device=0):
    return [GpuSample(t, device, util_pct=10.0 * i, mem_used_bytes=100 + i, power_w=50.0 + i, sm_clock_mhz=1000.0)
            for i, t in enumerate(times)]


def test_summary_over_the_interval_only():
    s = _samples([1.0, 2.0, 3.0, 4.0])
    out = summarize(s, [0], {0: "consumer"}, t0=1.5, t1=3.5)
    assert out == {"cuda:0": {"role": "consumer", "samples": 2, "over": "interval", "util_median_pct": 15.0,
                              "util_mean_pct": 15.0, "mem_max_bytes": 102, "power_median_w": 51.5,
                              "sm_clock_median_mhz": 1000.0}}


def test_regression_an_interval_shorter_than_the_sampling_period_keeps_the_runs_telemetry():
    """On a short bench the common post-warm-up interval fell between two samples (or was empty), so the report's
    telemetry was ``{}`` although NVML sampled the whole run; the whole run's samples are reported instead."""
    s = _samples([1.0, 2.0, 3.0])
    for t0, t1 in ((2.2, 2.4), (3.0, 2.0)):
        out = summarize(s, [0], {}, t0=t0, t1=t1)
        assert out["cuda:0"]["over"] == "run" and out["cuda:0"]["samples"] == 3
        assert out["cuda:0"]["role"] == "idle" and out["cuda:0"]["mem_max_bytes"] == 102


def test_a_device_without_samples_is_left_out_and_devices_are_kept_apart():
    s = _samples([1.0, 2.0], device=1)
    out = summarize(s, [0, 1], {1: "producer"})
    assert list(out) == ["cuda:1"] and out["cuda:1"]["samples"] == 2 and out["cuda:1"]["over"] == "interval"
    assert summarize([], [0], {}) == {}
    assert NullSampler().summary({0: "x"}, 0.0, 1.0) == {}
