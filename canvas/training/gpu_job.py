"""One call on a lent GPU trains a model variant; `unpack` brings it back as an ordinary run directory.

    # on the device machine, from the repository root, with data/tokens and data/tokenizer carried:
    python3 -m canvas.training.gpu_job train --out "$OUT" [--model canvas-9m] [--init DIR] [--minutes 8]
    # here, on the files that came back:
    python -m canvas.training.gpu_job unpack FILES_DIR --run runs/gpu-9m
    dcanvas train --run runs/gpu-9m --export-only --export DIR    # then `dcanvas eval --model DIR ...`

Why it is split this way: the device machine has torch, numpy and rich but not this project's environment, no
network, a 10-minute limit per command, and sends back at most 8 files of 16 MiB each. `train` imports only the
training stack; trains with bf16 autocast for a wall-clock budget, fixing the step count after a short timed
calibration so the learning-rate schedule still ends with its decay; evaluates the validation losses before,
during (keeping the best weights: the corpus is small enough to overfit on) and after; and writes the best weights
as a weights-only checkpoint cut into 15 MiB parts, with every sha256 and the figures in `result.json`. `unpack`
joins and checks the parts against `result.json` and the local token arrays, and writes a run directory that the
ordinary export reads. The judge evaluation runs here: the judge is larger than a call may carry.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any, cast

import torch

from canvas.env import KERNELS
from canvas.training.train import MODEL_SHAPES, TrainConfig, Trainer

PART_BYTES = 15 * 2**20  # under the 16 MiB a returned file may have
PARTS_PREFIX = "weights.pt."
RESULT = "result.json"


class JobError(RuntimeError):
    """The job cannot run, or what came back is not a complete, matching result."""


class _Tee(io.TextIOBase):
    """Standard output that also appends to the job log (the log comes back even when the command is killed)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, text: str) -> int:
        sys.stdout.write(text)
        sys.stdout.flush()
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(text)
        return len(text)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- device side --------------------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from rich.console import Console

    # Not a terminal: `Trainer.fit` then prints one plain line per log interval instead of a live bar.
    console = Console(file=cast(IO[str], _Tee(out / "job.log")), force_terminal=False, width=200, highlight=False)
    log = console.print
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        raise JobError("no CUDA device; --allow-cpu runs the job on the CPU (a smoke test)")
    device = "cuda" if on_gpu else "cpu"
    # The Triton kernels have no backward: training runs the torch references.
    os.environ[KERNELS.name] = "ref"
    torch.backends.cuda.matmul.allow_tf32 = True
    log(f"torch {torch.__version__} on {torch.cuda.get_device_name() if on_gpu else 'cpu'}; model {args.model}")

    base = None
    if args.base_staged:
        from canvas.training.gpu_base import unpack as unpack_base

        base = str(unpack_base(Path(args.base_staged), Path(args.work) / "base"))
        log(f"base from {args.base_staged} -> {base}")
    cfg = TrainConfig(
        model=args.model, tokens_dir=args.tokens_dir, tokenizer_dir=args.tokenizer_dir, seed=args.seed,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps, max_steps=10**9,
        log_every=args.log_every, eval_every=10**9, eval_batches=args.eval_batches, checkpoint_minutes=1e9,
        bf16=on_gpu, base=base, lora_rank=args.lora_rank,
    )  # fmt: skip
    trainer = Trainer(Path(args.work), cfg, device=device)
    if args.init:
        trainer.warm_start(Path(args.init))
    first = trainer.state.step
    n_params = sum(p.numel() for p in trainer.model.parameters())
    before = trainer.evaluate()
    log(f"{n_params / 1e6:.2f}M params, batch {cfg.batch_size}, start step {first}; valid before {before}")

    # Calibrate at the full learning rate's schedule shape: the step time sets how many steps the budget holds.
    trainer.fit(max_minutes=None, stop_at_step=first + args.calibration_steps, console=console)
    t0 = time.perf_counter()
    trainer.fit(max_minutes=None, stop_at_step=first + 2 * args.calibration_steps, console=console)
    per_step = (time.perf_counter() - t0) / args.calibration_steps
    left = 60 * args.minutes - (time.perf_counter() - started) - args.reserve_seconds
    total = 2 * args.calibration_steps + max(0, int(left / per_step))
    trainer.cfg = dataclasses.replace(trainer.cfg, max_steps=first + total)
    log(f"{per_step * 1e3:.0f} ms a step: training to step {first + total} ({total} steps)")

    best: dict[str, Any] = {"step": -1, "score": float("inf")}

    def consider() -> None:
        """Evaluate the current weights; keep them when they are the best so far (denoise + AR validation loss)."""
        valid = trainer.evaluate()
        log(f"step {trainer.state.step}: valid {valid}")
        score = valid["valid_denoise"] + valid["valid_ar"]
        if score < best["score"]:
            # A base run keeps only its trained tensors, in bf16 (the committed adapters' precision).
            dtype = torch.bfloat16 if base else None
            weights = {k: v.detach().to("cpu", dtype=dtype, copy=True) for k, v in trainer.model_state().items()}
            best.update(valid, score=score, step=trainer.state.step, weights=weights,
                        state=dataclasses.asdict(trainer.state))

    while trainer.state.step < trainer.cfg.max_steps:
        remaining = 60 * args.minutes - args.reserve_seconds - (time.perf_counter() - started)
        if remaining <= 0:
            log(f"budget spent at step {trainer.state.step}, before the planned {trainer.cfg.max_steps}")
            break
        stop = min(trainer.cfg.max_steps, trainer.state.step + args.eval_every)
        trainer.fit(max_minutes=remaining / 60, stop_at_step=stop, console=console)
        consider()
    if best["step"] != trainer.state.step:
        consider()  # the final weights are always evaluated (the loop may not have run)

    payload = {
        "model": best["weights"],
        "state": best["state"],
        "train_config": trainer.cfg.to_json(),
        "model_config": trainer.model_config.to_hf_dict(),
        "tokens_meta": trainer.train_data.meta,
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    parts = []
    for i in range(0, len(data), PART_BYTES):
        name = f"{PARTS_PREFIX}{i // PART_BYTES:03d}"
        chunk = data[i : i + PART_BYTES]
        (out / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
    state = trainer.state
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "params": n_params,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "init": args.init,
        "start_step": first,
        "end_step": state.step,
        "best_step": best["step"],
        "tokens_seen": state.tokens_seen,
        "ms_per_step": per_step * 1e3,
        "job_seconds": time.perf_counter() - started,
        "valid_before": before,
        "valid_best": {k: best[k] for k in before},
        "parts": parts,
        "sha256": _sha256(data),
    }
    (out / RESULT).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"best step {best['step']}: {result['valid_best']}; {len(parts)} parts, {len(data) / 2**20:.1f} MiB")
    return result


# ---- here ---------------------------------------------------------------------------------------------------------
def unpack(files: Path, run: Path, *, tokens_dir: str, tokenizer_dir: str, corpus_dir: str,
           base: str | None = None) -> Trainer:
    """Join and check the returned parts; write `run` (weights-only checkpoint, config with local paths, curve)."""
    result_path = files / RESULT
    if not result_path.is_file():
        raise JobError(f"{files}: no {RESULT}; the job did not finish (see job.log there)")
    result = json.loads(result_path.read_text(encoding="utf-8"))
    chunks = []
    for part in result["parts"]:
        path = files / part["name"]
        if not path.is_file():
            raise JobError(f"{path} is missing (result.json lists {len(result['parts'])} parts)")
        chunk = path.read_bytes()
        if _sha256(chunk) != part["sha256"]:
            raise JobError(f"{path}: sha256 differs from result.json (a broken transfer?)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if _sha256(data) != result["sha256"]:
        raise JobError("the joined parts' sha256 differs from result.json")
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    payload["model"] = {k: v.float() for k, v in payload["model"].items()}
    cfg = TrainConfig.from_json(payload["train_config"])
    # Local data and fp32: a continuation here runs on the CPU.
    if cfg.base is not None and base is None:
        raise JobError("these are adapters: name the local base they were trained for with --base")
    cfg = dataclasses.replace(cfg, tokens_dir=tokens_dir, tokenizer_dir=tokenizer_dir, corpus_dir=corpus_dir,
                              bf16=False, eval_every=TrainConfig().eval_every, checkpoint_minutes=5.0,
                              base=base if cfg.base is not None else None)
    trainer = Trainer(run, cfg)
    ours = trainer.train_data.meta.get("tokenizer_sha256")
    if payload["tokens_meta"].get("tokenizer_sha256") != ours:
        raise JobError(f"the job trained on other token arrays than {tokens_dir} (tokenizer hash differs)")
    if run.exists() and any(run.iterdir()):
        raise JobError(f"{run} exists and is not empty; choose another --run")
    run.mkdir(parents=True, exist_ok=True)
    (run / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n", encoding="utf-8")
    torch.save({k: payload[k] for k in ("model", "state", "model_config", "tokens_meta")} | {
        "train_config": cfg.to_json()}, trainer.checkpoint_path)
    if not trainer.load():
        raise JobError(f"{trainer.checkpoint_path} was not written")
    trainer.write_curve()
    (run / "gpu_job.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return trainer


# ---- CLI ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m canvas.training.gpu_job", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="train on the GPU (device side)")
    t.add_argument("--out", required=True, help="folder for the returned files ($OUT)")
    t.add_argument("--model", choices=sorted(MODEL_SHAPES), default="canvas-9m")
    t.add_argument("--init", default=None, help="warm-start from this exported model (same shape)")
    t.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole job")
    t.add_argument("--reserve-seconds", dest="reserve_seconds", type=float, default=45.0,
                   help="kept back for the last evaluation and the write-out")
    t.add_argument("--batch-size", dest="batch_size", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=200)
    t.add_argument("--calibration-steps", dest="calibration_steps", type=int, default=20)
    t.add_argument("--eval-every", dest="eval_every", type=int, default=250)
    t.add_argument("--eval-batches", dest="eval_batches", type=int, default=16)
    t.add_argument("--log-every", dest="log_every", type=int, default=50)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tokens-dir", dest="tokens_dir", default="data/tokens")
    t.add_argument("--tokenizer-dir", dest="tokenizer_dir", default="data/tokenizer")
    t.add_argument("--work", default="/tmp/dcanvas-gpu-run", help="the run's scratch directory")
    t.add_argument("--allow-cpu", dest="allow_cpu", action="store_true", help="run without CUDA (smoke test)")
    t.add_argument("--base-staged", dest="base_staged", default=None,
                   help="fine-tune the converted base staged here (canvas.training.gpu_base) under adapters")
    t.add_argument("--lora-rank", dest="lora_rank", type=int, default=16)
    u = sub.add_parser("unpack", help="turn the returned files into a run directory (here)")
    u.add_argument("files", type=Path, help="folder holding result.json and the weights.pt.* parts")
    u.add_argument("--run", type=Path, required=True)
    u.add_argument("--tokens-dir", dest="tokens_dir", default="data/tokens")
    u.add_argument("--tokenizer-dir", dest="tokenizer_dir", default="data/tokenizer")
    u.add_argument("--corpus-dir", dest="corpus_dir", default="data/corpus")
    u.add_argument("--base", default=None, help="for an adapter run: the exact local base they apply to")
    from canvas.training import gpu_gap

    gpu_gap.add_parsers(sub)  # the gap denoiser's job (`gap`, `gap-unpack`)
    args = parser.parse_args(argv)
    try:
        if args.what == "gap":
            gpu_gap.train(args)
        elif args.what == "gap-unpack":
            run = gpu_gap.unpack(args.files, args.run, base=args.base, tokens_dir=args.tokens_dir)
            print(f"{args.run}: step {run.state.step}; resume with `dcanvas train --objective gap-denoise --run "
                  f"{args.run}`, export with `--export-only`")
        elif args.what == "train":
            train(args)
        else:
            trainer = unpack(args.files, args.run, tokens_dir=args.tokens_dir, tokenizer_dir=args.tokenizer_dir,
                             corpus_dir=args.corpus_dir, base=args.base)
            print(f"{args.run}: step {trainer.state.step}; export with "
                  f"`dcanvas train --run {args.run} --export-only --export DIR`")
    except (JobError, ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
