"""The FIM fine-tune: what trains, bit-for-bit resume, export -> build -> the trained model's logits, and a build
without FIM adapters left as it was."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer

from canvas.convert.fim import fim_prompt, fim_tokens
from canvas.model import DiffusionModel
from canvas.training.fim import FIM, PLAIN, FimDataConfig, Rows, sample_rows
from canvas.training.fim_train import (
    FimTrainConfig,
    FimTrainer,
    SentinelRows,
    anchored_losses,
    base_plain_logprobs,
    export_fim_adapters,
    fim_tensors,
    packed_losses,
    plain_pieces,
    teaching_states,
)

DATA = FimDataConfig(seq_len=64, max_middle=16, max_prefix=16, max_suffix=12, min_fim_piece=12)


def _cfg(fim_base: dict[str, Path], **kw: Any) -> FimTrainConfig:
    return dataclasses.replace(
        FimTrainConfig(base=str(fim_base["base"]), tokens_dir=str(fim_base["tokens"]),
                       corpus_dir=str(fim_base["corpus"]), batch_size=2, lr=1e-2, warmup_steps=1, max_steps=4,
                       lora_rank=2, lora_alpha=4.0, log_every=1, eval_every=2, eval_batches=1, data=DATA,
                       plain_teacher="base"),
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
    from canvas.training.fim_train import LowRankWeight, adapters_off

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(12, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    lora = LoRA(12, 8, 2, 4.0, g)
    with torch.no_grad():
        lora.lora_B.normal_(generator=g)
    y = torch.nn.functional.linear(x, LowRankWeight(w, lora))
    merged = w + lora.lora_B @ lora.lora_A * lora.scale
    torch.testing.assert_close(y, x @ merged.T, rtol=1e-5, atol=1e-5)
    with adapters_off():  # the base: the frozen matrix alone
        torch.testing.assert_close(torch.nn.functional.linear(x, LowRankWeight(w, lora)), x @ w.T)
    y.square().sum().backward()
    a, b = lora.lora_A.grad, lora.lora_B.grad
    lora.zero_grad()
    (x @ lora(w).T).square().sum().backward()
    torch.testing.assert_close(a, lora.lora_A.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b, lora.lora_B.grad, rtol=1e-4, atol=1e-4)
    # lora_B starts at zero: before any step the adapted model is the base exactly (checked by the build test).


@pytest.mark.parametrize("anchor", [0.0, 0.9])
def test_resume_is_bit_for_bit(fim_base: dict[str, Path], tmp_path: Path, anchor: float) -> None:
    cfg = _cfg(fim_base, plain_anchor=anchor)
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
    assert rows[0]["valid_plain_kl"] == pytest.approx(0.0, abs=1e-5) and rows[-1]["valid_plain_kl"] > 0  # drift
    assert all(("plain_kl" in r) == (anchor > 0) for r in c.state.history[1:])
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
    assert before is not None and after is not None
    # The trained model runs x W^T + (x A^T) B^T s, the merged one x (W + B A s)^T: equal up to fp32 rounding (the
    # real 64k model: 3e-5 relative on logits of ~100 after a 2-step smoke run, the same argmax everywhere).
    torch.testing.assert_close(after, trained, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(after, before, atol=1e-3)  # the adapters did something
    (out / "adapters.safetensors").write_bytes(b"broken")
    with pytest.raises(ValueError, match="sha256"):
        apply_fim(DiffusionModel.from_pretrained(str(fim_base["base"])), fim_base["base"], out)


def test_a_build_without_fim_adapters_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from canvas.convert import build
    from canvas.sampling.modes import EXTRA_FILE
    from canvas.sampling.sampler import SamplerConfig, extra_settings, load_sampler_defaults

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


# ---- the plain anchor: KL from the frozen base on plain targets ----------------------------------------------------
def _batch(t: FimTrainer, fim_rate: float = 0.5, step: int = 0) -> Rows:
    data = dataclasses.replace(t.cfg.data, fim_rate=fim_rate)
    return sample_rows(t.train_data, data, 2, seed=1, step=step)


def _perturb(t: FimTrainer) -> None:
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, v in fim_tensors(t.model, t.rows).items():
            if name.endswith("lora_B"):
                v.copy_(torch.randn(v.shape, generator=g) * 0.05)


def test_plain_pieces_keep_the_plain_targets_whole_and_in_order(fim_base: dict[str, Path], tmp_path: Path) -> None:
    t = FimTrainer(tmp_path / "run", _cfg(fim_base))
    batch = _batch(t)
    plain = plain_pieces(batch)
    assert (batch.kind == FIM).any() and not (plain.kind == FIM).any()
    assert plain.tokens < batch.tokens and plain.ids.shape[1] == int((plain.segment >= 0).sum(1).max())
    for r in range(2):
        want = batch.ids[r, 1:][batch.kind[r, 1:] == PLAIN]
        assert torch.equal(plain.ids[r, 1:][plain.kind[r, 1:] == PLAIN], want)
        kept = plain.segment[r] >= 0
        assert (plain.positions[r][kept] == 0).sum() == len(set(plain.segment[r][kept].tolist()))  # whole pieces


def test_the_anchor_is_zero_at_zero_adapters_and_only_on_plain_targets(fim_base: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    t = FimTrainer(tmp_path / "run", _cfg(fim_base, plain_anchor=0.75))
    batch = _batch(t)
    with torch.no_grad():
        out = anchored_losses(t.model, t.rows, batch, 0.75)
    plain, fim = out.kind == PLAIN, out.kind == FIM
    assert out.kl is not None and out.kl.numel() == int(plain.sum()) and fim.any()
    torch.testing.assert_close(out.kl, torch.zeros_like(out.kl), rtol=0, atol=1e-5)  # lora_B = 0: the base itself
    _perturb(t)
    with torch.no_grad():
        out = anchored_losses(t.model, t.rows, batch, 0.75)
        ce, _ = packed_losses(t.model, t.rows, batch)
    assert out.kl is not None and float(out.kl.min()) >= -1e-6 and float(out.kl.mean()) > 1e-4
    torch.testing.assert_close(out.ce, ce)
    assert torch.equal(out.loss[fim], out.ce[fim])  # FIM middles keep the hard CE
    torch.testing.assert_close(out.loss[plain], 0.25 * out.ce[plain] + 0.75 * out.kl)
    old = anchored_losses(t.model, t.rows, batch, 0.0)
    assert old.kl is None and torch.equal(old.loss, old.ce)  # anchor 0: the old objective, no base pass


def test_the_anchor_reads_the_frozen_base_and_trains_only_the_adapters(fim_base: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    t = FimTrainer(tmp_path / "run", _cfg(fim_base))
    _perturb(t)
    batch = _batch(t, fim_rate=0.0)
    base = DiffusionModel.from_pretrained(str(fim_base["base"]))
    with torch.no_grad():
        logits = base.encode(batch.ids[:1, : int((batch.segment[0] == 0).sum())])[0]  # row 0's first piece alone
        assert logits is not None
        want = torch.log_softmax(logits[0, :-1].float(), -1)
    got = base_plain_logprobs(t.model, t.rows, batch)  # adapters perturbed, switched off for the teacher
    assert not got.requires_grad
    torch.testing.assert_close(got[: want.shape[0]], want, rtol=1e-4, atol=1e-4)
    out = anchored_losses(t.model, t.rows, batch, 1.0)
    assert out.kl is not None
    out.kl.sum().backward()
    with_grad = {n for n, p in t.model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in t.model.named_parameters() if p.requires_grad}
    grads = [t.model.get_parameter(n).grad for n in with_grad if n.endswith("lora_B")]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    assert base.embed.grad is None and t.model.embed.grad is None


def test_the_anchor_reads_the_teacher_it_is_given(fim_base: dict[str, Path], tmp_path: Path) -> None:
    t = FimTrainer(tmp_path / "run", _cfg(fim_base))
    _perturb(t)
    batch = _batch(t, fim_rate=0.0)
    base = base_plain_logprobs(t.model, t.rows, batch)
    same = anchored_losses(t.model, t.rows, batch, 1.0, teacher=lambda b: base_plain_logprobs(t.model, t.rows, b))
    own = anchored_losses(t.model, t.rows, batch, 1.0).kl
    assert same.kl is not None and own is not None and torch.equal(same.kl, own)
    uniform = torch.full_like(base, -math.log(base.shape[1]))  # a teacher that knows nothing
    other = anchored_losses(t.model, t.rows, batch, 1.0, teacher=lambda b: uniform)
    assert other.kl is not None and not torch.allclose(other.kl, same.kl)
    with torch.no_grad():  # KL(uniform || p) = -log V - mean log p, per target
        h, _, kind = teaching_states(t.model, t.rows, batch)
        logp = torch.log_softmax(t.rows.head_logits(t.model, h[kind == PLAIN]).float(), -1)
    torch.testing.assert_close(other.kl, -math.log(base.shape[1]) - logp.mean(-1), rtol=1e-4, atol=1e-4)


def test_a_run_saved_before_the_anchor_resumes_with_its_objective(fim_base: dict[str, Path]) -> None:
    saved = json.loads((Path(__file__).resolve().parents[3] / "runs" / "fim" / "train_config.json").read_text())
    assert "plain_anchor" not in saved
    cfg = FimTrainConfig.from_json(saved)
    assert cfg.plain_anchor == 0.0 and cfg.tokens_dir == "data/tokens-fim"
    assert FimTrainConfig.from_json(cfg.to_json()) == cfg
    assert FimTrainConfig(base="b").plain_anchor > 0  # a new run is anchored, to the original Gemma 3
    assert cfg.plain_teacher == "base" and FimTrainConfig(base="b").plain_teacher == "gemma3"
    with pytest.raises(ValueError, match="plain_teacher"):
        FimTrainConfig(base="b", plain_teacher="gemma4")
    with pytest.raises(ValueError, match="plain_anchor"):
        FimTrainConfig(base="b", plain_anchor=1.5)


def test_the_default_token_cache_follows_the_bases_vocabulary(fim_base: dict[str, Path], tmp_path: Path) -> None:
    import argparse

    from canvas.training.fim_train import fim_tokens_dir
    from canvas.training.train_cli import resolve_fim_config

    n = Tokenizer.from_file(str(fim_base["base"] / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    got = fim_tokens_dir(fim_base["base"])
    assert got.parent == Path("data") and got.name in (f"tokens-fim-{n // 1024}k", f"tokens-fim-{n}")
    assert got != Path("data/tokens-fim")  # never the 64k run's cache
    args = argparse.Namespace(base=str(fim_base["base"]))
    assert resolve_fim_config(tmp_path / "new", args).tokens_dir == str(got)  # recorded in the new run's config


def test_a_base_with_the_fim_adapters_merged_is_refused(tmp_path: Path) -> None:
    from canvas.training.fim_train import require_plain_base

    (tmp_path / "build.json").write_text(json.dumps({"fingerprint": {"fim_adapters": "abc"}}))
    with pytest.raises(ValueError, match="--without-fim"):
        require_plain_base(tmp_path)
    (tmp_path / "build.json").write_text(json.dumps({"fingerprint": {"gguf_sha256": "x"}}))
    require_plain_base(tmp_path)  # a build without them
    require_plain_base(tmp_path / "no-such-build")  # not a build at all: the loader says what is wrong


@pytest.mark.slow  # three short runs of the trainer, each evaluating: minutes on 2 cores
def test_a_new_run_starts_from_another_runs_adapters(fim_base: dict[str, Path], tmp_path: Path) -> None:
    from canvas.cli import main

    common = ["--seq-len", "64", "--base", str(fim_base["base"]), "--tokens-dir", str(fim_base["tokens"]),
              "--corpus-dir", str(fim_base["corpus"]), "--batch-size", "1", "--eval-every", "2", "--lora-rank", "2",
              "--plain-teacher", "base"]  # the tiny base teaches itself: Gemma 3 would be loaded where it is installed
    old = tmp_path / "old"
    assert main(["train", "--objective", "fim", "--run", str(old), *common, "--stop-at-step", "2"]) == 0
    before = (old / "checkpoint.pt").read_bytes()
    new = tmp_path / "new"
    args = ["train", "--objective", "fim", "--run", str(new), *common, "--init-from", str(old)]
    assert main([*args, "--stop-at-step", "0"]) == 0
    assert (old / "checkpoint.pt").read_bytes() == before  # the other run is only read
    mine = torch.load(new / "checkpoint.pt", weights_only=False)
    theirs = torch.load(old / "checkpoint.pt", weights_only=False)
    assert mine["state"]["step"] == 0 and not mine["optimizer"]["state"]  # fresh optimizer, step 0
    for name, t in theirs["adapters"].items():
        assert torch.equal(mine["adapters"][name], t)
    assert main([*args, "--stop-at-step", "1"]) == 0  # resuming ignores --init-from: its own checkpoint wins
    assert torch.load(new / "checkpoint.pt", weights_only=False)["state"]["step"] == 1
    assert main(["train", "--objective", "fim", "--run", str(tmp_path / "x"), *common, "--init-from",
                 str(tmp_path / "none")]) == 2
