"""`dcanvas generate` and the `dcanvas bench` commands, end to end on a tiny random checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from canvas.engine.backend import write_tiny_checkpoint
from canvas.engine.generate_cli import parse_masks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), canvas_length=16)


def dcanvas(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "canvas.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                                                "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_generate_json(tiny_dir: Path, mode: str) -> None:
    out = dcanvas("generate", "--model", str(tiny_dir), "--prompt", "The cat sat", "--mode", mode,
                  "--max-steps", "4", "--max-new-tokens", "20", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) >= {"tokens", "text", "tokens_per_forward", "steps", "wall_s"}
    assert 0 < len(doc["tokens"]) <= 20 and isinstance(doc["text"], str)
    assert doc["steps"] >= 1 and doc["tokens_per_forward"] > 0


def test_generate_takes_the_model_defaults(tiny_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 2}))
    out = dcanvas("generate", "--model", str(model), "--prompt", "The cat sat", "--max-new-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    assert 1 <= json.loads(out.stdout)["steps"] <= 2
    (model / "generation_config.json").write_text("{broken")
    out = dcanvas("generate", "--model", str(model), "--prompt", "The cat sat")
    assert out.returncode == 2 and "generation_config.json" in out.stderr and "Traceback" not in out.stderr


def test_parse_masks() -> None:
    assert parse_masks("plain") == ("plain", [])
    text, spans = parse_masks("a [[b c]] d [[e]]")
    assert text == "a b c d e" and [text[s:e] for s, e in spans] == ["b c", "e"]
    for bad, why in (("a [[b", "unbalanced"), ("a ]] b", "unbalanced"), ("a [[ ]] b", "empty"),
                     ("[[a [[b]] c]]", "unbalanced")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_masks(bad)


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_generate_infill_rewrites_only_the_marked_span(tiny_dir: Path, mode: str) -> None:
    out = dcanvas("generate", "--model", str(tiny_dir), "--prompt", "The cat [[sat on]] the mat.", "--mode", mode,
                  "--max-steps", "4", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    # The span grows to the tokens it touches (here its leading space); the rest of the text is kept as it was.
    assert doc["replaced"] in (["sat on"], [" sat on"], [" sat on "])
    assert doc["text"] == "The cat sat on the mat.".replace(doc["replaced"][0], doc["fills"][0])
    assert len(doc["tokens"]) <= 2 and doc["steps"] >= 1
    # What wrote the fill: the tiny model's AR drafts are scored by the seam (K = 8 by default).
    assert doc["written_by"] == {"diffusion": "diffusion", "ar": "ar-infill"}[mode]


def test_generate_infill_errors(tiny_dir: Path) -> None:
    out = dcanvas("generate", "--model", str(tiny_dir), "--prompt", "The [[cat]] sat", "--max-new-tokens", "3")
    assert out.returncode == 2 and "--max-new-tokens" in out.stderr
    far = "The [[cat]] " + "and the dog ran " * 10 + "[[home]]."
    out = dcanvas("generate", "--model", str(tiny_dir), "--prompt", far)
    assert out.returncode == 2 and "must fit one canvas of 16 tokens" in out.stderr and "Traceback" not in out.stderr
    out = dcanvas("generate", "--model", str(tiny_dir), "--prompt", "The [[cat sat")
    assert out.returncode == 2 and "unbalanced" in out.stderr


def test_generate_errors_are_clear(tmp_path: Path) -> None:
    out = dcanvas("generate", "--model", str(tmp_path), "--prompt", "x")
    assert out.returncode == 2 and "no config.json" in out.stderr and "Traceback" not in out.stderr
    out = dcanvas("generate", "--model", str(tmp_path), "--prompt", "x", "--max-steps", "0")
    assert out.returncode == 2 and "max_steps" in out.stderr


def test_bench_model_tiny() -> None:
    out = dcanvas("bench", "model", "--preset", "tiny", "--runs", "1", "--prompt", "8")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["encoder_ms"]["ours"] > 0 and doc["decoder_ms"]["reference"] > 0


def test_bench_engine_tiny_identical_tokens() -> None:
    out = dcanvas("bench", "engine", "--preset", "tiny", "--runs", "1", "--steps", "3", "--prompt", "8")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"speedup", "identical", "step_overhead", "sampler_buffers", "batch_gain"} <= set(doc)
    assert doc["identical"] is True
    assert doc["infill_window_slots"] < 256 and doc["infill_step_ms"] > 0 and doc["infill_step_vs_full"] > 0


def test_bench_model_gpu_path_runs_on_cpu() -> None:
    out = dcanvas("bench", "model", "--gpu", "--layers", "1", "--runs", "1")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["device"] in ("cpu", "cuda") and doc["ours"]["step_ms_extrapolated"] > 0


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_generate_stops_at_a_budget_shorter_than_a_canvas(tiny_dir: Path, mode: str) -> None:
    """A budget under one canvas generates only that many slots: AR runs a step per budgeted token, not one per slot
    of the canvas (16 here), and diffusion denoises only those slots."""
    out = dcanvas("generate", "--model", str(tiny_dir), "--prompt", "The cat sat", "--mode", mode,
                  "--max-steps", "2", "--max-new-tokens", "3", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert 0 < len(doc["tokens"]) <= 3
    if mode == "ar":
        assert doc["forwards"] <= 3 and doc["steps"] <= 4, doc  # a whole canvas would take 16
    else:
        assert doc["tokens_per_forward"] <= 3 / doc["forwards"] + 1e-6, doc  # only 3 slots were generated


@pytest.mark.parametrize("user", [None, "50"])
def test_the_cli_sets_openmp_spinning_before_torch_loads_and_a_users_value_wins(user: str | None) -> None:
    code = ("import os, sys, contextlib, io\nfrom canvas import cli\n"
            "assert 'torch' not in sys.modules\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    cli.main([])\n"
            "print(os.environ['GOMP_SPINCOUNT'])")
    env = {"TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin", **({"GOMP_SPINCOUNT": user} if user else {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    from canvas.cli import GOMP_SPINCOUNT

    assert out.stdout.strip() == (user or GOMP_SPINCOUNT)
