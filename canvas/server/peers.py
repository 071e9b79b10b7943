"""Other server processes serving the same documents: what a server does when its store is shared (PostgreSQL).

Owns the cross-process side of a document's lock (`Peers.guard`) and keeping this process's `LiveDoc`s up to date
with what the other processes write (`refresh`, and `follow` for the store's notifications). With a store that only
this process uses (SQLite), `guard` does nothing and `follow` listens to nothing.

Invariants:
- `guard` is entered with the document's `asyncio.Lock` held (`Hub.locked`, `Generations._finish`): inside it this
  process holds the document's cross-process lock too, and `live` is as the store has it. So a change made inside
  is made on the latest version and saved before any other process can change the document: versions stay
  monotonic and edits serialised per document across processes, and a save never races another's.
- `refresh` changes the `LiveDoc` in place (the same object, lock and subscribers): a running generation moves over
  the other process's changes or stops as `stale`, exactly as for a change made here, and subscribers get the new
  state. A document another process deleted leaves memory as if deleted here (`Hub.forget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from canvas.protocol import ErrorCode, ProtocolError
from canvas.server.persist import load_live, write_failed
from canvas.server.state import LiveDoc
from canvas.store.base import DocumentNotFound, SharedStore

if TYPE_CHECKING:
    from canvas.server.hub_port import HubPort

log = logging.getLogger("canvas.server")
LOCK_WAIT_S = 10.0  # how long a request waits for another server process to release a document


class Peers:
    def __init__(self, hub: HubPort) -> None:
        self.hub = hub
        self.shared: SharedStore | None = hub.store if isinstance(hub.store, SharedStore) else None
        self._catching_up: set[str] = set()  # documents with a catch-up task pending

    @contextlib.asynccontextmanager
    async def guard(self, live: LiveDoc) -> AsyncIterator[None]:
        """The document's cross-process lock, with `live` brought up to date if another process wrote it since
        this one read it (the caller holds `live.lock`). Without a shared store: nothing to do."""
        shared = self.shared
        if shared is None:
            yield
            return
        # Only ever tried (canvas.store.pg): waiting on the connection would stall this process's other documents.
        delay, waited = 0.002, 0.0
        while not await asyncio.to_thread(shared.try_lock, live.doc_id):
            if waited > LOCK_WAIT_S:
                raise ProtocolError(ErrorCode.BUSY, f"document {live.doc_id} is held by another server; retry")
            await asyncio.sleep(delay)
            waited += delay
            delay = min(0.05, delay * 2)
        try:
            if await asyncio.to_thread(shared.changed, live.doc_id):
                await self.refresh(live)
            yield
        finally:  # shielded: a cancelled request must still release the lock (the thread runs to the end)
            await asyncio.shield(asyncio.to_thread(shared.unlock, live.doc_id))

    async def refresh(self, live: LiveDoc) -> None:
        """Another process changed (or deleted) the document: bring `live` up to date in place, under its locks."""
        hub = self.hub
        old = live.doc
        try:
            fresh = await asyncio.to_thread(load_live, hub.store, live.doc_id, hub.backend.tokenizer)
        except DocumentNotFound:
            hub.forget(live)
            return
        changes = fresh.log.since(old.version) if fresh.doc.version >= old.version else None
        live.doc, live.name, live.snap, live.log = fresh.doc, fresh.name, fresh.snap, fresh.log
        live.proposals = {g: p for g, p in fresh.proposals.items() if g not in live.unsaved}
        hub.gens.after_remote_change(live, old, changes)
        hub.broadcast(live)

    def follow(self) -> None:
        """Have the store's notifications (another process changed a document) bring the documents open here up to
        date and tell their subscribers. Call once, from the event loop."""
        if self.shared is None:
            return
        loop = asyncio.get_running_loop()

        def changed(doc_id: str) -> None:  # on the store's listener thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
                loop.call_soon_threadsafe(self._changed, doc_id)

        self.shared.listen(changed)

    def _changed(self, doc_id: str) -> None:
        docs = self.hub.docs
        for d in list(docs) if doc_id == "*" else [doc_id]:
            if d in docs and d not in self._catching_up:
                self._catching_up.add(d)
                asyncio.create_task(self._catch_up(d), name=f"dcanvas-catch-up-{d}")

    async def _catch_up(self, doc_id: str) -> None:
        try:
            async with self.hub.locked(doc_id):  # refreshes (and broadcasts) when it changed
                pass
        except (DocumentNotFound, ProtocolError):
            pass
        except Exception as e:
            if write_failed(e):  # the database is restarting: the next request's `guard` re-reads the document
                log.warning("catching up with document %s: the store is unavailable (%s)", doc_id, e)
            else:
                log.exception("catching up with document %s", doc_id)
        finally:
            self._catching_up.discard(doc_id)
