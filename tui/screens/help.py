"""`HelpScreen`: every key binding (from `tui.keys`), grouped by when it applies. Esc, F1 or q closes it."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from tui.keys import sections

INTRO = (
    "Select text and press Ctrl+R to mask it (the model rewrites it), Ctrl+P to pin it (the model keeps it), "
    "or Ctrl+N to open a gap of new tokens at the cursor. Ctrl+G generates: with a selection it rewrites the "
    "selection, with nothing masked it fills a gap at the cursor. Watch the canvas converge, then accept, "
    "reject or regenerate the proposal. Ctrl+Z undoes an accepted proposal in one step."
)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,f1,q", "dismiss", "Close help")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Static(Text("dcanvas editor — keys    (Esc closes, arrows scroll)", style="bold"), id="help-title")
            yield Static(Text(INTRO), id="help-intro")
            for title, rows in sections(type(self.app)):
                table = Table(title=title, title_justify="left", title_style="bold", expand=True, show_edge=False)
                table.add_column("Keys", ratio=2, no_wrap=False)
                table.add_column("Action", ratio=5)
                for keys, what in rows:
                    table.add_row(keys, what)
                yield Static(table, classes="help-table")

    def on_mount(self) -> None:
        self.query_one("#help-body").focus()

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
