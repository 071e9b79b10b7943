"""Layout and the live model: wrapping keeps every character, slot states follow frames, hunks match the server."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from rich.style import Style

from canvas.protocol import DiffSegment, DocState, GenProgress, Proposal, SlotUpdate, Span, Window
from canvas.server.hub import compose
from tui.live import PENDING_GLYPH, STYLE_NAMES, UNWRITTEN_GLYPH, LiveCanvas, ProposalView, hunk_ids
from tui.render import Piece, entropy_color, line_cells, tag_at, wrap

PALETTE = {name: Style(italic=(name == "noise")) for name in STYLE_NAMES}
words = st.text(alphabet=st.sampled_from("ab \n\t中"), max_size=60)


@given(st.lists(words, max_size=5), st.integers(1, 30))
def test_wrap_keeps_every_character_in_order(parts: list[str], width: int) -> None:
    pieces = [Piece(p, Style(), k) for k, p in enumerate(parts)]
    lines = wrap(pieces, width)
    joined = "\n".join("".join(text for text, _, _ in line) for line in lines)
    assert joined.replace("\n", "") == "".join(parts).replace("\n", "")
    assert len(lines) >= "".join(parts).count("\n") + 1
    for line in lines:
        chars = "".join(text for text, _, _ in line)
        assert line_cells(line) <= width or len(chars) == 1  # only a lone wide character may overflow


def test_wrap_breaks_after_spaces_and_tags_map_back() -> None:
    lines = wrap([Piece("hello world ", Style(), 0), Piece("again", Style(), 1)], 8)
    assert ["".join(t for t, _, _ in line) for line in lines] == ["hello ", "world ", "again"]
    assert tag_at(lines[2], 0) == 1 and tag_at(lines[0], 3) == 0 and tag_at(lines[0], 40) == -1


def test_entropy_ramp_goes_from_green_to_red() -> None:
    low, high = entropy_color(0.0), entropy_color(100.0)
    assert low is not None and high is not None and entropy_color(None) is None
    lo, hi = low.get_truecolor(), high.get_truecolor()
    assert lo.green > lo.red and hi.red > hi.green
    assert entropy_color(4.0) == high  # saturated


def state() -> DocState:
    # "The cat sat." : pinned "The", free " cat" (2 slots), pinned " sat.", a gap of 1 slot at the end.
    spans = [
        Span(kind="pinned", start=0, end=3, slots=1),
        Span(kind="free", start=3, end=7, slots=2),
        Span(kind="pinned", start=7, end=12, slots=2),
        Span(kind="free", start=12, end=12, slots=1),
    ]
    return DocState(doc_id="d1", v=3, text="The cat sat.\nafter", window=Window(start=0, end=12), spans=spans)


def frame(seq: int, step: int, slots: list[tuple[int, str, float, bool]]) -> GenProgress:
    ups = [SlotUpdate(i=i, token=hash(t) % 1000, text=t, entropy=e, accepted=a) for i, t, e, a in slots]
    return GenProgress(gen="g1", seq=seq, step=step, max_steps=8, slots=ups, accepted=0, free=3)


def test_live_canvas_slot_states_and_layout() -> None:
    live = LiveCanvas(state(), "g1", 8)
    text = "".join(p.text for p in live.pieces(PALETTE))
    assert text == f"The{PENDING_GLYPH * 2} sat.{PENDING_GLYPH}\nafter"
    live.apply(frame(1, 1, [(1, " dog", 3.0, False), (2, "s", 0.2, True), (5, "!", 1.0, False)]))
    assert "".join(p.text for p in live.pieces(PALETTE)) == "The dogs sat.!\nafter"
    assert live.counts() == {"pending": 0, "unwritten": 0, "noise": 2, "accepted": 1, "converged": 0}
    # Slot 2 is left out of the next delta: unchanged and still accepted, so it has converged.
    live.apply(frame(2, 2, [(1, " cow", 0.1, True)]))
    assert live.slots[2].converged and live.slots[1].state == "accepted"
    assert live.counts() == {"pending": 0, "unwritten": 0, "noise": 1, "accepted": 1, "converged": 1}
    assert live.tokens_per_forward == 1.0 and not live.lost_frames
    live.apply(frame(4, 4, []))
    assert live.lost_frames  # seq 3 never came
    pieces = live.pieces(PALETTE, lo=4, hi=14)  # a window on part of the document
    assert pieces[0].text == "" and pieces[-1].text == "\na"
    noise = [p for p in live.pieces(PALETTE) if p.tag == 5][0]
    assert noise.style.italic and noise.style.color is not None  # state style plus the ramp colour


def test_unwritten_slots_show_a_blank_never_their_noise_token() -> None:
    """An AR row's slots the writer has not reached hold the initial noise: drawn as blanks until written, even
    when an update carries the noise token's text."""
    live = LiveCanvas(state(), "g1", 8)
    ups = [SlotUpdate(i=1, token=17, text=" dog", entropy=0.5, accepted=True),
           SlotUpdate(i=2, token=4711, text=" Syriansport", accepted=False, written=False),
           SlotUpdate(i=5, token=-1, text="", accepted=False, written=False)]  # fmt: skip
    live.apply(GenProgress(gen="g1", seq=1, step=1, max_steps=8, slots=ups, accepted=1, free=3))
    pieces = live.pieces(PALETTE)
    assert "".join(p.text for p in pieces) == f"The dog{UNWRITTEN_GLYPH} sat.{UNWRITTEN_GLYPH}\nafter"
    assert live.counts() == {"pending": 0, "unwritten": 2, "noise": 0, "accepted": 1, "converged": 0}
    blank = [p for p in pieces if p.tag == 2][0]
    assert blank.style == PALETTE["unwritten"]  # no entropy colour: nothing was sampled there
    assert live.settled == 1 and live.slots[2].shown == UNWRITTEN_GLYPH
    # Written the next step (a delta names only that slot); slot 1, left out and accepted, has converged.
    live.apply(frame(2, 2, [(2, "s", 0.2, True)]))
    assert "".join(p.text for p in live.pieces(PALETTE)) == f"The dogs sat.{UNWRITTEN_GLYPH}\nafter"
    assert live.counts() == {"pending": 0, "unwritten": 1, "noise": 0, "accepted": 1, "converged": 1}
    # A server that predates the field never sends it: its slots are written.
    old = SlotUpdate.model_validate({"i": 5, "token": 9, "text": "!", "accepted": False})
    live.apply(GenProgress(gen="g1", seq=3, step=3, max_steps=8, slots=[old], accepted=0, free=3))
    assert old.written and live.slots[5].state == "noise"
    assert "".join(p.text for p in live.pieces(PALETTE)) == "The dogs sat.!\nafter"


segments = st.lists(
    st.tuples(st.sampled_from(["equal", "insert", "delete"]), st.text(alphabet="ab", min_size=1, max_size=3)),
    max_size=8,
)


@given(segments, st.data())
def test_hunks_and_partial_accept_match_the_server(segs: list[tuple[str, str]], data: st.DataObject) -> None:
    diff = [DiffSegment(op=op, text=t) for op, t in segs]  # type: ignore[arg-type]
    old = "".join(s.text for s in diff if s.op != "insert")
    new = "".join(s.text for s in diff if s.op != "delete")
    st_ = DocState(doc_id="d1", v=1, text=old, window=Window(start=0, end=len(old)))
    view = ProposalView(st_, "g1", Proposal(base_v=1, start=0, end=len(old), text=new, diff=diff))
    assert view.new_text() == new and view.new_text([]) == old
    chosen = data.draw(st.lists(st.integers(0, max(0, view.n_hunks - 1)), unique=True)) if view.n_hunks else []
    assert view.new_text(chosen) == compose(tuple(diff), chosen)
    assert max(hunk_ids(diff), default=-1) + 1 == view.n_hunks


def test_proposal_cursor_marks_and_chosen() -> None:
    diff = [DiffSegment(op="delete", text="a"), DiffSegment(op="equal", text=" "), DiffSegment(op="insert", text="b")]
    st_ = DocState(doc_id="d1", v=1, text="a ", window=Window(start=0, end=2))
    view = ProposalView(st_, "g1", Proposal(base_v=1, start=0, end=2, text=" b", diff=diff))
    assert view.n_hunks == 2 and view.chosen() == [0]
    view.move(1)
    assert view.chosen() == [1]
    view.move(1)
    assert view.current == 0  # wraps around
    view.toggle_mark()
    view.move(1)
    view.toggle_mark()
    assert view.chosen() == [0, 1]
    tags = [p.tag for p in view.pieces(PALETTE)]
    assert tags == [-1, 0, -1, 1, -1]
