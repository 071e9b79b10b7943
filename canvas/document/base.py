"""Value types of the document: its config, the `Atom` it is made of, and the operations it accepts.

An `Atom` is the smallest unit the document addresses: one or more consecutive tokens whose bytes decode to
whole characters (a byte-level BPE can split one emoji over three tokens; those three form one atom). Character
offsets exist only at atom boundaries, which is why every operation snaps its range outward to them. A gap slot
is an atom with no tokens and no text that occupies one canvas slot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DocumentConfig:
    """Shape and limits of one document."""

    canvas_length: int = 256  # slots in the canvas window: the model's block length (`ModelConfig.canvas_length`)
    max_undo: int = 1000  # undo units kept; the oldest is dropped first
    # Local re-tokenisation looks at most this many neighbouring atoms on each side of an edit for a stable
    # token boundary (a BPE word rarely spans more than a few atoms).
    max_retokenize_atoms: int = 64

    def __post_init__(self) -> None:
        if self.canvas_length < 1:
            raise ValueError(f"canvas_length must be >= 1, got {self.canvas_length}")
        if self.max_undo < 0:
            raise ValueError(f"max_undo must be >= 0, got {self.max_undo}")
        if self.max_retokenize_atoms < 1:
            raise ValueError(f"max_retokenize_atoms must be >= 1, got {self.max_retokenize_atoms}")

    @classmethod
    def from_name(cls, name: str) -> DocumentConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown document preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


PRESETS: dict[str, DocumentConfig] = {
    "default": DocumentConfig(),
    "tiny": DocumentConfig(canvas_length=16, max_undo=64, max_retokenize_atoms=8),
}


@dataclass(frozen=True, slots=True)
class Atom:
    """Tokens that decode to whole characters, with the text they stand for and their slot state.

    `free` atoms are masked text (kept so that unmask or undo restores it exactly) or gap slots; every other atom
    is pinned when it sits inside the canvas window and plain context or trailing text when it does not.
    """

    ids: tuple[int, ...]
    text: str
    free: bool = False
    gap: bool = False

    def __post_init__(self) -> None:
        if self.gap:
            if self.ids or self.text or not self.free:
                raise ValueError(f"a gap atom has no ids, no text and is free, got {self!r}")
        elif not self.ids or not self.text:
            raise ValueError(f"a text atom needs ids and non-empty text, got {self!r}")

    @property
    def slots(self) -> int:
        """Canvas slots the atom occupies: one per token, one for a gap."""
        return 1 if self.gap else len(self.ids)

    @property
    def pinned(self) -> bool:
        return not self.free


GAP = Atom((), "", free=True, gap=True)


# Operations. Offsets are character offsets into the current text (Python str indices, i.e. code points).


@dataclass(frozen=True, slots=True)
class Pin:
    """Keep the text of [start, end): masked text in the range becomes pinned again (an empty range pins nothing).
    Gaps are left alone: they have no text to keep."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Unpin:
    """Release the text of [start, end) to the model: the slot-level name of `Mask` (same effect, same checks)."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Mask:
    """Rewrite [start, end): its text becomes free slots, one per token. The range must lie inside the window."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Unmask:
    """Undo a rewrite or infill over [start, end]: masked text becomes pinned, gaps touching the range go."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class InsertGap:
    """Infill: `n_tokens` new free slots at character offset `at` (inside the window)."""

    at: int
    n_tokens: int


@dataclass(frozen=True, slots=True)
class MoveWindow:
    """Start the canvas window at character offset `start`; every free slot must still fit inside it."""

    start: int


@dataclass(frozen=True, slots=True)
class Replace:
    """Plain text edit: replace [start, end) with `text` (typed text is pinned)."""

    start: int
    end: int
    text: str


Op = Pin | Unpin | Mask | Unmask | InsertGap | MoveWindow | Replace
