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


def modes_plot(summaries: dict, figures: dict, path: Path, title: str) -> Path:
    """Left: each consumer's committed steps over time in every mode (colour: consumer, line style:
    mode; time since the mode's first step). Right: producer captures per consumed position per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110, gridspec_kw={"width_ratios": [2.2, 1]})
    styles = {"artcache": "-", "naive": ":", "lockstep": "--"}
    ids = sorted({cid for f in figures.values() for cid in f["consumers"]})
    colours = {cid: f"C{i}" for i, cid in enumerate(ids)}
    for mode, f in figures.items():
        t_base = min((c["progress"][0][0] for c in f["consumers"].values() if c["progress"]), default=0.0)
        for cid, c in f["consumers"].items():
            if c["progress"]:
                ax.plot([p[0] - t_base for p in c["progress"]], [p[1] for p in c["progress"]],
                        styles.get(mode, "-."), color=colours[cid],
                        label=f"{mode} {cid} ({c['steps_per_s']:.3f} steps/s)")
    ax.set_xlabel("time since the mode's first step (s)")
    ax.set_ylabel("optimizer steps committed")
    ax.legend(loc="upper left", fontsize=7)
    ax.grid(alpha=0.3)
    names = list(summaries)
    values = [summaries[m]["captures_per_consumed_position"] for m in names]
    bars = bx.bar(names, values, color=["C2" if m == "artcache" else "0.6" for m in names])
    bx.bar_label(bars, fmt="%.2f")
    bx.set_ylabel("producer captures per consumed position")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
