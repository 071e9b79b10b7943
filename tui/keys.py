"""Every key binding of the editor as one table, read from the widgets' own `BINDINGS`.

The help screen shows it and `docs/tui.md` embeds it (`python -m tui.keydoc` prints the Markdown; a test checks
that the page matches), so neither can drift from the code. The app's own bindings come in as an argument: this
module sits below `tui.app` (whose help screen reads it) and so never imports it. Bindings are merged the way
Textual merges them: a subclass's binding for a key replaces the inherited one.

Sections: anywhere (the app), while editing, while generating, with a proposal, in the text area (Textual's
`TextArea` keys as this editor changes them) and the mouse.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.app import App
from textual.binding import Binding, BindingType

Row = tuple[str, str]  # (keys, what they do)

_NAMES = {"escape": "Esc", "pageup": "PgUp", "pagedown": "PgDn", "backspace": "Backspace", "delete": "Del"}

MOUSE_ROWS: list[Row] = [
    ("Drag in the text", "select text (then pin, mask or generate)"),
    ("Click a hunk", "put the hunk cursor on it"),
    ("Drag across hunks", "mark those hunks (accept them with y)"),
    ("Wheel", "scroll"),
]


def key_label(key: str) -> str:
    """`ctrl+shift+left` -> `Ctrl+Shift+Left`."""
    return "+".join(_NAMES.get(part, part.upper() if len(part) == 1 else part.capitalize()) for part in key.split("+"))


def _effective(classes: Iterable[type]) -> list[Binding]:
    """The bindings of the last class in `classes`, with inherited ones overridden key by key."""
    by_key: dict[str, Binding] = {}
    for cls in classes:
        own: list[BindingType] = list(cls.__dict__.get("BINDINGS", []))
        for b in Binding.make_bindings(own):
            by_key[b.key] = b
    return list(by_key.values())


def rows(bindings: Iterable[BindingType]) -> list[Row]:
    """Group bindings by (action, description), alternatives of one action on one row, in declaration order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for b in Binding.make_bindings(list(bindings)):
        if b.system:
            continue
        label = b.tooltip or b.description or b.action.replace("_", " ")
        groups.setdefault((b.action, label), []).append(key_label(b.key))
    return [(" / ".join(keys), label) for (_, label), keys in groups.items()]


def sections(app: type[App[Any]]) -> list[tuple[str, list[Row]]]:
    """The table of `app` (the editor's app class) and its screens and widgets."""
    from textual.widgets import TextArea

    from tui.screens.main import MainScreen
    from tui.widgets.canvas_view import CanvasView
    from tui.widgets.editor import CanvasEditor

    # Keys the text area passes on to the screen are listed with the screen's.
    editor_keys = [b for b in _effective([*reversed(TextArea.__mro__), CanvasEditor]) if "." not in b.action]
    return [
        ("Anywhere", rows(app.BINDINGS)),
        ("Editing", rows(MainScreen.EDIT_KEYS)),
        ("While generating", rows(MainScreen.RUN_KEYS)),
        ("With a proposal", rows([*MainScreen.PROPOSAL_KEYS, *CanvasView.BINDINGS])),
        ("In the text", rows(editor_keys)),
        ("Mouse", MOUSE_ROWS),
    ]
