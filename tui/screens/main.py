"""`MainScreen`: the editor's layout and everything but files and generations: the connection, the server
document, typing, pins, masks, gaps, the window, undo and redo.

All I/O runs in workers and comes back as messages (`tui.messages`) handled here. Document requests go through
`DocSync` one at a time. Typing is sent after a short pause as one `replace`; a server state that arrives while
the user typed on is merged into the text area (`tui.docsync.merge_remote`), never over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.timer import Timer
from textual.widgets import Footer, TextArea

from canvas.protocol import DocState, EditOp, InsertGapOp, MaskOp, MoveWindowOp, PinOp, ProtocolError, UnmaskOp
from canvas.protocol.client import ConnectionLost
from tui.docsync import merge_remote, shift_span, text_change
from tui.messages import Connected, Connecting, Disconnected, DocUpdated, Problem
from tui.screens.generation import GenerationScreen
from tui.screens.prompt import PromptScreen
from tui.settings import mode_label
from tui.textfile import TextFile, to_editor
from tui.widgets.banner import Banner
from tui.widgets.canvas_view import CanvasView
from tui.widgets.editor import CanvasEditor
from tui.widgets.mode_line import ModeLine
from tui.widgets.status_bar import RunInfo, StatusBar

PUSH_DELAY_S = 0.25  # typing is sent after this pause: one edit (and one undo step) per burst


def marks_for(state: DocState) -> list[tuple[int, int, str]]:
    """Editor highlights for a server state: free spans, gaps and the text outside the canvas window."""
    n, w = len(state.text), state.window
    out: list[tuple[int, int, str]] = []
    if w.start > 0:
        out.append((0, w.start, "outside"))
    if w.end < n:
        out.append((w.end, n, "outside"))
    free = [s for s in state.spans if s.kind == "free"]
    for s in free:
        if s.start == s.end == n and len(free) == 1:
            continue  # the continuation after the text, not a gap the user made
        out.append((s.start, s.end, "gap" if s.start == s.end else "free"))
    return out


class MainScreen(GenerationScreen):
    EDIT_KEYS: ClassVar[list[BindingType]] = [
        Binding("ctrl+g,f5", "generate", "Generate",
                tooltip="Generate: the masked text and gaps; with a selection, mask it first; with nothing masked, "
                "a gap at the cursor"),
        Binding("ctrl+r", "mask", "Mask", tooltip="Mask the selection: the model rewrites it"),
        Binding("ctrl+p", "pin", "Pin", tooltip="Pin the selection: the model keeps it (unmasks it)"),
        Binding("ctrl+n", "gap", "Gap", tooltip="Insert a gap of N new tokens at the cursor (infill)"),
        Binding("ctrl+u", "unmark", "Unmask", show=False,
                tooltip="Unmask the selection, or the masked span or gap at the cursor"),
        Binding("f4", "move_window", "Window", show=False,
                tooltip="Move the canvas window to start at the cursor's line"),
        Binding("ctrl+z", "undo", "Undo", show=False,
                tooltip="Undo: typing, pins, masks and a whole accepted proposal are each one step"),
        Binding("ctrl+y", "redo", "Redo", show=False, tooltip="Redo"),
        Binding("ctrl+o", "open", "Open", show=False, tooltip="Open a file"),
        Binding("ctrl+s", "save", "Save", tooltip="Save the file exactly as shown (the old one becomes NAME~)"),
        Binding("f3", "save_as", "Save as", show=False, tooltip="Save under another name"),
    ]  # fmt: skip
    BINDINGS: ClassVar[list[BindingType]] = EDIT_KEYS + GenerationScreen.RUN_KEYS + GenerationScreen.PROPOSAL_KEYS
    ACTION_PHASES: ClassVar[dict[str, tuple[str, ...]]] = {
        **{a: ("idle",) for a in ("generate", "mask", "pin", "gap", "unmark", "move_window", "undo", "redo",
                                   "open", "save", "save_as")},
        "cancel": ("starting", "generating"),
        **{a: ("proposal",) for a in ("accept_all", "accept_part", "reject", "regenerate")},
    }  # fmt: skip

    def __init__(self, text: str = "") -> None:
        super().__init__(text)
        self._push_timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Banner(id="banner")
        yield CanvasEditor(self.initial_text, id="editor", placeholder="Type here, or open a file with Ctrl+O.")
        yield CanvasView(id="canvas")
        yield ModeLine(id="mode-line")
        yield StatusBar(id="status")
        yield Footer(compact=True, show_command_palette=False)

    def document_replaced(self, file: TextFile, text: str) -> None:
        """A file was opened: it becomes a new server document."""
        self.dapp.textfile = file
        self.editor.load_text(to_editor(text))
        self.editor.set_marks([])
        self.sync.state = None
        if self.dapp.client is not None and not self.dapp.client.closed:
            self.attach()
        self.update_status()

    def after_save(self) -> None:
        self.update_status()

    def on_mount(self) -> None:
        self.query_one(Banner).hide()
        self.run_info = RunInfo(mode=mode_label(self.dapp.settings.mode))
        self.watch_phase("idle")
        self.update_status()

    # -- phases ----------------------------------------------------------------------------------------------

    def watch_phase(self, phase: str) -> None:
        editing = phase == "idle"
        self.editor.display = editing
        self.canvas.display = not editing
        self.query_one(ModeLine).display = not editing
        (self.editor if editing else self.canvas).focus()
        self.set_run(phase=phase)
        self.update_status()
        self.refresh_bindings()

    # -- connection --------------------------------------------------------------------------------------------

    @on(Connecting)
    def _connecting(self, msg: Connecting) -> None:
        if msg.lost is None:
            self.query_one(Banner).show(f"{msg.detail}…", "info")
        else:
            self.query_one(Banner).show(f"⚠ {msg.lost}. {msg.detail}… You can keep editing and saving.", "error")
        self.set_run(connection="starting")
        self.update_status()

    @on(Connected)
    def _on_connected(self, msg: Connected) -> None:
        self.query_one(Banner).hide()
        self.set_run(connection="connected", model=msg.welcome.model.name)
        self.update_status()
        self.attach()

    @on(Disconnected)
    def _on_disconnected(self, msg: Disconnected) -> None:
        retry = f" Retrying in {msg.retry_in:g} s." if msg.retry_in is not None else ""
        self.query_one(Banner).show(f"⚠ {msg.reason}.{retry} You can keep editing and saving.", "error")
        self.set_run(connection="offline")
        if self.phase == "proposal":
            self.notify("The proposal was lost with the connection; generate again once reconnected.")
            self._end_run()
        self.update_status()

    @work(group="doc", exit_on_error=False)
    async def attach(self) -> None:
        client = self.dapp.client
        if client is None:
            return
        text = self.editor.doc_text
        with self._report("Opening the document on the server"):
            state = await self.sync.attach(client, text, self.dapp.textfile.name)
            self.post_message(DocUpdated(state, sent=text))

    # -- document states ---------------------------------------------------------------------------------------

    def on_state(self, state: DocState) -> None:
        """The client's callback (on its reader task) for every doc.state; only broadcasts matter here."""
        if state.re is None:
            self.post_message(DocUpdated(state, sent=None))

    @on(DocUpdated)
    def _doc_updated(self, msg: DocUpdated) -> None:
        state = msg.state
        if msg.sent is None:  # a broadcast
            if self.sync.lock.locked():
                self.sync.deferred = state  # a reply is on its way; look at this one after it
                return
            old = self.sync.state
            if not self.sync.adopt(state):
                return
            base = old.text if old is not None else state.text
        else:
            base = msg.sent
        editor = self.editor
        now = editor.doc_text
        merged, clean = merge_remote(base, state.text, now)
        if merged != now:
            editor.set_doc_text(merged)
        marks = marks_for(state)
        local = text_change(state.text, merged)
        if local is not None:
            marks = [(*shift_span(s, e, local), k) for s, e, k in marks]
        editor.set_marks(marks)
        self.sync.shown()
        if not clean:
            self.notify("Another change overlapped your latest typing; the server's text was kept.", severity="warning")
        self.update_status()

    # -- typing ----------------------------------------------------------------------------------------------

    @on(TextArea.Changed)
    def _changed(self) -> None:
        if self._push_timer is not None:
            self._push_timer.stop()
        self._push_timer = self.set_timer(PUSH_DELAY_S, self.push_text)
        self.update_status()

    @on(TextArea.SelectionChanged)
    def _moved(self) -> None:
        self.update_status()

    @work(group="doc", exit_on_error=False)
    async def push_text(self) -> None:
        if not self.sync.ready:
            return  # offline: the text is sent when the connection comes back (attach)
        before = self.sync.state.v if self.sync.state is not None else -1
        with self._report("Sending your edit"):
            # The text is read when the push's turn comes: read now, it could be one an undo already replaced.
            sent, state = await self.sync.push(lambda: self.editor.doc_text)
            if state.v != before:
                self.post_message(DocUpdated(state, sent=sent))
        self._after_request()

    @work(group="doc", exit_on_error=False)
    async def apply_ops(self, what: str, ops: Sequence[EditOp]) -> None:
        sent = self.editor.doc_text
        with self._report(what):
            state = await self.sync.edit(sent, ops)
            self.post_message(DocUpdated(state, sent=sent))
        self._after_request()

    # -- pins, masks, gaps -------------------------------------------------------------------------------------

    def _selection(self, what: str) -> tuple[int, int] | None:
        start, end = self.editor.selected_range
        if start == end:
            self.notify(f"Select the text to {what} first (Shift+arrows, or drag with the mouse).")
            return None
        return start, end

    def action_mask(self) -> None:
        sel = self._selection("mask")
        if sel is not None and self._connected():
            self.apply_ops("Masking", self._in_window(*sel, [MaskOp(start=sel[0], end=sel[1])]))

    def action_pin(self) -> None:
        sel = self._selection("pin")
        if sel is not None and self._connected():
            self.apply_ops("Pinning", self._in_window(*sel, [PinOp(start=sel[0], end=sel[1])]))

    def action_unmark(self) -> None:
        if not self._connected():
            return
        start, end = self.editor.selected_range
        if start == end:  # no selection: the free span (or gap) under the cursor
            hit = [(s, e) for s, e, k in self.editor.marks if k != "outside" and s <= start <= e]
            if not hit:
                self.notify("Nothing masked at the cursor.")
                return
            start, end = hit[0]
        # Unmask keeps the text (it is pinned again) and drops gaps at its ends; Unpin would free the text instead.
        self.apply_ops("Unmasking", [UnmaskOp(start=start, end=end)])

    def action_gap(self) -> None:
        if not self._connected():
            return
        at = self.editor.selected_range[1]
        n = self.dapp.settings.gap_tokens

        def answer(value: str | None) -> None:
            if value is None:
                return
            if not value.isdigit() or not 1 <= int(value) <= 256:
                self.notify(f"A gap is 1 to 256 tokens, not {value!r}.", severity="warning")
                return
            self.apply_ops("Inserting a gap", self._in_window(at, at, [InsertGapOp(at=at, n_tokens=int(value))]))

        self.app.push_screen(PromptScreen("New tokens to insert at the cursor (1–256):", str(n)), answer)

    def action_move_window(self) -> None:
        if self._connected():
            at = self.editor.selected_range[0]
            self.apply_ops("Moving the window", [MoveWindowOp(start=self._window_start_for(at))])

    def action_undo(self) -> None:
        if self._connected():
            self.history(redo=False)

    def action_redo(self) -> None:
        if self._connected():
            self.history(redo=True)

    @work(group="doc", exit_on_error=False)
    async def history(self, redo: bool) -> None:
        sent = self.editor.doc_text
        try:
            state = await self.sync.history(sent, redo)
            self.post_message(DocUpdated(state, sent=sent))
        except ProtocolError as e:
            if e.code == "conflict":
                self.post_message(Problem(f"Nothing to {'redo' if redo else 'undo'}.", "information"))
            else:
                self.post_message(Problem(f"{'Redo' if redo else 'Undo'}: {e.message}"))
        except (ConnectionLost, ConnectionError, OSError) as e:
            self.post_message(Problem(f"{'Redo' if redo else 'Undo'}: no server connection ({e})"))
        self._after_request()
