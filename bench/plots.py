"""PNG plots for bench reports (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def progress_plot(figures: dict, path: Path, title: str) -> Path:
    """Each consumer's committed steps over time, with the common interval shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    t_base = min((c["progress"][0][0] for c in figures["consumers"].values() if c["progress"]), default=0.0)
    for cid, c in figures["consumers"].items():
        if c["progress"]:
            ts = [p[0] - t_base for p in c["progress"]]
            ax.plot(ts, [p[1] for p in c["progress"]], label=f"{cid} ({c['steps_per_s']:.2f} steps/s)")
    t0, t1 = figures["interval"]
    if t1 > t0:
        ax.axvspan(t0 - t_base, t1 - t_base, color="0.9", label="common post-warm-up interval")
    ax.set_xlabel("time since first step (s)")
    ax.set_ylabel("optimizer steps committed")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def gpu_plot(samples: list, roles: dict[int, str], path: Path, t_base: float) -> Path | None:
    """GPU utilisation per role over time (skipped when there are no NVML samples)."""
    if not samples:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    for d in sorted({s.device for s in samples}):
        s = [x for x in samples if x.device == d]
        ax.plot([x.t - t_base for x in s], [x.util_pct for x in s], label=f"cuda:{d} {roles.get(d, '')}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GPU utilisation (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
