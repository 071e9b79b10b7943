"""The soak's resource figures and its acceptance targets, as the report states them.

Owns `flatness` (RSS or descriptors of one process after its warm-up: the median of its last 5 samples over the
median of its first 5 after warm-up) and `targets`, one verdict per acceptance target of a long soak:
0 lost and 0 duplicated acknowledged edits, 0 untyped failures, every generation answered within 30 s of its
fault's end, RSS and descriptors of every process that lived past `LONG_LIVED_S` flat within `FLAT`.
The violations it sorts come from `canvas.soak.checker`, whose messages name what broke ("lost", "twice", ...).

Flat means "did not grow by more than `FLAT`": a process whose RSS shrank (the postmaster after its shared buffers
were paged out, the 60-minute soak's postgres:5453 at -20%) leaks nothing, and is reported with its figure, not as
grown. An engine replica's RSS grows by design until its context cache (`canvas.engine.prefix_cache`, bounded by
`dcanvas serve --context-cache-mb`, 512 MiB by default: one arena of pages, `engine.block_pool`) is full, which
with the soak's documents takes longer than a replica lives between `ray_kill`s (the 60-minute soak's replica:21581,
+12% at 822 s, never reached its plateau; replica:4828, 1494 s, was at -1.5%). So a replica that posts its cache's
fill (`context_cache_mib`) is judged from the later of its warm-up's end and the time its cache was first
`CACHE_FULL` of its budget (`judged_from`); one whose cache never filled is not judged (`judged: false`, with
`why`). Either way its raw growth after warm-up (`rss_growth`) and its growth net of the cache's own growth
(`rss_growth_net_of_cache`) are reported beside the verdict, so growth is never hidden.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

FLAT = 0.10  # RSS and descriptors may grow by this share after warm-up
WARMUP_S = 300.0  # the first 5 minutes of a process (or a third of its life, if shorter) are warm-up
LONG_LIVED_S = 300.0  # a process that lived this long is held to `FLAT`
CACHE_FULL = 0.9  # a replica's context cache holding this share of its budget is full (LRU eviction under way)

Series = list[tuple[float, float, float]]  # (t, rss_mib, fds) samples of one process
Caches = list[tuple[float, float, float]]  # (t, held_mib, budget_mib) of one process's context cache


def flatness(points: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Growth of one process's figure over `(t, value)` samples after its warm-up."""
    if not points:
        return {"growth": None, "flat": None}
    span = points[-1][0] - points[0][0]
    warm = points[0][0] + min(WARMUP_S, span / 3)
    after = [float(v) for t, v in points if t >= warm]
    if len(after) < 6:
        return {"growth": None, "flat": None, "samples_after_warmup": len(after)}
    base, end = statistics.median(after[:5]), statistics.median(after[-5:])
    growth = (end - base) / base if base else 0.0
    return {"first_after_warmup": base, "last": end, "max": max(after), "growth": round(growth, 4),
            "flat": growth <= FLAT, "samples_after_warmup": len(after), "warmup_ends_s": round(warm, 1)}


def processes(series: dict[str, Series], caches: dict[str, Caches] | None = None) -> dict[str, dict[str, Any]]:
    """Each sampled process: how long it lived (as sampled), its RSS and descriptor growth, whether it is judged.
    `caches`: the context cache fill of the processes that have one (engine replicas), judged as the module says."""
    out: dict[str, dict[str, Any]] = {}
    for label, points in series.items():
        if not points:
            continue
        rss, fds = flatness([(t, r) for t, r, _ in points]), flatness([(t, f) for t, _, f in points])
        lived = points[-1][0] - points[0][0]
        out[label] = {"lived_s": round(lived, 1), "judged": lived >= LONG_LIVED_S,
                      "rss_mib_first": points[0][1], "rss_mib_max": max(p[1] for p in points),
                      "fds_max": max(p[2] for p in points), "rss_growth": rss["growth"], "fds_growth": fds["growth"],
                      "flat": None if rss["flat"] is None else bool(rss["flat"] and fds["flat"])}  # fmt: skip
        fill = (caches or {}).get(label)
        if fill:
            out[label].update(_bounded(points, fill, rss, fds["flat"]))
    return out


def _bounded(points: Series, fill: Caches, rss: dict[str, Any], fds_flat: bool | None) -> dict[str, Any]:
    """A replica's verdict measured from the time its context cache was full (see the module docstring)."""
    held_mib, budget_mib = fill[-1][1], fill[-1][2]
    full_at = next((t for t, held, budget in fill if budget > 0 and held >= CACHE_FULL * budget), None)
    out: dict[str, Any] = {"context_cache_mib": [held_mib, budget_mib], "cache_full_at_s": full_at}
    span = points[-1][0] - points[0][0]
    warm = points[0][0] + min(WARMUP_S, span / 3)  # as `flatness` draws it
    held = [h for t, h, _ in fill if t >= warm]
    if rss.get("first_after_warmup") and len(held) >= 6:  # the growth the cache's own bytes do not account for
        cache_grew = statistics.median(held[-5:]) - statistics.median(held[:5])
        net = (rss["last"] - rss["first_after_warmup"] - cache_grew) / rss["first_after_warmup"]
        out["rss_growth_net_of_cache"] = round(net, 4)
    if full_at is None:
        why = f"its context cache was still filling ({held_mib:.0f} of {budget_mib:.0f} MiB): RSS grows to it"
        out.update(judged=False, flat=None, why=why)
        return out
    start = max(full_at, warm)
    after = [r for t, r, _ in points if t >= start]
    full_s = span - (start - points[0][0])
    if full_s < LONG_LIVED_S / 3 or len(after) < 6:
        out.update(judged=False, flat=None, why=f"its cache was full for only {full_s:.0f} s")
        return out
    base, end = statistics.median(after[:5]), statistics.median(after[-5:])
    growth = (end - base) / base if base else 0.0
    out.update(judged=True, judged_from_s=round(start, 1), rss_growth_after_cache_full=round(growth, 4),
               flat=growth <= FLAT and fds_flat is not False)  # fmt: skip
    return out


LOST = ("acknowledged change lost", "missing after the restart", "not in the store", "edit log is not")
DUPLICATED = ("applied twice", "twice in", "accepted again", "from nowhere", "twice:")
UNTYPED = ("internal", "failed", "no answer", "never ended", "without a close code")


def _count(violations: Sequence[str], words: Sequence[str]) -> int:
    return sum(1 for v in violations if any(w in v for w in words))


def targets(violations: Sequence[str], late: Sequence[str], slowest_after_fault_s: float | None,
            procs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One verdict per acceptance target (`held`), with its figure."""
    lost, duplicated, untyped = _count(violations, LOST), _count(violations, DUPLICATED), _count(violations, UNTYPED)
    judged = {k: v for k, v in procs.items() if v["judged"]}
    grew = sorted(k for k, v in judged.items() if v["flat"] is False)
    return {
        "lost_acknowledged_edits": {"count": lost, "held": lost == 0},
        "duplicated_acknowledged_edits": {"count": duplicated, "held": duplicated == 0},
        "untyped_failures": {"count": untyped, "held": untyped == 0},
        "answered_within_30s_of_fault_end": {"late": len(late), "slowest_s": slowest_after_fault_s,
                                             "held": not late},
        "flat_rss_and_fds": {"processes_judged": len(judged), "grew": grew, "held": not grew,
                             "note": f"processes that lived past {LONG_LIVED_S:.0f} s, within {FLAT:.0%}"},
    }
