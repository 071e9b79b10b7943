from __future__ import annotations

import json
from pathlib import Path

import pytest

from canvas.training.data import CorpusConfig, build_corpus, split_of, write_corpus
from canvas.training.sources import Document
from tests.canvas.training.conftest import SHARED


def _read(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_split_of_is_deterministic_seeded_and_near_the_fraction() -> None:
    ids = [f"doc/{i}" for i in range(20_000)]
    a = [split_of(i, seed=0, valid_fraction=0.02) for i in ids]
    assert a == [split_of(i, seed=0, valid_fraction=0.02) for i in ids]
    assert a != [split_of(i, seed=1, valid_fraction=0.02) for i in ids]
    share = a.count("valid") / len(a)
    assert 0.015 < share < 0.025


def test_corpus_config_validation() -> None:
    with pytest.raises(ValueError, match="valid_fraction"):
        CorpusConfig(valid_fraction=0.0)
    with pytest.raises(ValueError, match="unknown"):
        CorpusConfig(sources=("web", "wikipedia"))


def test_write_corpus_dedupes_paragraphs_and_drops_short_docs(tmp_path: Path) -> None:
    para = "A paragraph long enough to be deduplicated across documents."
    docs = [
        Document("s/1", "s", f"{para}\n\nFirst document's own text is here."),
        Document("s/2", "s", f"{para}\n\nSecond document's own text is here."),
        Document("s/3", "s", para),  # nothing left after dedupe
        Document("t/1", "t", "Too short."),
    ]
    stats = write_corpus(docs, tmp_path, CorpusConfig(valid_fraction=0.5, min_doc_chars=20))
    records = _read(tmp_path / "train.jsonl") + _read(tmp_path / "valid.jsonl")
    texts = {r["id"]: r["text"] for r in records}
    assert set(texts) == {"s/1", "s/2"}
    assert sum(t.count(para) for t in texts.values()) == 1
    assert texts["s/2"] == "Second document's own text is here."
    assert stats["s"].dropped_paragraphs == 2 and stats["s"].dropped_docs == 1
    assert stats["t"].dropped_docs == 1


def test_write_corpus_rejects_duplicate_ids(tmp_path: Path) -> None:
    docs = [Document("a", "s", "x" * 50), Document("a", "s", "y" * 50)]
    with pytest.raises(ValueError, match="duplicate document id"):
        write_corpus(docs, tmp_path, CorpusConfig())


def test_build_corpus_end_to_end_is_deterministic(fake_cache: Path, tmp_path: Path) -> None:
    config = CorpusConfig(valid_fraction=0.2)
    m1 = build_corpus(tmp_path / "a", fake_cache, config)
    m2 = build_corpus(tmp_path / "b", fake_cache, config)
    for name in ("train.jsonl", "valid.jsonl", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert m1 == m2

    train, valid = _read(tmp_path / "a" / "train.jsonl"), _read(tmp_path / "a" / "valid.jsonl")
    assert valid and train
    ids_train, ids_valid = {r["id"] for r in train}, {r["id"] for r in valid}
    assert not ids_train & ids_valid  # a document lies in one split only
    for r in train + valid:
        assert split_of(r["id"], seed=0, valid_fraction=0.2) == ("train" if r["id"] in ids_train else "valid")
    assert sum(r["text"].count(SHARED) for r in train + valid) == 1
    prose, code = {"web", "austen", "pydoc", "fortunes"}, {"pystdlib", "pypkgs", "jsdeb", "shell"}
    assert {r["source"] for r in train + valid} == prose | code  # the held-out "pyheld" in neither split
    assert all(r["kind"] == ("code" if r["source"] in code else "prose") for r in train + valid)

    by_name = {s["name"]: s for s in m1["sources"]}
    assert by_name["pydoc"]["dropped_paragraphs"] == 1
    assert by_name["fortunes"]["dropped_docs"] == 1  # "short"
    assert [p["version"] for p in by_name["fortunes"]["packages"]] == ["1:1.99.1-7.3", "1:1.99.1-7.3"]
    for split, records in (("train", train), ("valid", valid)):
        assert m1["splits"][split]["docs"] == len(records)
        assert m1["splits"][split]["chars"] == sum(len(r["text"]) for r in records)
        assert m1["splits"][split]["words"] == sum(len(r["text"].split()) for r in records)
    assert all(s["licence"] for s in m1["sources"])


def test_build_corpus_seed_changes_split_not_content(fake_cache: Path, tmp_path: Path) -> None:
    build_corpus(tmp_path / "s0", fake_cache, CorpusConfig(seed=0, valid_fraction=0.3))
    build_corpus(tmp_path / "s1", fake_cache, CorpusConfig(seed=1, valid_fraction=0.3))

    def all_ids(d: Path) -> tuple[set[str], set[str]]:
        return {r["id"] for r in _read(d / "valid.jsonl")}, {r["id"] for r in _read(d / "train.jsonl")}

    v0, t0 = all_ids(tmp_path / "s0")
    v1, t1 = all_ids(tmp_path / "s1")
    assert v0 | t0 == v1 | t1
    assert v0 != v1


def test_build_corpus_subset_of_sources(fake_cache: Path, tmp_path: Path) -> None:
    manifest = build_corpus(tmp_path / "c", fake_cache, CorpusConfig(sources=("web",)))
    assert [s["name"] for s in manifest["sources"]] == ["web"]
    records = _read(tmp_path / "c" / "train.jsonl") + _read(tmp_path / "c" / "valid.jsonl")
    assert {r["source"] for r in records} == {"web"}
    assert len(records) == 40
