"""Our DiffusionGemma text model: config, KV cache, the model (encode / denoise) and weight I/O."""

from __future__ import annotations

from canvas.model.cache import KVCache
from canvas.model.config import PRESETS, ModelConfig, RopeConfig
from canvas.model.io import WeightsError, load_pretrained, load_state_dict_hf, save_pretrained
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
