from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from canvas.cli import main
from canvas.model.tokenizer import (
    NULL,
    SPECIAL_TOKENS,
    TokenizerError,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)
from canvas.training.tokens import TokenArrays, tokenize_corpus

TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune.",
    "Naïve café owners in Zürich serve crème brûlée — “quoted” and ‘single’ marks.",
    "日本語のテキストと emoji 🙂 mixed with English words.",
    "The quick brown fox jumps over the lazy dog. " * 3,
] * 20


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(TEXTS, vocab_size=400), out)
    return out


def test_train_tokenizer_vocab_and_specials() -> None:
    tok = train_tokenizer(TEXTS, vocab_size=400)
    assert tok.get_vocab_size() <= 400
    ids = special_ids(tok)
    assert set(ids) == {"pad", "bos", "eos", "null"}
    assert len(set(ids.values())) == 4


@pytest.mark.parametrize("bad", [10, 70_000])
def test_train_tokenizer_rejects_bad_vocab(bad: int) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(TEXTS, vocab_size=bad)


def test_saved_files_and_autotokenizer_loading(tok_dir: Path) -> None:
    assert {p.name for p in tok_dir.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    tok = load_tokenizer(tok_dir)
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = special_ids(tok)
    assert ids == special_ids(raw)
    assert tok.pad_token_id == ids["pad"] and tok.bos_token_id == ids["bos"] and tok.eos_token_id == ids["eos"]
    assert tok.null_token == NULL and tok.null_token_id == ids["null"]
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["special_token_ids"]["null_token_id"] == ids["null"]
    assert set(json.loads((tok_dir / "special_tokens_map.json").read_text()).values()) == set(SPECIAL_TOKENS)


@pytest.mark.parametrize(
    "text",
    [
        "Naïve café in Zürich — “quoted”.",
        "日本語 and 🙂 emoji, unseen: Ωμέγα ØÆÅ ß",
        "  leading spaces, tabs\tand\nnewlines\n\nkept  ",
    ],
)
def test_round_trip_non_ascii(tok_dir: Path, text: str) -> None:
    tok = load_tokenizer(tok_dir)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    with_bos = tok(text)["input_ids"]
    assert with_bos[0] == tok.bos_token_id and with_bos[1:] == ids


def test_nfc_normalisation(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    composed = "café crème"
    decomposed = unicodedata.normalize("NFD", composed)
    assert (
        tok(decomposed, add_special_tokens=False)["input_ids"] == tok(composed, add_special_tokens=False)["input_ids"]
    )


def test_null_token_is_atomic(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    ids = tok(f"a{NULL}{NULL}b", add_special_tokens=False)["input_ids"]
    assert ids.count(tok.null_token_id) == 2
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_special_ids_reports_missing_tokens(tmp_path: Path) -> None:
    tok = train_tokenizer(TEXTS, vocab_size=300)
    save_tokenizer(tok, tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != NULL]
    del data["model"]["vocab"][NULL]
    broken = Tokenizer.from_str(json.dumps(data))
    with pytest.raises(TokenizerError, match="null"):
        special_ids(broken)
    with pytest.raises(TokenizerError, match="lacks the special token"):
        save_tokenizer(broken, tmp_path / "other")


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
