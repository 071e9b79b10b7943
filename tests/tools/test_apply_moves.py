"""`python -m tools.apply_moves`: old import paths rewritten by the move map, nothing else touched, idempotent; and the
map itself agrees with the tree (every new module exists, no old one survives as a shim, every moved name is there),
and the tree as it is comes out unchanged. This file holds old-layout text on purpose (apply-moves: skip-file)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tools.apply_moves import MAP_FILE, MoveMap, Rewriter, main

REPO = Path(__file__).resolve().parents[2]

OLD = '''\
from canvas.engine import Engine, GenRequest
from canvas.server import backend
from canvas import engine_ar, sampler as smp
from canvas.store import DocStore, Store, open_store
from canvas.bench import machine, print_table
import canvas.engine_ar as engine_ar
from canvas.server.http_api import (
    HttpApi,
    Refusal,
)
from canvas.document import Document  # did not move


def test_x(monkeypatch):
    monkeypatch.setattr("canvas.sampler.GumbelNoise", None)
    with mock.patch("canvas.engine.Engine.step"):
        run("python -m canvas.training.evaluate", "tests/canvas/test_engine.py::test_x", "canvas/store_pg.py")
'''

NEW = '''\
from canvas.engine.core import Engine, GenRequest
from canvas.engine import backend
from canvas.engine import ar as engine_ar
from canvas.sampling import sampler as smp
from canvas.store.base import DocStore
from canvas.store.sqlite import Store
from canvas.store import open_store
from canvas.bench.common import machine, print_table
import canvas.engine.ar as engine_ar
from canvas.server.http.core import (
    HttpApi,
    Refusal,
)
from canvas.document import Document  # did not move


def test_x(monkeypatch):
    monkeypatch.setattr("canvas.sampling.sampler.GumbelNoise", None)
    with mock.patch("canvas.engine.core.Engine.step"):
        run("python -m canvas.eval.evaluate", "tests/canvas/engine/test_engine.py::test_x", "canvas/store/pg.py")
'''


@pytest.fixture(scope="module")
def moves() -> MoveMap:
    return MoveMap.load()


def test_old_imports_strings_and_paths_are_rewritten(moves: MoveMap) -> None:
    rewriter = Rewriter(moves)
    assert rewriter.text(OLD, python=True) == NEW
    assert rewriter.text(NEW, python=True) == NEW  # idempotent: the new layout is left alone


def test_docs_and_config_are_rewritten_by_name_only(moves: MoveMap) -> None:
    rewriter = Rewriter(moves)
    text = 'dcanvas = "canvas.cli:main"\n`canvas/engine.py` and `canvas.store.Store`; the canvas engine.\n'
    assert rewriter.text(text, python=False) == (
        'dcanvas = "canvas.cli:main"\n`canvas/engine/core.py` and `canvas.store.sqlite.Store`; the canvas engine.\n'
    )


def test_the_command_rewrites_files_and_check_reports_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "pkg" / "test_old.py"
    old.parent.mkdir()
    old.write_text(OLD)
    untouched = tmp_path / "pkg" / "notes.md"
    untouched.write_text("nothing that moved\n")
    assert main(["--check", str(tmp_path)]) == 1
    assert old.read_text() == OLD  # --check writes nothing
    assert main([str(tmp_path)]) == 0
    assert old.read_text() == NEW and untouched.read_text() == "nothing that moved\n"
    assert main(["--check", str(tmp_path)]) == 0
    assert "test_old.py" in capsys.readouterr().out


def test_the_tree_is_already_in_the_new_layout(capsys: pytest.CaptureFixture[str]) -> None:
    targets = ["canvas", "kernels", "tui", "tests", "tools", "docs", "README.md", "BENCHMARKS.md", "pyproject.toml"]
    assert main(["--check", *(str(REPO / t) for t in targets)]) == 0, capsys.readouterr().out


def _module_path(name: str) -> Path:
    base = REPO.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_the_map_agrees_with_the_tree(moves: MoveMap) -> None:
    assert MAP_FILE.is_file()
    for old, new in moves.modules.items():
        assert _module_path(new).is_file(), f"{old} -> {new}: no such module"
        assert not REPO.joinpath(*old.split(".")).with_suffix(".py").exists(), f"{old} is still there (a shim?)"
    for old, new in moves.symbols.items():
        module, _, name = new.rpartition(".")
        assert name in _top_level_names(_module_path(module)), f"{old} -> {new}: not defined there"
