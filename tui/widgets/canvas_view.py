"""`CanvasView`: the read-only live view of a generation, and of its proposal as an inline diff.

A Line-API scroll view. Its source (`tui.live.LiveCanvas` or `ProposalView`) lays the document out as pieces;
the view wraps them (`tui.render.wrap`) and draws one strip per visual line. Frames only mark the view dirty; a
timer lays it out again at most `MAX_FPS` times a second and refreshes only the lines whose content changed
(`frame_refreshes` lists how many, one entry per frame layout, for tests). Lines after the changed part that only
moved (the window wrapped to more or fewer lines) are repainted where they are visible; off screen they are drawn
when scrolled to. A new source or a resize redraws everything and is not a frame layout. Strips are cached by
line content, so an unchanged line is never rendered twice. The document before and after the part a source can
change is wrapped once per source and width.

Styles come from the `canvas-view--*` component classes in `app.tcss`; the entropy ramp is `tui.render`'s. In a
proposal, a click puts the hunk under the pointer under the cursor, and dragging from one hunk to another marks
the hunks between them.
"""

from __future__ import annotations

from typing import ClassVar

from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.cache import LRUCache
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.live import STYLE_NAMES, LiveCanvas, ProposalView
from tui.render import Line, Piece, tag_at, to_strip, wrap
from tui.textfile import display

MAX_FPS = 30


def _split_static(text: str, start: int, end: int) -> tuple[str, int, int, str]:
    """Cut `text` at line breaks around `[start, end)`: (head, cut_start, cut_end, tail), where head and tail are
    whole lines that never change while a source is shown and `[cut_start, cut_end)` is the part that may."""
    nl = text.rfind("\n", 0, start)
    cut_start = nl + 1 if nl >= 0 else 0
    nl = text.find("\n", end)
    cut_end = nl if nl >= 0 else len(text)
    head = text[: cut_start - 1] if cut_start > 0 else ""
    tail = text[cut_end + 1 :] if cut_end < len(text) else ""
    return head, cut_start, cut_end, tail


class CanvasView(ScrollView, can_focus=True):
    COMPONENT_CLASSES: ClassVar[set[str]] = {f"canvas-view--{name}" for name in STYLE_NAMES}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("tab,n,right", "hunk(1)", "Next hunk", show=False, tooltip="Move the hunk cursor to the next hunk"),
        Binding("shift+tab,p,left", "hunk(-1)", "Previous hunk", show=False, tooltip="Move it to the previous hunk"),
        Binding("space", "mark", "Mark hunk", show=False, tooltip="Mark or unmark the hunk under the cursor"),
    ]

    class HunkMoved(Message):
        """The hunk cursor or the marks changed (the screen updates its mode line)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.source: LiveCanvas | ProposalView | None = None
        self._lines: list[Line] = []
        self._static: tuple[object, int, list[Line], list[Line], int, int] | None = None
        self._strips: LRUCache[tuple[Line, int], Strip] = LRUCache(1024)
        self._dirty = False
        self._press_hunk = -1
        self.frame_refreshes: list[int] = []  # per frame layout: lines repainted (tests read it)
        self.layouts = 0  # layouts done (at most MAX_FPS a second while frames arrive)
        self.live_frames_drawn = 0  # layouts that showed a newer frame of a generation
        self.last_live_text = ""  # the plain text of the latest such layout
        self.last_live_drafts: list[str] = []  # the slot drafts (as shown) of the frame it drew
        self._drawn_frames = -1

    def on_mount(self) -> None:
        self.set_interval(1 / MAX_FPS, self._flush)

    # -- source ----------------------------------------------------------------------------------------------

    def show(self, source: LiveCanvas | ProposalView | None) -> None:
        """Show a new source now (not coalesced) and scroll to the part that changes."""
        self.source = source
        self._drawn_frames = -1
        self._static = None
        self._lines = []
        self._strips.clear()
        self._layout(frame=False)
        focus = self._first_live_line()
        if focus is not None:
            self.scroll_to(y=max(0, focus - self.size.height // 3), animate=False)
        self.refresh()

    def mark_dirty(self) -> None:
        """A frame arrived: lay out again at the next tick."""
        self._dirty = True

    def _flush(self) -> None:
        if self._dirty:
            self._dirty = False
            self._layout(frame=True)

    def palette(self) -> dict[str, Style]:
        return {n: self.get_component_rich_style(f"canvas-view--{n}", partial=True) for n in STYLE_NAMES}

    def _width(self) -> int:
        return max(8, self.scrollable_content_region.width or self.size.width or 80)

    def _layout(self, frame: bool = False) -> None:
        source = self.source
        if source is None:
            new: list[Line] = []
        else:
            width = self._width()
            palette = self.palette()
            text = source.state.text
            if isinstance(source, LiveCanvas):
                start, end = source.state.window.start, source.state.window.end
            else:
                start, end = source.proposal.start, source.proposal.end
            if self._static is None or self._static[0] is not source or self._static[1] != width:
                head, cut_start, cut_end, tail = _split_static(text, start, end)
                head_lines = wrap([Piece(display(head), palette["context"])], width) if cut_start > 0 else []
                tail_lines = wrap([Piece(display(tail), palette["context"])], width) if cut_end < len(text) else []
                self._static = (source, width, head_lines, tail_lines, cut_start, cut_end)
            _, _, head_lines, tail_lines, cut_start, cut_end = self._static
            new = head_lines + wrap(source.pieces(palette, cut_start, cut_end), width) + tail_lines
        old = self._lines
        self._lines = new
        self.layouts += 1
        if isinstance(source, LiveCanvas) and source.frames > max(0, self._drawn_frames):
            self._drawn_frames = source.frames
            self.live_frames_drawn += 1
            self.last_live_text = "".join(text for line in new for text, _, _ in line)
            self.last_live_drafts = [d.shown for d in source.slots.values()]
        self.virtual_size = Size(self._width(), len(new))
        repainted = self._repaint(old, new)
        if frame:
            self.frame_refreshes.append(repainted)

    def _repaint(self, old: list[Line], new: list[Line]) -> int:
        """Refresh the lines of `new` that differ from `old`; return how many. The common head and tail are
        aligned separately, so a change in line count repaints the moved tail only where it is on screen."""
        head = 0
        limit = min(len(old), len(new))
        while head < limit and old[head] == new[head]:
            head += 1
        tail = 0
        while tail < limit - head and old[len(old) - 1 - tail] == new[len(new) - 1 - tail]:
            tail += 1
        changed = range(head, max(len(old), len(new)) - tail)  # new or different content (or lines removed)
        moved = range(len(new) - tail, len(new)) if len(new) != len(old) else range(0)
        top = self.scroll_offset.y
        visible = range(top, top + max(1, self.size.height))
        lines = set(changed) | {y for y in moved if y in visible}
        for y in sorted(lines):
            self.refresh_line(y)
        return len(lines)

    def _first_live_line(self) -> int | None:
        for y, line in enumerate(self._lines):
            if any(tag >= 0 for _, _, tag in line):
                return y
        return None

    # -- rendering -------------------------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        index = y + self.scroll_offset.y
        width = self.scrollable_content_region.width
        base = self.rich_style
        if index >= len(self._lines):
            return Strip.blank(width, base)
        line = self._lines[index]
        key = (line, width)
        strip = self._strips.get(key)
        if strip is None:
            strip = to_strip(line, width, base)
            self._strips[key] = strip
        return strip

    def on_resize(self, event: events.Resize) -> None:
        self._static = None
        self._strips.clear()
        self._layout(frame=False)

    # -- proposal interaction ----------------------------------------------------------------------------------

    def action_hunk(self, delta: int) -> None:
        if isinstance(self.source, ProposalView):
            self.source.move(delta)
            self._after_hunk_change()

    def action_mark(self) -> None:
        if isinstance(self.source, ProposalView):
            self.source.toggle_mark()
            self._after_hunk_change()

    def _after_hunk_change(self) -> None:
        self._layout()
        assert isinstance(self.source, ProposalView)
        for y, line in enumerate(self._lines):
            if any(tag == self.source.current for _, _, tag in line):
                self.scroll_to_region_line(y)
                break
        self.post_message(self.HunkMoved())

    def scroll_to_region_line(self, y: int) -> None:
        top, height = self.scroll_offset.y, self.size.height
        if not top <= y < top + height:
            self.scroll_to(y=max(0, y - height // 3), animate=False)

    def _hunk_at(self, x: int, y: int) -> int:
        index = y + self.scroll_offset.y
        return tag_at(self._lines[index], x) if 0 <= index < len(self._lines) else -1

    def on_mouse_down(self, event: events.MouseDown) -> None:
        self._press_hunk = self._hunk_at(event.x, event.y)

    def on_mouse_up(self, event: events.MouseUp) -> None:
        source = self.source
        hunk = self._hunk_at(event.x, event.y)
        if not isinstance(source, ProposalView) or hunk < 0:
            return
        if self._press_hunk >= 0 and self._press_hunk != hunk:
            lo, hi = sorted((self._press_hunk, hunk))
            source.marked |= set(range(lo, hi + 1))  # a drag across hunks selects them
        source.current = hunk
        self._after_hunk_change()
