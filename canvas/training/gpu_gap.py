"""The gap denoiser in one call on a lent GPU (`python -m canvas.training.gpu_job gap`), and its result back here
(`gpu_job gap-unpack`) as an ordinary `dcanvas train --objective gap-denoise` run directory.

Device side: the converted base staged in int8 parts (`canvas.training.gpu_base`) is unpacked; the base's small files
(`tokenizer.json`, `build.json`: the FIM record the teacher needs) come from `--model-files`; `GapTrainer` trains
for the wall-clock budget with bf16 autocast, evaluating before and after; the decoder tensors come back in bf16,
cut into parts under 16 MiB, with `result.json` (sha256s, figures). The staged base's experts are drawn afresh
(`gpu_base`: a recipe, not the values), so each expert delta travels as its decoder-side value (base + delta) and
`gap-unpack` subtracts the exact local base's: the decoder then computes with the trained values on either base.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from canvas.env import KERNELS
from canvas.training.decoder_adapt import decoder_tensors, load_decoder_tensors
from canvas.training.gap_train import GapTrainConfig, GapTrainer

PART_BYTES = 15 * 2**20
PREFIX, RESULT = "gap.pt.", "result.json"
_DELTA = ".delta"


def _owner_value(model: torch.nn.Module, delta_name: str) -> torch.Tensor:
    """The frozen base value under the delta `<module>.<leaf>.delta`."""
    *path, leaf, _ = delta_name.split(".")
    module = model
    for part in path:
        module = getattr(module, part)
    return getattr(module.parametrizations, leaf).original.detach()


def _as_values(trainer: GapTrainer) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in decoder_tensors(trainer.model).items():
        out[k] = (_owner_value(trainer.model, k) + v) if k.endswith(_DELTA) else v
    return {k: v.detach().to("cpu", torch.bfloat16, copy=True) for k, v in out.items()}


def train(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "job.log").open("a", encoding="utf-8") as log:
        return _train(args, started, out, Console(file=log, force_terminal=False, width=200))


def _train(args: argparse.Namespace, started: float, out: Path, console: Any) -> dict[str, Any]:
    from canvas.training.gpu_base import unpack as unpack_base

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        raise RuntimeError("no CUDA device; --allow-cpu runs the job on the CPU (a smoke test)")
    os.environ[KERNELS.name] = "ref"  # the Triton kernels have no backward
    torch.backends.cuda.matmul.allow_tf32 = True
    base = unpack_base(Path(args.base_staged), Path(args.work) / "base")
    for name in ("tokenizer.json", "tokenizer_config.json", "build.json"):
        src = Path(args.model_files) / name
        if src.is_file():
            shutil.copyfile(src, base / name)
    cfg = GapTrainConfig(base=str(base), tokens_dir=args.tokens_dir, batch_size=args.batch_size, lr=args.lr,
                         warmup_steps=args.warmup_steps, max_steps=args.max_steps,
                         curriculum_steps=args.curriculum_steps,
                         log_every=args.log_every, eval_every=10**9, eval_batches=args.eval_batches,
                         checkpoint_minutes=1e9, bf16=on_gpu or None)  # fmt: skip
    trainer = GapTrainer(Path(args.work) / "run", cfg, device="cuda" if on_gpu else "cpu")
    before = trainer.evaluate()
    console.print(f"valid before: {before}")
    left = 60 * args.minutes - (time.perf_counter() - started) - args.reserve_seconds
    trainer.state.history.append({"step": 0, "tokens": 0, "wall_s": 0.0, **before})
    trainer.fit(max_minutes=max(0.1, left / 60), stop_at_step=None, console=console)
    after = trainer.evaluate()
    console.print(f"valid after step {trainer.state.step}: {after}")
    payload = {"tensors": _as_values(trainer), "state": dataclasses.asdict(trainer.state),
               "train_config": trainer.cfg.to_json(), "model_config": trainer.model.config.to_hf_dict()}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    parts = []
    for i in range(0, len(data), PART_BYTES):
        name = f"{PREFIX}{i // PART_BYTES:03d}"
        (out / name).write_bytes(data[i : i + PART_BYTES])
        parts.append({"name": name, "sha256": hashlib.sha256(data[i : i + PART_BYTES]).hexdigest()})
    st = trainer.state
    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "end_step": st.step,
              "tokens_seen": st.tokens_seen, "seconds": time.perf_counter() - started, "valid_before": before,
              "valid_after": after, "parts": parts, "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    (out / RESULT).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def unpack(files: Path, run: Path, *, base: str, tokens_dir: str) -> GapTrainer:
    """Join and check the parts; write `run` (a checkpoint on the exact local `base`, fresh optimizer state)."""
    result = json.loads((files / RESULT).read_text(encoding="utf-8"))
    chunks = []
    for part in result["parts"]:
        chunk = (files / part["name"]).read_bytes()
        if hashlib.sha256(chunk).hexdigest() != part["sha256"]:
            raise ValueError(f"{files / part['name']}: sha256 differs from {RESULT} (a broken transfer?)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if hashlib.sha256(data).hexdigest() != result["sha256"]:
        raise ValueError("the joined parts' sha256 differs from result.json")
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if run.exists() and any(run.iterdir()):
        raise ValueError(f"{run} exists and is not empty; choose another --run")
    cfg = GapTrainConfig.from_json(payload["train_config"])
    cfg = dataclasses.replace(cfg, base=base, tokens_dir=tokens_dir, bf16=None, checkpoint_minutes=10.0,
                              eval_every=GapTrainConfig(base=base).eval_every)  # fmt: skip
    trainer = GapTrainer(run, cfg)
    if payload["model_config"] != trainer.model.config.to_hf_dict():
        raise ValueError(f"the job trained on another base shape than {base}")
    tensors = {}
    for k, v in payload["tensors"].items():
        v = v.float()
        tensors[k] = v - _owner_value(trainer.model, k) if k.endswith(_DELTA) else v
    load_decoder_tensors(trainer.model, tensors)
    trainer.state = type(trainer.state)(**payload["state"])
    run.mkdir(parents=True, exist_ok=True)
    (run / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n", encoding="utf-8")
    trainer.save()
    (run / "gpu_job.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return trainer


def add_parsers(sub: Any) -> None:
    g = sub.add_parser("gap", help="train the gap denoiser on the GPU (device side)")
    g.add_argument("--out", required=True, help="folder for the returned files ($OUT)")
    g.add_argument("--base-staged", dest="base_staged", required=True,
                   help="the staged base (canvas.training.gpu_base)")
    g.add_argument("--model-files", dest="model_files", required=True,
                   help="a folder with the base's tokenizer.json and build.json")
    g.add_argument("--tokens-dir", dest="tokens_dir", required=True, help="the base's token arrays (tokens-fim-96k)")
    g.add_argument("--minutes", type=float, default=8.0)
    g.add_argument("--reserve-seconds", dest="reserve_seconds", type=float, default=60.0)
    g.add_argument("--batch-size", dest="batch_size", type=int, default=32)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=50)
    g.add_argument("--max-steps", dest="max_steps", type=int, default=2000, help="the lr schedule's length")
    g.add_argument("--curriculum-steps", dest="curriculum_steps", type=int, default=300)
    g.add_argument("--eval-batches", dest="eval_batches", type=int, default=8)
    g.add_argument("--log-every", dest="log_every", type=int, default=20)
    g.add_argument("--work", default="/tmp/dcanvas-gap-run")
    g.add_argument("--allow-cpu", dest="allow_cpu", action="store_true", help="run without CUDA (smoke test)")
    u = sub.add_parser("gap-unpack", help="turn the gap job's files into a run directory (here)")
    u.add_argument("files", type=Path)
    u.add_argument("--run", type=Path, required=True)
    u.add_argument("--base", required=True, help="the exact local base (the build the editor serves)")
    u.add_argument("--tokens-dir", dest="tokens_dir", default="")
