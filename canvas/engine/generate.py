"""Static-batch block-diffusion generation: the reference `generate` loop on our model and sampler.

`generate_static` mirrors `DiffusionGemmaGenerationMixin.generate` (transformers 5.23.0) step for step: encode the
prompt, refine a canvas until every row stops or `max_steps` runs out, commit the argmax canvas through the encoder,
repeat for the next canvas, pad after EOS. Rows that have stopped stay in the batch frozen (the reference keeps
running them), which keeps the random stream identical: with `ReferenceNoise` and the same seed, the tokens equal
the reference's. Pins (B, L) extend it: pinned slots keep their token throughout every canvas.

This is the parity path and the baseline of `dcanvas bench engine`; interactive use goes through `canvas.engine.core`,
which batches continuously and stops rows individually.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from canvas.model import DiffusionModel
from canvas.sampling.sampler import (
    NoiseSource,
    ReferenceNoise,
    SamplerConfig,
    StoppingState,
    select_accepted,
    step_stats,
)


@dataclass
class StaticResult:
    sequences: Tensor  # (B, T + generated) prompt followed by the committed canvases, pad after EOS
    tokens_per_forward: Tensor  # (B,) fp32, as the reference counts it
    forwards: Tensor  # (B,) decoder passes each row needed
    steps: list[int]  # denoising steps run per canvas
    wall_s: float


@torch.no_grad()
def refine_canvas(model: DiffusionModel, cache, config: SamplerConfig, noise: NoiseSource, *,
                  pinned: Tensor | None = None, pinned_ids: Tensor | None = None,
                  on_step=None) -> tuple[Tensor, Tensor, int]:
    """Refine one batch of canvases to convergence. Returns (argmax canvas (B, L), forwards (B,), steps run)."""
    B, L, V = cache.batch_size, model.config.canvas_length, model.config.vocab_size
    dev = model.device
    free = torch.ones(B, L, dtype=torch.bool, device=dev) if pinned is None else ~pinned
    canvas = noise.uniform_tokens((B, L), V, dev)
    if pinned is not None and pinned_ids is not None:
        canvas = torch.where(pinned, pinned_ids, canvas)
    argmax = canvas
    soft: Tensor | None = None
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    forwards = torch.zeros(B, dtype=torch.long, device=dev)
    stopping = StoppingState(config.stability_threshold, config.confidence_threshold, B, L, dev)
    steps = 0
    for remaining in range(config.max_steps, 0, -1):
        forwards += ~finished
        logits = model.denoise(canvas, cache, soft_embeddings=soft)  # (B, L, V) fp32, ours to modify
        processed = logits.div_(config.temperature(remaining))
        stats = step_stats(processed, noise)
        accepted = select_accepted(stats.entropy, free, config.entropy_bound)
        renoise = noise.uniform_tokens((B, L), V, dev)
        new_canvas = torch.where(accepted, stats.sample, renoise)
        new_argmax = stats.argmax
        if pinned is not None and pinned_ids is not None:
            new_canvas = torch.where(pinned, pinned_ids, new_canvas)
            new_argmax = torch.where(pinned, pinned_ids, new_argmax)
        new_soft = model.soft_embeddings(processed)
        del logits, processed
        if finished.any():
            keep = finished[:, None]
            new_argmax = torch.where(keep, argmax, new_argmax)
            new_canvas = torch.where(keep, canvas, new_canvas)
            assert soft is not None  # a row can only have finished after a first step
            new_soft = torch.where(keep[..., None], soft, new_soft)
        finished |= stopping.update(new_argmax, stats.entropy, free) & ~finished
        canvas, argmax, soft = new_canvas, new_argmax, new_soft
        steps += 1
        if on_step is not None:
            on_step(steps, argmax, accepted, stats.entropy)
        if bool(finished.all()):
            break
    return argmax, forwards, steps


@torch.no_grad()
def generate_static(model: DiffusionModel, input_ids: Tensor, config: SamplerConfig, *,
                    attention_mask: Tensor | None = None, max_new_tokens: int | None = None,
                    noise: NoiseSource | None = None, eos_token_ids: tuple[int, ...] | None = None,
                    pad_token_id: int | None = None) -> StaticResult:
    """Generate `ceil(max_new_tokens / L)` canvases after `input_ids` (B, T), stopping rows on EOS."""
    t0 = time.perf_counter()
    cfg = model.config
    L = cfg.canvas_length
    B, T = input_ids.shape
    noise = noise if noise is not None else ReferenceNoise()
    eos = cfg.eos_token_ids if eos_token_ids is None else eos_token_ids
    pad = cfg.pad_token_id if pad_token_id is None else pad_token_id
    n_canvases = math.ceil((max_new_tokens if max_new_tokens is not None else L) / L)
    cache = model.new_cache(B, T + L * n_canvases)
    model.encode(input_ids, attention_mask, cache, logits="none")
    sequences = input_ids
    finished_seq = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    forwards = torch.zeros(B, dtype=torch.long, device=input_ids.device)
    eos_t = torch.tensor(eos, device=input_ids.device)
    steps = []
    for n in range(n_canvases):
        canvas, row_forwards, n_steps = refine_canvas(model, cache, config, noise)
        forwards += row_forwards * ~finished_seq
        steps.append(n_steps)
        previously_finished = finished_seq.clone()
        is_eos = torch.isin(canvas, eos_t)
        finished_seq |= is_eos.any(dim=-1)
        if pad is not None:
            canvas[previously_finished] = pad
            cum = is_eos.cumsum(dim=-1)
            after_eos = (cum > 0) & ~((cum == 1) & is_eos)
            newly = (finished_seq & ~previously_finished)[:, None]
            canvas = torch.where(after_eos & newly, torch.full_like(canvas, pad), canvas)
        sequences = torch.cat([sequences, canvas], dim=-1)
        if bool(finished_seq.all()) or n == n_canvases - 1:
            break
        model.encode(canvas, None, cache, logits="none")
    new = sequences[:, T:]
    valid = (new != pad).sum(-1) if pad is not None else torch.full((B,), new.shape[1])
    return StaticResult(sequences, valid.float() / forwards.clamp(min=1), forwards, steps,
                        time.perf_counter() - t0)
