"""Turning a generated canvas into the text of each free region, the word diff of a proposal, and the JSON
form of a proposal (`proposal_to_json` / `proposal_from_json`, so that a pending one outlives a server restart).

Null (gap) tokens are dropped wherever they appear in a region, so an infill can come out shorter than its gap
(a model whose tokenizer has no null token fills exactly). An end-of-sequence id, when given, ends its region:
it and everything after it in that region are dropped, as the reference pads everything after EOS. Ids at the end
of a region that never complete a character (the model stopped inside a multi-byte UTF-8 sequence) are dropped too,
as a streaming detokenizer holds back an incomplete character: kept, they would join bytes a later generation puts
after them, and the document would hold text its tokens do not decode to.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

from canvas.document.base import Atom
from canvas.document.errors import StateError
from canvas.document.history import atom_from_json, atom_to_json
from canvas.document.tokenizer import INCOMPLETE, TextTokenizer, atoms_from_ids
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
    atoms = atoms_from_ids(tokenizer, kept, left)
    # atoms_from_ids ends every atom but the last at a whole character: only its leftover ids can end in U+FFFD.
    if atoms and atoms[-1].text.endswith(INCOMPLETE):
        atoms.pop()
    return atoms


# Words, runs of spaces and single other characters: the units a proposal's diff replaces whole. A character diff of
# prose interleaves the letters of the old and the new word ("watched" -> "and" reads "wandtched" without colour).
_WORD = re.compile(r"\w+|\s+|[^\w\s]")


def word_diff(old: str, new: str) -> tuple[DiffChunk, ...]:
    """Diff of `old` -> `new` in whole words (`_WORD`), as equal/delete/insert chunks (a replacement is a delete then
    an insert); the deleted and equal chunks join to `old`, the inserted and equal ones to `new`."""
    a, b = _WORD.findall(old), _WORD.findall(new)
    chunks: list[DiffChunk] = []

    def add(op: DiffOp, parts: list[str]) -> None:
        text = "".join(parts)
        if not text:
            return
        if chunks and chunks[-1].op == op:
            chunks[-1] = DiffChunk(op, chunks[-1].text + text)
        else:
            chunks.append(DiffChunk(op, text))

    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            add("equal", a[i1:i2])
        else:
            add("delete", a[i1:i2])
            add("insert", b[j1:j2])
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
    return Proposal(doc_id, version, tuple(edits), start, end, old_text, new_text, word_diff(old_text, new_text))


def proposal_to_json(p: Proposal) -> dict[str, Any]:
    """Everything a `Proposal` holds, as JSON-serialisable data (atoms as in `Document.to_dict`)."""
    return {
        "doc_id": p.doc_id,
        "base_version": p.base_version,
        "regions": [
            [r.slot_start, r.slot_end, r.char_start, r.char_end, [atom_to_json(a) for a in r.atoms], r.tail]
            for r in p.regions
        ],
        "span": [p.start, p.end],
        "old_text": p.old_text,
        "new_text": p.new_text,
        "diff": [[c.op, c.text] for c in p.diff],
    }


def proposal_from_json(x: Any) -> Proposal:
    """Rebuild a proposal saved by `proposal_to_json`. Raises `StateError` on malformed data."""
    keys = {"doc_id", "base_version", "regions", "span", "old_text", "new_text", "diff"}
    if not isinstance(x, dict) or set(x) != keys:
        raise StateError(f"a proposal is an object with keys {sorted(keys)}")
    if not (isinstance(x["doc_id"], str) and _index(x["base_version"]) and isinstance(x["regions"], list)):
        raise StateError("proposal: doc_id, base_version or regions is malformed")
    if not (isinstance(x["span"], list) and len(x["span"]) == 2 and all(_index(v) for v in x["span"])):
        raise StateError("proposal.span: expected [start, end]")
    if not (isinstance(x["old_text"], str) and isinstance(x["new_text"], str) and isinstance(x["diff"], list)):
        raise StateError("proposal: old_text, new_text or diff is malformed")
    regions = []
    for k, r in enumerate(x["regions"]):
        if not (isinstance(r, list) and len(r) == 6 and all(_index(v) for v in r[:4]) and isinstance(r[4], list)
                and isinstance(r[5], bool)):  # fmt: skip
            raise StateError(f"proposal.regions[{k}]: expected [slot_start, slot_end, char_start, char_end, atoms, "
                             "tail]")  # fmt: skip
        atoms = tuple(atom_from_json(a, f"proposal.regions[{k}].atoms[{i}]") for i, a in enumerate(r[4]))
        regions.append(RegionEdit(r[0], r[1], r[2], r[3], atoms, r[5]))
    diff = []
    for k, c in enumerate(x["diff"]):
        if not (isinstance(c, list) and len(c) == 2 and c[0] in _DIFF_OPS and isinstance(c[1], str)):
            raise StateError(f"proposal.diff[{k}]: expected [equal|insert|delete, text]")
        diff.append(DiffChunk(c[0], c[1]))
    start, end = x["span"]
    return Proposal(x["doc_id"], x["base_version"], tuple(regions), start, end, x["old_text"], x["new_text"],
                    tuple(diff))  # fmt: skip


_DIFF_OPS = ("equal", "insert", "delete")


def _index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
