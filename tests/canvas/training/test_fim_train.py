"""The FIM fine-tune: what trains, bit-for-bit resume, export -> build -> the trained model's logits, and a build
without FIM adapters left as it was."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer

from canvas.model import DiffusionModel
from canvas.training.fim import FimDataConfig, fim_prompt, fim_tokens
from canvas.training.fim_train import FimTrainConfig, FimTrainer, SentinelRows, export_fim_adapters, fim_tensors

DATA = FimDataConfig(seq_len=64, max_middle=16, max_prefix=16, max_suffix=12, min_fim_piece=12)


def _cfg(fim_base: dict[str, Path], **kw: object) -> FimTrainConfig:
    return dataclasses.replace(
        FimTrainConfig(base=str(fim_base["base"]), tokens_dir=str(fim_base["tokens"]),
                       corpus_dir=str(fim_base["corpus"]), batch_size=2, lr=1e-2, warmup_steps=1, max_steps=4,
                       lora_rank=2, lora_alpha=4.0, log_every=1, eval_every=2, eval_batches=1, data=DATA),
        **kw,
    )  # fmt: skip


def _quiet() -> Console:
    return Console(file=io.StringIO())


def test_only_adapters_and_sentinel_rows_train(fim_base: dict[str, Path], tmp_path: Path) -> None:
    t = FimTrainer(tmp_path / "run", _cfg(fim_base))
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    rows_before = t.rows.rows.detach().clone()
    assert "embed" in frozen and not any(n.endswith("lora_A") for n in frozen)
    last = t.model.config.num_hidden_layers - 1
    trained = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert trained and all("_lora." in n and not n.startswith(f"layers.{last}.") for n in trained)
    t.train_step()
    for n, p in t.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert not torch.equal(t.rows.rows, rows_before)  # the sentinel rows moved, the embedding did not
    assert all(v.abs().sum() > 0 for k, v in fim_tensors(t.model, t.rows).items() if k.endswith("lora_B"))


def test_a_low_rank_weight_is_the_merged_matrix_with_the_adapters_gradients() -> None:
    from canvas.training.adapt import LoRA
    from canvas.training.fim_train import LowRankWeight

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(12, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    lora = LoRA(12, 8, 2, 4.0, g)
    with torch.no_grad():
        lora.lora_B.normal_(generator=g)
    y = torch.nn.functional.linear(x, LowRankWeight(w, lora))
    merged = w + lora.lora_B @ lora.lora_A * lora.scale
    torch.testing.assert_close(y, x @ merged.T, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    a, b = lora.lora_A.grad, lora.lora_B.grad
    lora.zero_grad()
    (x @ lora(w).T).square().sum().backward()
    torch.testing.assert_close(a, lora.lora_A.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b, lora.lora_B.grad, rtol=1e-4, atol=1e-4)
    # lora_B starts at zero: before any step the adapted model is the base exactly (checked by the build test).


def test_resume_is_bit_for_bit(fim_base: dict[str, Path], tmp_path: Path) -> None:
    cfg = _cfg(fim_base)
    a = FimTrainer(tmp_path / "run", cfg)
    a.fit(max_minutes=None, stop_at_step=2, console=_quiet())
    b = FimTrainer(tmp_path / "run", cfg)
    assert b.load() and b.state.step == 2
    b.fit(max_minutes=None, stop_at_step=None, console=_quiet())
    c = FimTrainer(tmp_path / "straight", cfg)
    c.fit(max_minutes=None, stop_at_step=None, console=_quiet())
    tb, tc = fim_tensors(b.model, b.rows), fim_tensors(c.model, c.rows)
    assert set(tb) == set(tc)
    for name in tb:
        assert torch.equal(tb[name], tc[name]), name
    assert b.state.tokens_seen == c.state.tokens_seen
    rows = [r for r in c.state.history if "valid_fim" in r]
    assert [r["step"] for r in rows] == [0, 2, 4] and rows[0]["plain_ppl_ratio"] == 1.0
    ckpt = torch.load(b.checkpoint_path, weights_only=False)
    assert "embed" not in ckpt["adapters"]  # the frozen base is not checkpointed
    assert (tmp_path / "run" / "loss.csv").is_file()


def _trained_logits(model: DiffusionModel, rows: SentinelRows, ids: torch.Tensor) -> torch.Tensor:
    """The trained model's AR logits with the sentinel rows in the input and the tied head. (1, T) -> (1, T, V)."""
    from canvas.training.fim import Rows, attention_mask

    T = ids.shape[1]
    batch = Rows(ids, torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long))
    masks = {s: attention_mask(batch, model.config.sliding_window if s else None) for s in (False, True)}
    x = model.run_layers(rows.embed(model, ids), batch.positions,
                         lambda i, k, v: (k, v, masks[model.blocks[i].attn.sliding]), decoder=False)
    weight = model.embed.detach().clone()
    weight[rows.ids] = rows.rows.detach()
    cfg = model.config
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps, -0.5) * model.norm.float()
    logits = torch.nn.functional.linear(h, weight)
    cap = cfg.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


def test_export_then_build_gives_the_trained_models_logits(fim_base: dict[str, Path], tmp_path: Path) -> None:
    from canvas.convert.build import apply_fim

    t = FimTrainer(tmp_path / "run", _cfg(fim_base))
    t.fit(max_minutes=None, stop_at_step=3, console=_quiet())
    out = export_fim_adapters(t, tmp_path / "fim-adapters")
    meta = json.loads((out / "adapters.json").read_text())
    assert meta["objective"] == "fim" and meta["step"] == 3
    tok = Tokenizer.from_file(str(fim_base["base"] / "tokenizer.json"))
    ft = fim_tokens(tok)
    ids = torch.tensor([fim_prompt(ft, tok.encode("In the beginning God").ids, tok.encode(" the earth.").ids)])
    base = DiffusionModel.from_pretrained(str(fim_base["base"]))
    with torch.no_grad():
        before, _ = base.encode(ids)
        merged = apply_fim(base, fim_base["base"], out)
        after, _ = merged.encode(ids)
        trained = _trained_logits(t.model.eval(), t.rows, ids)
    # The trained model runs x W^T + (x A^T) B^T s, the merged one x (W + B A s)^T: equal up to fp32 rounding (the
    # real 64k model: 3e-5 relative on logits of ~100 after a 2-step smoke run, the same argmax everywhere).
    torch.testing.assert_close(after, trained, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, before, atol=1e-3)  # the adapters did something
    (out / "adapters.safetensors").write_bytes(b"broken")
    with pytest.raises(ValueError, match="sha256"):
        apply_fim(DiffusionModel.from_pretrained(str(fim_base["base"])), fim_base["base"], out)


def test_a_build_without_fim_adapters_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from canvas.convert import build
    from canvas.sampling.sampler import EXTRA_FILE, SamplerConfig, extra_settings, load_sampler_defaults

    monkeypatch.setattr(build, "FIM_ADAPTERS", tmp_path / "none")
    fp = build.fingerprint(build.BuildConfig(), "sha")
    assert "fim_adapters" not in fp  # a model built before FIM stays up to date
    plain = extra_settings(SamplerConfig(ar_temperature=0.7))
    assert "fim" not in plain and plain["ar_temperature"] == 0.7  # the file a build wrote before FIM
    (tmp_path / "fim").mkdir()
    (tmp_path / "fim" / "adapters.json").write_text("{}")
    monkeypatch.setattr(build, "FIM_ADAPTERS", tmp_path / "fim")
    assert build.fingerprint(build.BuildConfig(), "sha")["fim_adapters"] is not None  # recorded by its hash
    model = tmp_path / "model"
    model.mkdir()
    (model / EXTRA_FILE).write_text(json.dumps(extra_settings(SamplerConfig(fim=True))))
    assert load_sampler_defaults(model).fim is True
    (model / EXTRA_FILE).write_text(json.dumps({"fim": "yes"}))
    with pytest.raises(ValueError, match="fim"):
        load_sampler_defaults(model)


def test_the_command_trains_resumes_and_exports(fim_base: dict[str, Path], tmp_path: Path) -> None:
    from canvas.cli import main

    common = ["train", "--objective", "fim", "--run", str(tmp_path / "run"), "--seq-len", "64"]
    first = ["--base", str(fim_base["base"]), "--tokens-dir", str(fim_base["tokens"]), "--corpus-dir",
             str(fim_base["corpus"]), "--batch-size", "1", "--max-steps", "2", "--eval-every", "2", "--lora-rank", "2"]
    assert main([*common, *first, "--stop-at-step", "1"]) == 0
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["lora_rank"] == 2 and saved["data"]["seq_len"] == 64
    assert main(common) == 0  # resumes from the saved config
    out = tmp_path / "adapters"
    assert main([*common, "--export-only", "--export", str(out)]) == 0
    assert json.loads((out / "adapters.json").read_text())["step"] == 2
    assert main(["train", "--objective", "fim", "--run", str(tmp_path / "new")]) == 2  # a new run needs --base


def test_the_curve_plots_from_the_runs_log(fim_base: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from canvas.training.fim_curve import main, read_curve

    t = FimTrainer(tmp_path / "run", _cfg(fim_base, max_steps=2))
    t.fit(max_minutes=None, stop_at_step=None, console=_quiet())
    rows = read_curve(tmp_path / "run")
    assert [r["step"] for r in rows if "valid_fim" in r] == [0, 2]
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bf16_only_where_the_device_has_native_bf16(fim_base: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from canvas.model import cpu
    from canvas.training.fim_train import uses_bf16

    cfg = _cfg(fim_base)
    for kind, want in (("avx2", False), ("other", False), ("avx512_bf16", True), ("amx", True)):
        monkeypatch.setattr(cpu, "cpu_kind", lambda features=None, k=kind: k)
        assert uses_bf16(cfg, torch.device("cpu")) is want, kind
    assert uses_bf16(cfg, torch.device("cuda")) is True
    assert uses_bf16(dataclasses.replace(cfg, bf16=False), torch.device("cuda")) is False
