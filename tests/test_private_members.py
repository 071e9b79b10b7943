"""No module reaches into another module's underscored members: what a module owns privately, only it touches.

A member access `x._name` (not a dunder) is the module's own when `_name` is defined in the same file: a function, a
class attribute, or an attribute assigned anywhere in it (`self._name = ...`, `other._name = ...`), since a class may
read its private state on another instance of itself (`clone`, `from_entries`); and `self._name` / `cls._name`
always is, a subclass using what its base class keeps for its subclasses. Otherwise it reaches into another
module, and fails here. `from pkg import _name` of the project's own modules fails the same way. Third-party private
API (`torch._C`, a tensor's `_version`) is allowed only where it is listed below with the reason it is needed.

The first test runs the checker on a small made-up tree, so that a check which could never fail is caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("canvas", "kernels", "tui")
OWN = ("canvas", "kernels", "tui")
# Third-party private members the project needs, each with why (the base's root name, the member).
THIRD_PARTY = {
    ("torch", "_C"): "the compiled extension's ABI flag and a tensor-only dispatch switch",
    ("torch", "_GLIBCXX_USE_CXX11_ABI"): "the C++ ABI the kernels must be built with, part of their cache key",
    ("torch", "_dynamo"): "marking a decode step as not to be compiled",
    ("torch", "_weight_int8pack_mm"): "the int8 weight-only matmul ATen ships without a public name",
    ("*", "_version"): "a tensor's in-place version counter: the only way to see a weight changed in place",
}


def _defined_here(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _root(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _allowed(base: ast.expr, attr: str) -> bool:
    return (_root(base), attr) in THIRD_PARTY or ("*", attr) in THIRD_PARTY


def reaches(source: str, where: str) -> list[str]:
    """Each `where:line: expr` of `source` that touches another module's underscored member."""
    tree = ast.parse(source)
    own = _defined_here(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr = node.attr
            private = attr.startswith("_") and not attr.startswith("__")
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if private and not mine and attr not in own and not _allowed(node.value, attr):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OWN:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def test_the_checker_finds_a_reach_and_passes_a_class_reading_itself() -> None:
    other = "def f(doc):\n    return doc._atoms\n"
    own = (
        "class D:\n    def __init__(self):\n        self._atoms = []\n"
        "    def clone(self, o):\n        return o._atoms\n"
    )
    imported = "from canvas.document.core import _helper\n"
    third = "import torch\nx = torch._C._jit_internal\n"
    assert reaches(other, "a.py") == ["a.py:2: doc._atoms"]
    assert reaches(own, "b.py") == []
    assert reaches(imported, "c.py") == ["c.py:1: from canvas.document.core import _helper"]
    assert reaches(third, "d.py") == ["d.py:2: torch._C._jit_internal"]  # `_C` is listed, this member of it is not


def test_no_module_touches_another_modules_private_members() -> None:
    found: list[str] = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            found += reaches(path.read_text(), str(path.relative_to(REPO)))
    assert not found, "private members reached from another module:\n" + "\n".join(found)
