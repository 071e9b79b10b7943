"""The FIM checkpoint evaluation's pieces: held-out losses equal to the run's own eval, a FIM build merged from a run's
adapters equal to the in-memory merge (and marked as having the format), rows appended and replaced, the eval's
cells, and the curve's seam panel."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer

from canvas.convert.fim import fim_prompt, fim_tokens, model_fim_tokens
from canvas.model import DiffusionModel
from canvas.training.fim import FimDataConfig
from canvas.training.fim_evalpoint import EvalPointConfig, append_row, cells, heldout_losses, table
from canvas.training.fim_train import FimTrainConfig, FimTrainer, export_fim_adapters

DATA = FimDataConfig(seq_len=64, max_middle=16, max_prefix=16, max_suffix=12, min_fim_piece=12)


@pytest.fixture(scope="module")
def trained(fim_base: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> FimTrainer:
    cfg = FimTrainConfig(base=str(fim_base["base"]), tokens_dir=str(fim_base["tokens"]),
                         corpus_dir=str(fim_base["corpus"]), batch_size=2, lr=1e-2, warmup_steps=1, max_steps=4,
                         lora_rank=2, lora_alpha=4.0, log_every=1, eval_every=3, eval_batches=2, data=DATA,
                         plain_teacher="base", bf16=False)  # fmt: skip
    # fp32 on every machine: under bf16 autocast (an AMX CPU) three steps of rank-2 adapters move the held-out loss
    # by less than bf16 outputs resolve (0.015 % on the AMX machine, 0.36 % in fp32), which the test below needs.
    t = FimTrainer(tmp_path_factory.mktemp("run") / "run", cfg)
    t.fit(max_minutes=None, stop_at_step=3, console=Console(file=io.StringIO()))
    return t


def test_heldout_losses_are_the_runs_own(trained: FimTrainer) -> None:
    logged = trained.state.history[-1]
    assert logged["step"] == 3 and "valid_fim" in logged
    got = heldout_losses(trained)
    assert got["valid_fim"] == pytest.approx(logged["valid_fim"], rel=1e-5)
    assert got["valid_plain"] == pytest.approx(logged["valid_plain"], rel=1e-5)
    first = trained.state.history[0]
    assert got["valid_fim"] != pytest.approx(first["valid_fim"], rel=1e-3)  # the trained adapters, not the base


def test_a_fim_build_from_a_runs_adapters(fim_base: dict[str, Path], trained: FimTrainer, tmp_path: Path) -> None:
    from canvas.convert.build import apply_fim, build_with_fim

    base = tmp_path / "base"
    shutil.copytree(fim_base["base"], base)
    with pytest.raises(FileNotFoundError, match="build.json"):
        build_with_fim(base, tmp_path / "adapters", tmp_path / "out")
    (base / "build.json").write_text(json.dumps({"fingerprint": {"build_version": 3}, "files": {}}))
    adapters = export_fim_adapters(trained, tmp_path / "adapters")
    out = build_with_fim(base, adapters, tmp_path / "models" / "fim")
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    assert model_fim_tokens(base, tok) is None and model_fim_tokens(out, tok) is not None
    meta = json.loads((out / "build.json").read_text())
    assert meta["fingerprint"]["build_version"] == 3 and meta["fingerprint"]["fim_adapters"]
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()
    ft = fim_tokens(tok)
    ids = torch.tensor([fim_prompt(ft, tok.encode("In the beginning God").ids, tok.encode(" the earth.").ids)])
    with torch.no_grad():
        want, _ = apply_fim(DiffusionModel.from_pretrained(str(base)), base, adapters).encode(ids)
        got, _ = DiffusionModel.from_pretrained(str(out)).encode(ids)
        plain, _ = DiffusionModel.from_pretrained(str(base)).encode(ids)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain, atol=1e-3)
    with pytest.raises(ValueError, match="already has FIM adapters"):
        build_with_fim(out, adapters, tmp_path / "again")
    # The plain-perplexity check of such a build against the one without (`dcanvas model check --against`).
    from canvas.convert.fidelity import compare_builds

    passages = ["In the beginning God created the heavens and the earth.", "It is a truth universally acknowledged."]
    same = compare_builds(base, base, passages)
    assert same.ratio == pytest.approx(1.0) and same.kl == pytest.approx(0.0, abs=1e-6) and same.top1_agree == 1.0
    moved = compare_builds(out, base, passages)
    assert moved.ratio != pytest.approx(1.0, abs=1e-4) and moved.kl > 0
    (tmp_path / "other").mkdir()
    shutil.copy(base / "config.json", tmp_path / "other" / "config.json")
    (tmp_path / "other" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer"):
        compare_builds(out, tmp_path / "other", passages)


def _result(seam: float) -> dict[str, Any]:
    point = {"samples": 3, "fill_ratio": 1.1, "seam_ratio": seam, "repeat_4gram": 0.0, "repeat_4gram_human": 0.01,
             "null_share": 0.1, "seconds_per_canvas": 2.0}  # fmt: skip
    return {"results": [{**point, "task": "infill-32", "fim": True}, {**point, "task": "infill-64", "fim": False},
                        {**point, "task": "continuation", "fim": None}]}  # fmt: skip


def test_rows_are_appended_in_step_order_and_a_rerun_replaces_its_row(tmp_path: Path) -> None:
    path = tmp_path / "evals.json"
    hot, cool = EvalPointConfig().settings(), EvalPointConfig(ar_temperature=0.7).settings()
    c = cells(_result(1.4), "valid")
    assert [(x["gap"], x["fim"]) for x in c] == [(32, True), (64, False)]  # the continuation is no cell
    row = {"step": 300, "tokens": 3000, "valid_fim": 3.4, "valid_plain": 3.5, "cells": c, "settings": hot}
    append_row(path, row)
    append_row(path, {**row, "step": 100, "tokens": 1000})
    append_row(path, {**row, "settings": cool})
    append_row(path, {**row, "cells": cells(_result(1.2), "valid")})  # the same step and settings: replaced
    rows = json.loads(path.read_text())
    assert [r["step"] for r in rows] == [100, 300, 300]
    assert sorted(r["cells"][0]["seam_ratio"] for r in rows if r["step"] == 300) == [1.2, 1.4]
    assert "| valid | 32 | on | 1.10 | 1.20 |" in table(rows[-1] if rows[-1]["settings"] == hot else rows[-2])
    path.write_text("{}")
    with pytest.raises(ValueError, match="list"):
        append_row(path, row)
    with pytest.raises(ValueError, match="samples"):
        EvalPointConfig(samples=0)


def test_the_curve_shows_the_seam_ratios_beside_the_loss(trained: FimTrainer, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from canvas.training.fim_curve import main, seam_series

    run = trained.run_dir
    trained.save()
    settings = EvalPointConfig().settings()
    rows = [{"step": s, "tokens": 10 * s, "cells": cells(_result(seam), "valid"), "settings": settings}
            for s, seam in ((3, 1.5), (1, 2.0))]
    rows.append({**rows[0], "cells": [{**rows[0]["cells"][0], "seam_ratio": math.nan}]})
    series = seam_series(rows)
    assert series[("valid", 32, True)] == [(10, 2.0), (30, 1.5)]  # token order; a NaN cell is no point
    evals = tmp_path / "evals.json"
    evals.write_text(json.dumps(rows[:2]))
    assert main([str(run), "--out", str(tmp_path / "c.png"), "--evals", str(evals)]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert dataclasses.asdict(EvalPointConfig())["gaps"] == (32, 64)
