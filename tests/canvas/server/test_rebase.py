"""Rebasing edits over concurrent changes: conflict rules, offset moves, convergence, and change measurement."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canvas.protocol import EditOp, InsertGapOp, MaskOp, MoveWindowOp, PinOp, ReplaceOp
from canvas.server.rebase import Change, ChangeLog, Snapshot, conflicts, diff, rebase_ops, rebase_range


def _apply(text: str, ops: Sequence[ReplaceOp]) -> str:
    for op in ops:
        assert 0 <= op.start <= op.end <= len(text)
        text = text[: op.start] + op.text + text[op.end :]
    return text


def _changes(ops: Sequence[ReplaceOp]) -> list[Change]:
    return [Change(op.start, op.end, op.start + len(op.text)) for op in ops]


@st.composite
def _edits(draw: st.DrawFn, text: str, max_ops: int = 3) -> list[ReplaceOp]:
    ops = []
    for _ in range(draw(st.integers(0, max_ops))):
        s = draw(st.integers(0, len(text)))
        e = draw(st.integers(s, min(len(text), s + 4)))
        new = draw(st.text("XYZ", max_size=3))
        ops.append(ReplaceOp(start=s, end=e, text=new))
        text = text[:s] + new + text[e:]
    return ops


@settings(max_examples=400, deadline=None)
@given(data=st.data(), base=st.text("abcdefgh", max_size=24))
def test_disjoint_edits_converge_whichever_applies_first(data: st.DataObject, base: str) -> None:
    mine = data.draw(_edits(base))
    theirs = data.draw(_edits(base))
    rebased = rebase_ops(mine, _changes(theirs))
    back = rebase_ops(theirs, _changes(mine))
    assert (rebased is None) == (back is None)  # the conflict rule is symmetric
    if rebased is not None and back is not None:
        one = _apply(_apply(base, theirs), rebased)  # type: ignore[arg-type]
        other = _apply(_apply(base, mine), back)  # type: ignore[arg-type]
        assert one == other


def test_conflict_rules() -> None:
    # ranges: sharing a character conflicts, touching does not
    assert conflicts(2, 5, Change(4, 8, 8)) and not conflicts(2, 5, Change(5, 8, 6))
    assert not conflicts(5, 8, Change(2, 5, 9))
    # points: inside a range conflicts, at its ends does not; two points at one offset conflict
    assert conflicts(4, 4, Change(2, 6, 6)) and not conflicts(2, 2, Change(2, 6, 3))
    assert not conflicts(6, 6, Change(2, 6, 3))
    assert conflicts(3, 3, Change(3, 3, 5)) and not conflicts(3, 3, Change(4, 4, 5))
    # an insertion strictly inside a range conflicts with it
    assert conflicts(2, 6, Change(4, 4, 7)) and not conflicts(2, 6, Change(6, 6, 7))


def test_rebase_shifts_ops_after_a_change_and_keeps_those_before() -> None:
    typed = [Change(0, 0, 5)]  # someone typed 5 characters at the start
    ops: list[EditOp] = [
        MaskOp(start=4, end=7),
        InsertGapOp(at=10, n_tokens=3),
        MoveWindowOp(start=2),
        ReplaceOp(start=20, end=21, text="q"),
    ]
    assert rebase_ops(ops, typed) == [
        MaskOp(start=9, end=12),
        InsertGapOp(at=15, n_tokens=3),
        MoveWindowOp(start=7),
        ReplaceOp(start=25, end=26, text="q"),
    ]
    # The same edit against a change that lies after all of it is unchanged.
    assert rebase_ops(ops, [Change(30, 31, 40)]) == ops
    # Any op that overlaps: the whole edit is refused.
    assert rebase_ops([PinOp(start=0, end=3), MaskOp(start=4, end=7)], [Change(6, 9, 9)]) is None


def test_later_ops_of_an_edit_see_the_earlier_ones() -> None:
    # base "0123456789": the edit deletes [0, 2) and then masks what is now [3, 5) (base [5, 7)); meanwhile someone
    # replaced base [8, 9) with "XYZ". The mask is disjoint from that change in either order.
    ops: list[EditOp] = [ReplaceOp(start=0, end=2, text=""), MaskOp(start=3, end=5)]
    assert rebase_ops(ops, [Change(8, 9, 11)]) == ops
    # ... but a change at base [5, 6) overlaps the mask once the deletion is accounted for.
    assert rebase_ops(ops, [Change(5, 6, 6)]) is None


def test_rebase_range_over_several_changes() -> None:
    assert rebase_range(10, 14, [Change(0, 2, 0), Change(20, 20, 25), Change(3, 3, 4)]) == (9, 13)
    assert rebase_range(10, 14, [Change(0, 2, 0), Change(11, 12, 12)]) is None  # second change, moved coordinates
    assert rebase_range(5, 5, [Change(5, 5, 6)]) is None


def _snap(
    text: str, spans: Sequence[tuple[str, int, int, int]] = (), window: tuple[int, int] | None = None
) -> Snapshot:
    return Snapshot.of(text, window or (0, len(text)), spans)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), old=st.text("ab ", max_size=30))
def test_diff_of_a_text_edit_is_within_the_edit_and_reconstructs(data: st.DataObject, old: str) -> None:
    [op] = data.draw(_edits(old, max_ops=1).filter(lambda ops: len(ops) == 1))
    new = _apply(old, [op])
    c = diff(_snap(old), _snap(new))
    if old == new:
        assert c is None
        return
    assert c is not None
    # Minimal: never larger than the edit (it may sit elsewhere when the text repeats, as in "aa" -> "a").
    assert c.end - c.start <= op.end - op.start and c.new_end - c.start <= len(op.text)
    assert old[: c.start] + new[c.start : c.new_end] + old[c.end :] == new


def test_diff_sees_slot_state_changes_and_gaps() -> None:
    text = "The cat sat on the mat."
    pinned = _snap(text, [("pinned", 0, 23, 7)])
    masked = _snap(text, [("pinned", 0, 4, 1), ("free", 4, 7, 1), ("pinned", 7, 23, 5)])
    assert diff(pinned, masked) == Change(4, 7, 7)
    assert diff(masked, masked) is None
    gap = _snap(text, [("pinned", 0, 8, 2), ("free", 8, 8, 4), ("pinned", 8, 23, 5)])
    assert diff(pinned, gap) == Change(8, 8, 8)
    bigger_gap = _snap(text, [("pinned", 0, 8, 2), ("free", 8, 8, 6), ("pinned", 8, 23, 5)])
    assert diff(gap, bigger_gap) == Change(8, 8, 8)
    # Moving the window changes the state signature where the window was and where it is now.
    first_half = _snap(text, [("pinned", 0, 11, 3)], window=(0, 11))
    second_half = _snap(text, [("pinned", 15, 23, 3)], window=(15, 23))
    assert diff(first_half, second_half) == Change(0, 23, 23)
    # A text edit elsewhere moves a gap without the gap counting as changed.
    typed = _snap("XX" + text, [("pinned", 0, 10, 3), ("free", 10, 10, 4), ("pinned", 10, 25, 5)])
    assert diff(gap, typed) == Change(0, 0, 2)
    # The free tail after the text shrinks as text is typed: that is no change of its own.
    tail = _snap(text, [("pinned", 0, 23, 7), ("free", 23, 23, 25)])
    longer = _snap("So " + text, [("pinned", 0, 26, 8), ("free", 26, 26, 24)])
    assert diff(tail, longer) == Change(0, 0, 3)


def test_change_log_reaches_back_only_so_far() -> None:
    log = ChangeLog(version=3, maxlen=2)
    assert log.since(3) == [] and log.since(2) is None
    log.record(4, Change(0, 1, 1))
    log.record(5, None)
    assert log.since(3) == [Change(0, 1, 1)] and log.since(4) == []
    log.record(6, Change(2, 2, 3))  # pushes version 4 out: base 3 can no longer be rebased
    assert log.since(3) is None
    assert log.since(4) == [Change(2, 2, 3)]
    assert log.since(6) == []


@pytest.mark.parametrize("ops", [[MaskOp(start=0, end=1)], [InsertGapOp(at=0, n_tokens=1)]])
def test_no_changes_means_no_move(ops: list[EditOp]) -> None:
    assert rebase_ops(ops, []) == ops


def test_a_restored_log_answers_like_the_one_it_was_saved_from() -> None:
    live = ChangeLog(version=0, maxlen=3)
    saved: list[tuple[int, Change | None]] = []
    for v, c in enumerate([Change(0, 1, 1), None, Change(4, 4, 6), Change(2, 3, 3)], start=1):
        live.record(v, c)
        saved.append((v, c))
    restored = ChangeLog.restore(4, saved, maxlen=3)
    for base in range(6):
        assert restored.since(base) == live.since(base), base
    assert restored.since(0) is None and restored.since(1) == [Change(4, 4, 6), Change(2, 3, 3)]


def test_a_restored_log_stops_at_a_missing_version() -> None:
    # Version 3's entry was never saved: nothing before it can be rebased over.
    log = ChangeLog.restore(5, [(1, Change(0, 1, 1)), (2, None), (4, Change(2, 2, 3)), (5, Change(7, 8, 8))])
    assert log.since(2) is None and log.since(3) == [Change(2, 2, 3), Change(7, 8, 8)]
    assert ChangeLog.restore(5, []).since(4) is None and ChangeLog.restore(5, []).since(5) == []
    # Entries past the version the document is at (there are none in a consistent store) count as a break too.
    assert ChangeLog.restore(1, [(1, None), (2, None)]).since(0) is None


def test_change_log_from_stored_edits() -> None:
    from canvas.document import StateError
    from canvas.server.persist import change_log, decode_change, encode_change
    from canvas.store.base import EditRecord

    assert decode_change(encode_change(Change(1, 2, 5))) == Change(1, 2, 5)
    assert decode_change(encode_change(None)) is None
    with pytest.raises(StateError):
        decode_change([1, 2])
    records = [EditRecord("d", 1, [], 0.0, [0, 1, 1]), EditRecord("d", 2, [], 0.0, None),  # 2: saved unmeasured
               EditRecord("d", 3, [], 0.0, [4, 4, 5]), EditRecord("d", 4, [], 0.0, [])]  # fmt: skip
    log = change_log(4, records)
    assert log.since(1) is None and log.since(2) == [Change(4, 4, 5)] and log.since(4) == []
