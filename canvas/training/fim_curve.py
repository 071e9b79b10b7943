"""The FIM run's curve as a PNG: held-out FIM loss and held-out plain loss against tokens seen (for BENCHMARKS.md).

`python -m canvas.training.fim_curve RUN_DIR [--out PNG]` reads the run's `loss.csv` (`canvas.training.fim_train`)
and plots its evaluation rows; the train losses (window means) are drawn faintly behind. The plain loss's base value
(step 0) is marked with the 2% perplexity bound the fine-tune must stay under; where the log has it, the held-out
plain KL from the anchor's teacher (the base: the drift; Gemma 3: what is left to learn back) is drawn on a
right-hand axis. Needs matplotlib (the `dev` extra).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path


def read_curve(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "loss.csv" if run_dir.is_dir() else run_dir
    with path.open(encoding="utf-8") as fh:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(fh)]


def plot_curve(rows: list[dict[str, float]], out: Path, *, title: str = "FIM fine-tune") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in rows if "valid_fim" in r]
    if not evals:
        raise ValueError("the log has no evaluation rows (valid_fim) yet")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run directory (or its loss.csv)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (RUN/fim_curve.png)")
    args = parser.parse_args(argv)
    out = args.out or (args.run if args.run.is_dir() else args.run.parent) / "fim_curve.png"
    print(plot_curve(read_curve(args.run), out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
