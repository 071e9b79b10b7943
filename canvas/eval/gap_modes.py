"""Diffusion infill beside AR + FIM per gap size: the table `dcanvas eval --preset gaps` reports and the per-size mode
choice it can write for the server (`--write-gap-modes`).

`gap_table(result)` reads an eval result's infill points (`results`, one per task and variant) into one row per gap
size and mode: fill ratio, seam ratio (with their 90 % intervals), repeated 4-grams beside the human text's,
tokens per forward (accepted tokens / model forwards: decoder passes for diffusion, batched encoder steps for AR),
seconds per fill (batch 1, context encoding included), null share, and the issue 49 bounds each meets
(`DIFFUSION_BOUNDS`: fill and seam ratio at most 2.0, repetition within 5 points of human, 3 tokens a forward).

`choose_gap_modes(table)`: diffusion serves a gap size only where the measurement says so, every other size runs AR:
diffusion and AR were both measured at that size, diffusion's fill and seam ratios are within `DIFFUSION_BOUNDS`, its
repetition is within 5 points of the human text's, it is not degenerate, and by `canvas.eval.choice.quality_loss`
it is no worse than AR among the variants within that size's speed bound (`metrics.speed_bound`; when neither is
within it, both are compared), ties to the faster. `write_gap_modes` stores the choice as
`canvas.sampling.modes.GAP_MODES_FILE` beside the decoder it measured (the served adapter set's directory, else
the model directory, but never a build's top level, whose files the build checks), with that decoder's sha256, so
the server uses it only with the same decoder (`canvas.engine.backend`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from canvas.eval.choice import quality_loss
from canvas.eval.metrics import REPEAT_POINTS, speed_bound
from canvas.eval.report import fmt_ci, fmt_num, fmt_pct
from canvas.sampling.modes import GAP_MODES_FILE, read_gap_modes

# Issue 49's bounds for diffusion infill on the held-out split (speed is compared with AR at the same size).
DIFFUSION_BOUNDS = {"fill_ratio": 2.0, "seam_ratio": 2.0, "repeat_points": REPEAT_POINTS, "tokens_per_forward": 3.0}
_KEYS = ("variant", "samples", "fill_ratio", "fill_ratio_ci", "seam_ratio", "seam_ratio_ci", "repeat_4gram",
         "repeat_4gram_human", "tokens_per_forward", "seconds_per_canvas", "null_share", "degenerate")  # fmt: skip


def _gap(task: str) -> int | None:
    return int(task.removeprefix("infill-")) if task.startswith("infill-") else None


def gap_table(result: dict[str, Any], speed_scale: float = 1.0) -> list[dict[str, Any]]:
    """One row per (gap size, mode) of the result's infill points, at its main settings (the first variant of each
    mode the eval ran: the headline's AR settings come first only when they are the model's own)."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[int, str]] = set()
    for p in result["results"]:
        gap = _gap(p["task"])
        if gap is None or (gap, p["mode"]) in seen:
            continue
        seen.add((gap, p["mode"]))
        bound = speed_bound(p["task"], speed_scale)
        row = {"gap": gap, "mode": p["mode"], **{k: p.get(k) for k in _KEYS}}
        row["seconds_per_fill"] = row.pop("seconds_per_canvas")
        row["within_speed"] = bound is None or row["seconds_per_fill"] <= bound
        row["bounds"] = {
            "fill_ratio": _le(row["fill_ratio"], DIFFUSION_BOUNDS["fill_ratio"]),
            "seam_ratio": _le(row["seam_ratio"], DIFFUSION_BOUNDS["seam_ratio"]),
            "repeat": _le(abs(row["repeat_4gram"] - row["repeat_4gram_human"]), DIFFUSION_BOUNDS["repeat_points"]),
            "tokens_per_forward": not row["tokens_per_forward"] < DIFFUSION_BOUNDS["tokens_per_forward"],
        }
        rows.append(row)
    return sorted(rows, key=lambda r: (r["gap"], r["mode"] != "diffusion"))


def _le(value: float | None, limit: float) -> bool:
    return value is not None and not math.isnan(value) and value <= limit


def choose_gap_modes(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per gap size: the mode that serves it and why (see the module docstring)."""
    out = []
    for gap in sorted({r["gap"] for r in table}):
        by_mode = {r["mode"]: r for r in table if r["gap"] == gap}
        d, a = by_mode.get("diffusion"), by_mode.get("ar")
        mode, why = "ar", ""
        if d is None or a is None:
            why = "not measured in both modes"
        elif d["degenerate"]:
            why = "diffusion degenerate"
        elif not (d["bounds"]["fill_ratio"] and d["bounds"]["seam_ratio"] and d["bounds"]["repeat"]):
            failed = [k for k in ("fill_ratio", "seam_ratio", "repeat") if not d["bounds"][k]]
            why = f"diffusion outside the bounds ({', '.join(failed)})"
        else:
            pool = [r for r in (d, a) if r["within_speed"]] or [d, a]
            losses = {r["mode"]: quality_loss([r]) for r in pool}
            if "diffusion" not in losses:
                why = "diffusion over the speed bound, AR within it"
            elif math.isnan(losses["diffusion"]):
                why = "diffusion unscored"
            else:
                ar_loss = losses.get("ar", math.inf)
                ar_loss = math.inf if math.isnan(ar_loss) else ar_loss
                key = {r["mode"]: (losses[r["mode"]], r["seconds_per_fill"]) for r in pool}
                wins = key["diffusion"] <= key.get("ar", (math.inf, math.inf))
                mode = "diffusion" if wins else "ar"
                why = (f"quality loss {losses['diffusion']:.3f} (diffusion) vs {ar_loss:.3f} (AR), "
                       f"{d['seconds_per_fill']:.2f} s vs {a['seconds_per_fill']:.2f} s per fill")
        out.append({"gap": gap, "mode": mode, "why": why})
    return out


def write_gap_modes(model_dir: Path, decoder: dict[str, Any] | None, choice: list[dict[str, Any]],
                    table: list[dict[str, Any]], measured: dict[str, Any]) -> Path:
    """Write `choice` (with the table it came from and `measured`: data, samples, machine) as GAP_MODES_FILE beside
    the decoder served (see the module docstring); returns its path. It reads back through the server's reader."""
    where = Path(decoder["path"]) if decoder is not None else model_dir
    if decoder is None and (model_dir / "build.json").is_file():
        raise ValueError(f"{model_dir} is a build, whose files its build.json fixes; serve a gap denoiser from its "
                         "decoder_adapters/ (or --decoder-adapters DIR) and measure with it")
    if not choice:
        raise ValueError("no infill gap sizes were measured")
    record = {"sizes": choice, "decoder_sha256": decoder["sha256"] if decoder is not None else None,
              "decoder_step": decoder.get("step") if decoder is not None else None, "table": table,
              "measured": measured}  # fmt: skip
    path = where / GAP_MODES_FILE
    path.write_text(json.dumps(record, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    read_gap_modes(where)  # what was written reads back (raises on a bad value)
    return path


def gap_markdown(table: list[dict[str, Any]], choice: list[dict[str, Any]]) -> str:
    """The per-gap table beside the mode each size would serve."""
    chosen = {c["gap"]: c for c in choice}
    lines = ["### Diffusion infill vs AR per gap size", "",
             "| gap | mode | fill ratio | seam ratio | rep. 4-grams (human) | tok/forward | s/fill | null | serves |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in table:
        serves = chosen[r["gap"]]["mode"] == r["mode"]
        lines.append(f"| {r['gap']} | {r['variant']}{' (degenerate)' if r['degenerate'] else ''} "
                     f"| {fmt_ci(r['fill_ratio'], r['fill_ratio_ci'])} | {fmt_ci(r['seam_ratio'], r['seam_ratio_ci'])} "
                     f"| {fmt_pct(r['repeat_4gram'])} ({fmt_pct(r['repeat_4gram_human'])}) "
                     f"| {fmt_num(r['tokens_per_forward'])} | {fmt_num(r['seconds_per_fill'])} "
                     f"| {fmt_pct(r['null_share'])} | {'yes' if serves else ''} |")
    lines += ["", *(f"- {c['gap']} tokens: {c['mode']} ({c['why']})" for c in choice), ""]
    return "\n".join(lines)
