"""`Document`: the one object that mutates canvas state (text, slot states, window, version, undo history).

State: a list of atoms (see `base.Atom`) whose texts concatenate to the document text, and the atom index where
the canvas window starts. The window holds the atoms from there that fit in `canvas_length` slots; atoms before it
are the context, atoms after it are carried unchanged. Invariants, checked after every operation: free atoms (masked
text, gap slots) all lie inside the window, and every mutation is a recorded splice, so that undo is exact.
"""

from __future__ import annotations

import uuid
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from canvas.document.base import GAP, Atom, DocumentConfig, InsertGap, Mask, MoveWindow, Op, Pin, Replace, Unmask, Unpin
from canvas.document.edit import local_edit
from canvas.document.errors import (
    CanvasFullError,
    HistoryError,
    ProposalError,
    RangeError,
    StaleVersionError,
    StateError,
    WindowError,
)
from canvas.document.history import FORMAT, Change, JsonMemo, SavedState, Splice, parse_state, state_to_json
from canvas.document.proposal import build_proposal, region_atoms
from canvas.document.tokenizer import TextTokenizer, atoms_from_text
from canvas.document.views import CanvasView, FreeRegion, Proposal, RegionEdit, Span, SpanKind


@dataclass(frozen=True, slots=True)
class _Layout:
    end: int  # atom index after the last atom in the window
    used: int  # slots taken by the atoms in the window
    free_atoms: int  # free atoms inside the window
    tail: int  # free continuation slots after the text (see CanvasView)


@dataclass(frozen=True, slots=True)
class _Run:
    """A free region with the atom indices it covers (`atom_start == atom_end` for the tail)."""

    atom_start: int
    atom_end: int
    region: FreeRegion


class Document:
    """A text split into context, canvas window and trailing text, with pinned and free slots in the window.

    Every operation takes character offsets into the current text and snaps them outward to token (atom)
    boundaries: a range grows to the tokens it touches, a point inside a token moves to that token's start. Default
    policy: text inside the window that is not masked is pinned; a fresh empty document is all free. Every change
    bumps `version` (undo and redo too) and is one undo unit; `apply(ops)` makes a batch one unit, all or nothing.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        text: str = "",
        *,
        config: DocumentConfig | None = None,
        window_start: int = 0,
        doc_id: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._cfg = config if config is not None else DocumentConfig()
        self._atoms: list[Atom] = atoms_from_text(tokenizer, text)
        self._w = 0
        self._n_free = 0
        self._version = 0
        self._undo: list[Change] = []
        self._redo: list[Change] = []
        self._doc_id = doc_id if doc_id is not None else uuid.uuid4().hex
        self._json_memo: JsonMemo = {}  # `to_dict`: each undo unit's JSON, made once (units never change)
        # Caches derived from the atoms and the window start; `_invalidate` drops them after every mutation.
        self._text: str | None = None
        self._bounds: tuple[list[int], list[int]] | None = None
        self._lay: _Layout | None = None
        self._check_range(window_start, window_start, "window_start")
        self._w = self._first_at(window_start)

    # ------------------------------------------------------------------ reading

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "".join(a.text for a in self._atoms)
        return self._text

    @property
    def version(self) -> int:
        return self._version

    @property
    def doc_id(self) -> str:
        return self._doc_id

    @property
    def config(self) -> DocumentConfig:
        return self._cfg

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tok

    @property
    def can_undo(self) -> bool:
        return bool(self._undo)

    @property
    def can_redo(self) -> bool:
        return bool(self._redo)

    def atoms(self) -> tuple[Atom, ...]:
        return tuple(self._atoms)

    def window(self) -> tuple[int, int]:
        """Character span `[start, end)` of the canvas window (its end is the end of the text when a tail is free)."""
        starts, ends = self._offsets()
        lay = self._layout()
        start = starts[self._w] if self._w < len(self._atoms) else len(self.text)
        end = len(self.text) if lay.end == len(self._atoms) else (ends[lay.end - 1] if lay.end > self._w else start)
        return start, end

    def spans(self) -> list[Span]:
        """Pinned and free character spans of the window, in order (see `Span`)."""
        starts, ends = self._offsets()
        lay = self._layout()
        out: list[Span] = []
        for k in range(self._w, lay.end):
            a = self._atoms[k]
            kind: SpanKind = "free" if a.free else "pinned"
            if out and out[-1].kind == kind:
                last = out[-1]
                out[-1] = Span(kind, last.start, ends[k], last.slots + a.slots)
            else:
                out.append(Span(kind, starts[k], ends[k], a.slots))
        if lay.tail:
            n = len(self.text)
            out.append(Span("free", n, n, lay.tail))
        return out

    def canvas_view(self) -> CanvasView:
        """The window as the engine sees it (see `CanvasView` for how unused slots are treated)."""
        lay = self._layout()
        placeholder = self._tok.placeholder_id
        slot_ids: list[int] = []
        pinned: list[bool] = []
        for a in self._atoms[self._w : lay.end]:
            slot_ids.extend([placeholder] * a.slots if a.free else a.ids)
            pinned.extend([not a.free] * a.slots)
        slot_ids.extend([placeholder] * lay.tail)
        pinned.extend([False] * lay.tail)
        replaced: list[list[int]] = []
        prev_free = False
        for a in self._atoms[self._w : lay.end]:
            if a.free and not prev_free:
                replaced.append([])
            if a.free:
                replaced[-1].extend(a.ids)  # a gap atom has none
            prev_free = a.free
        if lay.tail and not prev_free:
            replaced.append([])
        return CanvasView(
            context_ids=tuple(t for a in self._atoms[: self._w] for t in a.ids),
            slot_ids=tuple(slot_ids),
            pinned=tuple(pinned),
            free_regions=tuple(r.region for r in self._runs()),
            version=self._version,
            canvas_length=self._cfg.canvas_length,
            placeholder_id=placeholder,
            window=self.window(),
            doc_id=self._doc_id,
            replaced_ids=tuple(tuple(r) for r in replaced),
        )

    # ------------------------------------------------------------------ operations

    def pin(self, start: int, end: int) -> int:
        return self.apply([Pin(start, end)])

    def unpin(self, start: int, end: int) -> int:
        return self.apply([Unpin(start, end)])

    def mask(self, start: int, end: int) -> int:
        return self.apply([Mask(start, end)])

    def unmask(self, start: int, end: int) -> int:
        return self.apply([Unmask(start, end)])

    def insert_gap(self, at: int, n_tokens: int) -> int:
        return self.apply([InsertGap(at, n_tokens)])

    def move_window(self, start: int) -> int:
        return self.apply([MoveWindow(start)])

    def replace(self, start: int, end: int, text: str) -> int:
        return self.apply([Replace(start, end, text)])

    def apply(self, ops: Iterable[Op], *, label: str | None = None) -> int:
        """Apply `ops` in order as one undo unit; if any raises, none is applied. Returns the new version
        (unchanged when the ops change nothing: a no-op is not recorded)."""
        ops = list(ops)
        journal: list[Splice] = []
        w0 = self._w
        try:
            for op in ops:
                self._exec(op, journal)
                self._check_layout(type(op).__name__.lower())
        except BaseException:
            self._rollback(journal, w0)
            raise
        return self._commit(journal, w0, label if label is not None else "+".join(type(o).__name__ for o in ops))

    def undo(self) -> int:
        if not self._undo:
            raise HistoryError("nothing to undo")
        change = self._undo[-1]
        self._replay([Splice(s.index, s.new, s.old) for s in reversed(change.splices)], change.window_before)
        self._redo.append(self._undo.pop())
        self._version += 1
        return self._version

    def redo(self) -> int:
        if not self._redo:
            raise HistoryError("nothing to redo")
        change = self._redo[-1]
        self._replay(list(change.splices), change.window_after)
        self._undo.append(self._redo.pop())
        self._version += 1
        return self._version

    # ------------------------------------------------------------------ generation

    def make_proposal(
        self, gen_slot_ids: Sequence[int], null_id: int | None = None, *, eos_id: int | None = None
    ) -> Proposal:
        """Read a generated canvas back into text. `gen_slot_ids` holds the canvas slots in use (or all
        `canvas_length` slots; the excluded ones are ignored); pinned slots must still hold their tokens."""
        view = self.canvas_view()
        n, size = len(view.slot_ids), self._cfg.canvas_length
        if len(gen_slot_ids) not in (n, size):
            raise ProposalError(f"the generation has {len(gen_slot_ids)} slots; expected {n} (in use) or {size}")
        for k in range(n):
            t = gen_slot_ids[k]
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ProposalError(f"slot {k} holds {t!r}, not a token id")
            if view.pinned[k] and t != view.slot_ids[k]:
                raise ProposalError(f"slot {k} is pinned to token {view.slot_ids[k]} but the generation holds {t}")
        runs = self._runs()
        if not runs:
            raise ProposalError("the canvas has no free slots: mask text, insert a gap or move the window first")
        edits = []
        for run in runs:
            r = run.region
            left = self._atoms[max(0, run.atom_start - 3) : run.atom_start]
            ids = gen_slot_ids[r.slot_start : r.slot_end]
            atoms = region_atoms(self._tok, ids, left, null_id=null_id, eos_id=eos_id)
            edits.append(RegionEdit(r.slot_start, r.slot_end, r.char_start, r.char_end, tuple(atoms), r.tail))
        return build_proposal(self._doc_id, self._version, self.text, edits)

    def apply_proposal(self, proposal: Proposal) -> int:
        """Accept a proposal as one undo unit. The document must still be at the proposal's base version."""
        if proposal.doc_id != self._doc_id:
            raise StaleVersionError(f"the proposal belongs to document {proposal.doc_id}, not {self._doc_id}")
        if proposal.base_version != self._version:
            raise StaleVersionError(
                f"the proposal was made at version {proposal.base_version}; the document is at {self._version}"
            )
        runs = self._runs()
        have = [(r.region.slot_start, r.region.slot_end, r.region.char_start, r.region.char_end) for r in runs]
        got = [(e.slot_start, e.slot_end, e.char_start, e.char_end) for e in proposal.regions]
        if have != got:
            raise ProposalError(f"the proposal fills regions {got}, the canvas has {have}")
        for e in proposal.regions:
            if any(a.free for a in e.atoms) or sum(a.slots for a in e.atoms) > e.slot_end - e.slot_start:
                raise ProposalError(f"region at slots [{e.slot_start}, {e.slot_end}) holds free atoms or too many")
        journal: list[Splice] = []
        w0 = self._w
        try:
            for run, edit in reversed(list(zip(runs, proposal.regions, strict=True))):
                self._splice(run.atom_start, run.atom_end - run.atom_start, edit.atoms, journal)
            self._check_layout("apply_proposal")
        except BaseException:
            self._rollback(journal, w0)
            raise
        return self._commit(journal, w0, "generation")

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """Full state (atoms, window, version, undo and redo stacks) as JSON-serialisable data."""
        state = SavedState(FORMAT, self._doc_id, self._version, self._cfg, self._w, tuple(self._atoms),
                           tuple(self._undo), tuple(self._redo))  # fmt: skip
        return state_to_json(state, self._json_memo)

    @classmethod
    def from_dict(cls, data: Any, tokenizer: TextTokenizer) -> Document:
        """Rebuild a document saved by `to_dict` (with the same tokenizer). Raises `StateError` on bad data."""
        state = parse_state(data)
        doc = cls(tokenizer, config=state.config, doc_id=state.doc_id)
        doc._atoms = list(state.atoms)
        doc._w = state.window
        doc._n_free = sum(a.free for a in doc._atoms)
        doc._version = state.version
        doc._undo = list(state.undo)
        doc._redo = list(state.redo)
        doc._invalidate()
        try:
            doc._check_layout("from_dict")
        except (WindowError, CanvasFullError) as err:
            raise StateError(str(err)) from None
        return doc

    # ------------------------------------------------------------------ operation bodies

    def _exec(self, op: Op, journal: list[Splice]) -> None:
        match op:
            case Pin(start, end):
                self._check_range(start, end, "pin")
                if start < end:
                    i, j = self._core(start, end)
                    self._restate(i, j, free=False, journal=journal)
            case Mask(start, end) | Unpin(start, end):
                name = "mask" if isinstance(op, Mask) else "unpin"
                self._check_range(start, end, name)
                if start == end:
                    raise RangeError(f"{name}: the range [{start}, {end}) is empty")
                self._check_in_window(start, end, name)
                i, j = self._core(start, end)
                self._restate(i, j, free=True, journal=journal)
            case Unmask(start, end):
                self._unmask(start, end, journal)
            case InsertGap(at, n_tokens):
                self._insert_gap(at, n_tokens, journal)
            case MoveWindow(start):
                self._check_range(start, start, "move_window")
                self._w = self._first_at(start)
                self._invalidate()
                self._check_layout("move_window", window_op=True)
            case Replace(start, end, text):
                self._replace(start, end, text, journal)
            case _:
                raise TypeError(f"not a document operation: {op!r}")

    def _restate(self, i: int, j: int, *, free: bool, journal: list[Splice]) -> None:
        new = [a if a.gap else Atom(a.ids, a.text, free=free) for a in self._atoms[i:j]]
        self._splice(i, j - i, new, journal)

    def _unmask(self, start: int, end: int, journal: list[Splice]) -> None:
        self._check_range(start, end, "unmask")
        starts, _ = self._offsets()
        atoms, n = self._atoms, len(self._atoms)
        if start < end:
            i, j = self._core(start, end)
            while i > 0 and atoms[i - 1].gap and starts[i - 1] == start:
                i -= 1
        else:
            i = j = self._first_at(start)
        while j < n and atoms[j].gap and starts[j] == end:
            j += 1
        self._splice(i, j - i, [Atom(a.ids, a.text) for a in atoms[i:j] if not a.gap], journal)

    def _insert_gap(self, at: int, n_tokens: int, journal: list[Splice]) -> None:
        self._check_range(at, at, "insert_gap")
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
            raise RangeError(f"insert_gap: n_tokens must be an int >= 1, got {n_tokens!r}")
        size = self._cfg.canvas_length
        if n_tokens > size:
            raise CanvasFullError(f"insert_gap: a gap of {n_tokens} slots cannot fit a canvas of {size} slots")
        self._check_in_window(at, at, "insert_gap")
        _, ends = self._offsets()
        # First atom ending after `at`: the token containing `at` (the gap goes before it) or the one starting
        # there; gaps already at `at` end there too, so the new slots join them at their end.
        index = bisect_right(ends, at)
        self._splice(index, 0, [GAP] * n_tokens, journal)
        self._check_layout("insert_gap")

    def _replace(self, start: int, end: int, text: str, journal: list[Splice]) -> None:
        self._check_range(start, end, "replace")
        if not isinstance(text, str):
            raise TypeError(f"replace: text must be a str, got {type(text).__name__}")
        if start == end and not text:
            return
        starts, ends = self._offsets()
        index, n_old, new, in_window = local_edit(
            self._tok, self._atoms, starts, ends, self._w, start, end, text, self._cfg.max_retokenize_atoms
        )
        self._splice(index, n_old, new, journal, before_window=not in_window)
        self._check_layout("replace")

    # ------------------------------------------------------------------ internals

    def _splice(
        self, index: int, n_old: int, new: Sequence[Atom], journal: list[Splice], *, before_window: bool = False
    ) -> None:
        """Replace `n_old` atoms at `index` with `new`, record it, and keep the window start on its text: it shifts
        with edits before it, an edit across it starts the window at the edit, and an insertion exactly at it goes
        into the window unless `before_window` (text typed at the end of the context)."""
        old, fresh = tuple(self._atoms[index : index + n_old]), tuple(new)
        # Record only what changed: atoms kept at either end keep their identity, and the window start does not
        # move for a change that merely spans it (pinning text that runs into the context).
        a = 0
        while a < len(old) and a < len(fresh) and old[a] == fresh[a]:
            a += 1
        b = 0
        while b < len(old) - a and b < len(fresh) - a and old[-1 - b] == fresh[-1 - b]:
            b += 1
        if a == len(old) == len(fresh):
            return
        index, n_old = index + a, n_old - a - b
        old, fresh = old[a : len(old) - b], fresh[a : len(fresh) - b]
        self._put(index, old, fresh)
        journal.append(Splice(index, old, fresh))
        w, stop = self._w, index + n_old
        if w > stop or (w == stop and (n_old > 0 or before_window)):
            self._w += len(fresh) - n_old
        elif w > index:
            self._w = index

    def _put(self, index: int, old: tuple[Atom, ...], new: tuple[Atom, ...]) -> None:
        self._atoms[index : index + len(old)] = new
        self._n_free += sum(a.free for a in new) - sum(a.free for a in old)
        self._invalidate()

    def _rollback(self, journal: list[Splice], w0: int) -> None:
        for s in reversed(journal):
            self._put(s.index, s.new, s.old)
        self._w = w0
        self._invalidate()

    def _commit(self, journal: list[Splice], w0: int, label: str) -> int:
        if not journal and self._w == w0:
            return self._version
        if self._cfg.max_undo:
            self._undo.append(Change(label, tuple(journal), w0, self._w))
            del self._undo[: -self._cfg.max_undo]
        self._redo.clear()
        self._version += 1
        return self._version

    def _replay(self, splices: list[Splice], window: int) -> None:
        """Apply recorded splices (checking each against the atoms it replaces), then set the window start."""
        done: list[Splice] = []
        w0 = self._w
        for s in splices:
            if tuple(self._atoms[s.index : s.index + len(s.old)]) != s.old:
                self._rollback(done, w0)
                raise HistoryError(f"the history entry does not match the document at atom {s.index}")
            self._put(s.index, s.old, s.new)
            done.append(s)
        self._w = window
        self._invalidate()

    def _invalidate(self) -> None:
        self._text = None
        self._bounds = None
        self._lay = None

    def _offsets(self) -> tuple[list[int], list[int]]:
        """Start and end character offset of every atom (gaps: start == end)."""
        if self._bounds is None:
            starts, ends, pos = [], [], 0
            for a in self._atoms:
                starts.append(pos)
                pos += len(a.text)
                ends.append(pos)
            self._bounds = starts, ends
        return self._bounds

    def _layout(self) -> _Layout:
        if self._lay is None:
            size, k, used, free = self._cfg.canvas_length, self._w, 0, 0
            while k < len(self._atoms) and used + self._atoms[k].slots <= size:
                used += self._atoms[k].slots
                free += self._atoms[k].free
                k += 1
            tail = size - used if k == len(self._atoms) and self._n_free == 0 else 0
            self._lay = _Layout(k, used, free, tail)
        return self._lay

    def _runs(self) -> list[_Run]:
        """The free regions of the window, with their atom indices."""
        starts, ends = self._offsets()
        lay = self._layout()
        runs: list[_Run] = []
        slot, k = 0, self._w
        while k < lay.end:
            a = self._atoms[k]
            if not a.free:
                slot, k = slot + a.slots, k + 1
                continue
            first, first_slot = k, slot
            while k < lay.end and self._atoms[k].free:
                slot, k = slot + self._atoms[k].slots, k + 1
            runs.append(_Run(first, k, FreeRegion(first_slot, slot, starts[first], ends[k - 1])))
        if lay.tail:
            n = len(self.text)
            runs.append(_Run(lay.end, lay.end, FreeRegion(slot, slot + lay.tail, n, n, tail=True)))
        return runs

    def _core(self, start: int, end: int) -> tuple[int, int]:
        """Atom index range of the non-empty character range [start, end), snapped outward."""
        starts, ends = self._offsets()
        return bisect_right(ends, start), bisect_left(starts, end)

    def _first_at(self, pos: int) -> int:
        """Index of the first atom at or containing `pos`: gaps at `pos` count, the token ending there does not."""
        _, ends = self._offsets()
        k = bisect_left(ends, pos)
        if k < len(self._atoms) and ends[k] == pos and not self._atoms[k].gap:
            k += 1
        return k

    def _check_range(self, start: Any, end: Any, name: str) -> None:
        for label, v in (("start", start), ("end", end)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise RangeError(f"{name}: {label} must be an int character offset, got {v!r}")
        size = len(self.text)
        if start < 0:
            raise RangeError(f"{name}: start {start} is negative")
        if end > size:
            raise RangeError(f"{name}: end {end} is past the end of the text ({size} characters)")
        if start > end:
            raise RangeError(f"{name}: start {start} is after end {end}")

    def _check_in_window(self, start: int, end: int, name: str) -> None:
        lo, hi = self.window()
        if start < lo:
            raise WindowError(f"{name}: start {start} is before the window start {lo}")
        if end > hi:
            raise WindowError(f"{name}: end {end} is past the window end {hi}")

    def _check_layout(self, name: str, *, window_op: bool = False) -> None:
        """Every free atom must sit inside the window: raise what went wrong otherwise."""
        lay = self._layout()
        if lay.free_atoms == self._n_free:
            return
        starts, ends = self._offsets()
        free = [k for k, a in enumerate(self._atoms) if a.free]
        lo = self.window()[0]
        if free[0] < self._w:
            k = free[0]
            raise WindowError(f"{name}: free slots at characters [{starts[k]}, {ends[k]}) would lie before the "
                              f"window start {lo}; unmask them first")  # fmt: skip
        need = sum(a.slots for a in self._atoms[self._w : free[-1] + 1])
        size = self._cfg.canvas_length
        if window_op:
            raise WindowError(f"{name}: free slots up to character {ends[free[-1]]} would need {need} slots from the "
                              f"window start {lo}; the canvas holds {size}")  # fmt: skip
        raise CanvasFullError(f"{name}: masked text and gaps would need {need} slots from the window start "
                              f"(character {lo}); the canvas holds {size}")  # fmt: skip
