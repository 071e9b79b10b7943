"""The embedded model's byte-level BPE (`canvas.model.tokenizer`): training, special ids, saving and loading."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from canvas.model.tokenizer import (
    NULL,
    SPECIAL_TOKENS,
    TokenizerError,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)

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
