"""Validation passages laid out as `dcanvas eval` tasks: infill between pinned sides, and continuation.

`read_documents` reads the corpus JSONL that `dcanvas data build` writes, `read_texts` held-out text from outside
the corpus (JSONL or plain text); `build_samples` cuts each document into
non-overlapping passages at atom (whole-character token) boundaries, at most `chunks_per_doc` per document spread
over it, shuffles them with the eval seed and keeps `samples` per task. A `Sample` is the text given to a
`Document` and where its window starts (and, for infill, which characters are masked), so every run builds the
document afresh exactly as an editor session would. A passage is kept only if, re-tokenised on its own, its whole
window fits the canvas: the model and the judge then see the same text.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from canvas.document import Document, atoms_from_text

if TYPE_CHECKING:
    from canvas.engine.backend import Backend

CONTINUATION = "continuation"


class SampleSpec(Protocol):
    """What drawing samples reads of an evaluation's settings (`canvas.eval.evaluate.EvalConfig` has it all)."""

    @property
    def gaps(self) -> tuple[int, ...]: ...
    @property
    def context_tokens(self) -> int: ...
    @property
    def side_tokens(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def chunks_per_doc(self) -> int: ...
    @property
    def tasks(self) -> tuple[str, ...]: ...


class EvalError(ValueError):
    """The evaluation cannot run as asked (missing or too little data, a layout that does not fit the canvas)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One passage laid out for a task. `text` is the whole document given to `Document` (context + window);
    infill masks `gap` (characters) inside it; a continuation's window starts at the end of `text` and
    `reference` is the human text that followed."""

    task: str
    doc_id: str
    text: str
    window_start: int
    gap: tuple[int, int] | None
    reference: str

    def document(self, backend: Backend) -> Document:
        doc = Document(backend.tokenizer, self.text, config=backend.document_config(), window_start=self.window_start)
        if self.gap is not None:
            doc.mask(*self.gap)
        return doc


def read_documents(path: Path) -> list[tuple[str, str]]:
    """(id, text) of every line of a corpus JSONL file (`dcanvas data build` writes `valid.jsonl`)."""
    if path.is_dir():
        path = path / "valid.jsonl"
    if not path.is_file():
        raise EvalError(f"no validation split at {path}: run `dcanvas data build` first, or pass --data PATH")
    docs = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                docs.append((str(rec["id"]), str(rec["text"])))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise EvalError(f"{path}:{n}: not a corpus record with 'id' and 'text' ({exc})") from None
    if not docs:
        raise EvalError(f"{path} holds no documents")
    return docs


def read_texts(path: Path) -> list[tuple[str, str]]:
    """(id, text) of held-out documents from outside the corpus: a `.jsonl` file with a `text` (and optionally an
    `id`) per line, or plain text whose documents are separated by two or more blank lines (a file without them is
    one document). Ids are `<file stem>:<n>` where the file gives none."""
    if not path.is_file():
        raise EvalError(f"--texts: {path} is not a file")
    content = path.read_text(encoding="utf-8")
    docs: list[tuple[str, str]] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                docs.append((str(rec.get("id", f"{path.stem}:{n}")), str(rec["text"])))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise EvalError(f"{path}:{n}: not a JSON object with a 'text' ({exc})") from None
    else:
        parts = [p.strip() for p in re.split(r"\n[ \t]*\n(?:[ \t]*\n)+", content)]
        docs = [(f"{path.stem}:{n}", p) for n, p in enumerate((p for p in parts if p), 1)]
    if not docs:
        raise EvalError(f"{path} holds no text")
    return docs


def _pieces(text: str, backend: Backend, sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Non-overlapping passages of `text`, each cut into consecutive pieces of at least `sizes` tokens at atom
    boundaries; returns each passage's character cut points (len(sizes) + 1 of them), at most `limit` passages
    spread evenly over the document."""
    atoms = atoms_from_text(backend.tokenizer, text)
    chars, tokens = [0], [0]
    for a in atoms:
        chars.append(chars[-1] + len(a.text))
        tokens.append(tokens[-1] + a.slots)
    found: list[list[int]] = []
    i = 0
    while True:
        cuts, k = [i], i
        for size in sizes:
            target = tokens[k] + size
            while k < len(atoms) and tokens[k] < target:
                k += 1
            if tokens[k] < target:
                break
            cuts.append(k)
        if len(cuts) != len(sizes) + 1:
            break
        found.append([chars[c] for c in cuts])
        i = k
    if len(found) > limit:
        stride = len(found) / limit
        found = [found[int(j * stride)] for j in range(limit)]
    return found


def build_samples(docs: Sequence[tuple[str, str]], backend: Backend, cfg: SampleSpec) -> dict[str, list[Sample]]:
    """Up to `cfg.samples` samples per task, drawn with `cfg.seed`; raises `EvalError` when a task gets none."""
    L = backend.canvas_length
    widest = 2 * cfg.side_tokens + max(cfg.gaps)
    if widest > L:
        raise EvalError(f"an infill window of {widest} tokens (2 x {cfg.side_tokens} + {max(cfg.gaps)}) exceeds the "
                        f"model's {L}-token canvas")  # fmt: skip
    out: dict[str, list[Sample]] = {}
    for task in cfg.tasks:
        gap = int(task.removeprefix("infill-")) if task != CONTINUATION else 0
        sizes = [cfg.context_tokens, cfg.side_tokens, gap, cfg.side_tokens] if gap else [cfg.prompt_tokens, L]
        candidates: list[Sample] = []
        for doc_id, text in docs:
            for cuts in _pieces(text, backend, sizes, cfg.chunks_per_doc):
                base = cuts[0]
                if gap:
                    c, g0, g1, end = (x - base for x in cuts[1:])
                    s = Sample(task, doc_id, text[base : cuts[-1]], c, (g0, g1), text[cuts[2] : cuts[3]])
                else:
                    s = Sample(task, doc_id, text[base : cuts[1]], cuts[1] - base, None, text[cuts[1] : cuts[2]])
                if _fits(s, backend):
                    candidates.append(s)
        random.Random(f"{cfg.seed}:{task}").shuffle(candidates)
        if not candidates:
            need = sum(sizes)
            raise EvalError(f"no validation document is long enough for {task} ({need} tokens in one document)")
        out[task] = candidates[: cfg.samples]
    return out


def _fits(s: Sample, backend: Backend) -> bool:
    """The passage, re-tokenised on its own, still puts all of its window text inside the canvas."""
    doc = s.document(backend)
    return doc.window()[1] == len(doc.text) and len(doc.canvas_view().slot_ids) <= backend.canvas_length
