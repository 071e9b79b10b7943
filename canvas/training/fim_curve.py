"""The FIM run's curve as a PNG: held-out FIM loss and held-out plain loss against tokens seen (for BENCHMARKS.md).

`python -m canvas.training.fim_curve RUN_DIR [--out PNG]` reads the run's `loss.csv` (`canvas.training.fim_train`)
and plots its evaluation rows; the train losses (window means) are drawn faintly behind. The plain loss's base value
(step 0) is marked with the 2% perplexity bound the fine-tune must stay under; where the log has it, the held-out
plain KL from the anchor's teacher (the base: the drift; Gemma 3: what is left to learn back) is drawn on a
right-hand axis. Where the run has checkpoint evaluations (`RUN/evals.json`, `canvas.training.fim_evalpoint`), a
second panel beside it shows their seam ratios against the same tokens: per split and gap, FIM on solid and FIM off
dashed, with the issues' bounds (1.3 and 1.8). Needs matplotlib (the `dev` extra).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

EVALS = "evals.json"  # canvas.training.fim_evalpoint's rows (not imported: the plot needs no torch)


def read_curve(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "loss.csv" if run_dir.is_dir() else run_dir
    with path.open(encoding="utf-8") as fh:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(fh)]


def read_evals(path: Path) -> list[dict[str, Any]]:
    """The checkpoint evaluations (`fim_evalpoint`'s rows) in `path`, [] when there are none yet."""
    if not path.is_file():
        return []
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows")
    return rows


def seam_series(points: list[dict[str, Any]]) -> dict[tuple[str, int, bool], list[tuple[float, float]]]:
    """(split, gap, FIM on) -> [(tokens, seam ratio)] in token order, over the rows' cells (one settings' rows)."""
    out: dict[tuple[str, int, bool], list[tuple[float, float]]] = {}
    for row in sorted(points, key=lambda r: r["tokens"]):
        for c in row["cells"]:
            if not math.isnan(c["seam_ratio"]):
                out.setdefault((c["split"], c["gap"], c["fim"]), []).append((row["tokens"], c["seam_ratio"]))
    return out


def plot_curve(rows: list[dict[str, float]], out: Path, *, title: str = "FIM fine-tune",
               points: list[dict[str, Any]] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in rows if "valid_fim" in r]
    if not evals:
        raise ValueError("the log has no evaluation rows (valid_fim) yet")
    if points:
        fig, (ax, seams) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120)
        _plot_seams(seams, points)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for key, colour, label in (("fim", "tab:blue", "train FIM"), ("plain", "tab:orange", "train plain")):
        train = [(r["tokens"], r[key]) for r in rows if key in r and not math.isnan(r[key])]
        if train:
            ax.plot(*zip(*train, strict=True), color=colour, alpha=0.25, lw=0.8, label=label)
    x = [r["tokens"] for r in evals]
    ax.plot(x, [r["valid_fim"] for r in evals], "o-", color="tab:blue", ms=3, label="held-out FIM (middle + <end>)")
    ax.plot(x, [r["valid_plain"] for r in evals], "s-", color="tab:orange", ms=3, label="held-out plain AR")
    base = evals[0]["valid_plain"]
    ax.axhline(base + math.log(1.02), color="tab:orange", ls=":", lw=0.8, label="plain: base + 2% perplexity")
    kl = [(r["tokens"], r["valid_plain_kl"]) for r in evals if "valid_plain_kl" in r]
    handles, labels = ax.get_legend_handles_labels()
    if kl:
        right = ax.twinx()
        right.plot(*zip(*kl, strict=True), "^--", color="tab:red", ms=3, lw=0.8,
                   label="held-out plain KL from the teacher")
        right.set_ylabel("KL (nats / token)")
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(handles, labels, fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def _plot_seams(ax: Any, points: list[dict[str, Any]]) -> None:
    colours = {("valid", 32): "tab:blue", ("valid", 64): "tab:green", ("outside", 32): "tab:purple",
               ("outside", 64): "tab:red"}  # fmt: skip
    for (split, gap, fim), series in sorted(seam_series(points).items()):
        ax.plot(*zip(*series, strict=True), "o-" if fim else "s--", ms=4, lw=1.0 if fim else 0.8,
                color=colours.get((split, gap), "tab:gray"), label=f"{split} {gap}, FIM {'on' if fim else 'off'}")
    ax.axhline(1.3, color="black", ls=":", lw=0.8, label="issue 30 bound (1.3)")
    ax.axhline(1.8, color="gray", ls=":", lw=0.8, label="issue 29 bound (1.8)")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("seam ratio (judge ppl after the gap, model / human)")
    ax.set_title("checkpoint evals: seam ratio, K drafts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run directory (or its loss.csv)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (RUN/fim_curve.png)")
    parser.add_argument("--evals", type=Path, default=None, help=f"checkpoint evaluations (RUN/{EVALS})")
    args = parser.parse_args(argv)
    run_dir = args.run if args.run.is_dir() else args.run.parent
    out = args.out or run_dir / "fim_curve.png"
    points = read_evals(args.evals or run_dir / EVALS)
    if points:  # one line per setting: the settings most checkpoints were measured with
        keys = [json.dumps(r["settings"], sort_keys=True) for r in points]
        main_key = max(keys, key=keys.count)
        points = [r for r, k in zip(points, keys, strict=True) if k == main_key]
    print(plot_curve(read_curve(args.run), out, points=points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
