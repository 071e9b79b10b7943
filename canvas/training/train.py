"""`dcanvas train`: train the embedded model with the DiffusionGemma recipe, resumably, on the CPU (or a GPU).

A run lives in one directory (`--run`, default `runs/canvas-6m`): `train_config.json` (written on the first start;
later starts reuse it and only the options given on the command line override it), `checkpoint.pt` (model,
optimizer, step, tokens seen, wall time, loss history; written atomically every `checkpoint_minutes` and at exit,
the previous one kept as `checkpoint.prev.pt`), and `loss.json` / `loss.csv` (the loss curve). A start resumes
from the checkpoint when there is one. Batches are drawn from generators seeded by `(seed, step)`, so a resumed
run trains on exactly the batches an uninterrupted one would.

Learning rate: warmup, constant, then linear decay over the last `decay_frac` of `max_steps` (warmup-stable-decay),
so a run can be extended while it is in its stable phase. `--max-minutes` bounds one invocation (a process may be
stopped at any time; the CPU is shared) and `--threads` the torch threads. `dcanvas train --bench` prints the decoder
latency of the configured model (one 256-token canvas, batch 1, with self-conditioning) and exits; `--export DIR` writes
the trained model in HF format with its tokenizer and model card (`canvas.training.export`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from canvas.model import DiffusionModel, ModelConfig
from canvas.model.config import FULL, PRESETS, SLIDING
from canvas.training.corrupt import Batch, CorruptionConfig, sample_batch
from canvas.training.objective import ObjectiveConfig, compute_losses
from canvas.training.tokens import TokenArrays

# Model shapes; the vocabulary and special ids are filled in from the tokenizer (`model_config`).
# canvas-6m: sized for ~30 ms per decoder step (256-token canvas, batch 1, with self-conditioning) on this
# 2-core CPU in fp32. The vocabulary-sized work (LM head, softcap, self-conditioning's softmax @ embeddings)
# dominates at this size, hence a 4096-token vocabulary and hidden 192; see `dcanvas train --bench`.
_CANVAS_6M: dict[str, Any] = dict(
    hidden_size=192, intermediate_size=384, num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1,
    head_dim=64, global_head_dim=128, num_global_key_value_heads=1, layer_types=(SLIDING, FULL, SLIDING, FULL),
    sliding_window=256, num_experts=8, top_k_experts=2, moe_intermediate_size=192, canvas_length=256,
    max_position_embeddings=8192, final_logit_softcapping=30.0,
)  # fmt: skip
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "canvas-6m": _CANVAS_6M,
    # The larger variant for a GPU run (`canvas.training.gpu_job`): canvas-6m with a wider residual stream, one more
    # head and a wider dense FFN; 8.67M parameters, 33 MiB in fp32 (the committed model's limit is 40 MB).
    "canvas-9m": _CANVAS_6M | dict(hidden_size=256, intermediate_size=512, num_attention_heads=4),
    "tiny": {k: getattr(PRESETS["tiny"], k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "global_head_dim", "num_global_key_value_heads", "layer_types", "sliding_window", "num_experts",
        "top_k_experts", "moe_intermediate_size", "canvas_length")},
}  # fmt: skip


def model_config(shape: str, special: dict[str, int], vocab_size: int) -> ModelConfig:
    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(MODEL_SHAPES)}")
    return ModelConfig(
        **MODEL_SHAPES[shape],
        vocab_size=vocab_size,
        pad_token_id=special["pad"],
        bos_token_id=special["bos"],
        eos_token_ids=(special["eos"],),
        null_token_id=special["null"],
        name=shape,
    )


@dataclass(frozen=True, slots=True)
class TrainConfig:
    model: str = "canvas-6m"
    tokens_dir: str = "data/tokens"
    tokenizer_dir: str = "data/tokenizer"  # copied into an export (checked against the token arrays' hash)
    corpus_dir: str = "data/corpus"  # its manifest feeds the model card
    seed: int = 0
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_frac: float = 0.05  # the decay phase ends at lr * min_lr_frac
    warmup_steps: int = 200
    decay_frac: float = 0.2  # share of max_steps spent decaying the lr
    max_steps: int = 10_000  # hours on a 2-core CPU, not days (`dcanvas train --bench` times a step)
    weight_decay: float = 0.1  # matrices only; norms, scales and routers' per-expert scales are not decayed
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 4
    checkpoint_minutes: float = 5.0
    init_std: float = 0.02
    # A warm start (`--init DIR`) continues an exported model's step count; its warmup restarts at that step
    # (fresh optimizer moments must not meet the full learning rate at once).
    rewarm_from: int = 0
    # Autocast matmuls to bf16 (GPU runs; master weights and optimizer stay fp32). The CPU runs keep fp32.
    bf16: bool = False
    # Fine-tuning a converted model (`dcanvas model build`'s directory): its matrices frozen under low-rank
    # adapters, its new parts trained whole (canvas.training.adapt). None: train `model` from scratch.
    base: str | None = None
    lora_rank: int = 16
    lora_alpha: float = 32.0
    corruption: CorruptionConfig = field(default_factory=CorruptionConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_steps", "log_every", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_frac <= 1 or not 0 <= self.decay_frac <= 1:
            raise ValueError("need lr > 0 and min_lr_frac, decay_frac in [0, 1]")
        if self.warmup_steps < 0 or self.checkpoint_minutes <= 0 or self.grad_clip <= 0:
            raise ValueError("need warmup_steps >= 0, checkpoint_minutes > 0, grad_clip > 0")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TrainConfig:
        raw = dict(raw)
        corruption = CorruptionConfig(**raw.pop("corruption", {}))
        obj = dict(raw.pop("objective", {}))
        if "sc_temperature" in obj:  # JSON has no tuples
            obj["sc_temperature"] = tuple(obj["sc_temperature"])
        objective = ObjectiveConfig(**obj)
        return cls(**raw, corruption=corruption, objective=objective)

    def lr_at(self, step: int) -> float:
        if step < self.rewarm_from + self.warmup_steps:
            return self.lr * (step - self.rewarm_from + 1) / self.warmup_steps
        decay_start = int(self.max_steps * (1 - self.decay_frac))
        if step < decay_start:
            return self.lr
        frac = min(1.0, (step - decay_start) / max(1, self.max_steps - decay_start))
        return self.lr * (1 - frac * (1 - self.min_lr_frac))


def write_curve(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """A run's logged rows as `loss.json` and `loss.csv` (the step first, then every key any row has)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "loss.json").write_text(json.dumps(history, indent=1) + "\n", encoding="utf-8")
    keys = sorted({k for row in history for k in row}, key=lambda k: (k != "step", k))
    with (run_dir / "loss.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)


def save_checkpoint(payload: dict[str, Any], path: Path) -> None:
    """Write `payload` to `path` atomically (a temporary file renamed in), the previous checkpoint kept beside it as
    `checkpoint.prev.pt`: a run killed mid-write resumes from one or the other, never from half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    if path.exists():
        os.replace(path, path.with_name("checkpoint.prev.pt"))
    os.replace(tmp, path)


def _step_generators(seed: int, step: int, stream: int = 0) -> tuple[np.random.Generator, torch.Generator]:
    rng = np.random.default_rng([seed, stream, step])
    gen = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
    return rng, gen


def _base_config(base: Path, special: dict[str, int], vocab_size: int) -> ModelConfig:
    """The converted model's config, checked against the token arrays it will be trained on."""
    from canvas.model.io import read_config

    cfg = read_config(base)
    ours = {"pad": cfg.pad_token_id, "bos": cfg.bos_token_id, "eos": cfg.eos_token_ids[0], "null": cfg.null_token_id}
    if cfg.vocab_size != vocab_size or any(ours[k] != special[k] for k in ours):
        raise ValueError(f"{base}: vocabulary {cfg.vocab_size} / special ids {ours} differ from the token arrays' "
                         f"({vocab_size} / {special}); tokenize the corpus with this model's tokenizer")
    return cfg


def param_groups(model: DiffusionModel, weight_decay: float,
                 lr_scales: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """AdamW groups over the trainable parameters: matrices decay, norms and scales do not; a parameter named in
    `lr_scales` gets its own group whose learning rate is scaled (`lr_scale`, read by the training step)."""
    lr_scales = lr_scales or {}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in lr_scales]
    groups: list[dict[str, Any]] = [
        {"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": weight_decay, "lr_scale": 1.0},
        {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    params = dict(model.named_parameters())
    for name, scale in sorted(lr_scales.items()):
        groups.append({"params": [params[name]], "weight_decay": 0.0, "lr_scale": scale})
    return groups


@dataclass(slots=True)
class RunState:
    step: int = 0
    tokens_seen: int = 0  # stream tokens read (prefix + canvas per example)
    canvas_tokens: int = 0  # canvas slots denoised
    wall_seconds: float = 0.0  # training time summed over invocations
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    def __init__(self, run_dir: Path, cfg: TrainConfig, *, device: str = "cpu") -> None:
        self.run_dir = run_dir
        self.cfg = cfg
        self.device = torch.device(device)
        self.train_data = TokenArrays.open(cfg.tokens_dir, "train")
        self.valid_data = TokenArrays.open(cfg.tokens_dir, "valid")
        special = self.train_data.special_ids
        if cfg.base is not None:
            self.model_config = _base_config(Path(cfg.base), special, int(self.train_data.meta["vocab_size"]))
        else:
            self.model_config = model_config(cfg.model, special, int(self.train_data.meta["vocab_size"]))
        if self.model_config.canvas_length != cfg.corruption.canvas_length:
            # The model decides the canvas; training canvases must match it.
            corruption = dataclasses.replace(cfg.corruption, canvas_length=self.model_config.canvas_length)
            cfg = self.cfg = dataclasses.replace(cfg, corruption=corruption)
        torch.manual_seed(cfg.seed)
        lr_scales: dict[str, float] = {}
        if cfg.base is not None:
            from canvas.training.adapt import attach_lora, linear_regime_lr_scales

            self.model = DiffusionModel.from_pretrained(cfg.base, device=self.device)
            attach_lora(self.model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
            lr_scales = linear_regime_lr_scales(self.model)
        else:
            with torch.device(self.device):
                self.model = DiffusionModel(self.model_config, init=False)
            self.model.reset_parameters(std=cfg.init_std,
                                        generator=torch.Generator(self.device).manual_seed(cfg.seed))
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, cfg.weight_decay, lr_scales), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8
        )
        self.state = RunState()
        self.null_id = special["null"]

    def warm_start(self, model_dir: Path) -> None:
        """Start a new run from an exported model (weights, and its loss curve so steps and tokens continue).

        The model shape and tokenizer must match this run's; the optimizer starts fresh, its warmup restarting at the
        exported step (this sets `TrainConfig.rewarm_from`)."""
        source = DiffusionModel.from_pretrained(str(model_dir), device=self.device)
        theirs, ours = source.config.to_hf_dict(), self.model_config.to_hf_dict()
        theirs.pop("name", None)
        ours.pop("name", None)
        if theirs != ours:
            diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise ValueError(f"{model_dir} is another model shape or tokenizer than this run (differs in {diff})")
        self.model.load_state_dict(source.state_dict())
        curve = model_dir / "loss_curve.csv"
        if curve.exists():
            with curve.open(encoding="utf-8") as fh:
                rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(fh)]
            for row in rows:
                row["step"] = int(row["step"])
            if rows:
                last = rows[-1]
                self.state = RunState(
                    step=int(last["step"]),
                    tokens_seen=int(last["tokens"]),
                    # Curves from before the column existed: every step of the earlier run had this batch size.
                    canvas_tokens=int(last.get("canvas_tokens", last["step"] * self.cfg.batch_size
                                               * self.model_config.canvas_length)),
                    wall_seconds=float(last["wall_s"]),
                    history=rows,
                )
        self.cfg = dataclasses.replace(self.cfg, rewarm_from=self.state.step)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    def save(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "model": self.model_state(),
            "optimizer": self.optimizer.state_dict(),
            "state": asdict(self.state),
            "train_config": self.cfg.to_json(),
            "model_config": self.model_config.to_hf_dict(),
            "tokens_meta": self.train_data.meta,
        }
        save_checkpoint(payload, self.checkpoint_path)
        self.write_curve()

    def load(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        payload = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        if payload["model_config"] != self.model_config.to_hf_dict():
            raise ValueError(f"{self.checkpoint_path} holds another model shape or tokenizer; use another --run")
        if self.cfg.base is not None:
            from canvas.training.adapt import load_adapter_tensors

            load_adapter_tensors(self.model, payload["model"])
        else:
            self.model.load_state_dict(payload["model"])
        if "optimizer" in payload:  # a weights-only checkpoint (a GPU job's) restarts the optimizer's moments
            self.optimizer.load_state_dict(payload["optimizer"])
        self.state = RunState(**payload["state"])
        return True

    def model_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: every weight, or only the trained ones when fine-tuning a frozen base."""
        if self.cfg.base is not None:
            from canvas.training.adapt import adapter_tensors

            return adapter_tensors(self.model)
        return self.model.state_dict()

    def write_curve(self) -> None:
        write_curve(self.run_dir, self.state.history)

    # ---- steps ------------------------------------------------------------------------------------------------
    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def batch(self, step: int, *, valid: bool = False, index: int = 0) -> tuple[Batch, torch.Generator]:
        data = self.valid_data if valid else self.train_data
        rng, gen = _step_generators(self.cfg.seed, index if valid else step, stream=1 if valid else 0)
        batch = sample_batch(
            data.tokens,
            data.doc_starts,
            self.cfg.batch_size,
            self.cfg.corruption,
            vocab_size=self.model_config.vocab_size,
            null_id=self.null_id,
            rng=rng,
            gen=gen,
        )
        return batch, gen

    def train_step(self) -> dict[str, float]:
        step = self.state.step
        batch, gen = self.batch(step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr_at(step) * group.get("lr_scale", 1.0)
        self.model.train()
        with self.autocast():
            losses = compute_losses(self.model, batch, self.cfg.objective, gen)
        self.optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        # The clip sees the ordinary parameters only. A converted model's linear-regime norms (lr-scaled groups)
        # have gradients ~1e6 times larger by construction (the outer norm divides by sqrt(eps)): in one global
        # norm they would shrink every other gradient below Adam's eps and stall training (seen on the first GPU
        # run: grad norm 2e6). Adam normalises their steps, and their own lr scale sizes them.
        ordinary = [p for g in self.optimizer.param_groups if g.get("lr_scale", 1.0) == 1.0 for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(ordinary, self.cfg.grad_clip))
        self.optimizer.step()
        self.state.step += 1
        self.state.tokens_seen += int(batch.encoder_ids.numel())
        self.state.canvas_tokens += int(batch.canvas_noisy.numel())
        return {
            "loss": float(losses.total.detach()),
            "denoise": float(losses.denoise),
            "ar": float(losses.ar),
            "balance": float(losses.balance),
            "denoise_noised": losses.denoise_noised,
            "denoise_clean": losses.denoise_clean,
            "grad_norm": grad_norm,
            "lr": self.cfg.lr_at(step),
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation losses on fixed batches (the same every time), without self-conditioning."""
        self.model.eval()
        no_sc = dataclasses.replace(self.cfg.objective, p_self_cond=0.0)
        sums = {"valid_denoise": 0.0, "valid_ar": 0.0, "valid_denoise_noised": 0.0}
        for i in range(self.cfg.eval_batches):
            batch, gen = self.batch(0, valid=True, index=i)
            with self.autocast():
                losses = compute_losses(self.model, batch, no_sc, gen)
            sums["valid_denoise"] += float(losses.denoise)
            sums["valid_ar"] += float(losses.ar)
            sums["valid_denoise_noised"] += losses.denoise_noised
        return {k: v / self.cfg.eval_batches for k, v in sums.items()}

    def fit(self, *, max_minutes: float | None, stop_at_step: int | None, console: Any) -> RunState:
        """Train until `max_steps`, `stop_at_step` or `max_minutes` of this invocation; checkpoint on the way."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        end = min(self.cfg.max_steps, stop_at_step or self.cfg.max_steps)
        started = time.perf_counter()
        last_ckpt = started
        window: list[dict[str, float]] = []
        window_tokens, window_start = 0, time.perf_counter()
        progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(), console=console, disable=not console.is_terminal,
        )  # fmt: skip
        with progress:
            task = progress.add_task("train", total=self.cfg.max_steps, completed=self.state.step, info="")
            while self.state.step < end:
                if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                    console.print(f"stopping after {max_minutes} min (step {self.state.step})")
                    break
                t0 = time.perf_counter()
                before = self.state.tokens_seen
                window.append(self.train_step())
                self.state.wall_seconds += time.perf_counter() - t0
                window_tokens += self.state.tokens_seen - before
                step = self.state.step
                if step % self.cfg.log_every == 0 or step == end:
                    elapsed = time.perf_counter() - window_start
                    row = {k: sum(r[k] for r in window) / len(window) for k in window[0]}
                    row.update(step=step, tokens=self.state.tokens_seen, wall_s=round(self.state.wall_seconds, 1),
                               canvas_tokens=self.state.canvas_tokens)
                    row["tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
                    if step % self.cfg.eval_every == 0 or step == end:
                        row.update(self.evaluate())
                    self.state.history.append(row)
                    info = (
                        f"loss {row['loss']:.3f} (denoise {row['denoise']:.3f}, ar {row['ar']:.3f}) "
                        f"{row['tokens_per_s']:.0f} tok/s lr {row['lr']:.2e}"
                    )
                    if "valid_denoise" in row:
                        info += f" | valid denoise {row['valid_denoise']:.3f} ar {row['valid_ar']:.3f}"
                    progress.update(task, completed=step, info=info)
                    if not console.is_terminal:
                        console.print(f"step {step}: {info}")
                    window, window_tokens, window_start = [], 0, time.perf_counter()
                if time.perf_counter() - last_ckpt > 60 * self.cfg.checkpoint_minutes:
                    self.save()
                    last_ckpt = time.perf_counter()
        self.save()
        return self.state


def steps_for_tokens(tokens: int, cfg: TrainConfig) -> int:
    """Steps needed to read `tokens` stream tokens at this batch size (mean prefix length)."""
    c = cfg.corruption
    per_step = cfg.batch_size * ((c.min_prefix + c.max_prefix) / 2 + c.canvas_length)
    return math.ceil(tokens / per_step)
