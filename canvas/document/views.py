"""Read-only snapshots the document hands out: UI spans, the canvas view for the engine, and proposals.

All are frozen dataclasses holding tuples, so a snapshot taken at version v stays valid (and comparable) after
the document moves on; `version` says which state it describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from canvas.document.base import Atom

SpanKind = Literal["pinned", "free"]
DiffOp = Literal["equal", "insert", "delete"]


@dataclass(frozen=True, slots=True)
class Span:
    """A run of window text in one state, for the UI. Gaps are zero-width (`start == end`) free spans whose
    `slots` says how many tokens they may grow to; masked text adjacent to a gap shares its span."""

    kind: SpanKind
    start: int
    end: int
    slots: int


@dataclass(frozen=True, slots=True)
class FreeRegion:
    """Consecutive free slots `[slot_start, slot_end)` of the canvas, replacing text `[char_start, char_end)`.

    A gap replaces an empty span (`char_start == char_end`); masked text replaces itself. `tail` marks the free
    continuation after the end of the text (see `CanvasView`)."""

    slot_start: int
    slot_end: int
    char_start: int
    char_end: int
    tail: bool = False

    @property
    def slots(self) -> int:
        return self.slot_end - self.slot_start


@dataclass(frozen=True, slots=True)
class CanvasView:
    """What the engine needs to run one generation on a document.

    - `context_ids`: the tokens before the window, for the causal encoder.
    - `slot_ids`: the canvas slots in use, `len(slot_ids) <= canvas_length`. Pinned slots hold their token; free
      slots hold `placeholder_id` (the engine replaces it with noise).
    - `pinned[k]`: slot k must keep its token (never renoised, excluded from the entropy ranking and stopping).
    - `free_regions`: the free slots grouped by the text they replace, in slot order.

    Slots past `len(slot_ids)` up to `canvas_length` are **excluded**: the engine pads them, keeps them out of
    attention, never accepts them and never reads them back. "Continue the text" is not a padding rule but a
    free region: when the window reaches the end of the text and the document holds no mask or gap, the rest of
    the window is one free `tail` region, so a fresh empty document is all free slots; as soon as the user masks
    a phrase or opens a gap, only those slots are free and the canvas ends where the text in the window ends.
    Text after the window is not in the view at all: the model does not see it.
    """

    context_ids: tuple[int, ...]
    slot_ids: tuple[int, ...]
    pinned: tuple[bool, ...]
    free_regions: tuple[FreeRegion, ...]
    version: int
    canvas_length: int
    placeholder_id: int
    window: tuple[int, int]
    doc_id: str
    # Per run of consecutive free slots, in order: the ids of the masked text it replaces (empty for a gap): what a
    # rewrite should not hand back unchanged (`GenRequest.avoid`).
    replaced_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def n_free(self) -> int:
        return sum(r.slots for r in self.free_regions)


@dataclass(frozen=True, slots=True)
class DiffChunk:
    """One piece of a proposal's diff (in whole words, `canvas.document.proposal.word_diff`): `equal` text is in both,
    `delete` only in the old, `insert` only in the new."""

    op: DiffOp
    text: str


@dataclass(frozen=True, slots=True)
class RegionEdit:
    """The generated content of one free region: the old span it replaces, and the atoms (tokens plus text)
    that replace it, with null tokens already dropped."""

    slot_start: int
    slot_end: int
    char_start: int
    char_end: int
    atoms: tuple[Atom, ...]
    tail: bool = False

    @property
    def text(self) -> str:
        return "".join(a.text for a in self.atoms)

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(t for a in self.atoms for t in a.ids)


@dataclass(frozen=True, slots=True)
class Proposal:
    """A finished generation, to be accepted (`Document.apply_proposal`) or dropped.

    `start`/`end` is the changed span in the old text (from the first free region to the last); the document after
    applying is `old[:start] + new_text + old[end:]`. `diff` compares `old_text` (= `old[start:end]`) with
    `new_text` in characters; text outside the span is unchanged.
    """

    doc_id: str
    base_version: int
    regions: tuple[RegionEdit, ...]
    start: int
    end: int
    old_text: str
    new_text: str
    diff: tuple[DiffChunk, ...]
