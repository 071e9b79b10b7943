from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from canvas.cli import main as dcanvas
from canvas.training.gpu_job import PART_BYTES, main


def _train(data: dict[str, Path], out: Path, *extra: str) -> int:
    return main(["train", "--out", str(out), "--model", "tiny", "--tokens-dir", str(data["tokens"]),
                 "--tokenizer-dir", str(data["tokenizer"]), "--work", str(out.parent / "work"), "--allow-cpu",
                 "--batch-size", "2", "--calibration-steps", "2", "--eval-every", "3", "--eval-batches", "1",
                 "--log-every", "1", "--warmup-steps", "2", "--reserve-seconds", "0", *extra])  # fmt: skip


@pytest.fixture(scope="module")
def job(tiny_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-job") / "out"
    assert _train(tiny_data, out, "--minutes", "0.08") == 0
    return out


def test_job_trains_to_its_budget_and_returns_checked_parts(job: Path) -> None:
    result = json.loads((job / "result.json").read_text())
    assert result["device"] == "cpu" and result["model"] == "tiny" and result["start_step"] == 0
    # Calibration (2 x 2 steps) ran, then evaluation intervals while the budget lasted; the best step was evaluated.
    assert result["end_step"] >= 4 and result["best_step"] <= result["end_step"]
    assert result["best_step"] == result["end_step"] or (result["best_step"] - 4) % 3 == 0
    assert set(result["valid_best"]) == set(result["valid_before"]) >= {"valid_denoise", "valid_ar"}
    parts = sorted(job.glob("weights.pt.*"))
    assert [p.name for p in parts] == [p["name"] for p in result["parts"]]
    assert all(p.stat().st_size <= PART_BYTES for p in parts)
    assert "training to step" in (job / "job.log").read_text()


def test_unpack_makes_a_run_that_exports(job: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    local = ["--tokens-dir", str(tiny_data["tokens"]), "--tokenizer-dir", str(tiny_data["tokenizer"]),
             "--corpus-dir", str(tiny_data["corpus"])]  # fmt: skip
    assert main(["unpack", str(job), "--run", str(run), *local]) == 0
    result = json.loads((job / "result.json").read_text())
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    assert checkpoint["state"]["step"] == result["best_step"] and "optimizer" not in checkpoint
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["tokens_dir"] == str(tiny_data["tokens"]) and saved["bf16"] is False
    assert json.loads((run / "gpu_job.json").read_text())["sha256"] == result["sha256"]
    out = tmp_path / "exported"
    assert dcanvas(["train", "--run", str(run), "--export-only", "--export", str(out)]) == 0
    assert (out / "model.safetensors").exists()
    # The weights-only checkpoint also resumes (the optimizer starts fresh), on a schedule made longer.
    step = result["best_step"]
    assert dcanvas(["train", "--run", str(run), "--max-steps", str(step + 10), "--stop-at-step", str(step + 1)]) == 0
    assert json.loads((run / "loss.json").read_text())[-1]["step"] == step + 1
    # A second unpack into the same run refuses instead of overwriting it.
    assert main(["unpack", str(job), "--run", str(run), *local]) == 2


def test_unpack_refuses_broken_or_missing_parts(job: Path, tiny_data: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    broken = tmp_path / "files"
    broken.mkdir()
    for f in job.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    first = sorted(broken.glob("weights.pt.*"))[0]
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 1
    first.write_bytes(bytes(data))
    local = ["--tokens-dir", str(tiny_data["tokens"]), "--tokenizer-dir", str(tiny_data["tokenizer"])]
    assert main(["unpack", str(broken), "--run", str(tmp_path / "a"), *local]) == 2
    assert "sha256 differs" in capsys.readouterr().err
    first.unlink()
    assert main(["unpack", str(broken), "--run", str(tmp_path / "b"), *local]) == 2
    assert "is missing" in capsys.readouterr().err
    assert main(["unpack", str(tmp_path), "--run", str(tmp_path / "c"), *local]) == 2
    assert "no result.json" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_refuses_to_run_on_the_cpu_unless_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", str(tmp_path / "out")]) == 2
    assert "--allow-cpu" in capsys.readouterr().err
