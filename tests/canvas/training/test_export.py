from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from canvas.model import DiffusionModel
from canvas.model.tokenizer import load_tokenizer, special_ids
from canvas.sampling.sampler import load_sampler_defaults
from canvas.training import export as export_mod
from canvas.training.export import ExportError, export_run
from canvas.training.train import TrainConfig, Trainer


@pytest.fixture(scope="module")
def trained(tiny_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    cfg = TrainConfig(
        model="tiny", tokens_dir=str(tiny_data["tokens"]), tokenizer_dir=str(tiny_data["tokenizer"]),
        corpus_dir=str(tiny_data["corpus"]), batch_size=2, warmup_steps=1, log_every=1, eval_every=2, eval_batches=1,
    )  # fmt: skip
    trainer = Trainer(tmp_path_factory.mktemp("run"), cfg)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes (see conftest.one_thread)
    try:
        trainer.fit(max_minutes=None, stop_at_step=2, console=Console(file=io.StringIO()))
    finally:
        torch.set_num_threads(before)
    return trainer


def test_export_loads_in_ours_and_transformers_with_the_same_logits(trained: Trainer, tmp_path: Path) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    out = export_run(trained, tmp_path / "model", evaluation={"judge_ppl_ratio_infill": 1.5})
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "diffusion_gemma"
    assert {"generation_config.json", "README.md", "loss_curve.csv", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    # The sampler keeps each gap's head for text, as the training layout does.
    assert load_sampler_defaults(out).gap_min_fill == 1.0 - trained.cfg.corruption.max_null_frac

    tok = load_tokenizer(out)
    ours = DiffusionModel.from_pretrained(str(out))
    assert ours.config.null_token_id == special_ids(tok)["null"] == tok.null_token_id
    theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(str(out), experts_implementation="eager").eval()
    prompt = torch.tensor([tok("A penny saved is")["input_ids"]])
    canvas = torch.randint(0, ours.config.vocab_size, (1, ours.config.canvas_length), generator=torch.Generator())
    with torch.no_grad():
        ref = theirs(input_ids=prompt, decoder_input_ids=canvas).logits
        _, cache = ours.encode(prompt)
        mine = ours.denoise(canvas, cache)
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)

    card = (out / "README.md").read_text()
    assert f"{trained.state.tokens_seen:,} stream tokens" in card
    assert "| judge_ppl_ratio_infill | 1.5 |" in card and "Apache-2.0" in card


def test_export_rejects_another_tokenizer(trained: Trainer, tmp_path: Path, tiny_data: dict[str, Path]) -> None:
    other = tmp_path / "tok"
    other.mkdir()
    for f in export_mod.TOKENIZER_FILES:
        (other / f).write_bytes((tiny_data["tokenizer"] / f).read_bytes())
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace("<null>", "<nul2>"))
    trained.cfg = dataclasses.replace(trained.cfg, tokenizer_dir=str(other))
    try:
        with pytest.raises(ExportError, match="not the tokenizer"):
            export_run(trained, tmp_path / "model")
    finally:
        trained.cfg = dataclasses.replace(trained.cfg, tokenizer_dir=str(tiny_data["tokenizer"]))


def test_export_size_limit(trained: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export_mod, "MAX_BYTES", 1000)
    with pytest.raises(ExportError, match="over the"):
        export_run(trained, tmp_path / "model")
