"""The FIM fine-tune's cost model and `dcanvas train --objective fim --bench`: training tokens per second, FLOPs per
packed token by part (with the plain anchor's base pass when the run has one), and the share of the CPU's measured
matmul rate the training reaches. Reads a `FimTrainer`; changes nothing it saves."""

from __future__ import annotations

import math
import time

import torch

from canvas.model import DiffusionModel
from canvas.training.fim import PLAIN, Rows, sample_rows
from canvas.training.fim_train import FimTrainer, plain_pieces


def flops_per_token(model: DiffusionModel, batch: Rows, anchor: float = 0.0) -> dict[str, float]:
    """Training FLOPs per packed token, by part: the layers' frozen matrices (forward and input gradient: 4 per
    weight), the adapters (forward, input and weight gradients: 6 per weight), attention over each token's actual
    context in `batch`, the head at the loss positions only, and with an anchor the base's forward over the plain
    pieces and its head at the plain targets."""
    cfg = model.config
    dense = adapted = 0.0
    for name, p in model.named_parameters():
        if not name.startswith("layers.") or p.dim() < 2:
            continue
        n = float(p.numel()) * (cfg.top_k_experts / cfg.num_experts if p.dim() == 3 else 1.0)
        if p.requires_grad:
            adapted += n
        else:
            dense += n
    real = batch.segment >= 0
    ctx = torch.clamp(batch.positions[real].float() + 1, max=float(cfg.sliding_window)).mean().item()
    attn = sum(4.0 * b.attn.n_heads * b.attn.head_dim * ctx for b in model.blocks)  # QK^T and PV, forward
    loss_frac = float((batch.kind[:, 1:] != 0).sum()) / max(1, int(real.sum()))
    parts = {"matrices": 4 * dense + 6 * adapted, "attention": 3 * attn,
             "head": loss_frac * 4.0 * cfg.vocab_size * cfg.hidden_size}  # fmt: skip
    if anchor > 0:
        plain = plain_pieces(batch)
        n_real = max(1, int(real.sum()))
        plain_frac = float((plain.segment >= 0).sum()) / n_real
        plain_loss_frac = float((plain.kind[:, 1:] == PLAIN).sum()) / n_real
        head = plain_loss_frac * 2.0 * cfg.vocab_size * cfg.hidden_size
        parts["anchor"] = plain_frac * (2 * (dense + adapted) + attn) + head
    return {**parts, "total": sum(parts.values())}


def matmul_gflops(seconds: float = 2.0) -> float:
    """The CPU's fp32 matmul rate at the current thread count, on the fine-tune's own shape ((512, 640) @ (640,
    2048), the MLP's), best of repeated timings over about `seconds`."""
    a, b = torch.randn(512, 640), torch.randn(640, 2048)
    best, t_end = math.inf, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 512 * 640 * 2048 / best / 1e9


def bench(trainer: FimTrainer, steps: int = 3) -> dict[str, float]:
    """Training tokens per second over `steps` steps after one warm-up (nothing saved), the FLOPs per token, the
    measured matmul rate, and the share of that rate the training reaches."""
    trainer.train_step()
    t0, tokens = time.perf_counter(), 0
    for _ in range(steps):
        before = trainer.state.tokens_seen
        trainer.train_step()
        tokens += trainer.state.tokens_seen - before
    tps = tokens / (time.perf_counter() - t0)
    batch = sample_rows(trainer.train_data, trainer.cfg.data, trainer.cfg.batch_size, trainer.cfg.seed, 0)
    flops = flops_per_token(trainer.model, batch, trainer.cfg.plain_anchor)
    rate = matmul_gflops()
    return {"tokens_per_s": tps, "gflop_per_token": flops["total"] / 1e9, "matmul_gflops": rate,
            "of_matmul_rate": tps * flops["total"] / 1e9 / rate, "threads": torch.get_num_threads(),
            **{f"gflop_{k}": v / 1e9 for k, v in flops.items() if k != "total"}}  # fmt: skip
