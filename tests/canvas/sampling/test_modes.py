"""The model's default generation mode: stored in the model directory, resolved by one rule, and honoured by every
entry point (the websocket gen.start, /v1/completions, /infill, `dcanvas generate`); a named mode always wins.

The tiny random model runs with a 3-step budget; its default modes are set so that the two kinds differ (infill AR,
continuation diffusion), which makes a wrong kind, or a default that overrides a named mode, visible.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from starlette.testclient import TestClient

from canvas.engine.backend import Backend, load_backend, write_tiny_checkpoint
from canvas.engine.core import GenHandle
from canvas.sampling.modes import EXTRA_FILE, ModeDefaults, load_mode_defaults, request_kind, write_extra
from canvas.sampling.sampler import load_sampler_defaults
from tests.canvas.wsconn import TEXT, Conn, Factory, served
from tests.canvas.wsconn import edit as _edit
from tests.canvas.wsconn import generate as _generate
from tests.canvas.wsconn import open_doc as _open

pytestmark = pytest.mark.timeout(180)
SPLIT = ModeDefaults(infill="ar", continuation="diffusion")


# -- the rule ----------------------------------------------------------------------------------------------------


def test_request_kind_is_infill_only_with_pinned_text_after_a_free_slot() -> None:
    assert request_kind(()) == "continuation"
    assert request_kind((False, False)) == "continuation"
    assert request_kind((True, True, False, False)) == "continuation"  # a prompt, then free slots
    assert request_kind((True, False, True)) == "infill"
    assert request_kind((False, True)) == "infill"
    assert request_kind((True, True)) == "continuation"  # nothing free: nothing to fill


def test_resolve_honours_a_named_mode_and_else_takes_the_kind_default() -> None:
    assert ModeDefaults() == ModeDefaults("diffusion", "diffusion")  # no stored defaults: today's behaviour
    assert SPLIT.resolve(None, "infill") == "ar" and SPLIT.resolve(None, "continuation") == "diffusion"
    assert SPLIT.resolve("diffusion", "infill") == "diffusion" and SPLIT.resolve("ar", "continuation") == "ar"
    with pytest.raises(ValueError, match="default_mode_infill"):
        ModeDefaults(infill="beam")  # type: ignore[arg-type]


def test_a_model_decodes_by_default_where_either_kind_defaults_to_ar() -> None:
    assert SPLIT.decodes and ModeDefaults("diffusion", "ar").decodes and ModeDefaults("ar", "ar").decodes
    assert not ModeDefaults().decodes


def test_defaults_are_read_from_and_merged_into_the_extra_file(tmp_path: Path) -> None:
    assert load_mode_defaults(tmp_path) == ModeDefaults()  # no file
    (tmp_path / EXTRA_FILE).write_text(json.dumps({"gap_min_fill": 0.5, "ar_temperature": 0.7}))
    assert load_mode_defaults(tmp_path) == ModeDefaults()  # a file without the keys
    write_extra(tmp_path, SPLIT.to_extra())
    raw = json.loads((tmp_path / EXTRA_FILE).read_text())
    assert raw == {"gap_min_fill": 0.5, "ar_temperature": 0.7, "default_mode_infill": "ar",
                   "default_mode_continuation": "diffusion"}  # fmt: skip
    assert load_mode_defaults(tmp_path) == SPLIT
    assert load_sampler_defaults(tmp_path).gap_min_fill == 0.5  # the sampler's reading ignores the mode keys
    (tmp_path / EXTRA_FILE).write_text(json.dumps({"default_mode_continuation": "greedy"}))
    with pytest.raises(ValueError, match=f"{EXTRA_FILE}.*default_mode_continuation"):
        load_mode_defaults(tmp_path)
    (tmp_path / EXTRA_FILE).write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_mode_defaults(tmp_path)


# -- the entry points --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-modes"))
    write_extra(path, SPLIT.to_extra())
    (path / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 3}))
    return path


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Backend:
    b = load_backend(model_dir, max_batch=2)
    assert b.mode_defaults == SPLIT and b.sampler_defaults.max_steps == 3  # read from the model directory
    return b


@pytest.fixture
def modes_seen(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The mode of every request the engine is given while the test runs."""
    seen: list[str] = []
    submit = backend.engine.submit

    def spy(request: Any, *args: Any, **kwargs: Any) -> GenHandle:
        seen.append(request.config.mode)
        return submit(request, *args, **kwargs)

    monkeypatch.setattr(backend.engine, "submit", spy)
    return seen


@pytest.fixture
def serve(backend: Backend, tmp_path: Path) -> Iterator[Factory]:
    with served(backend, tmp_path) as make:
        yield make


def test_gen_start_without_a_mode_takes_the_default_of_its_kind(serve: Factory, modes_seen: list[str]) -> None:
    client = serve()
    with client.websocket_connect("/ws") as ws:
        c = Conn(ws)
        welcome = c.rpc({"type": "hello", "protocol": "dcanvas/1"})
        assert welcome["model"]["default_modes"] == {"infill": "ar", "continuation": "diffusion"}
        state = _open(c)
        middle = TEXT.index("mat")
        state = _edit(c, state, {"op": "mask", "start": middle, "end": middle + 3})  # pinned text after: infill
        accepted, _, done = _generate(c, state, seed=1)
        assert accepted["params"]["mode"] == "ar" and done["status"] == "completed"
        accepted, _, done = _generate(c, state, seed=1, mode="diffusion")  # named: honoured
        assert accepted["params"]["mode"] == "diffusion" and done["status"] == "completed"
        state = _edit(c, state, {"op": "unmask", "start": 0, "end": len(TEXT)},
                      {"op": "insert_gap", "at": len(TEXT), "n_tokens": 4})  # fmt: skip
        assert state["type"] == "doc.state", state
        accepted, _, _ = _generate(c, state, seed=1)  # a gap at the end, nothing after it: continuation
        assert accepted["params"]["mode"] == "diffusion"
        accepted, _, _ = _generate(c, state, seed=1, mode="ar")
        assert accepted["params"]["mode"] == "ar"
    assert modes_seen == ["ar", "diffusion", "diffusion", "ar"]  # what the engine ran, not just the echo


def test_http_dialects_take_the_default_of_their_kind(serve: Factory, modes_seen: list[str]) -> None:
    client: TestClient = serve()
    base = {"prompt": "The cat sat on", "max_tokens": 3, "seed": 1}
    for body, want in (
        (base, "diffusion"),  # no suffix: a continuation
        ({**base, "suffix": " the mat."}, "ar"),  # a suffix: an infill
        ({**base, "suffix": " the mat.", "dcanvas": {"mode": "diffusion"}}, "diffusion"),
        ({**base, "dcanvas": {"mode": "ar"}}, "ar"),
    ):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert modes_seen[-1] == want, body
    assert client.post("/v1/completions", json={**base, "dcanvas": {"mode": "beam"}}).status_code == 400
    infill = {"input_prefix": "The cat sat on", "input_suffix": " the mat.", "n_predict": 3, "seed": 1}
    for body, want in ((infill, "ar"), ({**infill, "dcanvas": {"mode": "diffusion"}}, "diffusion"),
                       ({**infill, "input_suffix": ""}, "diffusion")):  # fmt: skip
        r = client.post("/infill", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["generation_settings"]["mode"] == want == modes_seen[-1], body
    assert len(modes_seen) == 7


def test_generate_cli_takes_the_default_of_its_kind(model_dir: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from canvas.cli import main

    monkeypatch.setattr(sys, "argv", ["dcanvas"])
    common = ["generate", "--model", str(model_dir), "--json", "--max-steps", "2"]
    for extra, want in ((["--prompt", "The cat sat", "--max-new-tokens", "4"], "diffusion"),
                        (["--prompt", "The cat [[sat on]] the mat."], "ar"),
                        (["--prompt", "The cat [[sat on]] the mat.", "--mode", "diffusion"], "diffusion"),
                        (["--prompt", "The cat sat", "--max-new-tokens", "4", "--mode", "ar"], "ar"),
                        (["--prompt", "The cat sat [[on the mat.]]"], "diffusion")):  # fmt: skip
        assert main([*common, *extra]) == 0
        assert json.loads(capsys.readouterr().out)["mode"] == want, extra


def test_a_model_without_defaults_keeps_diffusion(model_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / EXTRA_FILE).unlink()
    b = dataclasses.replace(load_backend(bare, max_batch=1))
    assert b.mode_for(None, (True, False, True)) == "diffusion" == b.mode_for(None, (False,))
    assert b.mode_for("ar", (False,)) == "ar"


def test_labels_name_what_runs_and_what_wrote_it() -> None:
    """One table: a mode setting, the mode a request runs in (AR on an infill drafts and scores by the seam), and
    every `Writer` a Done can name."""
    from canvas.engine.types import Writer
    from canvas.sampling.modes import LABELS, mode_label

    assert mode_label(None) == LABELS["default"] == "model default"
    assert mode_label("ar", "infill") == mode_label("ar-infill") == "AR infill (K drafts, seam-scored)"
    assert mode_label("ar", "continuation") == mode_label("ar") == "AR (left to right)"
    assert mode_label("diffusion", "infill") == "diffusion (untrained decoder)"
    assert all(w in LABELS for w in get_args(Writer))


def test_the_modes_module_needs_no_torch() -> None:
    """The TUI is a client that never imports torch; it reads its labels from canvas.sampling.modes."""
    code = "import sys, canvas.sampling.modes, tui.settings; assert 'torch' not in sys.modules, 'torch was imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# -- per gap size --------------------------------------------------------------------------------------------------


def test_largest_gap_counts_free_runs_closed_by_a_pin() -> None:
    from canvas.sampling.modes import largest_gap

    assert largest_gap(()) == 0 and largest_gap((False, False)) == 0  # a continuation: no gap
    assert largest_gap((True, False, False, True, False, True)) == 2
    assert largest_gap((False, True, False, False, False, True, False, False, False, False)) == 3  # tail not a gap


def test_measured_gap_sizes_pick_the_infill_mode_and_default_to_ar() -> None:
    by_gap = ModeDefaults(infill="ar", continuation="ar", infill_by_gap=((8, "diffusion"), (16, "diffusion"),
                                                                           (32, "ar")))  # fmt: skip
    assert [by_gap.resolve(None, "infill", g) for g in (1, 8, 9, 16, 17, 32, 33, 200)] == [
        "diffusion", "diffusion", "diffusion", "diffusion", "ar", "ar", "ar", "ar"]  # past 32: nothing measured
    assert by_gap.resolve(None, "infill") == "ar"  # no gap size known: the kind's default
    assert by_gap.resolve("ar", "infill", 8) == "ar" and by_gap.resolve("diffusion", "infill", 64) == "diffusion"
    assert by_gap.resolve(None, "continuation", 8) == "ar"
    # A model whose infill default is diffusion still runs a gap past its table AR.
    assert ModeDefaults(infill_by_gap=((8, "diffusion"),)).resolve(None, "infill", 9) == "ar"
    assert ModeDefaults(infill_by_gap=((8, "diffusion"),)).decodes
    for bad in (((8, "ar"), (8, "diffusion")), ((16, "ar"), (8, "ar")), ((0, "ar"),), ((8, "beam"),)):
        with pytest.raises(ValueError, match="infill_by_gap"):
            ModeDefaults(infill_by_gap=bad)


def test_gap_modes_file_is_read_and_checked(tmp_path: Path) -> None:
    from canvas.sampling.modes import GAP_MODES_FILE, read_gap_modes

    assert read_gap_modes(tmp_path) is None
    (tmp_path / GAP_MODES_FILE).write_text(json.dumps({"sizes": [{"gap": 16, "mode": "diffusion"},
                                                                 {"gap": 8, "mode": "ar"}], "decoder_sha256": "ab"}))
    assert read_gap_modes(tmp_path) == (((8, "ar"), (16, "diffusion")), "ab")
    for bad in ({"sizes": [{"gap": 8, "mode": "beam"}]}, {"sizes": [{"mode": "ar"}]}, [1], {"sizes": 3},
                {"sizes": [], "decoder_sha256": 5}):
        (tmp_path / GAP_MODES_FILE).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=GAP_MODES_FILE):
            read_gap_modes(tmp_path)


def test_backend_takes_measured_gap_modes_only_for_the_decoder_they_measured(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from canvas.sampling.modes import GAP_MODES_FILE

    model_dir = write_tiny_checkpoint(tmp_path / "m")
    write_extra(model_dir, SPLIT.to_extra())
    table = {"sizes": [{"gap": 4, "mode": "diffusion"}, {"gap": 8, "mode": "ar"}], "decoder_sha256": None}
    (model_dir / GAP_MODES_FILE).write_text(json.dumps(table))
    backend = load_backend(model_dir, max_batch=1, threads=1, decoder_adapters=None)
    gap3 = (True, False, False, False, True)
    gap6 = (True, *(False,) * 6, True)
    assert backend.mode_for(None, gap3) == "diffusion" and backend.mode_for(None, gap6) == "ar"
    assert backend.mode_for(None, "infill") == "ar" and backend.mode_for(None, "infill", 2) == "diffusion"
    assert backend.mode_for(None, (False, False)) == "diffusion"  # a continuation: its own default
    # Measured with a decoder that is not served: left out, said once on stderr.
    (model_dir / GAP_MODES_FILE).write_text(json.dumps({**table, "decoder_sha256": "ab" * 32}))
    other = load_backend(model_dir, max_batch=1, threads=1, decoder_adapters=None)
    assert other.mode_defaults.infill_by_gap == () and other.mode_for(None, gap3) == "ar"
    assert "another decoder" in capsys.readouterr().err
