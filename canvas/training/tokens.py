"""Flat token arrays of the corpus, the input of training: `<split>.bin`, `<split>.docs.npy` and `meta.json`.

Layout: every document becomes `<bos> tokens... <eos>`, documents concatenated in corpus order into one flat array
(`uint16` when the vocabulary fits, else `int32`) written raw to `<split>.bin`; `<split>.docs.npy` holds the start
offset of each document (int64, ascending, first 0) and `<split>.kinds.npy` each document's kind (uint8, `KIND_CODE`
for a code file, `KIND_PROSE` else; a corpus record without "kind" is prose). `meta.json` records the dtype, sizes,
the special ids and the sha256 of the tokenizer and corpus files, so training can refuse arrays built with another
tokenizer. `TokenArrays.open` memory-maps them (read-only).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from canvas.model.tokenizer import load_tokenizer, special_ids

SPLITS = ("train", "valid")
KIND_PROSE, KIND_CODE = 0, 1


def _records(path: Path) -> Iterator[tuple[str, int]]:
    """(text, kind) of every line of a corpus JSONL file, in order."""
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            yield record["text"], KIND_CODE if record.get("kind") == "code" else KIND_PROSE


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _batches(texts: Iterator[tuple[str, int]], size: int) -> Iterator[list[tuple[str, int]]]:
    batch: list[tuple[str, int]] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_corpus(corpus_dir: Path, tokenizer_dir: Path, out_dir: Path, *, batch_size: int = 256) -> dict[str, Any]:
    """Tokenize `corpus_dir/{train,valid}.jsonl` with the tokenizer in `tokenizer_dir`; return the meta dict."""
    from tokenizers import Tokenizer

    ids = special_ids(load_tokenizer(tokenizer_dir))  # checks that the HF layout loads, as training will
    # The raw tokenizer encodes without the HF wrapper's per-call overhead and max-length warnings.
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "format": "bos-doc-eos concatenated, raw little-endian",
        "dtype": np.dtype(dtype).name,
        "vocab_size": vocab_size,
        "special_ids": ids,
        "tokenizer_sha256": file_sha256(tokenizer_dir / "tokenizer.json"),
        "splits": {},
    }
    for split in SPLITS:
        src = corpus_dir / f"{split}.jsonl"
        if not src.exists():
            raise FileNotFoundError(f"no {src}: run `dcanvas data build` first")
        starts: list[int] = []
        kinds: list[int] = []
        total = 0
        chars = 0
        bin_path = out_dir / f"{split}.bin"
        with bin_path.open("wb") as fh:
            for batch in _batches(_records(src), batch_size):
                chars += sum(len(t) for t, _ in batch)
                kinds += [k for _, k in batch]
                for enc in tok.encode_batch([t for t, _ in batch], add_special_tokens=False):
                    doc = enc.ids
                    arr = np.asarray([ids["bos"], *doc, ids["eos"]], dtype=np.int64)
                    if arr.max(initial=0) >= vocab_size or arr.min(initial=0) < 0:
                        raise ValueError(f"token id out of range in {src}")
                    starts.append(total)
                    total += int(arr.size)
                    fh.write(arr.astype("<" + np.dtype(dtype).str[1:]).tobytes())
        np.save(out_dir / f"{split}.docs.npy", np.asarray(starts, dtype=np.int64))
        np.save(out_dir / f"{split}.kinds.npy", np.asarray(kinds, dtype=np.uint8))
        meta["splits"][split] = {
            "file": bin_path.name,
            "tokens": total,
            "docs": len(starts),
            "code_docs": sum(k == KIND_CODE for k in kinds),
            "chars": chars,
            "chars_per_token": round(chars / max(1, total - 2 * len(starts)), 4),
            "corpus_sha256": file_sha256(src),
        }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


@dataclass(frozen=True, slots=True)
class TokenArrays:
    """One split's tokens (memory-mapped) and document starts."""

    tokens: np.ndarray  # (N,) uint16/int32
    doc_starts: np.ndarray  # (D,) int64
    meta: dict[str, Any]
    kinds: np.ndarray | None = None  # (D,) uint8 `KIND_*`; None: arrays made before kinds were recorded (all prose)

    @classmethod
    def open(cls, tokens_dir: Path | str, split: str) -> TokenArrays:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        base = Path(tokens_dir)
        meta_path = base / "meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"no {meta_path}: run `dcanvas data build` first")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        info = meta["splits"][split]
        tokens = np.memmap(base / info["file"], dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r")
        if tokens.size != info["tokens"]:
            raise ValueError(f"{base / info['file']} holds {tokens.size} tokens, meta.json says {info['tokens']}")
        starts = np.load(base / f"{split}.docs.npy")
        kinds_path = base / f"{split}.kinds.npy"
        kinds = np.load(kinds_path) if kinds_path.exists() else None
        if kinds is not None and kinds.shape != starts.shape:
            raise ValueError(f"{kinds_path} holds {kinds.size} kinds for {starts.size} documents")
        return cls(tokens=tokens, doc_starts=starts, meta=meta, kinds=kinds)

    @property
    def special_ids(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.meta["special_ids"].items()}

    def __len__(self) -> int:
        return int(self.tokens.size)
