"""The layout's rules, read from the source: imports point down the layers, no import circle between files, no loose
module in `canvas/`, and every package's `__init__` docstring is its map.
(apply-moves: skip-file: the package names here are the new layout's, not old modules for tools.apply_moves.)

Every `import` and `from ... import` counts wherever it stands, a lazy one inside a function included: it is still
a dependency, only a later one. Imports under `if TYPE_CHECKING:` count for the direction (an upward one, even for
an annotation, is a layering mistake) but not for circles: they never run, so two files whose annotations name each
other do not depend on each other to load. The layers, bottom up (a package may import its own layer and the ones
below, never one above):

    0  canvas (the face), canvas.env, canvas.protocol, canvas.document, canvas.store, kernels
                                canvas.env names and reads the DCANVAS_* variables: here, kernels may import it
    1  canvas.sampling          the sampler and its settings, which the model's directory carries
    2  canvas.model
    3  canvas.convert           builds models, and picks the one a command serves
    4  canvas.engine
    5  canvas.server, canvas.cluster
    6  canvas.eval, canvas.training, canvas.bench, canvas.soak, tui
    7  canvas.cli               the entry point (it names its subcommands' modules as strings)

A package's map is the docstring of its `__init__`, and it stays true:
- every module in the package (each `.py` beside the `__init__`, but `__main__`) and every subpackage is named in
  it in backticks: `prefix_cache`, `http/`, or its dotted name from the package (`kernels.moe.fused_moe` names
  `moe`), with a few words on what it owns;
- it holds one line `Imports: ...` and one line `Imported by: ...` (each may wrap, and runs to the first `.` outside
  backticks): the backticked packages, separated by commas or "and", or the word `nothing`. Imports are counted as
  above, between the modules that sit directly in a package (a subpackage is a package of its own: `canvas.server`
  imports `canvas.server.http` and the other way round), and the entry point `canvas.cli` counts as a package of its
  own, whose imports are the module names of its `SUBCOMMANDS` table. Both lists must be exactly the packages the
  code imports and that import it (tests/ and tools/ are not counted), so a new import, or a dropped one, fails here
  until the map says so. The prose around the two lines says why.

The first tests run the checker on small made-up trees, so that a check which could never fail is caught too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("canvas", "kernels", "tui")
LAYERS: dict[str, int] = {
    "canvas": 0, "canvas.env": 0, "canvas.protocol": 0, "canvas.document": 0, "canvas.store": 0, "kernels": 0,
    "canvas.sampling": 1,
    "canvas.model": 2,
    "canvas.convert": 3,
    "canvas.engine": 4,
    "canvas.server": 5, "canvas.cluster": 5,
    "canvas.eval": 6, "canvas.training": 6, "canvas.bench": 6, "canvas.soak": 6, "tui": 6,
    "canvas.cli": 7,
}  # fmt: skip
# The face, the environment's settings and the CLI entry are the only modules `canvas/` may hold beside its packages.
LOOSE_ALLOWED = {"canvas/__init__.py", "canvas/env.py", "canvas/cli.py"}


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
                target = next(
                    (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods), None
                )
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


# ---- the maps ------------------------------------------------------------------------------------------------------

ENTRY = "canvas.cli"  # the entry point: a package of its own here, as in LAYERS
_FIELDS = {"imports": "Imports:", "imported_by": "Imported by:"}
_BACKTICKED = re.compile(r"`([^`\n]+)`")


def package_of(module: str, mods: dict[str, Path]) -> str:
    """The package a module sits directly in (a package's `__init__` is its own); the entry point is its own."""
    if module == ENTRY or mods[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0]


def _cli_targets(root: Path, mods: dict[str, Path]) -> set[str]:
    """The modules the entry point imports by name: the first item of each `SUBCOMMANDS` entry."""
    path = root / "canvas" / "cli.py"
    if not path.is_file():
        return set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "SUBCOMMANDS"
            and isinstance(node.value, ast.Dict)
        ):
            names = {str(ast.literal_eval(v)[0]) for v in node.value.values}
            unknown = sorted(names - set(mods))
            assert not unknown, f"canvas/cli.py: SUBCOMMANDS names modules that are not there: {unknown}"
            return names
    raise AssertionError("canvas/cli.py: no `SUBCOMMANDS: dict[...] = {...}` table to read the subcommands from")


def package_imports(root: Path, packages: Iterable[str] = ROOTS) -> dict[str, dict[str, set[str]]]:
    """Package -> each other package it imports -> the `importer -> imported` module pairs behind it."""
    mods = modules(root, packages)
    graph = import_graph(root, packages)
    graph.setdefault(ENTRY, set()).update(_cli_targets(root, mods))
    found: dict[str, dict[str, set[str]]] = {package_of(m, mods): {} for m in mods}
    for src, targets in graph.items():
        for dst in targets:
            a, b = package_of(src, mods), package_of(dst, mods)
            if a != b:
                found[a].setdefault(b, set()).add(f"{src} -> {dst}")
    return found


def map_field(doc: str, label: str) -> set[str] | None:
    """The packages one `Imports:` / `Imported by:` line names (empty for `nothing`); None where it is missing.
    Raises ValueError for a line that is not a plain list of backticked names."""
    found = list(re.finditer(rf"^[ \t]*{re.escape(label)}", doc, re.MULTILINE))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"{label} appears {len(found)} times")
    rest = doc[found[0].end() :]
    text, ticks = "", False
    for ch in rest:  # up to the first period outside backticks
        if ch == "." and not ticks:
            break
        ticks ^= ch == "`"
        text += ch
    else:
        raise ValueError(f"{label} does not end with a period")
    names = set(_BACKTICKED.findall(text))
    between = " ".join(_BACKTICKED.sub(" ", text).replace(",", " ").split())
    if between == "nothing" and not names:
        return set()
    if not names or between.replace("and", "").strip():
        raise ValueError(f"{label} should list backticked packages or say `nothing`, not {text.strip()!r}")
    return names


def map_mistakes(root: Path, packages: Iterable[str] = ROOTS) -> list[str]:
    """What each package's map leaves out or gets wrong: unnamed modules, and import lines that differ from the code."""
    packages = list(packages)
    imports = package_imports(root, packages)
    imported_by: dict[str, dict[str, set[str]]] = {p: {} for p in imports}
    for src, targets in imports.items():
        for dst, pairs in targets.items():
            imported_by.setdefault(dst, {})[src] = pairs
    mistakes: list[str] = []
    for init in sorted(p for pkg in packages for p in (root / pkg).rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(root).parts)
        rel = init.relative_to(root)
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        named = set()
        for token in _BACKTICKED.findall(doc):
            token = token.rstrip("/").removeprefix(f"{package}.")
            named.add(token.split(".")[0])
        members = {p.stem for p in init.parent.glob("*.py")} - {"__init__", "__main__"}
        members |= {p.parent.name for p in init.parent.glob("*/__init__.py")}
        if unnamed := sorted(members - named):
            mistakes.append(f"{rel}: its map names no {', '.join(unnamed)} (name each in backticks, with what it owns)")
        for key, label in _FIELDS.items():
            actual = imports.get(package, {}) if key == "imports" else imported_by.get(package, {})
            try:
                said = map_field(doc, label)
            except ValueError as err:
                mistakes.append(f"{rel}: {err}")
                continue
            if said is None:
                mistakes.append(f"{rel}: no `{label}` line; the code says {label} {sorted(actual) or 'nothing'}")
                continue
            for missing in sorted(set(actual) - said):
                mistakes.append(f"{rel}: `{label}` misses {missing} ({'; '.join(sorted(actual[missing]))})")
            for extra in sorted(said - set(actual)):
                mistakes.append(f"{rel}: `{label}` names {extra}, but no such import is in the code")
    return mistakes


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


_MAPPED = {
    "canvas/__init__.py": '"""The face.\n\nImports: nothing.\nImported by: `canvas.cli`, `canvas.engine`."""\n',
    "canvas/cli.py": 'from canvas import __version__\n'
                     'SUBCOMMANDS: dict[str, tuple[str, str]] = {"gen": ("canvas.engine.run", "register")}\n',
    "canvas/engine/__init__.py": '"""Map: `core`, `run`, `http/`.\n\nImports: `canvas`.\n'
                                 'Imported by: `canvas.cli` and\n`canvas.engine.http`."""\n',
    "canvas/engine/core.py": "from canvas import __version__\n",
    "canvas/engine/run.py": "",
    "canvas/engine/http/__init__.py": '"""`routes`.\n\nImports: `canvas.engine`.\nImported by: nothing."""\n',
    "canvas/engine/http/routes.py": "from canvas.engine import core\n",
}  # fmt: skip


def test_true_maps_pass_and_each_drift_is_named(tmp_path: Path) -> None:
    assert map_mistakes(_tree(tmp_path / "ok", _MAPPED), ["canvas"]) == []
    drifted = dict(_MAPPED)
    drifted["canvas/engine/lag.py"] = "import canvas.engine.http.routes\n"  # a new module, and a new import
    drifted["canvas/engine/http/routes.py"] = ""  # an import dropped
    assert map_mistakes(_tree(tmp_path / "drift", drifted), ["canvas"]) == [
        "canvas/engine/__init__.py: its map names no lag (name each in backticks, with what it owns)",
        "canvas/engine/__init__.py: `Imports:` misses canvas.engine.http "
        "(canvas.engine.lag -> canvas.engine.http.routes)",
        "canvas/engine/__init__.py: `Imported by:` names canvas.engine.http, but no such import is in the code",
        "canvas/engine/http/__init__.py: `Imports:` names canvas.engine, but no such import is in the code",
        "canvas/engine/http/__init__.py: `Imported by:` misses canvas.engine "
        "(canvas.engine.lag -> canvas.engine.http.routes)",
    ]


def test_a_map_without_its_import_lines_or_with_prose_in_them_fails(tmp_path: Path) -> None:
    assert map_field("Imports: `a.b`, `c` and `d`.\nrest", "Imports:") == {"a.b", "c", "d"}
    assert map_field("Imported by:\n  nothing. More.", "Imported by:") == set()
    with pytest.raises(ValueError, match="backticked packages"):
        map_field("Imported by: the CLI and `canvas.eval`.", "Imported by:")
    with pytest.raises(ValueError, match="2 times"):
        map_field("Imports: nothing.\nImports: `a`.", "Imports:")
    old = dict(_MAPPED, **{"canvas/engine/http/__init__.py": '"""`routes`: imported by the engine only."""\n'})
    assert map_mistakes(_tree(tmp_path, old), ["canvas"]) == [
        "canvas/engine/http/__init__.py: no `Imports:` line; the code says Imports: ['canvas.engine']",
        "canvas/engine/http/__init__.py: no `Imported by:` line; the code says Imported by: nothing",
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


def test_every_map_names_its_modules_and_its_imports_as_the_code_has_them() -> None:
    mistakes = map_mistakes(REPO)
    assert mistakes == [], "package maps out of date:\n" + "\n".join(mistakes)


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
    loose = {".".join(Path(p).with_suffix("").parts) for p in LOOSE_ALLOWED} - {"canvas.__init__"}
    assert packages | loose | {"kernels", "tui"} == set(listed), "README: one row per package and module of canvas/"
    assert {name: LAYERS[name] for name in listed} == listed, "README: a row's layer differs from LAYERS here"
