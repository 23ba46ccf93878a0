"""Figures of the reliability lane, printed at the end of the pytest run (``pytest -m reliability``).

Tests call :func:`record` with a section, a row label and counts; ``pytest_terminal_summary`` (imported by
conftest.py) prints one table per section after the test results, so the lane's output carries its proof:
crash trials run/passed, processes × operations with zero torn reads and zero duplicate captures, fault
injections per errno with zero partial artifacts, hypothesis examples per stream length, corruptions
detected / injected. Figures are recorded only by tests that ran in this process; a section with no row is
not printed.
"""

from __future__ import annotations

from collections import defaultdict

#: section -> row label -> {column: value}; rows of the same label are summed column by column
FIGURES: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)

#: printed order and title of the known sections (others follow in insertion order)
SECTIONS = {
    "crash": "Crash trials (SIGKILL; seed logged)",
    "concurrency": "Concurrent processes x operations",
    "faults": "Fault injections (per errno / failing call)",
    "replays": "Replayed faults: per errno and site; every run ended (0 hangs), 0 false violations",
    "multihost": "Across hosts (UTS+PID namespaces over one root)",
    "hypothesis": "Hypothesis examples (window/lease/eviction model)",
    "corruption": "Corruptions detected / injected",
}


def record(section: str, row: str, **values: float) -> None:
    """Add ``values`` to ``FIGURES[section][row]`` (summing with earlier records of the same row)."""
    cur = FIGURES[section].setdefault(row, {})
    for k, v in values.items():
        cur[k] = cur.get(k, 0) + v


def _fmt(v) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.2f}"


def format_figures() -> list[str]:
    lines: list[str] = []
    order = [s for s in SECTIONS if FIGURES.get(s)] + [s for s in FIGURES if s not in SECTIONS and FIGURES[s]]
    for section in order:
        rows = FIGURES[section]
        cols: list[str] = []
        for vals in rows.values():
            cols += [c for c in vals if c not in cols]
        width = max(len(r) for r in rows) + 2
        widths = [max(9, len(c) + 2) for c in cols]
        lines.append(f"{SECTIONS.get(section, section)}")
        lines.append("  " + " " * width + "".join(f"{c:>{w}s}" for c, w in zip(cols, widths, strict=True)))
        for row, vals in rows.items():
            cells = (_fmt(vals[c]) if c in vals else "-" for c in cols)
            lines.append("  " + f"{row:<{width}s}" + "".join(f"{v:>{w}s}" for v, w in zip(cells, widths, strict=True)))
        lines.append("")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001 - pytest hook
    lines = format_figures()
    if not lines:
        return
    terminalreporter.section("artcache reliability figures")
    for line in lines:
        terminalreporter.write_line(line)
