from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from canvas.cli import main
from canvas.training.train import MODEL_SHAPES, TrainConfig, Trainer, model_config, steps_for_tokens


def _config(data: dict[str, Path], **changes: object) -> TrainConfig:
    base = TrainConfig(
        model="tiny",
        tokens_dir=str(data["tokens"]),
        tokenizer_dir=str(data["tokenizer"]),
        corpus_dir=str(data["corpus"]),
        batch_size=2,
        max_steps=50,
        warmup_steps=2,
        log_every=2,
        eval_every=4,
        eval_batches=1,
    )
    return TrainConfig.from_json({**base.to_json(), **changes})


def test_lr_schedule_warmup_stable_decay() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=100, decay_frac=0.2, min_lr_frac=0.1)
    assert cfg.lr_at(0) == pytest.approx(1e-4)
    assert cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(50) == cfg.lr_at(79) == pytest.approx(1e-3)
    assert cfg.lr_at(90) == pytest.approx(1e-3 * (1 - 0.5 * 0.9))
    assert cfg.lr_at(100) == cfg.lr_at(500) == pytest.approx(1e-4)


def test_config_json_round_trip_and_validation() -> None:
    cfg = TrainConfig(batch_size=3)
    assert TrainConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="unknown model shape"):
        model_config("huge", {"pad": 0, "bos": 1, "eos": 2, "null": 3}, 512)


def test_model_shapes_take_special_ids_from_the_tokenizer(tiny_data: dict[str, Path]) -> None:
    trainer = Trainer(Path("unused"), _config(tiny_data))
    special = trainer.train_data.special_ids
    mc = trainer.model_config
    assert (mc.pad_token_id, mc.bos_token_id, mc.eos_token_ids, mc.null_token_id) == (
        special["pad"], special["bos"], (special["eos"],), special["null"],
    )  # fmt: skip
    assert mc.vocab_size == trainer.train_data.meta["vocab_size"]
    assert trainer.cfg.corruption.canvas_length == mc.canvas_length  # follows the model
    shape = MODEL_SHAPES["canvas-6m"]
    assert shape["num_experts"] >= 8 and shape["top_k_experts"] == 2
    assert {"sliding_attention", "full_attention"} <= set(shape["layer_types"])


def test_resume_gives_the_same_model_as_an_uninterrupted_run(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    console = Console(file=io.StringIO())
    straight = Trainer(tmp_path / "a", _config(tiny_data))
    straight.fit(max_minutes=None, stop_at_step=6, console=console)

    first = Trainer(tmp_path / "b", _config(tiny_data))
    first.fit(max_minutes=None, stop_at_step=3, console=console)
    second = Trainer(tmp_path / "b", _config(tiny_data))
    assert second.load() and second.state.step == 3
    second.fit(max_minutes=None, stop_at_step=6, console=console)

    for (name, p), q in zip(straight.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert second.state.tokens_seen == straight.state.tokens_seen
    # The interruption adds a log row at step 3; the rows of both runs end at step 6.
    assert [int(r["step"]) for r in second.state.history] == [2, 3, 4, 6]
    assert second.state.history[-1]["step"] == straight.state.history[-1]["step"] == 6
    assert (tmp_path / "b" / "checkpoint.prev.pt").exists()


def test_loss_curve_files(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    trainer = Trainer(tmp_path / "run", _config(tiny_data))
    trainer.fit(max_minutes=None, stop_at_step=4, console=Console(file=io.StringIO()))
    history = json.loads((tmp_path / "run" / "loss.json").read_text())
    assert [r["step"] for r in history] == [2, 4]
    assert "valid_denoise" in history[-1] and "valid_denoise" not in history[0]
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in history)
    with (tmp_path / "run" / "loss.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [2, 4]


def test_other_model_shape_refuses_checkpoint(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    trainer = Trainer(tmp_path / "run", _config(tiny_data))
    trainer.save()
    other = Trainer(tmp_path / "run", _config(tiny_data, seed=1))
    other.model_config = other.model_config.replace(hidden_size=32)
    with pytest.raises(ValueError, match="another model shape"):
        other.load()


def test_cli_trains_resumes_and_exports(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    common = ["train", "--run", str(run), "--model", "tiny", "--tokens-dir", str(tiny_data["tokens"])]
    common += ["--tokenizer-dir", str(tiny_data["tokenizer"]), "--corpus-dir", str(tiny_data["corpus"])]
    assert main([*common, "--batch-size", "2", "--stop-at-step", "2", "--log-every", "1", "--eval-every", "2"]) == 0
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["batch_size"] == 2 and saved["model"] == "tiny"
    # A second start reuses the saved config and continues from the checkpoint.
    out = tmp_path / "exported"
    assert main(["train", "--run", str(run), "--stop-at-step", "3", "--export", str(out)]) == 0
    assert json.loads((run / "loss.json").read_text())[-1]["step"] == 3
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert "3 of a" in (out / "README.md").read_text()


def test_warm_start_continues_an_exported_model(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    common = ["--model", "tiny", "--tokens-dir", str(tiny_data["tokens"]), "--tokenizer-dir",
              str(tiny_data["tokenizer"]), "--corpus-dir", str(tiny_data["corpus"]), "--batch-size", "2"]  # fmt: skip
    out = tmp_path / "exported"
    assert main(["train", "--run", str(tmp_path / "a"), *common, "--stop-at-step", "3", "--log-every", "1",
                 "--export", str(out)]) == 0  # fmt: skip
    checkpoint = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    exported = checkpoint["model"]
    warm = Trainer(tmp_path / "b", _config(tiny_data, batch_size=3))
    warm.warm_start(out)
    assert warm.state.step == 3 and len(warm.state.history) == 3
    assert warm.state.tokens_seen == exported_tokens(tmp_path / "a")
    # Canvas slots come from the curve, not from this run's (different) batch size.
    assert warm.state.canvas_tokens == checkpoint["state"]["canvas_tokens"] == 3 * 2 * warm.model_config.canvas_length
    for name, tensor in warm.model.state_dict().items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=0)
    # Through the CLI: the run continues at step 3 with its warmup restarted there.
    assert main(["train", "--run", str(tmp_path / "b"), *common, "--init", str(out), "--stop-at-step", "5",
                 "--log-every", "1", "--warmup-steps", "4", "--export", str(tmp_path / "again")]) == 0  # fmt: skip
    assert "| warm start | at step 3," in (tmp_path / "again" / "README.md").read_text()
    saved = json.loads((tmp_path / "b" / "train_config.json").read_text())
    assert saved["rewarm_from"] == 3
    rows = json.loads((tmp_path / "b" / "loss.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["lr"] == pytest.approx(TrainConfig().lr / 4)  # first step after the warm start


def exported_tokens(run: Path) -> int:
    return int(json.loads((run / "loss.json").read_text())[-1]["tokens"])


def test_warm_start_refuses_another_shape(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    trainer = Trainer(tmp_path / "run", _config(tiny_data))
    trainer.model_config = trainer.model_config.replace(hidden_size=32)
    with pytest.raises(ValueError, match="another model shape"):
        trainer.warm_start(Path("canvas/assets/default-model"))
    with pytest.raises(ValueError, match="not a directory"):
        trainer.warm_start(tmp_path / "missing")


def test_cli_bad_input(tiny_data: dict[str, Path], tmp_path: Path) -> None:
    assert main(["train", "--run", str(tmp_path / "r"), "--tokens-dir", str(tmp_path / "missing")]) == 2
    assert main(["train", "--run", str(tmp_path / "r"), "--tokens-dir", str(tiny_data["tokens"]), "--lr", "-1"]) == 2
    args = ["train", "--run", str(tmp_path / "empty"), "--model", "tiny", "--tokens-dir", str(tiny_data["tokens"])]
    assert main([*args, "--export-only", "--export", str(tmp_path / "x")]) == 2


def test_steps_for_tokens() -> None:
    cfg = TrainConfig(batch_size=8)
    per_step = 8 * ((1 + 256) / 2 + 256)
    assert steps_for_tokens(int(per_step * 10), cfg) == 10
