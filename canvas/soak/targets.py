"""The soak's resource figures and its acceptance targets, as the report states them.

Owns `flatness` (RSS or descriptors of one process after its warm-up: the median of its last 5 samples over the
median of its first 5 after warm-up) and `targets`, one verdict per acceptance target of a long soak:
0 lost and 0 duplicated acknowledged edits, 0 untyped failures, every generation answered within 30 s of its
fault's end, RSS and descriptors of every process that lived past `LONG_LIVED_S` flat within `FLAT`.
The violations it sorts come from `canvas.soak.checker`, whose messages name what broke ("lost", "twice", ...).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

FLAT = 0.10  # RSS and descriptors may grow by this share after warm-up
WARMUP_S = 300.0  # the first 5 minutes of a process (or a third of its life, if shorter) are warm-up
LONG_LIVED_S = 300.0  # a process that lived this long is held to `FLAT`

Series = list[tuple[float, float, float]]  # (t, rss_mib, fds) samples of one process


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
            "flat": abs(growth) <= FLAT, "samples_after_warmup": len(after), "warmup_ends_s": round(warm, 1)}


def processes(series: dict[str, Series]) -> dict[str, dict[str, Any]]:
    """Each sampled process: how long it lived (as sampled), its RSS and descriptor growth, whether it is judged."""
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
