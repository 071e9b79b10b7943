"""Loading errors name what is wrong; save -> load is exact; sharded checkpoints load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from canvas.model import DiffusionModel, ModelConfig, WeightsError


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    DiffusionModel(ModelConfig.from_name("tiny")).save_pretrained(str(path))
    return path


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_roundtrip_exact(saved: Path) -> None:
    a = DiffusionModel.from_pretrained(str(saved))
    b = DiffusionModel.from_pretrained(str(saved))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert a.config == ModelConfig.from_name("tiny").replace(name=a.config.name)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="not a directory"):
        DiffusionModel.from_pretrained(str(tmp_path / "nope"))


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="no config.json"):
        DiffusionModel.from_pretrained(str(tmp_path))


def test_wrong_model_type(saved: Path, tmp_path: Path) -> None:
    d = copy_dir(saved, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="model_type is 'llama'"):
        DiffusionModel.from_pretrained(str(d))


def test_missing_weights_file(saved: Path, tmp_path: Path) -> None:
    d = copy_dir(saved, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors"):
        DiffusionModel.from_pretrained(str(d))


def test_missing_tensor_is_named(saved: Path, tmp_path: Path) -> None:
    d = copy_dir(saved, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.decoder.layers.1.router.proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"layers\.1\.router\.proj\.weight"):
        DiffusionModel.from_pretrained(str(d))


def test_shape_mismatch_is_named(saved: Path, tmp_path: Path) -> None:
    d = copy_dir(saved, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.decoder.layers.2.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"layers\.2\.mlp\.down_proj\.weight.*\(3, 3\)"):
        DiffusionModel.from_pretrained(str(d))


def test_sharded_checkpoint(saved: Path, tmp_path: Path) -> None:
    d = copy_dir(saved, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, chunk in (("model-00001-of-00002.safetensors", names[:half]),
                         ("model-00002-of-00002.safetensors", names[half:])):
        save_file({n: tensors[n] for n in chunk}, str(d / shard))
        weight_map.update({n: shard for n in chunk})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = DiffusionModel.from_pretrained(str(d))
    b = DiffusionModel.from_pretrained(str(saved))
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="shard model-00002-of-00002.safetensors"):
        DiffusionModel.from_pretrained(str(d))


def test_bad_config_values() -> None:
    with pytest.raises(ValueError, match="top_k_experts=9 exceeds num_experts=8"):
        ModelConfig.from_name("tiny").replace(top_k_experts=9)
    with pytest.raises(ValueError, match="last layer must use full_attention"):
        ModelConfig.from_name("tiny").replace(layer_types=("full_attention",) * 3 + ("sliding_attention",))
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_name("huge")
