"""Undo units of the document, and the JSON form of a whole document (`to_dict` / `from_dict`).

A `Change` is one undo unit: the atom splices an operation (or an atomic batch, or an accepted proposal) made, in
order, and the window start (an atom index) before and after. Undo replays the splices backwards with old and new
swapped, redo replays them forwards; each replay first checks that the atoms it replaces are the ones recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from canvas.document.base import Atom, DocumentConfig
from canvas.document.errors import StateError

FORMAT = "dcanvas.document/1"


@dataclass(frozen=True, slots=True)
class Splice:
    """`atoms[index : index + len(old)]` was `old` and became `new`."""

    index: int
    old: tuple[Atom, ...]
    new: tuple[Atom, ...]


@dataclass(frozen=True, slots=True)
class Change:
    label: str
    splices: tuple[Splice, ...]
    window_before: int
    window_after: int


@dataclass(frozen=True, slots=True)
class SavedState:
    """Everything `Document.to_dict` saves; `window` is the atom index where the window starts."""

    format: str
    doc_id: str
    version: int
    config: DocumentConfig
    window: int
    atoms: tuple[Atom, ...]
    undo: tuple[Change, ...]
    redo: tuple[Change, ...]


# id(change) -> (the change, its JSON). Holding the change keeps its id from being reused while it is cached.
JsonMemo = dict[int, tuple[Change, dict[str, Any]]]


def state_to_json(s: SavedState, memo: JsonMemo | None = None) -> dict[str, Any]:
    """The JSON form of `s`. With `memo` (one per document, kept by it) each undo unit is turned into JSON once:
    a `Change` never changes, and a server saves the whole state after every edit, so without it each edit costs the
    whole history again (200 units of up to a window each: found by the 60-minute soak, 70% of the event loop's
    time). The memo is left holding only the units of `s`. The JSON it hands out is shared: read it, never change it."""
    if memo is None:
        undo, redo = [change_to_json(c) for c in s.undo], [change_to_json(c) for c in s.redo]
    else:
        kept: JsonMemo = {}
        undo, redo = _memoised(s.undo, memo, kept), _memoised(s.redo, memo, kept)
        memo.clear()
        memo.update(kept)
    return {
        "format": s.format,
        "doc_id": s.doc_id,
        "version": s.version,
        "config": {
            "canvas_length": s.config.canvas_length,
            "max_undo": s.config.max_undo,
            "max_retokenize_atoms": s.config.max_retokenize_atoms,
        },
        "window": s.window,
        "atoms": [atom_to_json(a) for a in s.atoms],
        "undo": undo,
        "redo": redo,
    }


def _memoised(changes: tuple[Change, ...], memo: JsonMemo, kept: JsonMemo) -> list[dict[str, Any]]:
    out = []
    for c in changes:
        hit = memo.get(id(c))
        json = hit[1] if hit is not None and hit[0] is c else change_to_json(c)
        kept[id(c)] = (c, json)
        out.append(json)
    return out


def parse_state(data: Any) -> SavedState:
    """Validate the shape of saved data (the document checks its invariants). Raises `StateError`."""
    keys = {"format", "doc_id", "version", "config", "window", "atoms", "undo", "redo"}
    if not isinstance(data, dict) or set(data) != keys:
        raise StateError(f"expected an object with keys {sorted(keys)}")
    if data["format"] != FORMAT:
        raise StateError(f"unknown format {data['format']!r}; expected {FORMAT!r}")
    if not isinstance(data["doc_id"], str) or not data["doc_id"]:
        raise StateError("doc_id must be a non-empty string")
    for key in ("version", "window"):
        if not _is_index(data[key]):
            raise StateError(f"{key} must be a non-negative int, got {data[key]!r}")
    for key in ("atoms", "undo", "redo"):
        if not isinstance(data[key], list):
            raise StateError(f"{key} must be a list")
    if not isinstance(data["config"], dict):
        raise StateError("config must be an object")
    try:
        config = DocumentConfig(**data["config"])
    except (TypeError, ValueError) as err:
        raise StateError(f"config: {err}") from None
    atoms = tuple(atom_from_json(a, f"atoms[{k}]") for k, a in enumerate(data["atoms"]))
    if data["window"] > len(atoms):
        raise StateError(f"window {data['window']} is past the last atom ({len(atoms)})")
    undo = tuple(change_from_json(c, f"undo[{k}]") for k, c in enumerate(data["undo"]))
    redo = tuple(change_from_json(c, f"redo[{k}]") for k, c in enumerate(data["redo"]))
    return SavedState(FORMAT, data["doc_id"], data["version"], config, data["window"], atoms, undo, redo)


_STATES = {"p": (False, False), "f": (True, False), "g": (True, True)}


def atom_to_json(a: Atom) -> list[Any]:
    return [list(a.ids), a.text, "g" if a.gap else "f" if a.free else "p"]


def atom_from_json(x: Any, where: str) -> Atom:
    if not (isinstance(x, list) and len(x) == 3 and isinstance(x[0], list) and isinstance(x[1], str)):
        raise StateError(f"{where}: expected [ids, text, state], got {x!r:.80}")
    ids, text, state = x
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise StateError(f"{where}: token ids must be non-negative ints, got {ids!r:.80}")
    if state not in _STATES:
        raise StateError(f"{where}: state must be one of {sorted(_STATES)}, got {state!r}")
    free, gap = _STATES[state]
    try:
        return Atom(tuple(ids), text, free=free, gap=gap)
    except ValueError as err:
        raise StateError(f"{where}: {err}") from None


def change_to_json(c: Change) -> dict[str, Any]:
    return {
        "label": c.label,
        "window": [c.window_before, c.window_after],
        "splices": [[s.index, [atom_to_json(a) for a in s.old], [atom_to_json(a) for a in s.new]] for s in c.splices],
    }


def change_from_json(x: Any, where: str) -> Change:
    if not isinstance(x, dict) or set(x) != {"label", "window", "splices"}:
        raise StateError(f"{where}: expected an object with label, window, splices")
    window, splices = x["window"], x["splices"]
    if not isinstance(x["label"], str):
        raise StateError(f"{where}.label: expected a string")
    if not (isinstance(window, list) and len(window) == 2 and all(_is_index(v) for v in window)):
        raise StateError(f"{where}.window: expected [before, after] atom indices, got {window!r:.80}")
    if not isinstance(splices, list):
        raise StateError(f"{where}.splices: expected a list")
    out = []
    for k, s in enumerate(splices):
        w = f"{where}.splices[{k}]"
        if not (isinstance(s, list) and len(s) == 3 and _is_index(s[0]) and isinstance(s[1], list)):
            raise StateError(f"{w}: expected [index, old atoms, new atoms]")
        if not isinstance(s[2], list):
            raise StateError(f"{w}: expected [index, old atoms, new atoms]")
        old = tuple(atom_from_json(a, f"{w}.old[{i}]") for i, a in enumerate(s[1]))
        new = tuple(atom_from_json(a, f"{w}.new[{i}]") for i, a in enumerate(s[2]))
        out.append(Splice(s[0], old, new))
    return Change(x["label"], tuple(out), window[0], window[1])


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
