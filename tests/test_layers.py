"""The layout's rules, read from the source: imports point down the layers, no import circle between files, no loose
module in `canvas/`, and every package's `__init__` docstring is its map.

Every `import` and `from ... import` counts wherever it stands, a lazy one inside a function included: it is still
a dependency, only a later one. Imports under `if TYPE_CHECKING:` count for the direction (an upward one, even for
an annotation, is a layering mistake) but not for circles: they never run, so two files whose annotations name each
other do not depend on each other to load. The layers, bottom up (a package may import its own layer and the ones
below, never one above):

    0  canvas (the face), canvas.protocol, canvas.document, canvas.store, kernels
    1  canvas.sampling          the sampler and its settings, which the model's directory carries
    2  canvas.model
    3  canvas.convert           builds models, and picks the one a command serves
    4  canvas.engine
    5  canvas.server, canvas.cluster
    6  canvas.eval, canvas.training, canvas.bench, canvas.soak, tui
    7  canvas.cli               the entry point (it names its subcommands' modules as strings)

The first tests run the checker on small made-up trees, so that a check which could never fail is caught too.
(apply-moves: skip-file: the package names below are the new layout's, not old modules for tools.apply_moves.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("canvas", "kernels", "tui")
LAYERS: dict[str, int] = {
    "canvas": 0, "canvas.protocol": 0, "canvas.document": 0, "canvas.store": 0, "kernels": 0,
    "canvas.sampling": 1,
    "canvas.model": 2,
    "canvas.convert": 3,
    "canvas.engine": 4,
    "canvas.server": 5, "canvas.cluster": 5,
    "canvas.eval": 6, "canvas.training": 6, "canvas.bench": 6, "canvas.soak": 6, "tui": 6,
    "canvas.cli": 7,
}  # fmt: skip
# The face and the CLI entry are the only modules `canvas/` may hold beside its packages.
LOOSE_ALLOWED = {"canvas/__init__.py", "canvas/cli.py"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path, packages: Iterable[str] = ROOTS) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> Iterator[str]:
    """The dotted names one import statement may refer to (a module, or a name inside one)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING":
            found.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return found


def import_graph(root: Path, packages: Iterable[str] = ROOTS, *, type_only: bool = True) -> dict[str, set[str]]:
    """File -> the project files it imports (each import resolved to the longest module name it starts with);
    `type_only` False leaves out the imports under `TYPE_CHECKING`."""
    mods = modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = set() if type_only else _type_only(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip:
                continue
            for dotted in _imported(node, name, path.name == "__init__.py"):
                parts = dotted.split(".")
                target = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods),
                              None)
                if target is not None and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> tuple[str, int]:
    """The most specific layered package a module belongs to, and its layer."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix, layers[prefix]
    raise KeyError(f"{module} is in no layer: add its package to LAYERS in {__file__}")


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        src_pkg, src_layer = layer_of(src, layers)
        for dst in sorted(targets):
            dst_pkg, dst_layer = layer_of(dst, layers)
            if dst_layer > src_layer:
                bad.append(f"{src} ({src_pkg}, layer {src_layer}) imports {dst} ({dst_pkg}, layer {dst_layer})")
    return bad


# ---- the checker on made-up trees ----------------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_circle_through_a_lazy_import_is_found_and_a_type_only_one_is_not(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "canvas/__init__.py": "",
        "canvas/a.py": "from canvas.b import X\n",
        "canvas/b.py": "def f():\n    from canvas import c\n",
        "canvas/c.py": "import canvas.a\n",
        "canvas/d.py": "from .a import X\n",  # relative, into the circle but not part of it
        "canvas/e.py": "import typing\nif typing.TYPE_CHECKING:\n    from canvas.f import Y\n",
        "canvas/f.py": "from canvas.e import Z\n",
    })  # fmt: skip
    graph = import_graph(root, ["canvas"], type_only=False)
    assert graph["canvas.d"] == {"canvas.a"} and graph["canvas.e"] == set()
    assert circles(graph) == [["canvas.a", "canvas.b", "canvas.c"]]
    assert circles(import_graph(root, ["canvas"])) == [["canvas.a", "canvas.b", "canvas.c"], ["canvas.e", "canvas.f"]]


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "canvas/__init__.py": "",
        "canvas/model/__init__.py": "",
        "canvas/model/io.py": "import canvas.engine.core\n",
        "canvas/engine/__init__.py": "",
        "canvas/engine/core.py": "import typing\nif typing.TYPE_CHECKING:\n    from canvas.model import io\n",
    })  # fmt: skip
    graph = import_graph(root, ["canvas"])  # type-only imports count for the direction
    assert upward_imports(graph) == [
        "canvas.model.io (canvas.model, layer 2) imports canvas.engine.core (canvas.engine, layer 4)"
    ]


# ---- the project ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO)


def test_no_import_circle_between_files() -> None:
    found = circles(import_graph(REPO, type_only=False))
    assert found == [], "files that import each other: move the shared piece to a third module"


def test_imports_point_down_the_layers(graph: dict[str, set[str]]) -> None:
    assert upward_imports(graph) == []


def test_every_package_is_in_a_layer(graph: dict[str, set[str]]) -> None:
    for module in graph:
        layer_of(module)  # raises for a package no layer names


def test_no_loose_module_in_canvas() -> None:
    loose = {str(p.relative_to(REPO)) for p in (REPO / "canvas").glob("*.py")}
    assert loose <= LOOSE_ALLOWED, f"modules beside canvas/'s packages: {sorted(loose - LOOSE_ALLOWED)}"


def test_every_package_docstring_is_its_map() -> None:
    for init in sorted(p for root in ROOTS for p in (REPO / root).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        rel = init.relative_to(REPO)
        assert len(doc.split()) >= 20, f"{rel}: its docstring should say what the package owns and its imports"
        assert "import" in doc, f"{rel}: its docstring should say what it may import and what imports it"


def test_the_readme_table_matches_the_layers() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## What is here", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit() and cells[1].startswith("`"):
            path = cells[1].strip("`").rstrip("/").removesuffix(".py")
            listed[path.replace("/", ".")] = int(cells[0])
    packages = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "canvas").glob("*/__init__.py")}
    assert packages | {"kernels", "tui", "canvas.cli"} == set(listed), "README: one row per package of canvas/"
    assert {name: LAYERS[name] for name in listed} == listed, "README: a row's layer differs from LAYERS here"
