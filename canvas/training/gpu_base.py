"""Carrying the converted base to a lent GPU in pieces, and the adapter results back.

A device call carries at most 64 MiB with the repository, and the converted Gemma base is ~560 MB (fp32), so
`pack` writes it as groupwise int8 (each group of `GROUP` weights along a row shares one fp32 scale; vectors and
small tensors stay fp32), cut into `parts` files of ~26 MB, each with its sha256 in `base.json`. The matrices that
training replaces whole (experts, router, self-conditioning, the appended layer) travel as a recipe instead: zero
stays zero, the rest is drawn afresh from N(0, 0.02). Measured on 4 validation passages: encoder perplexity 22.81
exact, 22.87 from int8; int4 (groups of 128 or 32) gave 61.5 and 37.4 (the base was already 4-bit: no room left).
Each call stages one part outside $OUT (the warm machine keeps it); the training call joins and checks them,
dequantises and writes an ordinary model directory that `Trainer` fine-tunes
(`canvas.training.gpu_job train --base-staged DIR`).

The adapters trained on the int8 base are applied to the exact base here, as QLoRA applies adapters trained on a
quantised base; the figures that count are the evaluation here, on the exact merged model.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch
import torch.nn.functional as F

GROUP = 128
PREFIX, MANIFEST = "base.pt.", "base.json"


def _q8(t: torch.Tensor) -> dict[str, object]:
    """(..., K) float -> int8 codes (rows, groups, GROUP) and fp32 scales (rows, groups, 1)."""
    flat = t.reshape(-1, t.shape[-1]).float()
    pad = (-flat.shape[1]) % GROUP
    groups = F.pad(flat, (0, pad)).view(flat.shape[0], -1, GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    return {"q8": torch.round(groups / scale).clamp(-127, 127).to(torch.int8), "scale": scale,
            "shape": list(t.shape)}


def _dq8(d: dict[str, object]) -> torch.Tensor:
    q, scale, shape = d["q8"], d["scale"], d["shape"]
    assert isinstance(q, torch.Tensor) and isinstance(scale, torch.Tensor) and isinstance(shape, list)
    return (q.float() * scale).flatten(1)[:, : shape[-1]].reshape(shape)


def _trained_whole(name: str, n_layers: int) -> bool:
    """HF tensor names of the matrices the adapter set stores whole (their base values are only a start)."""
    if ".self_conditioning." in name or ".experts." in name or ".router.proj" in name:
        return True
    return f"layers.{n_layers - 1}." in name


def pack(model_dir: Path, out: Path, parts: int = 5) -> dict[str, object]:
    """Write `model_dir`'s weights as int8 parts plus `base.json` (config and sha256s) into `out`."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    n_layers = int(config["text_config"]["num_hidden_layers"])
    tensors = load_file(str(model_dir / "model.safetensors"))
    packed: dict[str, object] = {}
    for k, v in tensors.items():
        if v.dim() < 2 or v.numel() < 4096:
            packed[k] = v.float()
        elif _trained_whole(k, n_layers):
            packed[k] = {"init": "zeros" if not v.any() else "normal", "shape": list(v.shape)}
        else:
            packed[k] = _q8(v)
    buf = io.BytesIO()
    torch.save(packed, buf)
    data = buf.getvalue()
    size = -(-len(data) // parts)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(parts):
        chunk = data[i * size : (i + 1) * size]
        name = f"{PREFIX}{i:03d}"
        (out / name).write_bytes(chunk)
        names.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"config": json.loads((model_dir / "config.json").read_text()), "parts": names,
                "sha256": hashlib.sha256(data).hexdigest(), "group": GROUP}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def unpack(staged: Path, out: Path) -> Path:
    """Join and check the staged parts (and `base.json`) in `staged`; write a model directory at `out`."""
    from safetensors.torch import save_file

    manifest = json.loads((staged / MANIFEST).read_text())
    chunks = []
    for part in manifest["parts"]:
        path = staged / part["name"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} is not staged ({len(manifest['parts'])} parts expected)")
        chunk = path.read_bytes()
        if hashlib.sha256(chunk).hexdigest() != part["sha256"]:
            raise ValueError(f"{path}: sha256 differs from {MANIFEST} (a broken transfer?)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise ValueError("the joined base parts' sha256 differs")
    packed = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for k, v in packed.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        elif "q8" in v:
            tensors[k] = _dq8(v)
        elif v["init"] == "zeros":
            tensors[k] = torch.zeros(v["shape"])
        else:
            tensors[k] = torch.randn(v["shape"], generator=gen) * 0.02
        tensors[k] = tensors[k].contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(manifest["config"], indent=2) + "\n")
    return out
