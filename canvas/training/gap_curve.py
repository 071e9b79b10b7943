"""The gap denoiser's curve as a PNG: held-out denoising loss per gap size and argmax accuracy against tokens seen.

`python -m canvas.training.gap_curve RUN_DIR [--out PNG]` reads the run's `loss.csv` (`canvas.training.gap_train`)
and plots its evaluation rows (`valid_g8`, `valid_g16`, `valid_g32`: CE on the noised slots; `valid_acc` on a
right-hand axis, the share of noised slots whose argmax is the target: what one pass could commit); the train CE
(window means) is drawn faintly behind. Needs matplotlib (the `dev` extra).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from canvas.training.fim_curve import read_curve

SIZES = ("valid_g8", "valid_g16", "valid_g32")


def plot_curve(rows: list[dict[str, float]], out: Path, *, title: str = "gap denoiser (decoder only)") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in rows if "valid_denoise" in r]
    if not evals:
        raise ValueError("the log has no evaluation rows (valid_denoise) yet")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    train = [(r["tokens"], r["ce"]) for r in rows if "ce" in r and not math.isnan(r["ce"])]
    if train:
        ax.plot(*zip(*train, strict=True), color="tab:gray", alpha=0.3, lw=0.8, label="train CE (noised slots)")
    x = [r["tokens"] for r in evals]
    for key, colour in zip(SIZES, ("tab:blue", "tab:green", "tab:purple"), strict=True):
        if all(key in r for r in evals):
            ax.plot(x, [r[key] for r in evals], "o-", color=colour, ms=3, label=f"held-out, {key[7:]}-token gaps")
    handles, labels = ax.get_legend_handles_labels()
    right = ax.twinx()
    right.plot(x, [r["valid_acc"] for r in evals], "^--", color="tab:red", ms=3, lw=0.8, label="held-out argmax acc")
    right.set_ylabel("argmax accuracy on noised slots")
    more = right.get_legend_handles_labels()
    ax.set_xlabel("tokens seen (prefix + canvas)")
    ax.set_ylabel("cross-entropy on noised slots (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(handles + more[0], labels + more[1], fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run directory (or its loss.csv)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (RUN/gap_curve.png)")
    args = parser.parse_args(argv)
    run_dir = args.run if args.run.is_dir() else args.run.parent
    print(plot_curve(read_curve(args.run), args.out or run_dir / "gap_curve.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
