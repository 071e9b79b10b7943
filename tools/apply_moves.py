"""Rewrite references to moved modules by the move map, for files written against the layout before a move.

    python -m tools.apply_moves PATH...            # files, or directories (their .py/.md/.toml/... files)
    python -m tools.apply_moves --check PATH...    # only list what would change; exit 1 if anything would

Owns the rewriting rules; the map itself is data (`tools/module_moves.json`): `modules` maps every moved module's
old dotted name to its new one, `symbols` maps a name that left its module (`old.module.Name`) to where it lives
now. What gets rewritten, in any text file:
- dotted names of moved modules: `import x`, `from x import ...`, and strings such as mock.patch targets,
  monkeypatch paths, `python -m x`, `module:function` entry points and the names in docs;
- `from x import a, b` where some of the names moved elsewhere: split into one import per module (an imported
  submodule whose last name changed keeps its local name with `as`);
- file paths of moved modules (`canvas/engine.py` -> `canvas/engine/core.py`), as docs and test ids write them.
Invariant: a name already in the new layout is left alone, so running it twice changes nothing (a new module that
sits under an old module's name, as `canvas.engine.core` under the old `canvas.engine`, is recognised by its map).
A bare old module name that is now a package's (`canvas.engine`, `canvas.store`, `canvas.bench`) is read as the old
module in `import` and `from ... import` statements (with the names imported deciding) and in a string literal that
is nothing but the name (`("canvas.bench", "register")`: a module for importlib), and is left alone elsewhere (prose
may mean the package), so it may run over the whole tree: files already in the new layout come out unchanged. A
file that holds old-layout text on purpose says so in its first lines with the marker below (this one does:
apply-moves: skip-file).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MAP_FILE = Path(__file__).with_name("module_moves.json")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ".yml", ".yaml", ".json", ".pyi"}
SKIP_MARK = "apply-moves: skip-file"  # in a file's first 2000 characters: leave the file alone (old-layout fixtures)
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "data"}
ROOTS = ("canvas", "kernels", "tui", "tests")
_ROOT = "(?:" + "|".join(ROOTS) + ")"
# A dotted name that starts at a package root and is not the tail of a longer dotted name.
_DOTTED = re.compile(rf"(?<![\w.]){_ROOT}(?:\.[A-Za-z_]\w*)+")
# A dotted name that is a whole string literal: a module named for importlib, `python -m`, a patch target.
_QUOTED = re.compile(rf"""(["'])({_ROOT}(?:\.[A-Za-z_]\w*)+)(["'])""")
# A module's file path (relative, or the tail of an absolute one).
_PATH = re.compile(rf"(?<![\w.]){_ROOT}(?:/[A-Za-z_]\w*)+\.py\b")
# `import a.b, c as d` (the names of one statement).
_IMPORT = re.compile(r"^(?P<indent>[ \t]*)import[ \t]+(?P<names>[\w., \t]+)$", re.MULTILINE)
# `from x import names` (one line, a parenthesised list, or backslash continuations).
_FROM = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<mod>[\w.]+)[ \t]+import[ \t]+"
                   r"(?P<names>\([^)]*\)|(?:[^\n\\]*\\\n)*[^\n]*)", re.MULTILINE)


@dataclass(frozen=True)
class MoveMap:
    modules: dict[str, str]
    symbols: dict[str, str]

    @classmethod
    def load(cls, path: Path = MAP_FILE) -> MoveMap:
        raw = json.loads(path.read_text())
        return cls(dict(raw.get("modules", {})), dict(raw.get("symbols", {})))

    @property
    def new_names(self) -> set[str]:
        """Every module and package that exists after the move, so that a current name is never rewritten."""
        names: set[str] = set()
        for target in [*self.modules.values(), *(s.rpartition(".")[0] for s in self.symbols.values())]:
            parts = target.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        return names


def existing_modules(root: Path = MAP_FILE.parent.parent) -> set[str]:
    """Every module and package in the tree as it is now: a module added after the move under a package that bears an
    old module's name (`canvas.engine.prefix_cache`) is current, never an old name to rewrite."""
    names: set[str] = set()
    for top in ROOTS:
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


class Rewriter:
    def __init__(self, moves: MoveMap, current: set[str] | None = None) -> None:
        """`current`: the modules that exist now (`existing_modules`), kept as they are; the move map's targets always
        count."""
        self.moves = moves
        self.new_names = moves.new_names | (current or set())

    def dotted(self, name: str, *, bare: bool = False) -> str:
        """The current spelling of a dotted name (a module, or a name inside one); unchanged if it did not move.
        An old module's bare name that a package now has (`canvas.engine`) is rewritten only with `bare` (an import
        statement, where it can only mean the old module); in other text it may well name the package."""
        if not bare and name in self.moves.modules and name in self.new_names:
            return name
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            target = self.moves.symbols.get(prefix) or self.moves.modules.get(prefix)
            if target is None:
                continue
            if any(".".join(parts[:j]) in self.new_names for j in range(i + 1, len(parts) + 1)):
                return name  # already the new layout (a new module under an old module's name)
            return ".".join([target, *parts[i:]])
        return name

    def path(self, path: str) -> str:
        stem = path[: -len(".py")]
        if stem.endswith("/__init__"):  # a package's face: the package's own name, which is never an old module's
            return self.dotted(stem[: -len("/__init__")].replace("/", ".")).replace(".", "/") + "/__init__.py"
        return self.dotted(stem.replace("/", "."), bare=True).replace(".", "/") + ".py"  # a file: the old module

    def from_import(self, match: re.Match[str]) -> str:
        indent, module, names_src = match["indent"], match["mod"], match["names"]
        inner = names_src.strip()
        inner = inner[1:-1] if inner.startswith("(") else inner.replace("\\\n", " ")
        names = [n.strip() for n in inner.replace("\n", " ").split(",") if n.strip() and not n.strip().startswith("#")]
        if any("#" in n for n in names):  # comments inside the list: keep its layout, rename the module only
            return match[0].replace(module, self.dotted(module, bare=True), 1)
        groups: dict[str, list[str]] = {}
        for spec in names:
            name, _, alias = (p.strip() for p in spec.partition(" as "))
            full = self.dotted(f"{module}.{name}")
            if f"{module}.{name}" in self.new_names:  # a submodule imported by its new name
                target, new_name = module, name
            elif f"{module}.{name}" in self.moves.symbols or f"{module}.{name}" in self.moves.modules:
                target, _, new_name = full.rpartition(".")
            else:
                target, new_name = self.dotted(module, bare=True), name
            local = alias or name
            groups.setdefault(target, []).append(new_name if new_name == local else f"{new_name} as {local}")
        if len(groups) == 1:
            (target, specs), = groups.items()
            if specs == [(p.strip()) for p in names]:
                return match[0].replace(module, target, 1)
        lines = []
        for target, specs in groups.items():
            line = f"{indent}from {target} import {', '.join(specs)}"
            if len(line) > 120:
                body = "".join(f"{indent}    {s},\n" for s in specs)
                line = f"{indent}from {target} import (\n{body}{indent})"
            lines.append(line)
        return "\n".join(lines)

    def plain(self, src: str) -> str:
        src = _QUOTED.sub(lambda m: m[1] + self.dotted(m[2], bare=True) + m[3], src)
        src = _DOTTED.sub(lambda m: self.dotted(m[0]), src)
        return _PATH.sub(lambda m: self.path(m[0]), src)

    def imports(self, src: str) -> str:
        return _IMPORT.sub(lambda m: _DOTTED.sub(lambda d: self.dotted(d[0], bare=True), m[0]), src)

    def text(self, src: str, python: bool) -> str:
        if not python:
            return self.plain(src)
        # `from` statements are rewritten whole (their module is read with the names it imports); the text between
        # them name by name.
        out, pos = [], 0
        for match in _FROM.finditer(src):
            out += [self.plain(self.imports(src[pos:match.start()])), self.from_import(match)]
            pos = match.end()
        return "".join([*out, self.plain(self.imports(src[pos:]))])


def iter_files(paths: Sequence[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file() and child.suffix in SUFFIXES | {""} and child.resolve() != MAP_FILE.resolve() \
                        and not SKIP_DIRS.intersection(child.relative_to(path).parts):
                    if child.suffix or child.name == "Makefile":
                        yield child
        elif path.is_file():
            yield path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.apply_moves", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="list the files that would change; exit 1 if any")
    parser.add_argument("--map", type=Path, default=MAP_FILE, help="the move map (default: tools/module_moves.json)")
    args = parser.parse_args(argv)
    rewriter = Rewriter(MoveMap.load(args.map), existing_modules())
    changed = 0
    for path in iter_files(args.paths):
        try:
            src = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if SKIP_MARK in src[:2000]:
            continue
        new = rewriter.text(src, python=path.suffix in {".py", ".pyi"})
        if new != src:
            changed += 1
            print(f"{'would rewrite' if args.check else 'rewrote'} {path}")
            if not args.check:
                path.write_text(new, encoding="utf-8")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
