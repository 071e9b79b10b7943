"""`CanvasEditor`: the text area the user types in, with the server's canvas state drawn over the text.

It shows masked (free) spans, gaps and the text outside the canvas window through `TextArea.get_line`, Textual's
documented hook for styling a line, with styles from the `canvas-editor--*` component classes in `app.tcss`.
Marks are character ranges of the document; `set_marks` installs the server's, and every local edit shifts them
(`tui.docsync.shift_span`) so the highlights follow typing until the server's next state arrives.

Undo and redo are the server's (`ctrl+z`, `ctrl+y` go to the screen): one history covers typing, pins, masks and
accepted proposals. Text in the widget is the editor form (`tui.textfile.to_editor`): control characters are
visible symbols, the same length as the document text, so offsets are shared.
"""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar, cast

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import TextArea
from textual.widgets.text_area import Document, Edit, EditResult, Location

from tui.docsync import TextChange, shift_span, text_change
from tui.textfile import from_editor, to_editor

MARK_KINDS = ("free", "gap", "outside")


class CanvasEditor(TextArea):
    COMPONENT_CLASSES: ClassVar[set[str]] = {f"canvas-editor--{k}" for k in MARK_KINDS}
    BINDINGS: ClassVar[list[BindingType]] = [
        # The server's history, not the text area's own: typing, marks and accepted proposals in one list.
        Binding("ctrl+z,super+z", "screen.undo", "Undo", show=False),
        Binding("ctrl+y,super+y", "screen.redo", "Redo", show=False),
        Binding("ctrl+u", "screen.unmark", "Unmask", show=False),
        Binding("ctrl+home", "document_edge(False)", "Start of document", show=False),
        Binding("ctrl+end", "document_edge(True)", "End of document", show=False),
        Binding("ctrl+shift+home", "document_edge(False, True)", "Select to start of document", show=False),
        Binding("ctrl+shift+end", "document_edge(True, True)", "Select to end of document", show=False),
    ]

    def __init__(self, text: str = "", **kwargs: object) -> None:
        super().__init__(to_editor(text), soft_wrap=True, tab_behavior="indent", **kwargs)  # type: ignore[arg-type]
        self.marks: list[tuple[int, int, str]] = []  # (start, end, kind) in document offsets
        self._by_row: dict[int, list[tuple[int, int | None, str]]] = {}

    # -- text in document form -------------------------------------------------------------------------------

    @property
    def doc(self) -> Document:
        return cast(Document, self.document)  # no language: always a plain Document

    @property
    def doc_text(self) -> str:
        return from_editor(self.text)

    def set_doc_text(self, text: str) -> None:
        """Replace the content with `text` (document form) as one minimal edit, keeping the cursor near."""
        change = text_change(self.doc_text, text)
        if change is None:
            return
        doc = self.doc
        start = doc.get_location_from_index(change.start)
        end = doc.get_location_from_index(change.end)
        self.replace(to_editor(change.text), start, end, maintain_selection_offset=True)

    def offset_of(self, location: Location) -> int:
        return self.doc.get_index_from_location(location)

    def location_of(self, offset: int) -> Location:
        return self.doc.get_location_from_index(max(0, min(offset, len(self.text))))

    @property
    def selected_range(self) -> tuple[int, int]:
        """The selection as document offsets (start <= end); empty at the cursor."""
        a, b = self.offset_of(self.selection.start), self.offset_of(self.selection.end)
        return (a, b) if a <= b else (b, a)

    def action_document_edge(self, end: bool, select: bool = False) -> None:
        self.move_cursor(self.doc.end if end else (0, 0), select=select)

    # -- marks -----------------------------------------------------------------------------------------------

    def set_marks(self, marks: list[tuple[int, int, str]]) -> None:
        self.marks = marks
        self._index_marks()

    def _index_marks(self) -> None:
        doc = self.doc
        by_row: dict[int, list[tuple[int, int | None, str]]] = defaultdict(list)
        n = len(self.text)
        for start, end, kind in self.marks:
            start, end = max(0, min(start, n)), max(0, min(end, n))
            if kind == "gap":
                # A gap has no width: mark the character after it (or before it at the end of a line).
                r, c = doc.get_location_from_index(start)
                line = doc.get_line(r)
                if c < len(line):
                    by_row[r].append((c, c + 1, kind))
                elif c > 0:
                    by_row[r].append((c - 1, c, kind))
                continue  # on an empty line only the status bar shows it
            if end <= start:
                continue
            r0, c0 = doc.get_location_from_index(start)
            r1, c1 = doc.get_location_from_index(end)
            for r in range(r0, r1 + 1):
                by_row[r].append((c0 if r == r0 else 0, c1 if r == r1 else None, kind))
        self._by_row = dict(by_row)
        self.notify_style_update()  # drops the cached lines
        self.refresh()

    def get_line(self, line_index: int) -> Text:
        line = super().get_line(line_index)
        for start, end, kind in self._by_row.get(line_index, ()):
            style = self.get_component_rich_style(f"canvas-editor--{kind}", partial=True)
            line.stylize(style, start, end)
        return line

    def edit(self, edit: Edit) -> EditResult:
        # Marks move with local edits; the server's next state replaces them with its own.
        if self.marks:
            start, end = self.offset_of(edit.from_location), self.offset_of(edit.to_location)
            start, end = min(start, end), max(start, end)
            change = TextChange(start, end, edit.text)
            self.marks = [(*shift_span(s, e, change), k) for s, e, k in self.marks]
        result = super().edit(edit)
        if self.marks:
            self._index_marks()
        return result
