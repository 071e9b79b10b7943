"""Token arrays (`canvas.training.tokens`) from a corpus, and `dcanvas data build` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from canvas.cli import main
from canvas.model.tokenizer import load_tokenizer, save_tokenizer, special_ids, train_tokenizer
from canvas.training.tokens import TokenArrays, tokenize_corpus
from tests.canvas.model.test_tokenizer import TEXTS


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(TEXTS, vocab_size=400), out)
    return out


def _write_corpus(d: Path, texts: dict[str, list[str]]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for split, docs in texts.items():
        lines = [json.dumps({"id": f"{split}/{i}", "source": "s", "text": t}) for i, t in enumerate(docs)]
        (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_tokenize_corpus_layout(tok_dir: Path, tmp_path: Path) -> None:
    docs = {"train": TEXTS[:4], "valid": ["Café 🙂 one.", "Two."]}
    _write_corpus(tmp_path / "corpus", docs)
    meta = tokenize_corpus(tmp_path / "corpus", tok_dir, tmp_path / "tokens")
    tok = load_tokenizer(tok_dir)
    ids = special_ids(tok)
    for split, texts in docs.items():
        arr = TokenArrays.open(tmp_path / "tokens", split)
        assert arr.tokens.dtype == np.uint16 and len(arr) == meta["splits"][split]["tokens"]
        assert arr.doc_starts.tolist()[0] == 0 and len(arr.doc_starts) == len(texts)
        bounds = [*arr.doc_starts.tolist(), len(arr)]
        for text, start, end in zip(texts, bounds[:-1], bounds[1:], strict=True):
            doc = arr.tokens[start:end].tolist()
            assert doc[0] == ids["bos"] and doc[-1] == ids["eos"]
            assert tok.decode(doc[1:-1]) == text
    assert TokenArrays.open(tmp_path / "tokens", "train").special_ids == ids
    with pytest.raises(ValueError, match="split"):
        TokenArrays.open(tmp_path / "tokens", "test")


def test_token_arrays_detect_truncated_file(tok_dir: Path, tmp_path: Path) -> None:
    _write_corpus(tmp_path / "corpus", {"train": TEXTS[:2], "valid": ["x y z"]})
    tokenize_corpus(tmp_path / "corpus", tok_dir, tmp_path / "tokens")
    path = tmp_path / "tokens" / "train.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="meta.json says"):
        TokenArrays.open(tmp_path / "tokens", "train")


def test_cli_data_build_all_stages(fake_cache: Path, tmp_path: Path) -> None:
    args = ["data", "build", "--cache", str(fake_cache), "--out", str(tmp_path / "corpus")]
    args += ["--tokenizer-out", str(tmp_path / "tok"), "--tokens-out", str(tmp_path / "tokens")]
    assert main([*args, "--vocab-size", "320", "--valid-fraction", "0.2"]) == 0
    manifest = json.loads((tmp_path / "corpus" / "manifest.json").read_text())
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["splits"]["train"]["docs"] == manifest["splits"]["train"]["docs"]
    assert meta["special_ids"] == special_ids(load_tokenizer(tmp_path / "tok"))


def test_cli_rejects_bad_stage(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="bad stages"):
        main(["data", "build", "--out", str(tmp_path), "--stages", "corpus,bogus"])
