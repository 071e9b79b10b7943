"""`MainScreen`: the editor. Typing, pins, masks and gaps; generation with the live view; proposals; files.

Phases: `idle` (the text area has the keys), `starting`, `generating` and `cancelling` (the live canvas view is
shown, Esc cancels), `proposal` (the inline diff is shown: accept all, accept the hunks under the cursor or the
marked ones, reject, regenerate with a new seed). `check_action` enables each binding only in its phases, so the
footer shows what applies now.

All I/O runs in workers and comes back as messages (`tui.messages`) handled here. Document requests go through
`DocSync` one at a time; the generation runs in an exclusive worker (a new one cancels the old one's stream) and
every generation message carries its id, so frames of a generation that is no longer current are dropped.
Failures become a notification in words (`_report`): a typed server error, a lost connection, a file problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Iterator, Sequence
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import Footer, TextArea

from canvas.client import ConnectionLost, Generation
from canvas.protocol import (
    DocState,
    EditOp,
    GenParams,
    GenProgress,
    InsertGapOp,
    MaskOp,
    MoveWindowOp,
    PinOp,
    ProtocolError,
    UnmaskOp,
)
from tui.docsync import DocSync, merge_remote, shift_span, text_change
from tui.live import LiveCanvas, ProposalView
from tui.messages import Connected, Connecting, Disconnected, DocUpdated, GenFinished, GenFrame, GenStarted, Problem
from tui.screens.files import FileScreen
from tui.screens.prompt import PromptScreen
from tui.textfile import TextFile, to_editor
from tui.widgets.banner import Banner
from tui.widgets.canvas_view import CanvasView
from tui.widgets.editor import CanvasEditor
from tui.widgets.mode_line import ModeLine
from tui.widgets.status_bar import DocInfo, RunInfo, StatusBar

log = logging.getLogger("tui")
PUSH_DELAY_S = 0.25  # typing is sent after this pause: one edit (and one undo step) per burst
RUNNING = ("starting", "generating", "cancelling")
DONE_WORDS = {
    "cancelled": "Generation cancelled.",
    "superseded": "Generation replaced by a newer one.",
    "stale": "Generation stopped: an edit overlapped the text being generated.",
}


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


class MainScreen(FileScreen):
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
    RUN_KEYS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", tooltip="Cancel the generation (the masks stay)")
    ]
    PROPOSAL_KEYS: ClassVar[list[BindingType]] = [
        Binding("enter,a", "accept_all", "Accept all", tooltip="Accept the whole proposal (one undo step)"),
        Binding("y", "accept_part", "Accept hunk",
                tooltip="Accept only the marked hunks, or the hunk under the cursor"),
        Binding("escape,x", "reject", "Reject", tooltip="Reject the proposal (the masks stay)"),
        Binding("g,ctrl+g,f5", "regenerate", "Regenerate", tooltip="Reject it and generate again with a new seed"),
    ]  # fmt: skip
    BINDINGS: ClassVar[list[BindingType]] = EDIT_KEYS + RUN_KEYS + PROPOSAL_KEYS
    ACTION_PHASES: ClassVar[dict[str, tuple[str, ...]]] = {
        **{a: ("idle",) for a in ("generate", "mask", "pin", "gap", "unmark", "move_window", "undo", "redo",
                                   "open", "save", "save_as")},
        "cancel": ("starting", "generating"),
        **{a: ("proposal",) for a in ("accept_all", "accept_part", "reject", "regenerate")},
    }  # fmt: skip

    phase: reactive[str] = reactive("idle")

    def __init__(self, text: str = "") -> None:
        super().__init__()
        self.initial_text = text
        self.saved_text = text
        self.sync = DocSync()
        self.live: LiveCanvas | None = None
        self.proposal: ProposalView | None = None
        self.current_gen: str | None = None
        self.run_info = RunInfo()
        self._push_timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Banner(id="banner")
        yield CanvasEditor(self.initial_text, id="editor", placeholder="Type here, or open a file with Ctrl+O.")
        yield CanvasView(id="canvas")
        yield ModeLine(id="mode-line")
        yield StatusBar(id="status")
        yield Footer(compact=True, show_command_palette=False)

    @property
    def editor(self) -> CanvasEditor:
        return self.query_one(CanvasEditor)

    @property
    def canvas(self) -> CanvasView:
        return self.query_one(CanvasView)

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
        self.run_info = RunInfo(mode=self.dapp.settings.mode)
        self.watch_phase("idle")
        self.update_status()

    # -- phases ----------------------------------------------------------------------------------------------

    def watch_phase(self, phase: str) -> None:
        editing = phase == "idle"
        self.editor.display = editing
        self.canvas.display = not editing
        self.query_one(ModeLine).display = not editing
        (self.editor if editing else self.canvas).focus()
        self.run_info = _replace(self.run_info, phase=phase)
        self.update_status()
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        phases = self.ACTION_PHASES.get(action)
        return phases is None or self.phase in phases

    def update_status(self) -> None:
        ed = self.editor
        row, col = ed.cursor_location
        st = self.sync.state
        info = self.sync.describe()
        self.query_one(StatusBar).doc = DocInfo(
            name=self.dapp.textfile.name,
            dirty=ed.doc_text != self.saved_text,
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

    # -- connection --------------------------------------------------------------------------------------------

    @on(Connecting)
    def _connecting(self, msg: Connecting) -> None:
        self.query_one(Banner).show(f"{msg.detail}…", "info")
        self.run_info = _replace(self.run_info, connection="starting")
        self.update_status()

    @on(Connected)
    def _on_connected(self, msg: Connected) -> None:
        self.query_one(Banner).hide()
        self.run_info = _replace(self.run_info, connection="connected", model=msg.welcome.model.name)
        self.update_status()
        self.attach()

    @on(Disconnected)
    def _on_disconnected(self, msg: Disconnected) -> None:
        retry = f" Retrying in {msg.retry_in:g} s." if msg.retry_in is not None else ""
        self.query_one(Banner).show(f"⚠ {msg.reason}.{retry} You can keep editing and saving.", "error")
        self.run_info = _replace(self.run_info, connection="offline")
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
        if not clean:
            self.notify("Another change overlapped your latest typing; the server's text was kept.", severity="warning")
        self.update_status()

    def _after_request(self) -> None:
        deferred, self.sync.deferred = self.sync.deferred, None
        if deferred is not None and self.sync.state is not None and deferred.v > self.sync.state.v:
            self.post_message(DocUpdated(deferred, sent=None))

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
        sent = self.editor.doc_text
        before = self.sync.state.v if self.sync.state is not None else -1
        with self._report("Sending your edit"):
            state = await self.sync.push(sent)
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

    # -- generation --------------------------------------------------------------------------------------------

    def _has_free(self, cursor: int) -> bool:
        st = self.sync.state
        if st is None:
            return False
        free = [s for s in st.spans if s.kind == "free"]
        n = len(st.text)
        tail_only = len(free) == 1 and free[0].start == free[0].end == n
        return bool(free) and (not tail_only or cursor >= n or n == 0)

    def action_generate(self) -> None:
        if not self._connected():
            return
        start, end = self.editor.selected_range
        ops: list[EditOp] = []
        if end > start:
            ops = self._in_window(start, end, [MaskOp(start=start, end=end)])
        elif not self._has_free(start):
            gap = InsertGapOp(at=start, n_tokens=self.dapp.settings.gap_tokens)
            ops = self._in_window(start, start, [gap])
        self.start_generation(self.dapp.settings.gen_params(), ops)

    def start_generation(self, params: GenParams, ops: Sequence[EditOp] = (), reject: str | None = None) -> None:
        self.current_gen = None
        self.phase = "starting"
        self.run_info = _replace(self.run_info, mode=params.mode, step=None, max_steps=params.max_steps,
                                 tokens_per_forward=None, tok_s=None, seed=params.seed)  # fmt: skip
        self.update_status()
        self.generate(params, list(ops), reject)

    @work(exclusive=True, group="generate", exit_on_error=False)
    async def generate(self, params: GenParams, ops: list[EditOp], reject: str | None) -> None:
        sent = self.editor.doc_text
        gen: Generation | None = None
        try:
            if reject is not None:
                with contextlib.suppress(ProtocolError):  # already resolved: nothing to drop
                    await self.sync.reject(reject)
            state, gen = await self.sync.start(sent, params, ops)
            assert gen.accepted is not None
            self.post_message(DocUpdated(state, sent=sent))
            self.post_message(GenStarted(gen.accepted))
            async for event in gen:
                if isinstance(event, GenProgress):
                    self.post_message(GenFrame(event))
                else:
                    self.post_message(GenFinished(event.gen, event))
        except ProtocolError as e:
            self.post_message(GenFinished(None if gen is None or gen.accepted is None else gen.gen, None, e.message))
        except (ConnectionLost, ConnectionError, OSError, TimeoutError) as e:
            gen_id = None if gen is None or gen.accepted is None else gen.gen
            self.post_message(GenFinished(gen_id, None, f"lost the server connection ({e})"))
        except Exception as e:
            log.exception("generation failed")
            self.post_message(GenFinished(None, None, f"unexpected error: {type(e).__name__}: {e}"))
        finally:
            self._after_request()

    @on(GenStarted)
    def _gen_started(self, msg: GenStarted) -> None:
        acc = msg.accepted
        state = self.sync.state
        if state is None or self.phase not in RUNNING:
            return
        self.current_gen = acc.gen
        self.live = LiveCanvas(state, acc.gen, acc.params.max_steps)
        self.canvas.show(self.live)
        self.query_one(ModeLine).show_live(self.live, self.canvas.palette())
        if self.phase == "starting":
            self.phase = "generating"
        self.run_info = _replace(self.run_info, seed=acc.params.seed, step=0)
        self.update_status()
        if self.phase == "cancelling":  # Esc came before the server accepted it
            self._send_cancel(acc.gen)

    @on(GenFrame)
    def _gen_frame(self, msg: GenFrame) -> None:
        p = msg.progress
        if p.gen != self.current_gen or self.live is None:
            return  # a stale frame of an older generation
        self.live.apply(p)
        self.canvas.mark_dirty()
        self.query_one(ModeLine).show_live(self.live, self.canvas.palette())
        self.run_info = _replace(self.run_info, step=p.step, max_steps=p.max_steps,
                                 tokens_per_forward=self.live.tokens_per_forward, tok_s=self.live.tok_s)  # fmt: skip
        self.update_status()

    @on(GenFinished)
    def _gen_finished(self, msg: GenFinished) -> None:
        if msg.gen is not None and msg.gen != self.current_gen:
            return
        if self.phase not in RUNNING:
            return
        done = msg.done
        if done is None:
            self.notify(f"Generation failed: {msg.error}", severity="error", timeout=8)
            self._end_run()
            return
        s = done.stats
        self.run_info = _replace(self.run_info, step=s.steps, tokens_per_forward=s.tokens_per_forward, tok_s=s.tok_s)
        state = self.sync.state
        if done.status == "completed" and done.proposal is not None and state is not None:
            self.proposal = ProposalView(state, done.gen, done.proposal)
            self.canvas.show(self.proposal)
            self.query_one(ModeLine).show_proposal(self.proposal)
            self.phase = "proposal"
            return
        if done.status == "failed":
            self.notify(f"Generation failed: {done.message or 'no reason given'}", severity="error", timeout=8)
        else:
            self.notify(DONE_WORDS.get(done.status, f"Generation ended: {done.status}."))
        self._end_run()

    def _end_run(self) -> None:
        self.live = None
        self.proposal = None
        self.current_gen = None
        self.canvas.show(None)
        self.phase = "idle"

    def action_cancel(self) -> None:
        gen = self.current_gen
        self.phase = "cancelling"
        if gen is not None:
            self._send_cancel(gen)

    @work(group="cancel", exit_on_error=False)
    async def _send_cancel(self, gen: str) -> None:
        client = self.dapp.client
        if client is None:
            return
        with self._report("Cancelling"):
            await client.cancel(gen)  # the generation still ends with gen.done (cancelled)

    # -- proposals ---------------------------------------------------------------------------------------------

    @on(CanvasView.HunkMoved)
    def _hunk_moved(self) -> None:
        if self.proposal is not None:
            self.query_one(ModeLine).show_proposal(self.proposal)

    def action_accept_all(self) -> None:
        if self.proposal is not None:
            self.accept(self.proposal.gen, None)

    def action_accept_part(self) -> None:
        if self.proposal is not None:
            self.accept(self.proposal.gen, self.proposal.chosen())

    @work(group="doc", exit_on_error=False)
    async def accept(self, gen: str, hunks: list[int] | None) -> None:
        sent = self.editor.doc_text
        with self._report("Accepting the proposal"):
            state = await self.sync.accept(gen, hunks)
            self.post_message(DocUpdated(state, sent=sent))
        self._end_run()
        self._after_request()

    def action_reject(self) -> None:
        if self.proposal is not None:
            self.reject(self.proposal.gen)

    @work(group="doc", exit_on_error=False)
    async def reject(self, gen: str) -> None:
        with self._report("Rejecting the proposal"):
            await self.sync.reject(gen)
        self._end_run()

    def action_regenerate(self) -> None:
        if self.proposal is not None:
            gen = self.proposal.gen
            self.proposal = None
            params = self.dapp.settings.gen_params(seed=secrets.randbits(63))
            self.start_generation(params, (), reject=gen)


def _replace(info: RunInfo, **changes: object) -> RunInfo:
    return dataclasses.replace(info, **changes)  # type: ignore[arg-type]
