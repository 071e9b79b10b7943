"""Turning a generated canvas into the text of each free region, and the character diff of a proposal.

Null (gap) tokens are dropped wherever they appear in a region, so an infill can come out shorter than its gap
(a model whose tokenizer has no null token fills exactly). An end-of-sequence id, when given, ends its region:
it and everything after it in that region are dropped, as the reference pads everything after EOS.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from canvas.document.base import Atom
from canvas.document.tokenizer import TextTokenizer, atoms_from_ids
from canvas.document.views import DiffChunk, DiffOp, Proposal, RegionEdit


def region_atoms(
    tokenizer: TextTokenizer,
    ids: Sequence[int],
    left: Sequence[Atom],
    *,
    null_id: int | None,
    eos_id: int | None,
) -> list[Atom]:
    """The pinned atoms a region becomes, from its generated ids (`left`: the atoms just before the region)."""
    kept: list[int] = []
    for t in ids:
        if eos_id is not None and t == eos_id:
            break
        if null_id is not None and t == null_id:
            continue
        kept.append(t)
    return atoms_from_ids(tokenizer, kept, left)


def char_diff(old: str, new: str) -> tuple[DiffChunk, ...]:
    """Character diff of `old` -> `new` as equal/delete/insert chunks (a replacement is a delete then an insert)."""
    chunks: list[DiffChunk] = []

    def add(op: DiffOp, text: str) -> None:
        if not text:
            return
        if chunks and chunks[-1].op == op:
            chunks[-1] = DiffChunk(op, chunks[-1].text + text)
        else:
            chunks.append(DiffChunk(op, text))

    # autojunk off: its popularity heuristic would treat frequent characters (spaces) as junk on long texts.
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            add("equal", old[i1:i2])
        else:
            add("delete", old[i1:i2])
            add("insert", new[j1:j2])
    return tuple(chunks)


def build_proposal(doc_id: str, version: int, text: str, edits: Sequence[RegionEdit]) -> Proposal:
    """The proposal that replaces each edit's span of `text` (edits in order, non-overlapping)."""
    start, end = edits[0].char_start, edits[-1].char_end
    pieces, pos = [], start
    for e in edits:
        pieces += [text[pos : e.char_start], e.text]
        pos = e.char_end
    new_text = "".join(pieces) + text[pos:end]
    old_text = text[start:end]
    return Proposal(doc_id, version, tuple(edits), start, end, old_text, new_text, char_diff(old_text, new_text))
