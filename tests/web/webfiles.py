"""Reading the web client's files from Python: the name tables of web/protocol.js, imports, and index.html controls.

protocol.js keeps its tables in a fixed form (`export const NAME = Object.freeze({ KEY: "value", ... });` and
`export const NAME = "value";`), which `protocol_tables` parses; the browser test checks the parse against what
the browser itself evaluates, so a table the parser misreads cannot pass unnoticed.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WEB = REPO / "web"

_TABLE = re.compile(r"export const (\w+) = Object\.freeze\(\{(.*?)\}\);", re.S)
_ENTRY = re.compile(r"^\s*(\w+):\s*(\"[^\"]*\"|-?\d+),?\s*(//.*)?$")
_SCALAR = re.compile(r"^export const (\w+) = (\"[^\"]*\"|-?\d+);", re.M)


def protocol_tables(source: str | None = None) -> dict[str, dict[str, str | int] | str | int]:
    """Every `Object.freeze({...})` table and scalar constant in web/protocol.js, as Python values."""
    text = (WEB / "protocol.js").read_text(encoding="utf-8") if source is None else source
    out: dict[str, dict[str, str | int] | str | int] = {}
    for name, body in _TABLE.findall(text):
        table: dict[str, str | int] = {}
        for line in body.splitlines():
            if not line.strip():
                continue
            m = _ENTRY.match(line)
            if m is None:
                raise ValueError(f"protocol.js: {name}: cannot parse the line {line.strip()!r}")
            key, raw = m.group(1), m.group(2)
            table[key] = raw[1:-1] if raw.startswith('"') else int(raw)
        out[name] = table
    for name, raw in _SCALAR.findall(text):
        out[name] = raw[1:-1] if raw.startswith('"') else int(raw)
    return out


def js_files() -> list[Path]:
    return sorted(WEB.glob("*.js"))


_IMPORT = re.compile(r"^import\s*\{([^}]*)\}\s*from\s*\"([^\"]+)\";", re.M)
_EXPORT = re.compile(r"^export\s+(?:const|let|class|function|async function)\s+(\w+)", re.M)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """`(module specifier, imported names)` for each `import { ... } from "..."` of a module."""
    text = path.read_text(encoding="utf-8")
    return [(spec, [n.strip() for n in names.split(",") if n.strip()]) for names, spec in _IMPORT.findall(text)]


def exports(path: Path) -> set[str]:
    return set(_EXPORT.findall(path.read_text(encoding="utf-8")))


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))


def html_elements(path: Path | None = None) -> list[tuple[str, dict[str, str | None]]]:
    """Every start tag of web/index.html with its attributes."""
    parser = _Elements()
    parser.feed((path or WEB / "index.html").read_text(encoding="utf-8"))
    return parser.elements
