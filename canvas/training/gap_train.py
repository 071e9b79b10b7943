"""`dcanvas train --objective gap-denoise`: the decoder's gap denoiser on the frozen converted base, resumable bit for
bit on a CPU (the objective: `canvas.training.gap_denoise`; the data: `canvas.training.gap_data`).

The base is the build the editor serves (`dcanvas model build`: its FIM adapters merged): its causal pass is the AR
pathway and the teacher, and stays exactly as it is; what trains is `canvas.training.decoder_adapt`'s decoder-only
set. A run lives in one directory: `train_config.json`, `checkpoint.pt` (decoder tensors, optimizer, state: step,
tokens, history; batches, coins and the LoRA init are functions of (seed, step), so nothing else is needed to
resume), written atomically with the previous one kept, and `loss.csv` / `loss.json`. Each evaluation reports the
held-out denoising loss on fixed validation batches per gap size (`valid_g8` ... CE on the noised slots at noise
levels over the whole range), their mean `valid_denoise`, the argmax accuracy `valid_acc` and the middle slots' KL
from the teacher `valid_kl`. `export_gap_adapters` writes the set `decoder_adapt.load_decoder_adapters` reads.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from canvas.env import KERNELS
from canvas.model import DiffusionModel
from canvas.training.decoder_adapt import (
    DEFAULT_TARGETS,
    attach_decoder_adapters,
    decoder_tensors,
    export_decoder_adapters,
    load_decoder_tensors,
    param_groups,
)
from canvas.training.gap_data import GapBatch, GapDataConfig, sample_gap_batch
from canvas.training.gap_denoise import GapObjectiveConfig, gap_losses
from canvas.training.train import save_checkpoint, write_curve

TRAIN_STREAM = 0
EVAL_GAPS = (8, 16, 32)  # the gap sizes; each its own fixed validation stream


@dataclass(frozen=True, slots=True)
class GapTrainConfig:
    base: str  # the converted model directory the editor serves (FIM adapters merged)
    tokens_dir: str = ""  # the corpus tokenized with the base's tokenizer; "" -> data/tokens-fim-<vocab>k
    seed: int = 0
    batch_size: int = 4
    lr: float = 1e-3
    sc_lr_scale: float = 0.3  # self-conditioning is trained whole (3.9M parameters): a gentler step than LoRA's
    warmup_steps: int = 50
    max_steps: int = 20000
    curriculum_steps: int = 2000  # gaps and noise reach their full range here (`GapDataConfig`)
    decay_frac: float = 0.2
    min_lr_frac: float = 0.1
    grad_clip: float = 1.0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    bf16: bool | None = None  # None: where the device has native bf16 matmuls
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 2  # per gap size
    checkpoint_minutes: float = 10.0
    objective: GapObjectiveConfig = field(default_factory=GapObjectiveConfig)
    data: GapDataConfig = field(default_factory=GapDataConfig)

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_steps", "log_every", "eval_every", "eval_batches", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.grad_clip <= 0 or self.checkpoint_minutes <= 0 or self.warmup_steps < 0:
            raise ValueError("need lr > 0, grad_clip > 0, checkpoint_minutes > 0, warmup_steps >= 0")
        if self.curriculum_steps < 1:
            raise ValueError(f"curriculum_steps must be >= 1, got {self.curriculum_steps}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> GapTrainConfig:
        raw = dict(raw)
        obj = dict(raw.pop("objective", {}))
        obj["sc_temperature"] = tuple(obj.get("sc_temperature", (0.4, 1.0)))
        data = GapDataConfig(**raw.pop("data", {}))
        return cls(**{**raw, "targets": tuple(raw.get("targets", DEFAULT_TARGETS))},
                   objective=GapObjectiveConfig(**obj), data=data)  # fmt: skip

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_start = int(self.max_steps * (1 - self.decay_frac))
        frac = min(1.0, max(0, step - decay_start) / max(1, self.max_steps - decay_start))
        return self.lr * (1 - frac * (1 - self.min_lr_frac))


@dataclass(slots=True)
class GapState:
    step: int = 0
    tokens_seen: int = 0  # canvas slots + prefix tokens read
    noised_slots: int = 0  # of which loss targets
    wall_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


def _generators(seed: int, step: int, stream: int) -> tuple[np.random.Generator, torch.Generator]:
    rng = np.random.default_rng([seed, stream, step])
    return rng, torch.Generator().manual_seed(int(rng.integers(0, 2**62)))


class GapTrainer:
    def __init__(self, run_dir: Path, cfg: GapTrainConfig, *, device: str = "cpu") -> None:
        from tokenizers import Tokenizer

        from canvas.convert.fim import fim_tokens, recorded_fim_adapters, word_boundaries
        from canvas.training.fim_train import fim_tokens_dir
        from canvas.training.tokens import TokenArrays, file_sha256

        base = Path(cfg.base)
        if cfg.objective.teacher_weight > 0 and recorded_fim_adapters(base) is None:
            raise ValueError(f"{base}: this build has no FIM adapters merged, so it has no FIM pathway to teach "
                             "(serve the default build, or set the teacher weight to 0)")
        self.run_dir, self.cfg, self.device = run_dir, cfg, torch.device(device)
        tokens = Path(cfg.tokens_dir or fim_tokens_dir(base))
        self.train_data = TokenArrays.open(tokens, "train")
        self.valid_data = TokenArrays.open(tokens, "valid")
        tok_sha = file_sha256(base / "tokenizer.json")
        if self.train_data.meta["tokenizer_sha256"] != tok_sha:
            raise ValueError(f"{tokens} was tokenized with another tokenizer than {base}'s; use another --tokens-dir")
        tok = Tokenizer.from_file(str(base / "tokenizer.json"))
        self.fim = fim_tokens(tok)
        self.starts_word = word_boundaries(tok)[0]
        self.bf16 = uses_bf16(cfg.bf16, self.device)
        self.model = DiffusionModel.from_pretrained(cfg.base, device=self.device)
        if self.model.config.null_token_id is None:
            raise ValueError(f"{base}: the model has no <null> token id (a gap's unused slots need one)")
        attach_decoder_adapters(self.model, cfg.lora_rank, cfg.lora_alpha, cfg.targets, seed=cfg.seed)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg.sc_lr_scale), lr=cfg.lr, betas=(0.9, 0.95),
                                           eps=1e-8, weight_decay=0.0)  # fmt: skip
        self.state = GapState()

    # ---- data -------------------------------------------------------------------------------------------------
    def batch(self, step: int, *, stream: int = TRAIN_STREAM, gap_len: int | None = None) -> tuple[
            GapBatch, torch.Generator]:  # fmt: skip
        data = self.train_data if stream == TRAIN_STREAM else self.valid_data
        rng, gen = _generators(self.cfg.seed, step, stream)
        progress = step / self.cfg.curriculum_steps
        b = sample_gap_batch(data.tokens, data.doc_starts, self.cfg.batch_size, self.cfg.data,
                             vocab_size=self.model.config.vocab_size, null_id=int(self.model.config.null_token_id or 0),
                             fim=self.fim, rng=rng, gen=gen, progress=progress, gap_len=gap_len,
                             starts_word=self.starts_word)  # fmt: skip
        return b.to(self.device), gen

    # ---- checkpoints ------------------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    def save(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "adapters": {k: v.cpu() for k, v in decoder_tensors(self.model).items()},
            "optimizer": self.optimizer.state_dict(),
            "state": asdict(self.state),
            "train_config": self.cfg.to_json(),
            "model_config": self.model.config.to_hf_dict(),
        }
        save_checkpoint(payload, self.checkpoint_path)
        self.write_curve()

    def load(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        payload = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        if payload["model_config"] != self.model.config.to_hf_dict():
            raise ValueError(f"{self.checkpoint_path} was trained on another base; use another --run")
        load_decoder_tensors(self.model, payload["adapters"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.state = GapState(**payload["state"])
        return True

    def write_curve(self) -> None:
        write_curve(self.run_dir, self.state.history)

    # ---- steps ------------------------------------------------------------------------------------------------
    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def train_step(self) -> dict[str, float]:
        step = self.state.step
        batch, gen = self.batch(step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr_at(step) * group["lr_scale"]
        self.model.train()
        with self.autocast():
            out = gap_losses(self.model, batch, self.cfg.objective, gen)
        self.optimizer.zero_grad(set_to_none=True)
        out.total.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
        self.optimizer.step()
        self.state.step += 1
        self.state.tokens_seen += batch.canvas_noisy.numel() + batch.encoder_ids.numel()
        self.state.noised_slots += int(out.ce.numel())
        row = {"loss": float(out.total.detach()), "ce": float(out.ce.mean()), "acc": float(out.correct.float().mean()),
               "null_share": float(out.is_null.float().mean()), "grad_norm": grad_norm, "lr": self.cfg.lr_at(step),
               "max_gap": float(int(batch.gap_len.max()))}  # fmt: skip
        if out.kl is not None:
            row["kl"] = float(out.kl.mean())
        return row

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out denoising loss per gap size on the same validation batches every time (see the docstring)."""
        self.model.eval()
        out: dict[str, float] = {}
        ce_all, correct, kl_sum, kl_n = [], 0, 0.0, 0
        for g in EVAL_GAPS:
            if g > self.cfg.data.max_gap:
                continue
            ces = []
            for i in range(self.cfg.eval_batches):
                batch, gen = self.batch(i, stream=1000 + g, gap_len=g)
                with self.autocast():
                    losses = gap_losses(self.model, batch, self.cfg.objective, gen)
                ces.append(losses.ce)
                correct += int(losses.correct.sum())
                if losses.kl is not None:
                    kl_sum, kl_n = kl_sum + float(losses.kl.sum()), kl_n + int(losses.kl.numel())
            out[f"valid_g{g}"] = float(torch.cat(ces).mean())
            ce_all += ces
        n = sum(int(c.numel()) for c in ce_all)
        out["valid_denoise"] = float(np.mean([out[k] for k in out]))
        out["valid_acc"] = correct / max(1, n)
        if kl_n:
            out["valid_kl"] = kl_sum / kl_n
        return out

    def fit(self, *, max_minutes: float | None, stop_at_step: int | None, console: Any) -> GapState:
        """Train until `max_steps`, `stop_at_step` or `max_minutes`; a new run evaluates step 0 first."""
        if not self.state.history:
            self.state.history.append({"step": 0, "tokens": 0, "wall_s": 0.0, **self.evaluate()})
            console.print(f"step 0 (untrained decoder): {self.state.history[-1]}")
        end = min(self.cfg.max_steps, stop_at_step or self.cfg.max_steps)
        started = last_ckpt = time.perf_counter()
        window: list[dict[str, float]] = []
        window_tokens, window_time = 0, 0.0
        while self.state.step < end:
            if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                console.print(f"stopping after {max_minutes} min (step {self.state.step})")
                break
            t0, before = time.perf_counter(), self.state.tokens_seen
            window.append(self.train_step())
            dt = time.perf_counter() - t0
            self.state.wall_seconds += dt
            window_tokens, window_time = window_tokens + self.state.tokens_seen - before, window_time + dt
            step = self.state.step
            if step % self.cfg.log_every == 0 or step == end:
                keys = dict.fromkeys(k for r in window for k in r)
                row = {k: _nanmean([r.get(k, math.nan) for r in window]) for k in keys}
                row.update(step=step, tokens=self.state.tokens_seen, noised_slots=self.state.noised_slots,
                           wall_s=round(self.state.wall_seconds, 1),
                           tokens_per_s=window_tokens / max(window_time, 1e-9))
                if step % self.cfg.eval_every == 0 or step == end:
                    row.update(self.evaluate())
                self.state.history.append(row)
                info = f"loss {row['loss']:.3f} ce {row['ce']:.3f} acc {row['acc']:.3f} " \
                       f"{row['tokens_per_s']:.0f} tok/s lr {row['lr']:.2e}"
                if "valid_denoise" in row:
                    info += f" | valid {row['valid_denoise']:.3f} acc {row['valid_acc']:.3f}"
                console.print(f"step {step}: {info}")
                window, window_tokens, window_time = [], 0, 0.0
            if time.perf_counter() - last_ckpt > 60 * self.cfg.checkpoint_minutes:
                self.save()
                last_ckpt = time.perf_counter()
        self.save()
        return self.state


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def export_gap_adapters(trainer: GapTrainer, out: Path) -> Path:
    st = trainer.state
    meta = {"logit_shift": trainer.cfg.objective.logit_shift, "step": st.step, "tokens_seen": st.tokens_seen,
            "gap_min_fill": trainer.cfg.data.min_fill, "max_gap": trainer.cfg.data.max_gap}  # fmt: skip
    return export_decoder_adapters(trainer.model, out, meta)


def uses_bf16(choice: bool | None, device: torch.device) -> bool:
    """bf16 autocast where asked, else where the device has native bf16 matmuls (as the FIM run decides)."""
    if choice is not None:
        return choice
    if device.type == "cuda":
        return True
    from canvas.model.cpu import cpu_kind

    return cpu_kind() in ("amx", "avx512_bf16", "arm_bf16")


_OVERRIDES = ("base", "tokens_dir", "seed", "batch_size", "lr", "warmup_steps", "max_steps", "log_every",
              "eval_every", "checkpoint_minutes", "lora_rank", "bf16")
_OBJECTIVE_OVERRIDES = ("teacher_weight", "logit_shift")


def resolve_gap_config(run_dir: Path, args: Any) -> GapTrainConfig:
    """The run's saved config (or the defaults; a new run needs --base) with the options given."""
    saved = run_dir / "train_config.json"
    changes = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k, None) is not None}
    obj = {k: getattr(args, k) for k in _OBJECTIVE_OVERRIDES if getattr(args, k, None) is not None}
    if saved.exists():
        cfg = GapTrainConfig.from_json(json.loads(saved.read_text(encoding="utf-8")))
    elif "base" in changes:
        cfg = GapTrainConfig(base=changes["base"])
    else:
        raise ValueError("a new gap-denoise run needs --base MODEL_DIR (the build the editor serves)")
    return replace(cfg, **changes, objective=replace(cfg.objective, **obj))


def run_gap(args: Any, console: Any) -> int:
    """`dcanvas train --objective gap-denoise`: train (resuming), bench one step, or export the adapters."""
    import os

    run_dir = args.run or Path("runs/gap-denoise")
    if args.device != "cpu":
        os.environ[KERNELS.name] = "ref"  # the Triton kernels have no backward
    try:
        cfg = resolve_gap_config(run_dir, args)
        trainer = GapTrainer(run_dir, cfg, device=args.device)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    resumed = trainer.load()
    if args.bench:
        t0 = time.perf_counter()
        row = trainer.train_step()
        dt = time.perf_counter() - t0
        tokens = cfg.batch_size * (cfg.data.canvas_length + cfg.data.max_prefix)
        console.print(f"gap-denoise step ({'bf16' if trainer.bf16 else 'fp32'}, batch {cfg.batch_size}, "
                      f"{torch.get_num_threads()} thread(s)): {dt:.2f} s, ~{tokens / dt:.0f} tok/s at most; {row}")
        return 0
    if args.export_only and not resumed:
        console.print(f"[red]error:[/red] no checkpoint in {run_dir}")
        return 2
    if not args.export_only:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n", encoding="utf-8")
        n = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
        what = f"resuming at step {trainer.state.step}" if resumed else "new run"
        console.print(f"{run_dir}: {what}; gap denoiser on {cfg.base}: {n / 1e6:.2f}M decoder-only parameters "
                      f"(rank {cfg.lora_rank} on {', '.join(cfg.targets)}, expert deltas, self-conditioning), batch "
                      f"{cfg.batch_size}, {'bf16' if trainer.bf16 else 'fp32'}, {torch.get_num_threads()} thread(s)")
        trainer.fit(max_minutes=args.max_minutes, stop_at_step=args.stop_at_step, console=console)
    if args.export_only or args.export is not None:
        out = export_gap_adapters(trainer, args.export or run_dir / "adapters")
        console.print(f"exported the decoder adapters (step {trainer.state.step}) to {out}")
    return 0
