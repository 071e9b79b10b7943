"""Fine-tuning a converted model under low-rank adapters: exact start, what trains, checkpoints, export + merge."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch
from rich.console import Console

from canvas.convert.adapters import apply_adapters
from canvas.model import PRESETS, DiffusionModel
from canvas.training.adapt import adapter_tensors, attach_lora, export_adapters
from canvas.training.train import TrainConfig, Trainer, model_config


def _logits(model: DiffusionModel, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (1, 6), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
    with torch.no_grad():
        return model.denoise(canvas, model.encode(prompt)[1])


def round_to_bf16(model: DiffusionModel) -> None:
    with torch.no_grad():
        for v in adapter_tensors(model).values():
            v.copy_(v.to(torch.bfloat16).float())


def test_adapters_start_exact_and_train_only_the_new_parts() -> None:
    model = DiffusionModel(PRESETS["tiny"])
    before = _logits(model)
    attach_lora(model, rank=4, alpha=8.0)
    assert torch.equal(_logits(model), before)  # B = 0: the converted model exactly
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "embed" not in trainable
    assert "layers.0.attn.parametrizations.qkv.0.lora_A" in trainable
    assert "layers.0.attn.parametrizations.qkv.original" not in trainable
    assert "layers.0.experts_gate_up" in trainable and "self_conditioning.down" in trainable
    assert "layers.0.post_feedforward_layernorm" in trainable
    assert "layers.0.post_feedforward_layernorm_1" not in trainable  # a conversion constant
    last = model.config.num_hidden_layers - 1
    assert f"layers.{last}.attn.qkv" in trainable  # the appended layer trains whole
    names = set(adapter_tensors(model))
    assert "layers.0.attn.qkv.lora_B" in names and "layers.0.attn.qkv" not in names and "embed" not in names


def test_export_then_merge_reproduces_the_adapted_model(tmp_path: Path) -> None:
    base = DiffusionModel(PRESETS["tiny"])
    model = DiffusionModel(PRESETS["tiny"], init=False)
    model.load_state_dict(base.state_dict())
    attach_lora(model, rank=4, alpha=8.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    export_adapters(model, tmp_path / "a")
    merged = apply_adapters(base, tmp_path / "a")
    # The adapters are stored in bf16: the merged model is the adapted one with its trained tensors so rounded.
    # (No tolerance against the unrounded one: a random tiny model's top-k routing flips on tiny changes.)
    round_to_bf16(model)
    torch.testing.assert_close(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)
    (tmp_path / "a" / "adapters.safetensors").write_bytes(b"broken")
    with pytest.raises(ValueError, match="sha256"):
        apply_adapters(DiffusionModel(PRESETS["tiny"]), tmp_path / "a")


def test_a_base_run_trains_resumes_and_exports(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    from canvas.training.tokens import TokenArrays

    data = TokenArrays.open(tiny_data["tokens"], "train")
    cfg = model_config("tiny", data.special_ids, int(data.meta["vocab_size"]))
    DiffusionModel(dataclasses.replace(cfg, name="tiny-base")).save_pretrained(str(tmp_path / "base"))
    train = TrainConfig(model="tiny", tokens_dir=str(tiny_data["tokens"]), tokenizer_dir=str(tiny_data["tokenizer"]),
                        corpus_dir=str(tiny_data["corpus"]), batch_size=2, max_steps=6, warmup_steps=1, log_every=2,
                        eval_every=4, eval_batches=1, base=str(tmp_path / "base"), lora_rank=2)
    console = Console(file=io.StringIO())
    a = Trainer(tmp_path / "run", train)
    a.fit(max_minutes=None, stop_at_step=3, console=console)
    ckpt = torch.load(a.checkpoint_path, weights_only=False)
    assert "embed" not in ckpt["model"]  # the frozen base is not checkpointed
    b = Trainer(tmp_path / "run", train)
    assert b.load()
    b.fit(max_minutes=None, stop_at_step=None, console=console)
    c = Trainer(tmp_path / "run2", train)  # uninterrupted, for comparison
    c.fit(max_minutes=None, stop_at_step=None, console=console)
    for (name, pb), pc in zip(adapter_tensors(b.model).items(), adapter_tensors(c.model).values(), strict=True):
        assert torch.equal(pb, pc), name  # resumed bit for bit
    from canvas.training.adapt import export_base_run

    out = export_base_run(tmp_path / "base", b.model, b.state.history, tmp_path / "export")
    merged = DiffusionModel.from_pretrained(str(out))
    round_to_bf16(b.model)
    torch.testing.assert_close(_logits(merged), _logits(b.model), rtol=1e-5, atol=1e-5)
    assert (out / "adapters" / "adapters.json").is_file() and (out / "loss_curve.csv").is_file()
