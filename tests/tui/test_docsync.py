"""The editor's document mirror: text diffs, spans following local edits, merging server text, and DocSync
against a real server (chunked open, rebased pushes when another client edits)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from canvas.protocol import ReplaceOp
from canvas.protocol.client import DcanvasClient
from tui.docsync import DocSync, TextChange, merge_remote, shift_span, text_change

texts = st.text(alphabet="ab \n", max_size=30)


@given(texts, texts)
def test_text_change_is_one_minimal_replace(old: str, new: str) -> None:
    change = text_change(old, new)
    if old == new:
        assert change is None
        return
    assert change is not None and change.apply(old) == new
    # Minimal: the kept prefix and suffix cannot grow.
    assert change.start == len(old) - len(old[change.start :]) and (
        change.start == len(old)
        or change.end == change.start
        or change.text == ""
        or old[change.start] != change.text[0]
    )


@given(texts, st.data())
def test_shift_span_keeps_the_spanned_text_when_edits_are_outside(text: str, data: st.DataObject) -> None:
    s = data.draw(st.integers(0, len(text)))
    e = data.draw(st.integers(s, len(text)))
    a = data.draw(st.integers(0, len(text)))
    b = data.draw(st.integers(a, len(text)))
    ins = data.draw(st.text(alphabet="xy", max_size=4))
    assume(b <= s or a >= e)  # the edit does not touch the span...
    assume(not (a == b == s) and not (a == b == e))  # ...and is not an insert at its edge (which stretches it)
    change = TextChange(a, b, ins)
    ns, ne = shift_span(s, e, change)
    assert change.apply(text)[ns:ne] == text[s:e]


def test_shift_span_stretches_over_edits_inside() -> None:
    # "The cat sat": span "cat" (4, 7); typing inside it keeps the span around the new text.
    assert shift_span(4, 7, TextChange(5, 6, "XYZ")) == (4, 9)
    assert shift_span(4, 7, TextChange(0, 0, "ab")) == (6, 9)
    assert shift_span(4, 7, TextChange(9, 9, "ab")) == (4, 7)
    assert shift_span(5, 5, TextChange(5, 5, "ab")) == (5, 5)  # a gap stays where the cursor typed


@given(st.integers(6, 20), st.data())
def test_merge_remote_keeps_both_disjoint_changes(n: int, data: st.DataObject) -> None:
    base = "abcdefghijklmnopqrstuvwxyz"[:n]  # distinct letters: every edit has one reading
    cut = data.draw(st.integers(2, len(base) - 2))
    theirs = TextChange(data.draw(st.integers(0, cut - 1)), cut - 1, data.draw(st.text(alphabet="X", max_size=3)))
    mine = TextChange(cut + 1, data.draw(st.integers(cut + 1, len(base))), data.draw(st.text(alphabet="Y", max_size=3)))
    remote, now = theirs.apply(base), mine.apply(base)
    merged, clean = merge_remote(base, remote, now)
    assert clean
    assert merged == base[: theirs.start] + theirs.text + base[theirs.end : mine.start] + mine.text + base[mine.end :]
    # And the other way round (their change after mine).
    merged2, clean2 = merge_remote(base, now, remote)
    assert clean2 and merged2 == merged


def test_merge_remote_overlap_prefers_the_server() -> None:
    assert merge_remote("abcdef", "abXdef", "abYdef") == ("abXdef", False)
    assert merge_remote("abc", "abc", "abcd") == ("abcd", True)
    assert merge_remote("abc", "xbc", "abc") == ("xbc", True)


async def test_docsync_chunks_a_large_open_and_rebases_pushes(server_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "".join(f"line {k}\n" for k in range(40))
    async with DcanvasClient.connect(server_url) as a, DcanvasClient.connect(server_url) as b:
        sync = DocSync()
        monkeypatch.setattr(sync, "_chunk", lambda: 50)  # as if the server took 50 characters per text field
        state = await sync.attach(a, text, "big.txt")
        assert state.text == text and state.name == "big.txt"
        assert state.v == len(text) // 50  # one open, then one append per further chunk

        # Another client edits the start; this editor, unaware, edits the end against its old version.
        other = await b.open(state.doc_id)
        await b.edit(other.doc_id, other.v, [ReplaceOp(start=0, end=4, text="LINE")])
        mine = text + "the end\n"
        sent, state = await sync.push(lambda: mine)
        assert sent == mine
        assert state.text == "LINE" + mine[4:]  # the server rebased the push over the other edit

        # After a reconnect the same document is opened again, and the text is brought up to date.
        sync.client = None
        state = await sync.attach(a, state.text + "more\n", "big.txt")
        assert state.doc_id == other.doc_id and state.text.endswith("the end\nmore\n")


async def test_a_stale_push_does_not_undo_an_undo(server_url: str) -> None:
    # The push timer may fire while an undo is in flight and read the text the undo is about to replace; sending
    # that text would re-apply what was undone (and drop the spans it covered).
    text = "The cat sat on the mat.\n"
    async with DcanvasClient.connect(server_url) as client:
        sync = DocSync()
        await sync.attach(client, text, "cat.txt")
        typed = text.replace("cat", "dog")
        state = await sync.history(typed, redo=False)  # the typing is sent first, then undone
        assert state.text == text
        sent, after = await sync.push(lambda: typed)  # the editor has not redrawn yet: still the undone text
        assert sent == typed and after.text == text and after.v == state.v
        sync.shown()  # the editor took the undo; typing the same words again is new typing
        _, after = await sync.push(lambda: typed)
        assert after.text == typed and after.v == state.v + 1
