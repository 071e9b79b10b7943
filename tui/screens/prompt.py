"""`PromptScreen`: ask for one line (a file name, a number of tokens). Enter answers, Esc cancels (None)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class PromptScreen(ModalScreen[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "", *, note: str = "") -> None:
        super().__init__()
        self.question, self.value, self.note = question, value, note

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-box"):
            yield Label(self.question, id="prompt-question")
            yield Input(self.value, id="prompt-input", compact=True, select_on_focus=False)
            if self.note:
                yield Label(self.note, id="prompt-note")

    @on(Input.Submitted)
    def _submit(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        self.dismiss(value or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
