"""GPU telemetry through NVML (``nvidia-ml-py``), behind a null object for machines without it.

:func:`make_sampler` returns an :class:`NvmlSampler` when NVML initialises and reports the requested
devices, else a :class:`NullSampler` with the same interface, so CPU runs take the same code path.
Samples: time (s since epoch), device index, GPU utilisation (%), memory used (bytes), power (W),
SM clock (MHz).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from statistics import median


@dataclass
class GpuSample:
    t: float
    device: int
    util_pct: float
    mem_used_bytes: int
    power_w: float
    sm_clock_mhz: float


@dataclass
class NullSampler:
    """Samples nothing; ``summary()`` says why."""

    reason: str = "NVML unavailable"
    samples: list[GpuSample] = field(default_factory=list)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def environment(self) -> dict:
        return {"nvml": False, "reason": self.reason}

    def summary(self, roles: dict[int, str], t0: float | None = None, t1: float | None = None) -> dict:
        return {}


class NvmlSampler(NullSampler):
    """Samples the given devices every ``period_s`` seconds on a background thread."""

    def __init__(self, devices: list[int], period_s: float = 0.2) -> None:
        super().__init__(reason="")
        import pynvml

        self._nv = pynvml
        self.devices = devices
        self.period_s = period_s
        self._handles = {d: pynvml.nvmlDeviceGetHandleByIndex(d) for d in devices}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nvml-sampler")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _loop(self) -> None:
        nv = self._nv
        while not self._stop.wait(self.period_s):
            now = time.time()
            for d, h in self._handles.items():
                try:
                    util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                    mem = nv.nvmlDeviceGetMemoryInfo(h).used
                    power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                    clock = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                except nv.NVMLError:
                    continue
                self.samples.append(GpuSample(now, d, float(util), int(mem), power, float(clock)))

    def environment(self) -> dict:
        nv = self._nv
        h = self._handles[self.devices[0]] if self.devices else None
        name = nv.nvmlDeviceGetName(h) if h is not None else ""
        return {"nvml": True, "gpu": name.decode() if isinstance(name, bytes) else name,
                "driver": _s(nv.nvmlSystemGetDriverVersion()), "devices": self.devices}

    def summary(self, roles: dict[int, str], t0: float | None = None, t1: float | None = None) -> dict:
        """See :func:`summarize` (over this sampler's devices and samples)."""
        return summarize(self.samples, self.devices, roles, t0, t1)


def summarize(samples: list[GpuSample], devices: list[int], roles: dict[int, str], t0: float | None = None,
              t1: float | None = None) -> dict:
    """Per device (labelled with its role): median/mean utilisation (%), max memory (bytes), median power (W)
    and SM clock (MHz), over the samples in [t0, t1] (s since epoch) when given.

    ``over`` says which samples: ``"interval"`` (those in [t0, t1], or all when no bound is given) or
    ``"run"``: every sample of the device, when [t0, t1] held none (an interval shorter than the sampling
    period, or empty: a short run's common post-warm-up interval; regression: the report then had no
    telemetry at all). A device with no sample at all is left out.
    """
    out = {}
    for d in devices:
        every = [x for x in samples if x.device == d]
        s = [x for x in every if (t0 is None or x.t >= t0) and (t1 is None or x.t <= t1)]
        over = "interval"
        if not s:
            s, over = every, "run"
        if not s:
            continue
        out[f"cuda:{d}"] = {
            "role": roles.get(d, "idle"), "samples": len(s), "over": over,
            "util_median_pct": median(x.util_pct for x in s),
            "util_mean_pct": sum(x.util_pct for x in s) / len(s),
            "mem_max_bytes": max(x.mem_used_bytes for x in s),
            "power_median_w": median(x.power_w for x in s),
            "sm_clock_median_mhz": median(x.sm_clock_mhz for x in s),
        }
    return out


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def make_sampler(devices: list[int], period_s: float = 0.2) -> NullSampler:
    """An NVML sampler for ``devices``, or a NullSampler saying why not."""
    if not devices:
        return NullSampler("no GPU roles in this run")
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:  # library missing, no driver, no device
        return NullSampler(f"NVML unavailable: {exc}")
    if any(d >= count for d in devices):
        return NullSampler(f"NVML reports {count} device(s); wanted {devices}")
    return NvmlSampler(devices, period_s)
