"""Settings: defaults mirror the protocol's, they persist under XDG_CONFIG_HOME, and a bad file never blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from canvas.protocol import GenParams
from tui.settings import Settings, config_path, load_settings, save_settings


def test_defaults_match_the_protocol() -> None:
    params = Settings().gen_params()
    defaults = GenParams()
    for field in ("mode", "max_steps", "entropy_bound", "t_max", "t_min", "seed"):
        assert getattr(params, field) == getattr(defaults, field)


def test_config_path_honours_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config_path() == tmp_path / "dcanvas" / "tui.json"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert config_path() == Path.home() / ".config" / "dcanvas" / "tui.json"


def test_save_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert load_settings() == (Settings(), None)  # no file yet
    s = Settings(mode="ar", max_steps=12, entropy_bound=0.5, t_max=1.0, t_min=0.2, seed=3, gap_tokens=9)
    where = save_settings(s)
    assert where == tmp_path / "dcanvas" / "tui.json"
    assert load_settings() == (s, None)
    assert s.gen_params(seed=99).seed == 99 and s.gen_params().seed == 3


@pytest.mark.parametrize(
    ("content", "why"),
    [("{not json", "not valid JSON"), (json.dumps({"max_steps": 0}), "max_steps"),
     (json.dumps({"t_max": 0.1, "t_min": 0.5}), "t_max")],
)  # fmt: skip
def test_bad_file_falls_back_with_a_reason(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "tui.json"
    path.write_text(content)
    settings, problem = load_settings(path)
    assert settings == Settings()
    assert problem is not None and why in problem and "default settings" in problem


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "tui.json"
    path.write_text(json.dumps({"max_steps": 7, "from_the_future": True}))
    assert load_settings(path) == (Settings(max_steps=7), None)


def test_assignment_is_validated() -> None:
    s = Settings()
    with pytest.raises(ValidationError):
        s.max_steps = 1000
