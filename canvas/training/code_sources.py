"""The code sources of the corpus: Python, JavaScript, shell and Markdown files read as they are, one file a document.

Packages (licences in each `SourceSpec`, and in docs/training-data.md):
- `pystdlib`: the `.py` files of CPython 3.11's standard library, Debian `libpython3.11-minimal` and
  `libpython3.11-stdlib` (the `python3.11` package itself holds only the interpreter; Debian ships the test suite
  apart, in `libpython3.11-testsuite`, which is not used);
- `pypkgs`: the `.py` files of well-known permissively licensed pure-Python wheels from PyPI (`pip download
  --no-deps --only-binary :all:`), with each wheel's Markdown description (its README, in the `METADATA`);
- `pyheld`: three more such wheels, held out whole (`SourceSpec.heldout`): never in the train or validation split,
  their files listed in the manifest and written to `heldout.jsonl`, for a code evaluation on unseen packages;
- `jsdeb`: JavaScript of Debian `libjs-jquery` and `libjs-underscore` (the readable `.js`, not the minified);
- `shell`: the shell scripts and Markdown docs of Debian `shunit2`, `bats` and `neofetch`.

Invariants: a code document's text is the file's bytes decoded as UTF-8 with `\\r\\n` made `\\n` and nothing else
changed (indentation, tabs, blank lines and trailing text stay: an editor's gap is cut in exactly this text); files
that are data rather than code (`is_code_text`: tables of escapes, very long lines, little text) are skipped. Ids are
`<source>/<package>/<path in the package>`, read in sorted order, so a build is deterministic.
"""

from __future__ import annotations

import email
import gzip
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from canvas.training.sources import Document, Package, SourceError, SourceSpec

_PYPI = "https://pypi.org/project/"
TRAIN_WHEELS = (
    ("requests", "2.34.2", "Apache-2.0"),
    ("attrs", "26.1.0", "MIT"),
    ("click", "8.5.1", "BSD-3-Clause"),
    ("six", "1.17.0", "MIT"),
    ("idna", "3.21", "BSD-3-Clause"),
    ("packaging", "26.4", "Apache-2.0 OR BSD-2-Clause"),
    ("jinja2", "3.1.6", "BSD-3-Clause"),
    ("pyparsing", "3.3.3", "MIT"),
)
HELDOUT_WHEELS = (
    ("more-itertools", "11.2.1", "MIT"),
    ("itsdangerous", "2.2.0", "BSD-3-Clause"),
    ("toolz", "1.2.0", "BSD-3-Clause"),
)


def _licences(wheels: Sequence[tuple[str, str, str]]) -> str:
    return "; ".join(f"{name} {licence}" for name, _, licence in wheels)


CODE_SOURCES: tuple[SourceSpec, ...] = (
    SourceSpec(
        name="pystdlib",
        title="CPython 3.11 standard library (.py files)",
        licence="PSF-2.0 (Python Software Foundation License Version 2)",
        url="https://packages.debian.org/bookworm/libpython3.11-stdlib",
        packages=(Package("debian", "libpython3.11-minimal"), Package("debian", "libpython3.11-stdlib")),
    ),
    SourceSpec(
        name="pypkgs",
        title="Pure-Python PyPI packages (.py files and README)",
        licence=_licences(TRAIN_WHEELS),
        url=_PYPI,
        packages=tuple(Package("pypi-wheel", n, v) for n, v, _ in TRAIN_WHEELS),
    ),
    SourceSpec(
        name="jsdeb",
        title="JavaScript libraries (jQuery, Underscore.js)",
        licence="jQuery MIT; Underscore.js MIT",
        url="https://packages.debian.org/bookworm/libjs-jquery",
        packages=(Package("debian", "libjs-jquery"), Package("debian", "libjs-underscore")),
    ),
    SourceSpec(
        name="shell",
        title="Shell scripts and their Markdown docs (shunit2, bats, neofetch)",
        licence="shunit2 Apache-2.0; bats MIT; neofetch MIT",
        url="https://packages.debian.org/bookworm/shunit2",
        packages=(Package("debian", "shunit2"), Package("debian", "bats"), Package("debian", "neofetch")),
    ),
    SourceSpec(
        name="pyheld",
        title="Held-out pure-Python PyPI packages (never trained on; for code evaluation)",
        licence=_licences(HELDOUT_WHEELS),
        url=_PYPI,
        packages=tuple(Package("pypi-wheel", n, v) for n, v, _ in HELDOUT_WHEELS),
        heldout=True,
    ),
)

# Not code to learn from: tests (Debian ships CPython's apart; these are the stragglers), bundled wheels and
# generated tables (the Unicode, codec and topic tables are data).
_STDLIB_SKIP = re.compile(
    r"(^|/)(tests?|idle_test|test_\w+\.py|site-packages|dist-packages|ensurepip|pydoc_data|config-3\.11[^/]*|encodings|"
    r"lib2to3/tests|__phello__)(/|$)"
)
_SHEBANG = re.compile(rb"^#!\s*\S*\b(sh|bash|dash|ksh|zsh)\b|^#!\s*/usr/bin/env\s+(sh|bash)\b")
MAX_FILE_CHARS = 400_000


def code_text(raw: bytes) -> str | None:
    """A code file's text: UTF-8 with `\\r\\n` made `\\n`, else None (not UTF-8, or NUL bytes: binary)."""
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n").removeprefix("\ufeff")


def is_code_text(text: str, *, max_line: int = 300, min_letters: float = 0.4) -> bool:
    """Code to learn from rather than data: some text, lines of editor width (a line over `max_line` characters in
    more than 1% of lines marks a table or minified code), letters at least `min_letters` of the non-space
    characters."""
    if not text.strip() or len(text) > MAX_FILE_CHARS:
        return False
    lines = text.split("\n")
    if sum(len(line) > max_line for line in lines) > max(1, len(lines) // 100):
        return False
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) / max(1, len(chars)) >= min_letters


def _doc(source: str, doc_id: str, raw: bytes) -> Document | None:
    text = code_text(raw)
    if text is None or not is_code_text(text):
        return None
    return Document(id=f"{source}/{doc_id}", source=source, text=text, kind="code")


def read_stdlib(root: Path) -> Iterator[Document]:
    found = sorted(p for p in root.glob("usr/lib/python3.*") if p.is_dir())
    if not found:
        raise SourceError(f"no usr/lib/python3.* under {root}")
    base = found[0]
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base).as_posix()
        if path.is_symlink() or _STDLIB_SKIP.search(rel):
            continue
        doc = _doc("pystdlib", f"{base.name}/{rel}", path.read_bytes())
        if doc is not None:
            yield doc


def wheel_readme(dist_info: Path) -> str | None:
    """A wheel's description (its README) when the METADATA says it is Markdown."""
    meta = dist_info / "METADATA"
    if not meta.is_file():
        return None
    msg = email.message_from_bytes(meta.read_bytes())
    if not str(msg.get("Description-Content-Type", "")).startswith("text/markdown"):
        return None
    body = msg.get_payload()
    return code_text(body.encode("utf-8")) if isinstance(body, str) and body.strip() else None


def read_wheel(root: Path, source: str) -> Iterator[Document]:
    infos = sorted(root.glob("*.dist-info"))
    if not infos:
        raise SourceError(f"no *.dist-info under {root}: not an unpacked wheel")
    package = infos[0].name.split("-")[0].lower().replace("_", "-")
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not path.is_symlink():
            doc = _doc(source, f"{package}/{rel}", path.read_bytes())
            if doc is not None:
                yield doc
    readme = wheel_readme(infos[0])
    if readme is not None and is_code_text(readme, min_letters=0.5):
        yield Document(id=f"{source}/{package}/README.md", source=source, text=readme, kind="code")


def _markdown_docs(root: Path, source: str, package: str) -> Iterator[Document]:
    for path in sorted(root.glob("usr/share/doc/*/*.md")) + sorted(root.glob("usr/share/doc/*/*.md.gz")):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = code_text(raw)
        if text is not None and is_code_text(text, min_letters=0.5):
            name = path.name.removesuffix(".gz")
            yield Document(id=f"{source}/{package}/{name}", source=source, text=text, kind="code")


def _deb_name(root: Path) -> str:
    return root.name.split("_")[0]


def read_js(root: Path) -> Iterator[Document]:
    package = _deb_name(root)
    found = [p for p in sorted(root.glob("usr/share/javascript/**/*.js")) if not p.name.endswith(".min.js")]
    if not found:
        raise SourceError(f"no usr/share/javascript/**/*.js under {root}")
    for path in found:
        if not path.is_symlink():
            doc = _doc("jsdeb", f"{package}/{path.relative_to(root).as_posix()}", path.read_bytes())
            if doc is not None:
                yield doc
    yield from _markdown_docs(root, "jsdeb", package)


def read_shell(root: Path) -> Iterator[Document]:
    package = _deb_name(root)
    count = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("usr/share/man/") or path.suffix == ".gz":
            continue
        raw = path.read_bytes()
        if path.suffix in (".sh", ".bash") or _SHEBANG.match(raw[:80]):
            doc = _doc("shell", f"{package}/{rel}", raw)
            if doc is not None:
                count += 1
                yield doc
    if count == 0:
        raise SourceError(f"no shell scripts under {root}")
    yield from _markdown_docs(root, "shell", package)


def read_code_source(spec: SourceSpec, roots: Sequence[Path]) -> Iterator[Document]:
    """All documents of one code source, from the unpacked roots of its packages (in `spec.packages` order)."""
    for root in roots:
        if spec.name == "pystdlib":
            yield from read_stdlib(root)
        elif spec.name in ("pypkgs", "pyheld"):
            yield from read_wheel(root, spec.name)
        elif spec.name == "jsdeb":
            yield from read_js(root)
        elif spec.name == "shell":
            yield from read_shell(root)
        else:
            raise SourceError(f"{spec.name} is not a code source")
