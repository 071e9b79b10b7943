"""`dcanvas train`'s command line: options, the run's config from them, and what one invocation does.

Owns the flags and their mapping onto `TrainConfig` (`resolve_config`: the run's saved config, overridden by the
options given) and `run` (train, bench or export one run directory). The training itself is `canvas.training.train`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from canvas.env import KERNELS
from canvas.training.fim_train import FimTrainConfig
from canvas.training.tokens import file_sha256
from canvas.training.train import MODEL_SHAPES, TrainConfig, Trainer

_OVERRIDES = (
    "model", "tokens_dir", "tokenizer_dir", "corpus_dir", "seed", "batch_size", "lr", "warmup_steps", "max_steps",
    "log_every", "eval_every", "checkpoint_minutes", "base", "lora_rank", "bf16",
)  # fmt: skip


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", type=Path, default=None,
                        help="run directory (resumes if present; runs/canvas-6m, or runs/fim for --objective fim)")
    parser.add_argument("--objective", choices=("diffusion", "fim", "gap-denoise"), default="diffusion",
                        help="diffusion (the DiffusionGemma recipe), fim (the FIM fine-tune of --base, "
                        "canvas.training.fim_train) or gap-denoise (the decoder's gap denoiser on the frozen --base, "
                        "canvas.training.gap_train)")
    parser.add_argument("--teacher-weight", dest="teacher_weight", type=float, default=None,
                        help="gap-denoise: middle slots' weight on KL from the FIM teacher (0.5)")
    parser.add_argument("--logit-shift", dest="logit_shift", choices=("on", "off"), default=None,
                        help="gap-denoise, a new run: slot i read from hidden state i-1, as the AR head (on)")
    parser.add_argument("--fim-rate", dest="fim_rate", type=float, default=None, help="fim: share of FIM pieces (0.5)")
    parser.add_argument("--plain-anchor", dest="plain_anchor", type=float, default=None,
                        help="fim, a new run: plain targets' weight on KL from the teacher, the rest hard CE (0.8)")
    parser.add_argument("--plain-teacher", dest="plain_teacher", choices=("gemma3", "base"), default=None,
                        help="fim, a new run: whose distribution the anchor keeps (gemma3: the original)")
    parser.add_argument("--seq-len", dest="seq_len", type=int, default=None, help="fim: packed row length (512)")
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default=None, help="model shape (canvas-6m)")
    parser.add_argument("--tokens-dir", dest="tokens_dir", default=None, help="token arrays (data/tokens; fim: "
                        "data/tokens-fim-<vocab>k, after the base's vocabulary)")
    parser.add_argument("--tokenizer-dir", dest="tokenizer_dir", default=None, help="tokenizer (data/tokenizer)")
    parser.add_argument("--corpus-dir", dest="corpus_dir", default=None, help="corpus with manifest (data/corpus)")
    parser.add_argument("--base", default=None, help="fine-tune this converted model (`dcanvas model build`'s "
                        "directory) under low-rank adapters instead of training --model from scratch")
    parser.add_argument("--lora-rank", dest="lora_rank", type=int, default=None, help="adapter rank (16)")
    parser.add_argument("--bf16", action="store_true", default=None, help="autocast matmuls to bf16")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=None)
    parser.add_argument("--max-steps", dest="max_steps", type=int, default=None, help="length of the lr schedule")
    parser.add_argument("--log-every", dest="log_every", type=int, default=None)
    parser.add_argument("--eval-every", dest="eval_every", type=int, default=None)
    parser.add_argument("--checkpoint-minutes", dest="checkpoint_minutes", type=float, default=None)
    parser.add_argument("--max-minutes", type=float, default=None, help="stop this invocation after N minutes")
    parser.add_argument("--stop-at-step", type=int, default=None, help="stop this invocation at step N")
    # One thread by default: on the shared 2-core machine, two torch threads next to other busy processes ran
    # a training step ~10x slower than one thread (the threads wait on each other at every op).
    parser.add_argument("--init", type=Path, default=None,
                        help="a new run starts from this exported model (weights, step and loss curve)")
    parser.add_argument("--init-from", dest="init_from", type=Path, default=None,
                        help="fim, a new run: start from this FIM run's adapters and sentinel rows (its checkpoint.pt; "
                        "fresh optimizer state, step 0, warm-up again); that run is only read")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--bench", action="store_true", help="print the decoder latency of the model and exit (fim: "
                        "training tokens/s, FLOPs per token and the matmul rate)")
    parser.add_argument("--export", type=Path, default=None, help="after training, export to this directory")
    parser.add_argument("--export-only", action="store_true", help="export the run's checkpoint, do not train "
                        "(fim: to --export or canvas/assets/gemma3-fim-adapters)")
    parser.set_defaults(func=run)


def resolve_config(run_dir: Path, args: argparse.Namespace) -> TrainConfig:
    """The run's saved config (or the defaults for a new run) with the options given on the command line."""
    saved = run_dir / "train_config.json"
    base = TrainConfig.from_json(json.loads(saved.read_text(encoding="utf-8"))) if saved.exists() else TrainConfig()
    changes = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k, None) is not None}
    return dataclasses.replace(base, **changes)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    torch.set_num_threads(max(1, args.threads))
    if args.objective == "fim":
        return run_fim(args, console)
    if args.objective == "gap-denoise":
        from canvas.training.gap_train import run_gap

        if args.logit_shift is not None:
            args.logit_shift = args.logit_shift == "on"
        return run_gap(args, console)
    args.run = args.run or Path("runs/canvas-6m")
    if args.device != "cpu":
        # The Triton kernels have no backward; training runs the torch references (the CPU path anyway).
        os.environ[KERNELS.name] = "ref"
    try:
        cfg = resolve_config(args.run, args)
        trainer = Trainer(args.run, cfg, device=args.device)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    resumed = trainer.load()
    if args.init is not None and not resumed:
        try:
            trainer.warm_start(args.init)
        except (ValueError, FileNotFoundError, OSError) as exc:
            console.print(f"[red]error:[/red] --init: {exc}")
            return 2
        cfg = trainer.cfg
        state = trainer.state
        console.print(f"warm start from {args.init} at step {state.step} ({state.tokens_seen:,} tokens)")
    if args.bench:
        from canvas.training.export import measure_decoder_ms

        n = sum(p.numel() for p in trainer.model.parameters())
        console.print(f"{cfg.model}: {n / 1e6:.2f}M parameters; decoder step {measure_decoder_ms(trainer.model)}")
        return 0
    if not args.export_only:
        args.run.mkdir(parents=True, exist_ok=True)
        (args.run / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n", encoding="utf-8")
        n = sum(p.numel() for p in trainer.model.parameters())
        what = f"resuming at step {trainer.state.step}" if resumed else "new run"
        shape = f"{cfg.base} (adapters rank {cfg.lora_rank})" if cfg.base else cfg.model
        console.print(f"{args.run}: {what}; {shape} {n / 1e6:.2f}M params, batch {cfg.batch_size}, "
                      f"tokens {file_sha256(Path(cfg.tokens_dir) / 'train.bin')[:12]}")  # fmt: skip
        trainer.fit(max_minutes=args.max_minutes, stop_at_step=args.stop_at_step, console=console)
    if args.export is not None:
        from canvas.training.export import export_run

        if not resumed and args.export_only:
            console.print(f"[red]error:[/red] no checkpoint in {args.run}")
            return 2
        if cfg.base is not None:
            from canvas.training.adapt import export_base_run

            out = export_base_run(Path(cfg.base), trainer.model, trainer.state.history, args.export)
        else:
            out = export_run(trainer, args.export)
        console.print(f"exported to {out}")
    return 0


_FIM_OVERRIDES = ("base", "tokens_dir", "corpus_dir", "seed", "batch_size", "lr", "warmup_steps", "max_steps",
                  "log_every", "eval_every", "checkpoint_minutes", "lora_rank", "bf16", "plain_anchor",
                  "plain_teacher")


def resolve_fim_config(run_dir: Path, args: argparse.Namespace) -> FimTrainConfig:
    """The FIM run's saved config (or the defaults; a new run needs --base) with the options given."""
    saved = run_dir / "train_config.json"
    changes = {k: getattr(args, k) for k in _FIM_OVERRIDES if getattr(args, k, None) is not None}
    data = {k: getattr(args, k) for k in ("fim_rate", "seq_len") if getattr(args, k, None) is not None}
    if saved.exists():
        cfg = FimTrainConfig.from_json(json.loads(saved.read_text(encoding="utf-8")))
    elif "base" in changes:
        from canvas.training.fim_train import fim_tokens_dir

        # A new run records its token cache: the one its base's vocabulary names unless --tokens-dir says otherwise.
        cfg = FimTrainConfig(base=changes["base"], tokens_dir=str(fim_tokens_dir(changes["base"])))
    else:
        raise ValueError("a new FIM run needs --base MODEL_DIR (the converted model, `dcanvas model build`)")
    return dataclasses.replace(cfg, **changes, data=dataclasses.replace(cfg.data, **data))


def init_fim_from(trainer: Any, other: Path) -> int:
    """Load another FIM run's adapters and sentinel rows into a new run's trainer (same base, rank and targets);
    the optimizer, step and curve stay the new run's own. Returns the other run's step."""
    from canvas.training.fim_train import load_fim_tensors

    path = other / "checkpoint.pt" if other.is_dir() else other
    if not path.exists():
        raise FileNotFoundError(f"no {path}")
    payload = torch.load(path, map_location=trainer.device, weights_only=False)
    if payload["model_config"] != trainer.model.config.to_hf_dict():
        raise ValueError(f"{path} was trained on another base than {trainer.cfg.base}")
    load_fim_tensors(trainer.model, trainer.rows, payload["adapters"])
    return int(payload["state"]["step"])


def run_fim(args: argparse.Namespace, console: Any) -> int:
    from canvas.convert.build import FIM_ADAPTERS
    from canvas.training.fim_train import FimTrainer, export_fim_adapters

    run_dir = args.run or Path("runs/fim")
    if args.device != "cpu":
        os.environ[KERNELS.name] = "ref"  # the Triton kernels have no backward
    try:
        cfg = resolve_fim_config(run_dir, args)
        trainer = FimTrainer(run_dir, cfg, device=args.device)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    resumed = trainer.load()
    if getattr(args, "init_from", None) is not None and not resumed:
        try:
            step = init_fim_from(trainer, args.init_from)
        except (ValueError, FileNotFoundError, KeyError) as exc:
            console.print(f"[red]error:[/red] --init-from: {exc}")
            return 2
        console.print(f"{run_dir}: adapters and sentinel rows from {args.init_from} (its step {step}); fresh optimizer")
    if args.bench:
        from canvas.training.fim_bench import bench

        console.print(f"FIM fine-tune step ({'bf16' if trainer.bf16 else 'fp32'}, batch {cfg.batch_size} x "
                      f"{cfg.data.seq_len}): {bench(trainer)}")
        return 0
    if args.export_only:
        if not resumed:
            console.print(f"[red]error:[/red] no checkpoint in {run_dir}")
            return 2
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n", encoding="utf-8")
        n = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad) + trainer.rows.rows.numel()
        what = f"resuming at step {trainer.state.step}" if resumed else "new run"
        console.print(f"{run_dir}: {what}; FIM fine-tune of {cfg.base}: {n / 1e6:.2f}M trained parameters (rank "
                      f"{cfg.lora_rank} on {', '.join(cfg.targets)}, sentinel rows), batch {cfg.batch_size} x "
                      f"{cfg.data.seq_len}, {'bf16' if trainer.bf16 else 'fp32'}, {torch.get_num_threads()} thread(s)")
        trainer.fit(max_minutes=args.max_minutes, stop_at_step=args.stop_at_step, console=console)
    if args.export_only or args.export is not None:
        out = export_fim_adapters(trainer, args.export or FIM_ADAPTERS)
        console.print(f"exported the FIM adapters (step {trainer.state.step}) to {out}")
    return 0
