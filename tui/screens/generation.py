"""`GenerationScreen`: generate, watch the live view, cancel; then accept, reject or regenerate the proposal.

The generation runs in an exclusive worker (starting another cancels the old one's stream; the server supersedes
the old generation) and every message about it carries its id, so frames of a generation that is no longer
current are dropped. Accepting goes through `DocSync` like every other document request, as one undo unit.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Sequence
from typing import ClassVar

from textual import on, work
from textual.binding import Binding, BindingType

from canvas.protocol import DocState, EditOp, GenParams, GenProgress, InsertGapOp, MaskOp, ProtocolError
from canvas.protocol.client import ConnectionLost, Generation
from canvas.sampling.modes import Kind, request_kind
from tui.live import LiveCanvas, ProposalView
from tui.messages import DocUpdated, GenFinished, GenFrame, GenStarted
from tui.screens.base import RUNNING, log
from tui.screens.files import FileScreen
from tui.settings import mode_label
from tui.widgets.canvas_view import CanvasView
from tui.widgets.mode_line import ModeLine

DONE_WORDS = {
    "cancelled": "Generation cancelled.",
    "superseded": "Generation replaced by a newer one.",
    "stale": "Generation stopped: an edit overlapped the text being generated.",
    "unavailable": "Generation lost: its engine replica went away. Start it again.",
}


def state_kind(state: DocState) -> Kind:
    """Whether a generation over `state`'s window is an infill (free text with pinned text after it) or a
    continuation: the kind that decides which mode a request naming none runs in, and how it is labelled."""
    pinned = [s.kind == "pinned" for s in state.spans if s.end > s.start or s.slots > 0]
    return request_kind(pinned)


class GenerationScreen(FileScreen):
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

    def __init__(self, text: str = "") -> None:
        super().__init__(text)
        self.live: LiveCanvas | None = None
        self.proposal: ProposalView | None = None
        self.current_gen: str | None = None

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
        self.set_run(mode=mode_label(params.mode), step=None, max_steps=params.max_steps,
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
        # The mode the server resolved, named for what it runs on this kind of request.
        self.set_run(seed=acc.params.seed, step=0, mode=mode_label(acc.params.mode, state_kind(state)))
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
        self.set_run(step=p.step, max_steps=p.max_steps,
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
        self.set_run(step=s.steps, tokens_per_forward=s.tokens_per_forward, tok_s=s.tok_s)
        if s.mode is not None:  # what actually wrote the proposal (absent from older servers and when nothing ran)
            self.set_run(mode=mode_label(s.mode))
        self.update_status()
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
