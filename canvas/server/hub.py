"""The server's state and request handlers: sessions, live documents, generations, proposals.

Owns every document that a session has open (`LiveDoc`: the `canvas.document.Document`, its change log, its
subscribers, its running generation and pending proposals), the generations (`canvas.server.gens`) and the
proposals they leave (`canvas.server.proposals`). Handlers take a parsed request and either return the reply or
raise (`ProtocolError`, or a domain error that `canvas.protocol.error_for_exception` maps to a code); `handle`
sends one or the other with `re`.

Invariants:
- One `asyncio.Lock` per document serialises its mutations (`locked`); a mutation is acknowledged (reply and
  broadcast) only after `Store.save` has returned (or raised `CommitUnknown`, a connection lost during COMMIT, and
  the store, read back, shows it saved), so a `kill -9` loses no acknowledged change and a retry never makes one
  twice. A change is refused as "nothing changed" only when the store shows it was not made; while that cannot be
  told the client hears so (`outcome_unknown`), and memory keeps nothing the store may not hold (`LiveDoc.dirty`:
  reloaded before the next request acts on it). The save carries the change's measure and the moved proposals
  too, so a restarted server rebases exactly as this one would.
- Every change is measured (`rebase.diff`) and recorded with the version it made; edits against an old version are
  rebased over those changes or refused with `stale_version`. A change that overlaps a running generation's region
  stops it (`stale`); one that overlaps a pending proposal makes accepting it fail with `stale_version`.
- The engine never waits on a session: generations report through their session's `Outbox`.
- With a store that several server processes share (`canvas.store.base.SharedStore`: PostgreSQL), `locked` also takes
  the document's cross-process lock and, when another process has written the document since this one read it,
  brings the `LiveDoc` up to date in place first (`canvas.server.peers`). So versions stay monotonic and edits
  serialised per document across processes, and each request acts on the latest state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any

from canvas import __version__
from canvas.document import Document, InsertGap, Mask, MoveWindow, Op, Pin, Replace, Unmask, Unpin
from canvas.engine.backend import Backend
from canvas.protocol import (
    PROTOCOL,
    Ack,
    ClientRequest,
    DefaultModes,
    DocClose,
    DocDelete,
    DocDeleted,
    DocEdit,
    DocList,
    DocListing,
    DocOpen,
    DocState,
    DocSummary,
    EditOp,
    ErrorCode,
    GenDefaults,
    Hello,
    HistoryRedo,
    HistoryUndo,
    InsertGapOp,
    MaskOp,
    ModelInfo,
    MoveWindowOp,
    Ping,
    PinOp,
    Pong,
    ProtocolError,
    ReplaceOp,
    ServerInfo,
    ServerLimits,
    ServerReply,
    Span,
    UnmaskOp,
    UnpinOp,
    Welcome,
    Window,
    error_for_exception,
)
from canvas.sampling.modes import LABELS
from canvas.server.admission import Admission, Admits
from canvas.server.gens import Generations
from canvas.server.peers import Peers
from canvas.server.persist import (
    RESOLVE_S,
    encode_change,
    load_live,
    outcome_unknown,
    positions,
    unavailable,
    write_failed,
)
from canvas.server.proposals import Proposals, compose
from canvas.server.rebase import Change, ChangeLog, diff, rebase_ops, rebase_range
from canvas.server.security import authorized
from canvas.server.state import LiveDoc, Session, snapshot
from canvas.store.base import CommitUnknown, DocStore, DocumentNotFound

log = logging.getLogger("canvas.server")
__all__ = ["Hub", "compose", "to_doc_op"]  # compose lives in canvas.server.proposals; importing it here still works


def to_doc_op(op: EditOp) -> Op:
    match op:
        case ReplaceOp():
            return Replace(op.start, op.end, op.text)
        case PinOp():
            return Pin(op.start, op.end)
        case UnpinOp():
            return Unpin(op.start, op.end)
        case MaskOp():
            return Mask(op.start, op.end)
        case UnmaskOp():
            return Unmask(op.start, op.end)
        case InsertGapOp():
            return InsertGap(op.at, op.n_tokens)
        case MoveWindowOp():
            return MoveWindow(op.start)
    raise TypeError(f"not an edit op: {op!r}")  # pragma: no cover - the union is closed


def _length_after(length: int, ops: list[EditOp]) -> int:
    for op in ops:
        if isinstance(op, ReplaceOp):
            length += len(op.text) - (min(op.end, length) - min(op.start, length))
    return length


class Hub:
    def __init__(self, backend: Backend, store: DocStore, limits: ServerLimits, token: str | None = None,
                 admission: Admits | None = None) -> None:
        self.backend, self.store, self.limits, self.token = backend, store, limits, token
        self.peers = Peers(self)  # other server processes sharing the store (PostgreSQL), if any
        self.admission: Admits = admission if admission is not None else Admission(backend.engine)
        self.sessions: dict[str, Session] = {}
        self.docs: dict[str, LiveDoc] = {}
        self.gens = Generations(self)
        self.proposals = Proposals(self)
        self._load_lock = asyncio.Lock()
        self.resolve_s = RESOLVE_S  # how long a COMMIT that lost its connection waits to learn its outcome
        # (session, document) -> (request, its save) of a change whose outcome the store could not tell (`_repeat`)
        self._unsure: dict[tuple[str, str], tuple[Hashable, CommitUnknown]] = {}
        self._handlers: dict[str, Callable[[Session, Any], Awaitable[ServerReply | None]]] = {
            "hello": self._hello,
            "doc.open": self._doc_open,
            "doc.close": self._doc_close,
            "doc.delete": self._doc_delete,
            "doc.edit": self._doc_edit,
            "doc.list": self._doc_list,
            "history.undo": self._undo,
            "history.redo": self._redo,
            "gen.start": self.gens.start,
            "gen.cancel": self.gens.cancel,
            "proposal.accept": self.proposals.accept,
            "proposal.reject": self.proposals.reject,
            "ping": self._ping,
        }

    # -- sessions --------------------------------------------------------------------------------------------

    def open_session(self, session: Session) -> None:
        self.sessions[session.id] = session

    def close_session(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        for key in [k for k in self._unsure if k[0] == session.id]:
            del self._unsure[key]
        self.gens.stop_session(session)
        for doc_id in list(session.docs):
            live = self.docs.get(doc_id)
            if live is not None:  # its proposals stay: it may come back (or anyone may settle them now)
                live.subscribers.discard(session)
                self.maybe_unload(live)
        session.docs.clear()

    async def handle(self, session: Session, msg: ClientRequest) -> None:
        """Run one request; send its reply or its error (with `re`)."""
        try:
            if not session.hello and not isinstance(msg, Hello):
                raise ProtocolError(ErrorCode.UNAUTHORIZED, "send hello first")
            reply = await self._handlers[msg.type](session, msg)  # type: ignore[attr-defined]
            if reply is not None:
                session.send(reply.model_copy(update={"re": msg.id}))
        except Exception as e:  # every failure becomes a typed error; the connection stays open
            err = unavailable(e, msg.id) if write_failed(e) else error_for_exception(e, msg.id)
            if err.code is ErrorCode.INTERNAL:
                log.exception("session %s: %s failed", session.id, getattr(msg, "type", "?"))
            session.send(err.to_message())

    # -- documents -------------------------------------------------------------------------------------------

    def state(self, live: LiveDoc) -> DocState:
        doc = live.doc
        start, end = doc.window()
        return DocState(
            doc_id=doc.doc_id,
            v=doc.version,
            name=live.name,
            text=doc.text,
            window=Window(start=start, end=end),
            spans=[Span(kind=s.kind, start=s.start, end=s.end, slots=s.slots) for s in doc.spans()],
            can_undo=doc.can_undo,
            can_redo=doc.can_redo,
            gen=None if live.run is None else live.run.id,
        )

    def broadcast(self, live: LiveDoc, exclude: Session | None = None) -> None:
        msg = self.state(live)
        for s in list(live.subscribers):
            if s is not exclude:
                s.send(msg)

    async def live(self, doc_id: str) -> LiveDoc:
        """The document in memory, loaded from the store if needed; `DocumentNotFound` if there is none."""
        live = self.docs.get(doc_id)
        if live is not None:
            return live
        async with self._load_lock:  # two sessions opening one document must share one LiveDoc
            live = self.docs.get(doc_id)
            if live is None:
                live = await asyncio.to_thread(load_live, self.store, doc_id, self.backend.tokenizer)
                self.docs[doc_id] = live
            return live

    @contextlib.asynccontextmanager
    async def locked(self, doc_id: str) -> AsyncIterator[LiveDoc]:
        """The document in memory with its lock held. A `LiveDoc` can be unloaded or deleted while a request waits
        for its lock; the request then loads the document again (`DocumentNotFound` once it is deleted)."""
        while True:
            live = await self.live(doc_id)
            async with live.lock:
                if self.docs.get(doc_id) is not live:
                    continue
                async with self.peers.guard(live):
                    if self.docs.get(doc_id) is not live:  # another process deleted it (`Peers.refresh`)
                        raise DocumentNotFound(doc_id)
                    if live.dirty:  # memory may hold a change the store refused: act on what the store holds
                        await self._reload(live)
                    yield live
                    return

    def maybe_unload(self, live: LiveDoc) -> None:
        # Pending proposals do not keep a document in memory: they are in the store and load with it.
        if not live.subscribers and live.run is None and self.docs.get(live.doc_id) is live:
            del self.docs[live.doc_id]

    async def mutate(
        self,
        live: LiveDoc,
        apply: Callable[[], object],
        ops_json: list[Any],
        session: Session | None,
        *,
        accepting: str | None = None,
        retry: Hashable | None = None,
    ) -> Change | None:
        """Apply a change under the document's lock (held by the caller), then measure, save and broadcast it.
        `accepting`: the gen whose proposal the change applies (settled in the same transaction). `retry`: what
        identifies the request (`_repeat`), should the store fail in a way that leaves it unknown if it saved."""
        doc = live.doc
        before = doc.version
        self.gens.before_change(live)
        apply()  # raises on bad input and then leaves the document as it was
        if doc.version == before:  # a no-op is not a change: nothing to save or tell anyone
            if accepting is not None:  # but the proposal it applied is settled all the same
                await asyncio.to_thread(self.store.resolve_proposal, doc.doc_id, accepting, "accepted")
                del live.proposals[accepting]
            return None
        after = snapshot(doc)
        change = diff(live.snap, after)
        live.snap = after
        live.log.record(doc.version, change)
        if accepting is not None:
            del live.proposals[accepting]
            live.unsaved[accepting] = "accepted"
        if change is not None:
            self.gens.after_change(live, change)
            for p in live.proposals.values():
                moved = None if p.stale else rebase_range(p.start, p.end, [change])
                if moved is None:
                    p.stale = True
                else:
                    p.start, p.end = moved
        state = doc.to_dict()
        # If the store cannot write (`write_failed`: I/O error, full disk) the document is rolled back to what the
        # store holds and the request gets a retryable `busy`: nobody is told of the change, and a retry makes it
        # once (keeping it in memory would have a retry apply it twice, and lose it at the next restart).
        settled = dict(live.unsaved)
        try:
            unknown = await self._save(
                doc.doc_id, doc.version, state, ops_json, name=live.name, chars=len(doc.text),
                change=encode_change(change), positions=positions(live), resolved=settled,
            )  # fmt: skip
        except Exception as e:
            if not write_failed(e):
                raise
            await self._roll_back(live, accepting)  # the store shows nothing of it: neither may memory
            raise
        if unknown is not None:  # it may or may not be stored: memory keeps nothing of it, the retry is checked
            if session is not None and retry is not None:
                self._unsure[(session.id, doc.doc_id)] = (retry, unknown)
            self._stale(live, accepting)
            raise outcome_unknown(unknown)
        for gen in settled:
            live.unsaved.pop(gen, None)
        self.broadcast(live, exclude=session)
        return change

    async def _save(self, *args: Any, **kwargs: Any) -> CommitUnknown | None:
        """`store.save` (in a thread). A COMMIT that lost its connection (`CommitUnknown`) is read back from the store
        before anyone is told anything: made, this returns None as for a save that returned; not made, it raises
        as any failed save (nothing changed); still unknown after `resolve_s`, it returns the `CommitUnknown`."""
        try:
            await asyncio.to_thread(self.store.save, *args, **kwargs)
        except CommitUnknown as e:
            made = await self._outcome(e)
            if made is None:
                return e
            if not made:
                raise
            log.warning("document %s: v%s was saved although the connection was lost at COMMIT", e.doc_id, e.v)
        return None

    async def _outcome(self, unknown: CommitUnknown) -> bool | None:
        """Whether the save that raised `unknown` was made, read back while the store restarts (None: still unknown
        after `resolve_s`). Holding the document's lock meanwhile: nothing may act on a version of unknown fate."""
        deadline = time.monotonic() + self.resolve_s
        delay = 0.05
        while True:
            try:
                return bool(await asyncio.to_thread(self.store.committed, unknown))
            except Exception as e:
                if not write_failed(e):
                    raise
            if time.monotonic() + delay > deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def _repeat(self, session: Session, live: LiveDoc, retry: Hashable) -> bool:
        """Whether this request repeats one of the session's whose outcome the store could not tell, and which the
        store now shows made (the answer was lost, not the change): then it is acknowledged, not made again."""
        key = (session.id, live.doc_id)
        unsure = self._unsure.pop(key, None)
        if unsure is None or unsure[0] != retry:
            return False
        try:
            return bool(await asyncio.to_thread(self.store.committed, unsure[1]))
        except Exception as e:
            if write_failed(e):  # still cannot tell: the next retry asks again
                self._unsure[key] = unsure
            raise

    async def _roll_back(self, live: LiveDoc, accepting: str | None) -> None:
        """The store did not save a change `mutate` made in memory: put the document back as the store has it (in
        place, like `Peers.refresh`), so that nobody sees a change that was refused and a retry applies it once. A
        generation running on it stops as `unavailable` (its region may have moved over the change). When the store
        cannot be read either, the document is reloaded before its next request (`LiveDoc.dirty`)."""
        try:
            await self._reload(live, accepting)
        except Exception:
            log.warning("document %s: could not roll back a change the store refused; reloading it later", live.doc_id)
            self._stale(live, accepting)
            return
        if live.run is not None:
            live.run.stop("unavailable", "the document store could not save a change to the document; retry")

    def _stale(self, live: LiveDoc, accepting: str | None) -> None:
        """Memory holds a change the store may not: reload before the next request (`locked`); stop a generation."""
        if accepting is not None:
            live.unsaved.pop(accepting, None)  # still pending in the store (or settled there: the reload says)
        live.dirty = True
        if live.run is not None:
            live.run.stop("unavailable", "the document store could not save a change to the document; retry")

    async def _reload(self, live: LiveDoc, accepting: str | None = None) -> None:
        """The document as the store has it, in place (the same object, lock and subscribers)."""
        if accepting is not None:
            live.unsaved.pop(accepting, None)  # still pending in the store: pending here again
        fresh = await asyncio.to_thread(load_live, self.store, live.doc_id, self.backend.tokenizer)
        live.doc, live.name, live.snap, live.log = fresh.doc, fresh.name, fresh.snap, fresh.log
        live.proposals = {g: p for g, p in fresh.proposals.items() if g not in live.unsaved}
        live.dirty = False

    def _subscribe(self, session: Session, live: LiveDoc) -> None:
        if live.doc_id not in session.docs and len(session.docs) >= self.limits.max_open_docs:
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"a session may have {self.limits.max_open_docs} documents open; close one"
            )
        session.docs.add(live.doc_id)
        live.subscribers.add(session)

    # -- handlers --------------------------------------------------------------------------------------------

    async def _hello(self, session: Session, msg: Hello) -> Welcome:
        if session.hello:
            raise ProtocolError(ErrorCode.CONFLICT, "hello was already sent on this connection")
        if msg.protocol != PROTOCOL:
            session.close_after = (4409, "unsupported protocol")
            raise ProtocolError(ErrorCode.UNSUPPORTED_PROTOCOL, f"this server speaks {PROTOCOL}, not {msg.protocol!r}")
        presented = session.offered_tokens if msg.token is None else (msg.token, *session.offered_tokens)
        if not authorized(presented, self.token):
            session.close_after = (1008, "unauthorized")
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong token")
        session.hello = True
        b = self.backend
        d = b.sampler_defaults
        return Welcome(
            session=session.id,
            server=ServerInfo(name="dcanvas", version=__version__),
            model=ModelInfo(
                name=b.name, canvas_length=b.canvas_length, modes=list(b.modes),  # type: ignore[arg-type]
                defaults=GenDefaults(**{k: getattr(d, k) for k in GenDefaults.model_fields}),
                default_modes=DefaultModes(infill=b.mode_defaults.infill, continuation=b.mode_defaults.continuation),
                labels=dict(LABELS),
            ),
            limits=self.limits.to_wire(),
        )

    async def _doc_open(self, session: Session, msg: DocOpen) -> DocState:
        if msg.doc_id is not None:
            async with self.locked(msg.doc_id) as live:
                self._subscribe(session, live)
                if msg.name is not None and msg.name != live.name:
                    state = live.doc.to_dict()
                    unknown = await self._save(
                        live.doc_id, live.doc.version, state, None, name=msg.name, chars=len(live.doc.text)
                    )
                    if unknown is not None:
                        live.dirty = True  # the name is the store's to say
                        raise outcome_unknown(unknown)
                    live.name = msg.name  # only once stored: a refused save leaves the old name
                return self.state(live)
        text = msg.text or ""
        if len(text) > self.limits.max_doc_chars:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a document may hold {self.limits.max_doc_chars} characters")
        if await asyncio.to_thread(self.store.count) >= self.limits.max_docs:
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"the server holds its maximum of {self.limits.max_docs} documents"
            )
        if len(session.docs) >= self.limits.max_open_docs:
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"a session may have {self.limits.max_open_docs} documents open; close one"
            )
        doc = Document(self.backend.tokenizer, text, config=self.backend.document_config(), doc_id=secrets.token_hex(8))
        live = LiveDoc(doc, msg.name or "", snapshot(doc), ChangeLog(doc.version))
        unknown = await self._save(doc.doc_id, doc.version, doc.to_dict(), None, name=live.name, chars=len(doc.text))
        if unknown is not None:
            raise outcome_unknown(unknown)
        self.docs[doc.doc_id] = live
        self._subscribe(session, live)
        return self.state(live)

    async def _doc_close(self, session: Session, msg: DocClose) -> Ack:
        session.docs.discard(msg.doc_id)
        live = self.docs.get(msg.doc_id)
        if live is not None:
            live.subscribers.discard(session)
            self.maybe_unload(live)
        return Ack()

    async def _doc_delete(self, session: Session, msg: DocDelete) -> DocDeleted:
        """Delete a document. A generation running on it is cancelled rather than waited for (the document it would
        fill is gone), its pending proposals are settled as `deleted`, and every other session that has it open is
        told (`doc.deleted`) and no longer has it open."""
        async with self.locked(msg.doc_id) as live:
            v = live.doc.version
            if msg.base_v is not None and msg.base_v > v:
                raise ProtocolError(ErrorCode.INVALID_PARAMS, f"base_v: {msg.base_v} is newer than the document (v{v})")
            if msg.base_v is not None and msg.base_v != v:
                raise ProtocolError(
                    ErrorCode.STALE_VERSION,
                    f"document {live.doc_id} changed since v{msg.base_v} (it is at v{v}); read it before deleting it",
                    data={"current_v": v},
                )
            await asyncio.to_thread(self.store.delete, live.doc_id)
            return self.forget(live, session)

    def forget(self, live: LiveDoc, by: Session | None = None) -> DocDeleted:
        """A deleted document leaves memory: its generation is cancelled, its proposals settled as `deleted`, and
        every session that had it open (but `by`, which gets the reply) is told and no longer has it open."""
        # From here on nothing may touch it: requests waiting for the lock find it unloaded and then not found.
        if self.docs.get(live.doc_id) is live:
            del self.docs[live.doc_id]
        if live.run is not None:
            live.run.stop("cancelled", "the document was deleted")
        for gen in live.proposals:
            self.gens.resolved(gen, "deleted")
        live.proposals.clear()
        gone = DocDeleted(doc_id=live.doc_id)
        for s in list(live.subscribers):
            s.docs.discard(live.doc_id)
            if s is not by:
                s.send(gone)
        live.subscribers.clear()
        if by is not None:
            by.docs.discard(live.doc_id)
        return gone

    async def _doc_list(self, session: Session, msg: DocList) -> DocListing:
        records = await asyncio.to_thread(self.store.list_docs)
        docs = [DocSummary(doc_id=r.doc_id, name=r.name, v=r.v, chars=r.chars, updated=r.updated) for r in records]
        return DocListing(docs=docs)

    async def _doc_edit(self, session: Session, msg: DocEdit) -> DocState:
        async with self.locked(msg.doc_id) as live:
            retry = ("edit", msg.base_v, repr([op.model_dump() for op in msg.ops]))
            if self._unsure and await self._repeat(session, live, retry):
                return self.state(live)
            ops = self._rebased(live, msg.base_v, msg.ops)
            if _length_after(len(live.doc.text), ops) > self.limits.max_doc_chars:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"a document may hold {self.limits.max_doc_chars} characters")
            doc_ops = [to_doc_op(op) for op in ops]
            label = "+".join(op.op for op in ops)
            await self.mutate(
                live, lambda: live.doc.apply(doc_ops, label=label), [op.model_dump() for op in ops], session,
                retry=retry,
            )  # fmt: skip
            return self.state(live)

    def _rebased(self, live: LiveDoc, base_v: int, ops: list[EditOp]) -> list[EditOp]:
        v = live.doc.version
        if base_v > v:
            raise ProtocolError(ErrorCode.INVALID_PARAMS, f"base_v: {base_v} is newer than the document (v{v})")
        if base_v == v:
            return ops
        changes = live.log.since(base_v)
        moved = None if changes is None else rebase_ops(ops, changes)
        if moved is None:
            raise ProtocolError(
                ErrorCode.STALE_VERSION,
                f"document {live.doc_id} is at v{v}; the edit overlaps changes since v{base_v}",
                data={"current_v": v},
            )
        return moved

    async def _history(self, session: Session, doc_id: str, redo: bool) -> DocState:
        async with self.locked(doc_id) as live:
            kind = "redo" if redo else "undo"
            if self._unsure and await self._repeat(session, live, kind):
                return self.state(live)
            step = live.doc.redo if redo else live.doc.undo
            await self.mutate(live, step, [{"op": kind}], session, retry=kind)
            return self.state(live)

    async def _undo(self, session: Session, msg: HistoryUndo) -> DocState:
        return await self._history(session, msg.doc_id, redo=False)

    async def _redo(self, session: Session, msg: HistoryRedo) -> DocState:
        return await self._history(session, msg.doc_id, redo=True)

    async def _ping(self, session: Session, msg: Ping) -> Pong:
        return Pong()
