"""Our DiffusionGemma text model: config, KV cache, the model (encode / denoise) and weight I/O.

Modules: `config` (`ModelConfig`, presets), `cache` (the static `KVCache`), `model` (`DiffusionModel`), `io` (the
HF-layout weights), `int8` (int8 decode weights), `cpu` (dtype, threads and allocator for the CPU), `tokenizer`
(the embedded model's byte-level BPE: training, saving, special ids). Imports `kernels` and `canvas.sampling` (the
sampler defaults saved with the weights), nothing above; imported by the conversion, the engine and everything
over it."""

from __future__ import annotations

from pathlib import Path

import torch

from canvas.model.cache import KVCache
from canvas.model.config import PRESETS, ModelConfig, RopeConfig
from canvas.model.io import WeightsError, load_dir, load_tensors, save_pretrained
from canvas.model.model import DiffusionModel

__all__ = [
    "PRESETS",
    "DiffusionModel",
    "KVCache",
    "ModelConfig",
    "RopeConfig",
    "WeightsError",
    "load_pretrained",
    "load_state_dict_hf",
    "save_pretrained",
]


def load_pretrained(path: str | Path, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> DiffusionModel:
    """Our model from a model directory (`DiffusionModel.from_pretrained` as a function)."""
    return load_dir(DiffusionModel, path, device=device, dtype=dtype)


def load_state_dict_hf(config: ModelConfig, tensors: dict[str, torch.Tensor], *, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> DiffusionModel:
    """Our model from tensors named as in a transformers `DiffusionGemmaForBlockDiffusion.state_dict()`."""
    return load_tensors(DiffusionModel, config, tensors, device=device, dtype=dtype)
