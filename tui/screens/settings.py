"""`SettingsScreen`: the generation settings as a small form; saving validates them with the `Settings` model.

Tab moves between fields, Enter (or Ctrl+S) saves, Esc cancels. A bad value keeps the form open and says which
field is wrong and why; the screen answers the new `Settings`, or None when cancelled.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ValidationError
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from canvas.protocol import describe_error
from tui.settings import MODE_CHOICES, Settings, setting_label

_DEFAULT = "default"  # the mode select's value for "the model's default" (a Select value cannot be None)
# field -> (label, hint)
FIELDS: dict[str, tuple[str, str]] = {
    "max_steps": ("Max steps", "1–256"),
    "entropy_bound": ("Entropy bound", "> 0; higher: faster"),
    "t_max": ("Temperature, first step", ">= last step's"),
    "t_min": ("Temperature, last step", "> 0"),
    "seed": ("Seed", "empty: random"),
    "gap_tokens": ("Gap size (tokens)", "1–256"),
}


class SettingsScreen(ModalScreen[Settings | None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save"),
    ]

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="settings-box"):
            yield Label("Generation settings", id="settings-title")
            yield Label("Empty sampler fields take the model's own defaults.", classes="settings-hint")
            with Horizontal(classes="settings-row"):
                yield Label("Mode", classes="settings-label")
                yield Select(
                    [(setting_label(m), m or _DEFAULT) for m in MODE_CHOICES],
                    value=s.mode or _DEFAULT,
                    allow_blank=False,
                    compact=True,
                    id="set-mode",
                )
            for name, (label, hint) in FIELDS.items():
                value = getattr(s, name)
                with Horizontal(classes="settings-row"):
                    yield Label(label, classes="settings-label")
                    yield Input("" if value is None else str(value), id=f"set-{name}", compact=True)
                    yield Label(hint, classes="settings-hint")
            yield Label("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="settings-save", compact=True)
                yield Button("Cancel", id="settings-cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#set-mode").focus()

    def values(self) -> dict[str, Any]:
        mode = self.query_one("#set-mode", Select).value
        out: dict[str, Any] = {"mode": None if mode == _DEFAULT else mode}
        for name in FIELDS:
            raw = self.query_one(f"#set-{name}", Input).value.strip()
            out[name] = None if raw == "" and name != "gap_tokens" else raw
        return out

    def action_save(self) -> None:
        error = self.query_one("#settings-error", Label)
        try:
            # Inputs are text; pydantic's lax mode turns "48" into 48 and says which field is wrong otherwise.
            result = Settings.model_validate(self.values())
        except ValidationError as e:
            error.update(describe_error(e))
            return
        self.dismiss(result)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#settings-save")
    def _save_pressed(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#settings-cancel")
    def _cancel_pressed(self) -> None:
        self.action_cancel()
