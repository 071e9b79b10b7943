"""Versions and rebasing: what each document change touched, and how a request against an old version moves.

Owns the pure rules behind `stale_version`. Every change of a document (edit, undo, redo, accepted proposal) is
reduced to one `Change`: the character range `[start, end)` of the text before it that changed (text or slot
state), and where that range ends afterwards (`new_end`). A `ChangeLog` keeps the recent changes of a document.

A request made against version `base_v` is rebased over the changes since then when it is disjoint from all of
them, and rejected otherwise (`rebase_ops` / `rebase_range` return None). Disjointness:
- two non-empty ranges conflict when they share a character (touching ends do not);
- a point (an insertion, a gap, an empty range) conflicts with a range strictly around it, and with a point at
  the same offset, since the order of two insertions at one offset is ambiguous.
Ops of one edit are sequential, so each op is moved over the changes and the changes over the op (the usual
operational-transform pairing); only `replace` shifts text, every other op leaves offsets where they are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from canvas.protocol import EditOp, InsertGapOp, MoveWindowOp, ReplaceOp


@dataclass(frozen=True, slots=True)
class Change:
    """`[start, end)` of the old text became `[start, new_end)` of the new one (text or slot states)."""

    start: int
    end: int
    new_end: int

    @property
    def delta(self) -> int:
        return self.new_end - self.end


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a change is measured on: the text, a per-character state signature (`o` outside the window, `p` pinned,
    `f` free) and the zero-width free spans (gaps, the free tail) as `(offset, slots)`."""

    text: str
    signature: str
    gaps: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, text: str, window: tuple[int, int], spans: Sequence[tuple[str, int, int, int]]) -> Snapshot:
        """From a document's text, window and spans `(kind, start, end, slots)`.

        A last zero-width free span at the end of the text is the free tail (continue the text): its size follows
        from how many tokens the window holds, so it is not a change of its own and is left out."""
        parts: list[str] = []
        pos = 0
        gaps: list[tuple[int, int]] = []
        spans = list(spans)
        if spans and spans[-1][0] == "free" and spans[-1][1] == spans[-1][2] == len(text):
            spans.pop()
        for kind, start, end, slots in spans:
            if start == end:
                gaps.append((start, slots))
                continue
            parts.append("o" * (start - pos))
            parts.append(("f" if kind == "free" else "p") * (end - start))
            pos = end
        parts.append("o" * (len(text) - pos))
        del window  # the spans cover the window; outside it every character is `o`
        return cls(text, "".join(parts), tuple(gaps))


def _common_prefix(a: str, b: str) -> int:
    if a == b:
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    # Binary search on slice equality: O(n log n) character compares, all in C.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def diff(old: Snapshot, new: Snapshot) -> Change | None:
    """The smallest `Change` that turns `old` into `new`; None when nothing changed."""
    lo, ln = len(old.text), len(new.text)
    p = min(_common_prefix(old.text, new.text), _common_prefix(old.signature, new.signature))
    room = min(lo, ln) - p
    q = min(_common_suffix(old.text, new.text, room), _common_suffix(old.signature, new.signature, room))
    start, end = p, lo - q
    shift = ln - lo
    changed = not (start == end and lo == ln)
    if old.gaps != new.gaps:

        def to_old(x: int) -> int:  # a new-text offset in old-text coordinates
            return x if x <= p else (x - shift if x >= ln - q else min(max(x, start), end))

        moved = set(old.gaps) ^ {(to_old(x), n) for x, n in new.gaps}
        if moved:
            lo_x, hi_x = min(x for x, _ in moved), max(x for x, _ in moved)
            start, end = (min(start, lo_x), max(end, hi_x)) if changed else (lo_x, hi_x)
            changed = True
    if not changed:
        return None
    return Change(start, end, end + shift)


# -- moving offsets over a change ------------------------------------------------------------------------------


def conflicts(s: int, e: int, c: Change) -> bool:
    """Whether `[s, e)` and the changed range of `c` overlap (see the module docstring)."""
    if s == e and c.start == c.end:
        return s == c.start  # two insertions at one offset: their order is ambiguous
    if s == e:
        return c.start < s < c.end
    if c.start == c.end:
        return s < c.start < e
    return s < c.end and c.start < e


def _move_start(x: int, c: Change) -> int:
    return x + c.delta if x >= c.end else x


def _move_end(x: int, c: Change) -> int:
    return x if x <= c.start else x + c.delta


def _move(s: int, e: int, c: Change) -> tuple[int, int]:
    if s == e:
        x = _move_start(s, c)
        return x, x
    return _move_start(s, c), _move_end(e, c)


def rebase_range(start: int, end: int, changes: Sequence[Change]) -> tuple[int, int] | None:
    """Move `[start, end)` over `changes` (oldest first); None if it conflicts with one of them."""
    for c in changes:
        if conflicts(start, end, c):
            return None
        start, end = _move(start, end, c)
    return start, end


def _op_range(op: EditOp) -> tuple[int, int]:
    if isinstance(op, InsertGapOp):
        return op.at, op.at
    if isinstance(op, MoveWindowOp):
        return op.start, op.start
    return op.start, op.end


def _as_change(op: EditOp, s: int, e: int) -> Change:
    """The op at `[s, e)` seen as a change: only `replace` moves the text after it."""
    return Change(s, e, s + len(op.text)) if isinstance(op, ReplaceOp) else Change(s, e, e)


def _with_range(op: EditOp, s: int, e: int) -> EditOp:
    if isinstance(op, InsertGapOp):
        return op.model_copy(update={"at": s})
    if isinstance(op, MoveWindowOp):
        return op.model_copy(update={"start": s})
    return op.model_copy(update={"start": s, "end": e})


def rebase_ops(ops: Sequence[EditOp], changes: Sequence[Change]) -> list[EditOp] | None:
    """Move the ops of one edit (made against an old version) over the changes since; None on any conflict."""
    pending = list(changes)
    out: list[EditOp] = []
    for op in ops:
        s, e = _op_range(op)
        moved: list[Change] = []
        for c in pending:
            if conflicts(s, e, c):
                return None
            # The change as seen after this op, for the next op of the edit (which comes after this one).
            cs, ce = _move(c.start, c.end, _as_change(op, s, e))
            moved.append(Change(cs, ce, ce + c.delta))
            s, e = _move(s, e, c)
        out.append(_with_range(op, s, e))
        pending = moved
    return out


class ChangeLog:
    """The recent changes of one document, keyed by the version each produced."""

    def __init__(self, version: int, maxlen: int = 256) -> None:
        self._first = version  # the oldest base version the log can rebase from
        self._entries: deque[tuple[int, Change | None]] = deque()
        self._maxlen = maxlen

    def record(self, version: int, change: Change | None) -> None:
        """`change` made `version` (None: the version moved but nothing measurable changed)."""
        self._entries.append((version, change))
        while len(self._entries) > self._maxlen:
            v, _ = self._entries.popleft()
            self._first = v

    @classmethod
    def restore(cls, version: int, entries: Sequence[tuple[int, Change | None]], maxlen: int = 256) -> ChangeLog:
        """The log of a document now at `version`, rebuilt from saved `(version, change)` entries, oldest first.

        Only the unbroken run of entries that ends at `version` counts (at most `maxlen` of them): a version with
        no entry (its record was lost) is as far back as a request can be rebased from, as after `maxlen` changes.
        """
        kept: list[tuple[int, Change | None]] = []
        for v, change in reversed(entries):
            if v != version - len(kept) or len(kept) == maxlen:
                break
            kept.append((v, change))
        log = cls(version - len(kept), maxlen)
        log._entries.extend(reversed(kept))
        return log

    def since(self, base_v: int) -> list[Change] | None:
        """Changes after `base_v`, oldest first; None when the log no longer reaches back that far."""
        if base_v < self._first:
            return None
        return [c for v, c in self._entries if v > base_v and c is not None]
