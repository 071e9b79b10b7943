"""Generations: from `gen.start` to exactly one `gen.done`, each driven by its own asyncio task.

A `Run` is submitted to the engine (which steps every running canvas in one batched forward on its own thread); the
engine's events cross to the event loop with `call_soon_threadsafe` and the run's task turns them into `gen.progress`
deltas (only slots whose token, acceptance or entropy changed) on the owner's `Outbox`, then a `gen.done`. A slot an AR
frame says is not written yet holds the canvas's initial noise: it goes out as `written: false` with no token and no
text, never as the noise. Because the run is a task, the session keeps reading requests while it runs: a `gen.cancel`,
an edit that makes it stale, a new `gen.start` that supersedes it or the session closing all stop it between engine
steps (or, while it waits in the engine's queue, take it out of the queue at once), and whatever stopped it, the engine
still reports `Done` and the run still sends its one `gen.done` with the reason. Admission (`canvas.server.admission`)
may refuse a `gen.start` with `busy`; `gen.accepted` says where it queued.

While a run is going, a disjoint change may move the document on; the first such change snapshots the document
at the run's base version, so the proposal is read back against the canvas the engine actually filled. A completed
run's proposal is stored (`Proposals.add`) before its `gen.done` goes out. Every run ends with its one `gen.done`,
whatever the store does: when it cannot store the proposal, or (shared) cannot be locked or read at the run's end
(the database restarting or down), a completed run ends `unavailable` (typed, retryable) with nothing stored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from canvas.document import Document, DocumentError
from canvas.engine.core import Done, Frame, GenHandle
from canvas.protocol import (
    Ack,
    DiffSegment,
    ErrorCode,
    GenAccepted,
    GenCancel,
    GenDefaults,
    GenDone,
    GenDrafts,
    GenParams,
    GenStart,
    GenStats,
    GenStatus,
    Proposal,
    ProtocolError,
    SlotUpdate,
)
from canvas.sampling.sampler import Mode, SamplerConfig
from canvas.server.admission import Busy
from canvas.server.persist import write_failed
from canvas.server.rebase import Change, conflicts, rebase_range
from canvas.server.state import LiveDoc, PendingProposal, RecentOutcomes, Session

if TYPE_CHECKING:
    from canvas.server.hub_port import HubPort

log = logging.getLogger("canvas.server")
_UNWRITTEN = (-1, False, None)  # what `Run.shown` remembers of a slot the model has not written yet


def resolve_params(p: GenParams, defaults: SamplerConfig, mode: Mode) -> tuple[GenParams, SamplerConfig]:
    """Fill what the client left out (the model's defaults, a fresh seed; `mode`, the request's mode as the backend
    resolved it, when it named none); the params echo the resolved values."""
    d = defaults
    update: dict[str, object] = {k: getattr(d, k) for k in GenDefaults.model_fields if getattr(p, k) is None}
    if p.mode is None:
        update["mode"] = mode
    if p.seed is None:
        update["seed"] = secrets.randbits(63)
    params = p.model_copy(update=update) if update else p
    assert params.max_steps is not None and params.entropy_bound is not None
    assert params.t_max is not None and params.t_min is not None and params.mode is not None
    if params.t_max < params.t_min:  # one given, the other a default
        raise ProtocolError(ErrorCode.INVALID_PARAMS, f"t_max ({params.t_max}) must be >= t_min ({params.t_min})")
    config = dataclasses.replace(d, max_steps=params.max_steps, entropy_bound=params.entropy_bound,
                                 t_max=params.t_max, t_min=params.t_min, seed=params.seed, mode=params.mode)
    return params, config


@dataclass(eq=False)
class Run:
    id: str
    session: Session
    live: LiveDoc
    re: str | int | None
    params: GenParams
    base_v: int
    region: tuple[int, int]  # the text the generation replaces, in the current text's offsets
    pinned: tuple[bool, ...]  # per slot in use
    handle: GenHandle | None = None
    reason: GenStatus | None = None  # why we stopped it: cancelled, superseded or stale
    message: str | None = None  # what gen.done says about the reason, when there is more to say
    snapshot: Document | None = None  # the document at base_v, once it has moved on
    events: asyncio.Queue[Frame | Done] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    shown: dict[int, tuple[int, bool, float | None]] = field(default_factory=dict)

    @property
    def n_free(self) -> int:
        return self.pinned.count(False)

    def stop(self, reason: GenStatus, message: str | None = None) -> None:
        if self.reason is None:
            self.reason, self.message = reason, message
        if self.handle is not None:
            self.handle.cancel()


class Generations:
    def __init__(self, hub: HubPort) -> None:
        self.hub = hub
        self.runs: dict[str, Run] = {}
        self.outcomes = RecentOutcomes()

    # -- requests --------------------------------------------------------------------------------------------

    async def start(self, session: Session, msg: GenStart) -> None:
        hub = self.hub
        async with hub.locked(msg.doc_id) as live:
            doc = live.doc
            if msg.base_v != doc.version:
                raise ProtocolError(
                    ErrorCode.STALE_VERSION,
                    f"document {doc.doc_id} is at v{doc.version}, not v{msg.base_v}",
                    data={"current_v": doc.version},
                )
            if len(session.gens) >= hub.limits.max_gens_per_session:
                raise ProtocolError(
                    ErrorCode.BUSY, f"{len(session.gens)} generations are running on this connection; wait for one"
                )
            view = doc.canvas_view()
            if not view.free_regions:
                raise ProtocolError(
                    ErrorCode.CONFLICT, "nothing to generate: mask some text or insert a gap in the canvas window"
                )
            mode = hub.backend.mode_for(msg.params.mode, view.pinned)
            params, config = resolve_params(msg.params, hub.backend.sampler_defaults, mode)  # may refuse: first
            old: Run | None = live.run
            region = (min(r.char_start for r in view.free_regions), max(r.char_end for r in view.free_regions))
            run = Run("g-" + secrets.token_hex(6), session, live, msg.id, params, doc.version, region, view.pinned)
            request = hub.backend.request(view, config, stream_every=params.stream_every)
            loop = asyncio.get_running_loop()

            def deliver(ev: Frame | Done) -> None:  # on the engine's thread (this one for a cancel in the queue)
                try:
                    loop.call_soon_threadsafe(run.events.put_nowait, ev)
                except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                    pass

            # A refusal changes nothing: the generation it would supersede keeps running (or waiting). With remote
            # replicas this awaits one round trip under the document's lock, so no edit slips in between.
            try:
                admitted = await hub.admission.submit_async(request, deliver, owner=session.id,
                                                            replacing=None if old is None else old.handle,
                                                            affinity=doc.doc_id)
            except Busy as e:
                raise e.protocol_error() from None
            if session.id not in hub.sessions:  # it closed while a remote replica was asked: nobody to tell
                admitted.handle.cancel()
                return
            if old is not None:
                old.stop("superseded")  # if it was queued, it has already left the queue
            run.handle = admitted.handle
            self.runs[run.id] = run
            session.gens.add(run.id)
            live.run = run
            # The reply goes out before the task exists, so it precedes every progress frame.
            session.send(GenAccepted(re=msg.id, gen=run.id, doc_id=doc.doc_id, base_v=doc.version, params=params,
                                     queue_position=admitted.placement.position, est_wait_s=admitted.est_wait_s))
            run.task = asyncio.create_task(self._drive(run), name=f"dcanvas-{run.id}")
            hub.broadcast(live, exclude=session)

    async def cancel(self, session: Session, msg: GenCancel) -> Ack:
        run = self.runs.get(msg.gen)
        if run is None or run.session is not session:
            if msg.gen in self.outcomes or await asyncio.to_thread(self.hub.store.proposal, msg.gen) is not None:
                return Ack()  # already over (it left a proposal, perhaps before a restart): cancelling is idempotent
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no generation {msg.gen!r} on this connection")
        run.stop("cancelled")
        return Ack()

    # -- hooks from the hub ----------------------------------------------------------------------------------

    def stop_session(self, session: Session) -> None:
        for gen in list(session.gens):
            run = self.runs.get(gen)
            if run is not None:
                run.stop("cancelled")

    def before_change(self, live: LiveDoc) -> None:
        run: Run | None = live.run
        if run is not None and run.snapshot is None and live.doc.version == run.base_v:
            run.snapshot = Document.from_dict(live.doc.to_dict(), self.hub.backend.tokenizer)

    def after_change(self, live: LiveDoc, change: Change) -> None:
        run: Run | None = live.run
        if run is None or run.reason is not None:
            return
        if conflicts(run.region[0], run.region[1], change):
            run.stop("stale")
        else:
            moved = rebase_range(run.region[0], run.region[1], [change])
            assert moved is not None
            run.region = moved

    def after_remote_change(self, live: LiveDoc, old: Document, changes: list[Change] | None) -> None:
        """Another server process moved the document on from `old` (now replaced in `live`) by `changes` (None: it
        cannot say how): the running generation moves over them, or stops as stale, as for changes made here."""
        run: Run | None = live.run
        if run is None or run.reason is not None:
            return
        if run.snapshot is None and old.version == run.base_v:
            run.snapshot = old  # no longer changed by anyone: the canvas the engine fills is read back against it
        if changes is None:
            run.stop("stale", "the document was changed through another server")
            return
        for change in changes:
            self.after_change(live, change)

    def resolved(self, gen: str, outcome: str) -> None:
        self.outcomes.note(gen, outcome)

    def outcome(self, gen: str) -> str | None:
        return self.outcomes.get(gen)

    # -- the run's task --------------------------------------------------------------------------------------

    async def _drive(self, run: Run) -> None:
        try:
            while True:
                ev = await run.events.get()
                if isinstance(ev, Frame):
                    self._progress(run, ev)
                else:
                    await self._finish(run, ev)
                    return
        except asyncio.CancelledError:
            if run.handle is not None:
                run.handle.cancel()
            raise
        except Exception:
            log.exception("generation %s failed in the server", run.id)
            self._close(run, "failed", None, None, "internal server error")

    def _progress(self, run: Run, frame: Frame) -> None:
        text = self.hub.backend.token_text
        slots: list[SlotUpdate] = []
        accepted = 0
        written = frame.written
        for k, pinned in enumerate(run.pinned):
            if pinned:
                continue
            if written is not None and not written[k]:  # still the canvas's noise: no token, no text
                if run.shown.get(k) != _UNWRITTEN:
                    run.shown[k] = _UNWRITTEN
                    slots.append(SlotUpdate(i=k, token=-1, text="", entropy=None, accepted=False, written=False))
                continue
            token, ok = int(frame.draft[k]), bool(frame.accepted[k])
            e = float(frame.entropy[k])
            entropy = round(e, 3) if math.isfinite(e) and e >= 0 else None
            accepted += ok
            key = (token, ok, entropy)
            if run.shown.get(k) != key:
                run.shown[k] = key
                slots.append(SlotUpdate(i=k, token=token, text=text(token), entropy=entropy, accepted=ok))
        run.session.outbox.progress(
            run.id,
            re=run.re,
            step=frame.step,
            max_steps=frame.max_steps,
            slots=slots,
            accepted=accepted,
            free=run.n_free,
            elapsed_s=frame.elapsed_s,
            drafts=self._drafts(run, frame),
        )

    def _drafts(self, run: Run, frame: Frame) -> GenDrafts | None:
        """The frame's AR drafts as texts, or None when it has none (or they lie outside the slots in use)."""
        d = frame.drafts
        if d is None or d.end > len(run.pinned):
            return None
        text = self.hub.backend.token_text
        texts = ["".join(text(t) for t in lane) for lane in d.tokens]
        kept = None
        if d.chosen is not None:
            kept = "".join(text(t) for t in d.tokens[d.chosen][: d.length])
        return GenDrafts(start=d.start, end=d.end, texts=texts, tokens=len(d.tokens[0]) if d.tokens else 0,
                         lead=d.lead, chosen=d.chosen, kept=kept)

    async def _finish(self, run: Run, done: Done) -> None:
        live = run.live
        async with live.lock:
            try:
                async with self.hub.peers.guard(live):  # up to date with other server processes (a shared store)
                    status, proposal, message = await self._outcome(run, done)
                    self._close(run, status, proposal, done, message)
            except Exception as e:
                # The shared store's lock or catch-up failed (the database restarting or down, or another server
                # holding the document too long): the generation still ends, typed and retryable, with nothing
                # saved. After its gen.done went out (only the unlock failed) there is nothing left to tell.
                busy = isinstance(e, ProtocolError) and e.code is ErrorCode.BUSY
                if not (busy or write_failed(e)):
                    raise
                if run.id in self.runs:
                    log.warning("generation %s: the document store is unavailable: %s", run.id, e)
                    status, proposal, message = await self._outcome(run, done, store=False)
                    self._close(run, status, proposal, done, message)

    async def _outcome(self, run: Run, done: Done, *, store: bool = True) -> tuple[GenStatus, Proposal | None,
                                                                                    str | None]:
        """How the generation ended, under the document's lock: a completed one's proposal is stored first; without
        the `store` (it cannot be locked or read), a completed one ends `unavailable` and the others as they are."""
        status: GenStatus = run.reason or done.status
        if run.session.id not in self.hub.sessions:
            status = "cancelled"  # its session is gone: nobody could accept a proposal
        proposal: Proposal | None = None
        message: str | None = run.message
        if status == "completed" and not store:
            status, message = "unavailable", "the document store is unavailable: nothing was saved; retry"
        elif status == "completed":
            try:
                proposal = await self._proposal(run, done)
            except DocumentError as e:
                log.warning("generation %s: no proposal: %s", run.id, e)
                status, message = "failed", f"the generation could not be read back: {e}"
            except Exception as e:  # the store could not keep the proposal: retryable, nothing was changed
                if not write_failed(e):
                    raise
                log.warning("generation %s: the store could not save its proposal: %s", run.id, e)
                status, message = "unavailable", "the document store could not save the proposal; retry"
        elif status == "failed":
            message = (done.error or "the engine failed")[:300]
        elif status == "unavailable":  # its replica died, or the store refused a change: retryable, nothing lost
            message = run.message or (done.error or "the engine replica went away")[:300]
        elif status == "stale":
            message = "an edit overlapped the text being generated"
        return status, proposal, message

    async def _proposal(self, run: Run, done: Done) -> Proposal:
        live, backend = run.live, self.hub.backend
        if not done.canvases:
            raise DocumentError("the engine returned no canvas")
        source = live.doc if live.doc.version == run.base_v else run.snapshot
        assert source is not None  # taken by before_change when the document first moved on
        made = backend.proposal(source, done.canvases[0][: len(run.pinned)])
        start, end = run.region  # the same span as made.start/end, moved over later disjoint changes
        # Stored before gen.done goes out: a client that saw the proposal can accept it even after a kill -9.
        await self.hub.proposals.add(live, PendingProposal(run.id, run.session.id, made, start, end))
        segments = [DiffSegment(op=c.op, text=c.text) for c in made.diff]
        return Proposal(base_v=live.doc.version, start=start, end=end, text=made.new_text, diff=segments)

    def _close(
        self, run: Run, status: GenStatus, proposal: Proposal | None, done: Done | None, message: str | None
    ) -> None:
        live = run.live
        if self.runs.pop(run.id, None) is None:
            return  # closed already: a generation gets exactly one gen.done
        run.session.gens.discard(run.id)
        self.resolved(run.id, status if proposal is None else "pending")
        was_current = live.run is run
        if was_current:
            live.run = None
        stats = GenStats(
            steps=done.steps if done else 0,
            tokens_per_forward=round(done.tokens_per_forward, 4) if done else 0.0,
            tok_s=round(done.tok_s, 2) if done else 0.0,
            wall_s=round(done.wall_s, 4) if done else 0.0,
            mode=done.mode if done else None,
        )
        msg = GenDone(re=run.re, gen=run.id, doc_id=live.doc_id, status=status, proposal=proposal, stats=stats)
        run.session.send(msg if message is None else msg.model_copy(update={"message": message}))
        if was_current:
            self.hub.broadcast(live)
        self.hub.maybe_unload(live)

    async def shutdown(self) -> None:
        tasks = [r.task for r in self.runs.values() if r.task is not None]
        for run in list(self.runs.values()):
            run.stop("cancelled")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
