"""`canvas.env`: the one list of `DCANVAS_*` variables, read at call time, and the only place that spells their names.

The source scan covers `canvas/`, `kernels/` and `tui/` (Python and the C++ kernels): every `DCANVAS_*` name they
mention is one `canvas.env` lists, and no Python module but `canvas.env` holds a name as a string of its own (a
reader imports the `EnvVar`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from canvas import env

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("canvas", "kernels", "tui")
_NAME = re.compile(r"DCANVAS_[A-Z0-9_]+")


def _source_files(suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for root in SOURCES for p in (REPO / root).rglob("*") if p.suffix in suffixes)


def test_every_variable_is_listed_once_with_its_meaning_default_and_readers() -> None:
    names = [v.name for v in env.VARIABLES]
    assert len(names) == len(set(names))
    listed = {getattr(env, n) for n in env.__all__ if isinstance(getattr(env, n), env.EnvVar)}
    assert listed == set(env.VARIABLES), "every EnvVar is exported and in VARIABLES"
    doc = env.__doc__ or ""
    for v in env.VARIABLES:
        assert _NAME.fullmatch(v.name), v.name
        assert v.meaning and v.default and v.readers, v.name
        assert f"`{v.name}`" in doc, f"canvas.env's docstring does not name {v.name}"


def test_values_are_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    var = env.DECODE_COMPILE
    monkeypatch.delenv(var.name, raising=False)
    assert (var.get(), var.text(), var.word()) == (None, "", "")
    monkeypatch.setenv(var.name, "  On ")
    assert (var.get(), var.text(), var.word()) == ("  On ", "On", "on")
    monkeypatch.setenv(var.name, "")
    assert (var.get(), var.text()) == ("", "")
    assert str(var) == var.name


def test_every_variable_the_source_mentions_is_listed() -> None:
    listed = {v.name for v in env.VARIABLES}
    unlisted: dict[str, list[str]] = {}
    for path in _source_files((".py", ".h", ".cpp")):
        if path == REPO / "canvas" / "env.py":
            continue
        for name in set(_NAME.findall(path.read_text(encoding="utf-8"))) - listed:
            unlisted.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert unlisted == {}, "DCANVAS_* variables that canvas.env does not list (add an EnvVar there)"


def test_only_canvas_env_spells_a_variable_name_in_code() -> None:
    spelled: dict[str, list[str]] = {}
    for path in _source_files((".py",)):
        rel = str(path.relative_to(REPO))
        if rel == "canvas/env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value):
                spelled.setdefault(rel, []).append(node.value)
    assert spelled == {}, "import the EnvVar from canvas.env instead"
