"""What `dcanvas eval --write-defaults` makes a model's defaults: its default mode per kind of request (and the AR
settings chosen) from measured quality, and diffusion's step budget and entropy bound from the sweep.

The mode rule, per kind (infill: every `infill-G` task; continuation): among the variants run (a mode with its AR
settings) whose fills the judge could score, drop the degenerate ones (any task flagged) as long as a sound one has
its fill ratio within the target range on every task (when none has, every run is off in its own way, loops or
noise, and they are all ranked); keep those within the speed bounds (`eval_metrics.speed_bound` on every task of
the kind; when none is, the bounds assume a faster machine and all are kept, the choice saying so); the best
quality wins, ties to the faster. Quality is a loss, the mean over the kind's tasks of |ln fill ratio| +
max(0, ln seam ratio): a fill is as far from human-like above as below, and a seam only counts against a fill when
it is harder to read than after the human text. A kind keeps the model's current default when nothing could be
scored or only one mode was run (nothing was compared). The AR settings written are the infill choice's when it is
AR (they matter most there: the suffix scoring), else the continuation's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from canvas.eval.metrics import AR_SETTINGS, FILL_RANGE, speed_bound
from canvas.eval.samples import CONTINUATION
from canvas.sampling.modes import MODE_KEYS, Kind, load_mode_defaults, write_extra
from canvas.sampling.sampler import SamplerConfig, load_sampler_defaults


def quality_loss(points: Sequence[dict[str, Any]]) -> float:
    """The loss of one variant over one kind's tasks (lower is better); NaN when a fill ratio is unmeasured."""
    total = 0.0
    for p in points:
        fill, seam = p["fill_ratio"], p["seam_ratio"]
        if not fill > 0:  # NaN (nothing scored) or zero
            return math.nan
        total += abs(math.log(fill)) + (max(0.0, math.log(seam)) if seam > 0 else 0.0)
    return total / len(points)


def choose_defaults(results: Sequence[dict[str, Any]], speed_scale: float = 1.0) -> dict[str, Any]:
    """The best variant per kind (see the module docstring) from the eval's `results` (one dict per task and
    variant at the main settings). Returns {kind: choice or None, "candidates": [...]}, where a choice holds the
    variant, its mode and AR settings, its loss and whether it met the speed bounds."""
    by_variant: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in results:
        kind = "continuation" if p["task"] == CONTINUATION else "infill"
        by_variant.setdefault((kind, p["variant"]), []).append(p)
    out: dict[str, Any] = {"candidates": []}
    lo, hi = FILL_RANGE
    for kind in ("infill", "continuation"):
        rows = []
        for (k, label), points in by_variant.items():
            if k != kind:
                continue
            loss = quality_loss(points)
            bounds = [(p["seconds_per_canvas"], speed_bound(p["task"], speed_scale)) for p in points]
            row = {"kind": kind, "variant": label, "mode": points[0]["mode"], "loss": loss,
                   "degenerate": any(p["degenerate"] for p in points),
                   "fill_in_range": all(lo <= p["fill_ratio"] <= hi for p in points),
                   "within_speed": all(b is None or s <= b for s, b in bounds),
                   "seconds": sum(p["seconds_per_canvas"] for p in points) / len(points),
                   **{s: points[0].get(s) for s in AR_SETTINGS}}  # fmt: skip
            out["candidates"].append(row)
            if not math.isnan(loss):
                rows.append(row)
        sound = [r for r in rows if not r["degenerate"]]
        # Degenerate runs are out while a sound one reads like human text (fill ratio in range); when none does,
        # every run is wrong in its own way and the loss alone ranks them (loops against noise, say).
        pool = sound if any(r["fill_in_range"] for r in sound) else rows
        pool = [r for r in pool if r["within_speed"]] or pool
        out[kind] = min(pool, key=lambda r: (r["loss"], r["seconds"])) if pool else None
    return out


def operating_point(sweep: dict[str, Any]) -> dict[str, Any]:
    """The sweep point to make a model's default: the fastest (most tokens per forward) whose judge perplexity is
    within 10% of the best point's. Quality first, then speed; the reference settings get no special standing."""
    points = sweep["points"]
    best = min(p["judge_ppl"] for p in points)
    good = [p for p in points if p["judge_ppl"] <= 1.1 * best]
    return max(good, key=lambda p: (p["tokens_per_forward"], -p["judge_ppl"]))


def write_operating_point(model_dir: Path, point: dict[str, Any]) -> SamplerConfig:
    """Make `point`'s step budget and entropy bound the model's defaults in its generation_config.json (the other
    keys of the file are kept)."""
    path = model_dir / "generation_config.json"
    current = load_sampler_defaults(model_dir)
    chosen = replace(current, max_steps=int(point["max_steps"]), entropy_bound=float(point["entropy_bound"]))
    raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    raw.update(chosen.to_generation_config())
    path.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    return chosen


def write_defaults(model_dir: Path, choice: dict[str, Any], sweep: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `choose_defaults`' choice into the model directory (the default modes and AR settings into its
    `EXTRA_FILE`; a kind without a choice keeps its current default) and, given a sweep, its operating point.
    Returns what was written."""
    current = load_mode_defaults(model_dir)
    kinds: tuple[Kind, ...] = ("infill", "continuation")
    written: dict[str, Any] = {}
    for k in kinds:
        compared = {c["mode"] for c in choice["candidates"] if c["kind"] == k}
        # A run of one mode (a diffusion-only sweep, say) measured no choice of mode: the stored one stays.
        measured = choice[k] is not None and len(compared) > 1
        written[MODE_KEYS[k]] = choice[k]["mode"] if measured else getattr(current, k)
    ar = next((choice[k] for k in kinds if choice[k] is not None and choice[k]["mode"] == "ar"), None)
    if ar is not None:
        written |= {s: ar[s] for s in AR_SETTINGS if ar.get(s) is not None}
        if written.get("fim"):  # FIM on is stored as null (on when the model has the format), never true: a build
            written["fim"] = None  # without FIM adapters would then refuse AR infills
    write_extra(model_dir, written)
    load_mode_defaults(model_dir)  # what was written reads back (raises on a bad value)
    if sweep:
        chosen = write_operating_point(model_dir, operating_point(sweep))
        written |= {"max_steps": chosen.max_steps, "entropy_bound": chosen.entropy_bound}
    return written
