"""One point of the FIM run's quality curve: a checkpoint's held-out FIM loss and `dcanvas eval`'s infill figures with
FIM on and off, appended as one row to the run's `evals.json` (issue 30 item 4).

`python -m canvas.training.fim_evalpoint RUN --texts FILE [--samples 12 --outside-samples 8 --threads 2]`:
1. loads the run's checkpoint (`FimTrainer`, no teacher: nothing trains) and measures the held-out FIM and plain
   cross-entropy on the same validation rows the run's own eval reads (`heldout_losses`);
2. exports its adapters and merges them into a copy of the build without FIM adapters (`--base-build`, default the
   run's base; `canvas.convert.build.build_with_fim`, under `--cache`): nothing is committed or rebuilt;
3. runs the eval's evaluator on that copy: AR infills with K drafts, FIM on and off side by side on the same
   samples, per gap, on the validation split and on `--texts` (text outside the corpus);
4. appends `{step, tokens, valid_fim, valid_plain, settings, cells: [{split, gap, fim, fill_ratio, seam_ratio,
   repeat_4gram, repeat_4gram_human, null_share, seconds}]}` to `RUN/evals.json` (or `--out`); a row of the same
   step and settings is replaced, so a rerun never doubles a point. Each split's full eval result (with the example
   fills) goes beside it as `<out stem>-<step>-<split>.json`.
Invariant: the run directory is only read unless `--out` points into it (the default), so a snapshot of a live run
can be measured while the run trains. `canvas.training.fim_curve` plots the rows' seam ratios beside the loss curve.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from canvas.training.fim import FimDataConfig, sample_rows
from canvas.training.fim_train import VALID_FIM_STREAM, VALID_PLAIN_STREAM, FimTrainer, packed_losses

if TYPE_CHECKING:
    from canvas.eval.judge import Judge

EVALS = "evals.json"


@dataclass(frozen=True, slots=True)
class EvalPointConfig:
    samples: int = 12  # per task on the validation split (the issues' acceptance set)
    outside_samples: int = 8  # per task on --texts; 0: validation split only
    gaps: tuple[int, ...] = (32, 64)  # the issues' two gap sizes
    ar_drafts: int = 8  # K: the FIM path is judged as it serves, drafting K and choosing by the seam score
    ar_temperature: float = 0.8  # the FIM build's measured default (BENCHMARKS.md, issue 29/30)
    ar_seam_tokens: int | None = None  # None: the model's setting
    seed: int = 0  # the eval's passage choice and sampler seeds: every point reads the same samples

    def __post_init__(self) -> None:
        if self.samples < 1 or self.outside_samples < 0:
            raise ValueError(f"samples must be >= 1 and outside_samples >= 0, got {self.samples}, "
                             f"{self.outside_samples}")  # fmt: skip
        if not self.gaps or any(g < 1 for g in self.gaps):
            raise ValueError(f"gaps must be one or more positive sizes, got {self.gaps}")
        if self.ar_drafts < 1 or (self.ar_seam_tokens is not None and self.ar_seam_tokens < 1):
            raise ValueError("ar_drafts and ar_seam_tokens must be >= 1")
        if not self.ar_temperature > 0:
            raise ValueError(f"ar_temperature must be > 0, got {self.ar_temperature}")

    def settings(self) -> dict[str, Any]:
        """What makes two rows of one step comparable (the key a rerun replaces)."""
        return {k: v for k, v in asdict(self).items() if k != "gaps"} | {"gaps": list(self.gaps)}


@torch.no_grad()
def heldout_losses(trainer: FimTrainer) -> dict[str, float]:
    """Held-out FIM and plain cross-entropy (token means) on the rows `FimTrainer.evaluate` reads: the same streams,
    seeds and batch count, so the figures equal the run's own `valid_fim` / `valid_plain` at that step."""
    trainer.model.eval()
    out: dict[str, float] = {}
    for key, stream, rate in (("valid_fim", VALID_FIM_STREAM, 1.0), ("valid_plain", VALID_PLAIN_STREAM, 0.0)):
        data = FimDataConfig(**{**asdict(trainer.cfg.data), "fim_rate": rate})
        total, count = 0.0, 0
        for i in range(trainer.cfg.eval_batches):
            batch = sample_rows(trainer.valid_data, data, trainer.cfg.batch_size, trainer.cfg.seed, i, stream)
            with trainer.autocast():
                ce, _ = packed_losses(trainer.model, trainer.rows, batch.to(trainer.device))
            total, count = total + float(ce.sum()), count + int(ce.numel())
        out[key] = total / max(1, count)
    return out


def cells(result: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """One cell per (gap, FIM on/off) of an eval result: the figures the curve and the tables read."""
    out = []
    for p in result["results"]:
        if not p["task"].startswith("infill-"):
            continue
        out.append({"split": split, "gap": int(p["task"].split("-", 1)[1]), "fim": bool(p["fim"]),
                    "samples": p["samples"], "fill_ratio": p["fill_ratio"], "seam_ratio": p["seam_ratio"],
                    "repeat_4gram": p["repeat_4gram"], "repeat_4gram_human": p["repeat_4gram_human"],
                    "null_share": p["null_share"], "seconds": p["seconds_per_canvas"]})  # fmt: skip
    return out


def append_row(path: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Add `row` to the JSON list in `path` (made if absent), replacing a row of the same step and settings; rows
    stay in step order."""
    rows: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of rows")
    rows = [r for r in rows if (r.get("step"), r.get("settings")) != (row["step"], row["settings"])]
    rows.append(row)
    rows.sort(key=lambda r: (r["step"], json.dumps(r["settings"], sort_keys=True)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    return rows


def measure_build(model_dir: Path, docs: list[tuple[str, str]], cfg: EvalPointConfig, samples: int, judge: Judge,
                  threads: int) -> dict[str, Any]:
    """The eval on `model_dir` (a build with FIM adapters): AR infills only, FIM on and off side by side."""
    from canvas.engine.backend import load_backend
    from canvas.eval.evaluate import PRESETS, evaluate

    ecfg = replace(PRESETS["default"], samples=samples, seed=cfg.seed, gaps=cfg.gaps, modes=("ar",),
                   ar_drafts=(cfg.ar_drafts,), ar_temperature=(cfg.ar_temperature,), fim=(True, False),
                   ar_seam_tokens=() if cfg.ar_seam_tokens is None else (cfg.ar_seam_tokens,),
                   continuation=False, sweep_task="")  # fmt: skip
    backend = load_backend(model_dir, max_batch=1, threads=threads)
    return evaluate(backend, judge, docs, ecfg)


def evalpoint(run_dir: Path, cfg: EvalPointConfig, *, base_build: Path | None, texts: Path | None, data: Path,
              cache: Path, out: Path, judge: Judge, threads: int, log: Any = print) -> dict[str, Any]:
    """Measure the run's checkpoint (see the module docstring) and append its row to `out`; returns the row."""
    from canvas.convert.build import build_with_fim
    from canvas.eval.samples import read_documents, read_texts
    from canvas.training.fim_train import export_fim_adapters
    from canvas.training.train_cli import resolve_fim_config

    if cfg.outside_samples and texts is None:
        raise ValueError("outside_samples > 0 needs --texts (held-out text outside the corpus)")
    t0 = time.perf_counter()
    fim_cfg = resolve_fim_config(run_dir, argparse.Namespace())
    # No teacher and no anchor: the held-out CE reads neither, and Gemma 3 need not be loaded.
    trainer = FimTrainer(run_dir, replace(fim_cfg, plain_anchor=0.0))
    if not trainer.load():
        raise FileNotFoundError(f"{run_dir}: no checkpoint.pt")
    step, tokens = trainer.state.step, trainer.state.tokens_seen
    log(f"{run_dir}: step {step}, {tokens:,} tokens; held-out losses")
    row: dict[str, Any] = {"step": step, "tokens": tokens, **heldout_losses(trainer)}
    adapters = export_fim_adapters(trainer, cache / "adapters" / f"step-{step}")
    del trainer
    base = base_build or Path(fim_cfg.base)
    model_dir = build_with_fim(base, adapters, cache / "models" / f"{base.name}-fim-step-{step}")
    log(f"built {model_dir}")
    splits: list[tuple[str, list[tuple[str, str]], int]] = [("valid", read_documents(data), cfg.samples)]
    if cfg.outside_samples and texts is not None:
        splits.append(("outside", read_texts(texts), cfg.outside_samples))
    row["cells"] = []
    for split, docs, n in splits:
        log(f"eval on {split}: {n} samples a task, gaps {list(cfg.gaps)}, K={cfg.ar_drafts}, FIM on/off")
        result = measure_build(model_dir, docs, cfg, n, judge, threads)
        result["data"] = str(texts if split == "outside" else data)
        full = out.with_name(f"{out.stem}-{step}-{split}.json")
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(json.dumps(result, indent=1, allow_nan=True) + "\n", encoding="utf-8")
        row["cells"] += cells(result, split)
    row["settings"] = cfg.settings()
    row["texts"] = str(texts) if texts is not None else None
    row["threads"] = threads
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    append_row(out, row)
    return row


def table(row: dict[str, Any]) -> str:
    """The row as a markdown table (one line per split, gap and FIM setting)."""
    lines = [f"step {row['step']} ({row['tokens']:,} tokens): held-out FIM loss {row['valid_fim']:.3f}, plain "
             f"{row['valid_plain']:.3f}", "",
             "| split | gap | FIM | fill ratio | seam ratio | repeated 4-grams (human) | null share | s per infill |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for c in row["cells"]:
        lines.append(f"| {c['split']} | {c['gap']} | {'on' if c['fim'] else 'off'} | {c['fill_ratio']:.2f} | "
                     f"{c['seam_ratio']:.2f} | {c['repeat_4gram']:.0%} ({c['repeat_4gram_human']:.0%}) | "
                     f"{c['null_share']:.0%} | {c['seconds']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from canvas.eval.evaluate import DEFAULT_DATA, parse_ints
    from canvas.eval.judge import JudgeError, load_judge
    from canvas.eval.samples import EvalError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the FIM run directory (a copy of a live run's is safest)")
    parser.add_argument("--texts", type=Path, default=None, help="held-out text outside the corpus (JSONL with a "
                        "'text' per line), e.g. the probe set's news and fiction")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"validation split (default {DEFAULT_DATA})")
    parser.add_argument("--base-build", type=Path, default=None, help="the build without FIM adapters to merge into "
                        "(default: the run's base)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fimeval-cache"),
                        help="where the exported adapters and the merged build go (default /tmp/fimeval-cache)")
    parser.add_argument("--out", type=Path, default=None, help=f"the rows' JSON (default RUN/{EVALS})")
    parser.add_argument("--samples", type=int, default=12, help="samples per task, validation split (12)")
    parser.add_argument("--outside-samples", type=int, default=8, help="samples per task on --texts (8; 0: none)")
    parser.add_argument("--gaps", type=parse_ints, default=(32, 64), help="gap sizes (32,64)")
    parser.add_argument("--ar-drafts", type=int, default=8, help="K (8)")
    parser.add_argument("--ar-temperature", type=float, default=0.8, help="draft temperature (0.8)")
    parser.add_argument("--ar-seam-tokens", type=int, default=None, help="seam tokens (the model's setting)")
    parser.add_argument("--judge", type=Path, default=None, help="judge (default: SmolLM2, as `dcanvas eval`)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    args = parser.parse_args(argv)
    try:
        cfg = EvalPointConfig(samples=args.samples, outside_samples=args.outside_samples, gaps=tuple(args.gaps),
                              ar_drafts=args.ar_drafts, ar_temperature=args.ar_temperature,
                              ar_seam_tokens=args.ar_seam_tokens)  # fmt: skip
        torch.set_num_threads(max(1, args.threads))
        judge = load_judge(args.judge)
        row = evalpoint(args.run, cfg, base_build=args.base_build, texts=args.texts, data=args.data,
                        cache=args.cache, out=args.out or args.run / EVALS, judge=judge, threads=max(1, args.threads))
    except (ValueError, FileNotFoundError, EvalError, JudgeError) as exc:
        print(f"fim_evalpoint: {exc}")
        return 2
    print(table(row))
    return 0 if all(not math.isnan(c["seam_ratio"]) for c in row["cells"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
