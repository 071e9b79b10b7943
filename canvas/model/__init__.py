"""Our DiffusionGemma text model: config, KV cache, the model (encode / denoise) and weight I/O.

Modules: `config` (`ModelConfig`, presets), `cache` (the static `KVCache`), `model` (`DiffusionModel`), `decode`
(the encoder's one-token decode step written for few ops, and `DecodeCompiler`, which compiles its halves once per
process), `band` (a long pass's sliding-window attention computed block by block over the band each query sees),
`io` (the HF-layout weights), `int8` (int8 decode weights), `cpu` (dtype, threads and allocator for the
CPU), `tokenizer` (the embedded model's byte-level BPE: training, saving, special ids).

It imports `kernels`, `canvas.sampling` (the sampler defaults saved with the weights) and `canvas.env` (the
dtype, int8 and compile variables), nothing above; the conversion, the engine, the eval, training and the
benchmarks import it.
Imports: `canvas`, `canvas.sampling` and `kernels`.
Imported by: `canvas.bench`, `canvas.convert`, `canvas.engine`, `canvas.eval` and `canvas.training`.
"""

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
