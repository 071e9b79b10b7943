"""Run the tiny model once and save its outputs: imported by the parent test, run as a script with the Triton
interpreter forced (TRITON_INTERPRET=1, DCANVAS_KERNELS=triton) in a child process."""

from __future__ import annotations

import dataclasses
import sys

import torch

from canvas.engine.generate import generate_static
from canvas.model import PRESETS, DiffusionModel
from canvas.sampling.sampler import ReferenceNoise, SamplerConfig


def outputs() -> dict[str, torch.Tensor]:
    cfg = dataclasses.replace(PRESETS["tiny"], canvas_length=8)
    torch.manual_seed(0)
    model = DiffusionModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (1, 6), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
    sc = 3 * torch.randn(1, cfg.canvas_length, cfg.vocab_size, generator=g)
    enc, cache = model.encode(prompt)
    dec = model.denoise(canvas, cache, sc)
    torch.manual_seed(2)
    gen = generate_static(
        model, prompt, SamplerConfig(max_steps=3), max_new_tokens=cfg.canvas_length, noise=ReferenceNoise()
    ).sequences
    return {"encoder": enc, "decoder": dec, "tokens": gen}


if __name__ == "__main__":
    torch.save(outputs(), sys.argv[1])
