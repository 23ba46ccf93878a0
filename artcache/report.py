"""Plain-text tables for ``artcache inspect`` and the bench."""

from __future__ import annotations

from collections.abc import Sequence

from artcache.accounting import Accounting

#: the most steps each end of :func:`loss_ends` averages
LOSS_ENDS_STEPS = 5


def table(headers: list[str], rows: list[list]) -> str:
    """A fixed-width text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, three significant figures or so: ``512 B``, ``4.0 KiB``, ``120.0 MiB``,
    ``11.72 GiB``, ``1.25 TiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit in ("GiB", "TiB") else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def first_few(names: Sequence[str], n: int = 5) -> str:
    """``names`` joined by ", ", at most the first ``n`` of them, then `` and K more`` for the rest: what a one-line
    message lists of a long collection. ``first_few(["a", "b", "c"], 2)`` → ``"a, b and 1 more"``."""
    shown = ", ".join(str(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _budget_text(c) -> str:
    """The latest producer's disk budget as both of inspect's tables print it: bytes (also 0, when it
    recorded a budget of 0 under ``--retention need``), ``none (windows rule)`` or ``none recorded``."""
    if c.retention == "need" and (c.budget_bytes or c.budget_recorded):
        return str(c.budget_bytes)
    return "none (windows rule)" if c.retention == "windows" else "none recorded"


def format_accounting(acc: Accounting) -> str:
    c = acc.cache
    shared = [
        ["captures (producer, once)", c.captures], ["publications", c.publications],
        ["published bytes", c.published_bytes],
        ["capture failures", c.failures], ["captures lost in a producer crash", c.captures_lost_in_crash],
        ["recaptures", c.recaptures], ["evictions", c.evictions],
        ["coalesced requests", c.coalesced],
        ["distinct positions consumed", c.distinct_positions_consumed],
        ["captures / consumed position", round(c.captures_per_consumed_position, 3)],
        ["retained artifacts now", c.retained_artifacts], ["retained bytes now", c.retained_bytes],
        ["max retained artifacts", c.max_retained_artifacts],
        ["window bound (artifacts: Σ windows + held-out, ≤ plan)", c.window_bound_artifacts],
        ["max retained bytes", c.max_retained_bytes],
        ["disk budget (bytes)", _budget_text(c)], ["retention", c.retention or "-"],
        ["filled root: artifacts kept beside the rule", c.kept_fill_artifacts or "-"],
        ["budget binding (some producer pass so far)", "yes" if c.budget_binding else "no"],
        ["evictions by reason", ", ".join(f"{k} {v}" for k, v in sorted(c.evictions_by_reason.items())) or "-"],
        ["leases acquired", c.leases_acquired], ["leases released", c.leases_released],
        ["leases expired", c.leases_expired], ["leases held now", c.leases_held],
        ["lease removals lost in a kill", c.leases_removal_unjournaled],
        ["fences", c.fences], ["producer busy (s)", round(c.producer_busy_s, 2)],
        ["torn journal lines", c.torn_journal_lines],
    ]
    if c.journals_holding:  # a full filesystem: their lines follow once space is back (docs/protocol.md)
        shared += [["journals holding events in memory (full disk)", c.journals_holding],
                   ["lease releases held in memory", c.leases_release_held]]
    # B: the block size of a draft with blocks (DFlash, DSpark), as its ConsumerStart recorded it; EAGLE-3 has
    # none (journals of older consumers recorded an unused 16 for it)
    per = [[k.consumer if k.ranks == 1 else f"{k.consumer} ({k.ranks} ranks)", k.draft,
            k.block_size if k.block_size and k.draft != "eagle3" else "-", f"{k.lookbehind}:{k.lookahead}",
            k.state, k.steps, k.cursor, k.logical_requests, k.hits, k.misses, round(k.wait_s, 2),
            k.leases_acquired, k.leases_released, k.timeouts, k.quarantined] for k in acc.consumers]
    totals = ["total (consumer requests)", "", "", "", "", "", "", c.logical_requests, c.hits, c.misses, "",
              c.leases_acquired, c.leases_released, c.timeouts, c.quarantined]
    out = ["Shared production (counted once):", table(["counter", "value"], shared), "",
           "Per consumer (each consumer's own requests and committed work):",
           table(["consumer", "draft", "B", "window", "state", "steps", "cursor", "requests", "hits", "misses",
                  "wait_s", "leases+", "leases-", "timeouts", "quarantined"], [*per, totals]), ""]
    now = acc.retention_now
    if now is not None:
        rows = [["policy", now.policy], ["disk budget (bytes)", _budget_text(c)],
                ["retained now", f"{now.retained_artifacts} artifacts, {now.retained_bytes} bytes"],
                ["live consumers (rates, positions/s)", f"{now.live_consumers} "
                 f"({', '.join(f'{k} {v:g}' for k, v in now.rates.items()) or '-'})"],
                ["kept: in a live window / leased", f"{now.kept.get('window', 0)} / {now.kept.get('leased', 0)}"],
                ["kept: needed later / needed by no live consumer",
                 f"{now.kept.get('needed', 0)} / {now.kept.get('unneeded', 0)}"],
                ["would evict now", ", ".join(f"{k} {v}" for k, v in sorted(now.would_evict.items())) or "nothing"],
                ["budget binding now", "yes" if now.binding else "no"]]
        if now.windows_exceed_budget:
            rows.append(["live windows alone exceed the budget", "yes (the windows are kept)"])
        out += ["Retention now (the decision the producer would take on this state):",
                table(["", "value"], rows), ""]
    if acc.violations:
        out.append("INVARIANT VIOLATIONS:")
        out.extend(f"  - {v}" for v in acc.violations)
    else:
        out.append("invariants: ok (captures = publications + failures + lost in a crash; leases balance; "
                   "requests = hits + misses; retained bytes <= the disk budget, or <= the window bound (plus a "
                   "kept fill) under the windows-only rule)")
    return "\n".join(out)


def loss_ends(losses: Sequence[float]) -> tuple[float | None, float | None, int]:
    """The training loss at the start and at the end of a run: (mean of the first k losses, mean of the last k,
    k) with k = max(1, min(:data:`LOSS_ENDS_STEPS`, n // 2)) for n losses, so the two means never share a step
    when n >= 2 (n = 1: both are that one step's loss); (None, None, 0) for none. ``losses``: per-step training
    losses in step order (steps that supervised nothing left out). The one rule behind the consume summary,
    ``artcache run``'s report and the bench's ``first_loss`` / ``final_loss``."""
    n = len(losses)
    if not n:
        return None, None, 0
    k = max(1, min(LOSS_ENDS_STEPS, n // 2))
    return sum(losses[:k]) / k, sum(losses[-k:]) / k, k


#: held-out figures a consume summary shows when the evaluation has them, with what each counts
_EVAL_SHOWN = (("replay_tau", "greedy-replay τ (incl. +1 bonus)"), ("tau", "τ (incl. +1 bonus)"),
               ("sim_acc_len", "sim_acc_len (no bonus)"), ("loss", "loss"))


def format_consume_summary(summary: dict | None, signal_name: str = "") -> str:
    """``artcache consume``'s closing lines for a person: what ended and why, steps, loss, the last held-out
    figures and the checkpoint to continue from. ``summary``: :func:`artcache.trainers.consumer.run_consumer`'s
    dict (None: the run stopped before it had one); ``signal_name``: the signal that stopped it (``SIGTERM``),
    empty for a run that finished."""
    if summary is None:
        return f"consume: stopped by {signal_name or 'an interrupt'} before the first step; nothing trained"
    cid, planned, steps = summary.get("consumer_id", "?"), summary.get("steps_planned"), summary.get("steps", 0)
    of = f"/{planned}" if planned is not None else ""
    secs = summary.get("seconds") or 0.0
    what = f"stopped by {signal_name}" if signal_name else summary.get("state", "completed")
    head = f"{cid} ({summary.get('draft')}): {what} at step {steps}{of} after {secs:.1f} s"
    lines = [head + f", cursor {summary.get('cursor', 0)}, {summary.get('wait_s', 0.0):.1f} s waiting for batches"]
    first, last = summary.get("first_loss"), summary.get("final_loss")
    k, n = summary.get("loss_ends_steps") or 0, summary.get("loss_steps") or 0
    if first is not None and last is not None:
        if n == 1:
            lines.append(f"  train loss {first:.4f} (the one step this process ran)")
        else:
            lines.append(f"  train loss {first:.4f} -> {last:.4f} (mean of the first / last {k} of the {n} steps "
                         "this process ran)")
    ev = summary.get("eval") or {}
    shown = [f"{label} {ev[k]:.4f}" for k, label in _EVAL_SHOWN if isinstance(ev.get(k), (int, float))]
    if shown:
        lines.append(f"  held-out at step {ev.get('step', '?')}: " + ", ".join(shown))
    best = summary.get("best")
    if best:
        lines.append(f"  checkpoints/best: {best['metric']} {best['value']:.4f} at step {best['step']}")
    ckpt = summary.get("checkpoint")
    if ckpt:
        resume = "; continue with the same command and --resume" if signal_name else ""
        lines.append(f"  checkpoint {ckpt}{resume}")
    elif signal_name:
        lines.append("  no checkpoint was written")
    return "\n".join(lines)
