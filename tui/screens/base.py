"""`EditorScreen`: what the editor's screens share: the phase, the server document, the status bar, reporting.

Phases: `idle` (the text area has the keys), `starting`, `generating` and `cancelling` (the live canvas view is
shown, Esc cancels), `proposal` (the inline diff is shown). `check_action` enables each binding only in the phases
listed in `ACTION_PHASES`, so the footer shows what applies now. Failures become a notification in words
(`_report`): a typed server error, a lost connection, a file problem; never a traceback.

The screen is built in layers, one concern per module: `EditorScreen` (here) < `FileScreen` (open, save) <
`GenerationScreen` (generate, cancel, proposals) < `MainScreen` (layout, connection, typing, pins and masks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from textual import on
from textual.reactive import reactive
from textual.screen import Screen

from canvas.protocol import EditOp, MoveWindowOp, ProtocolError
from canvas.protocol.client import ConnectionLost
from tui.docsync import DocSync
from tui.messages import DocUpdated, Problem
from tui.widgets.canvas_view import CanvasView
from tui.widgets.editor import CanvasEditor
from tui.widgets.status_bar import DocInfo, RunInfo, StatusBar

if TYPE_CHECKING:
    from tui.app import DcanvasApp

log = logging.getLogger("tui")
RUNNING = ("starting", "generating", "cancelling")


class EditorScreen(Screen[None]):
    ACTION_PHASES: ClassVar[dict[str, tuple[str, ...]]] = {}

    phase: reactive[str] = reactive("idle")

    def __init__(self, text: str = "") -> None:
        super().__init__()
        self.initial_text = text
        self.saved_text = text
        self.sync = DocSync()
        self.run_info = RunInfo()

    @property
    def dapp(self) -> DcanvasApp:
        return self.app  # type: ignore[return-value]

    @property
    def editor(self) -> CanvasEditor:
        return self.query_one(CanvasEditor)

    @property
    def canvas(self) -> CanvasView:
        return self.query_one(CanvasView)

    @property
    def dirty(self) -> bool:
        return self.editor.doc_text != self.saved_text

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        phases = self.ACTION_PHASES.get(action)
        return phases is None or self.phase in phases

    def set_run(self, **changes: object) -> None:
        self.run_info = dataclasses.replace(self.run_info, **changes)  # type: ignore[arg-type]

    def update_status(self) -> None:
        ed = self.editor
        row, col = ed.cursor_location
        st = self.sync.state
        info = self.sync.describe()
        self.query_one(StatusBar).doc = DocInfo(
            name=self.dapp.textfile.name,
            dirty=self.dirty,
            v=None if st is None else st.v,
            window=None if st is None else (st.window.start, st.window.end),
            masked=info.get("masked", 0),
            gaps=sum(1 for m in ed.marks if m[2] == "gap"),
            free_slots=info.get("free_slots", 0),
            row=row,
            col=col,
        )
        self.query_one(StatusBar).run = self.run_info

    # -- reporting -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _report(self, what: str) -> Iterator[None]:
        """Turn a failed request into a message for people (never a traceback)."""
        try:
            yield
        except ProtocolError as e:
            self.post_message(Problem(f"{what}: {e.message}", "warning" if e.retryable else "error"))
        except (ConnectionLost, ConnectionError, OSError, TimeoutError) as e:
            self.post_message(Problem(f"{what}: no server connection ({e or type(e).__name__})"))
        except Exception as e:  # a bug: log it for the developer, tell the user in one line
            log.exception("%s failed", what)
            self.post_message(Problem(f"{what} failed unexpectedly: {type(e).__name__}: {e}"))

    @on(Problem)
    def _problem(self, msg: Problem) -> None:
        self.notify(msg.message, severity=msg.severity, timeout=8)  # type: ignore[arg-type]

    def _connected(self) -> bool:
        if self.sync.ready:
            return True
        self.notify("Not connected to a server yet: see the banner at the top.", severity="warning")
        return False

    def _after_request(self) -> None:
        deferred, self.sync.deferred = self.sync.deferred, None
        if deferred is not None and self.sync.state is not None and deferred.v > self.sync.state.v:
            self.post_message(DocUpdated(deferred, sent=None))

    # -- the canvas window -------------------------------------------------------------------------------------

    def _in_window(self, start: int, end: int, ops: list[EditOp]) -> list[EditOp]:
        """Prepend a window move when `[start, end)` is outside the canvas window."""
        st = self.sync.state
        if st is None or (st.window.start <= start and end <= st.window.end):
            return ops
        return [MoveWindowOp(start=self._window_start_for(start)), *ops]

    def _window_start_for(self, at: int) -> int:
        """Where to start the window so that `at` is in it with some text before it: the start of its line when
        that is near, else a word boundary about half a window before it (~2 characters a token, a safe guess)."""
        text = self.editor.doc_text
        line_start = text.rfind("\n", 0, at) + 1
        welcome = self.dapp.client.welcome if self.dapp.client is not None else None
        budget = welcome.model.canvas_length if welcome is not None else 64
        if at - line_start <= budget:
            return line_start
        space = text.rfind(" ", at - budget, at)
        return space + 1 if space >= 0 else at
