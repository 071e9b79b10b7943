"""The server's shared state types: sessions, live documents, pending proposals, recent outcomes.

Kept apart from the handlers (`hub`) and the generation driver (`gens`), which both use them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from canvas.document import Document
from canvas.document import Proposal as DocProposal
from canvas.protocol import ServerLimits, ServerReply
from canvas.server.outbox import Outbox, SlowConsumer
from canvas.server.rebase import ChangeLog, Snapshot
from canvas.server.security import TokenBucket

log = logging.getLogger("canvas.server")


class Session:
    """One websocket connection after `accept()`."""

    def __init__(self, outbox: Outbox, limits: ServerLimits, kill: Callable[[int, str], None]) -> None:
        self.id = "s-" + secrets.token_hex(6)
        self.outbox = outbox
        self.bucket = TokenBucket(limits.rate_per_s, limits.rate_burst)
        self.hello = False
        self.docs: set[str] = set()
        self.gens: set[str] = set()
        self.close_after: tuple[int, str] | None = None  # close the socket after sending the reply
        self.offered_tokens: tuple[str | None, ...] = ()  # tokens offered as websocket subprotocols (checked at hello)
        self._kill = kill

    def send(self, msg: ServerReply) -> None:
        try:
            self.outbox.put(msg)
        except SlowConsumer as e:
            log.warning("session %s: %s; closing it", self.id, e)
            self._kill(1008, "too slow: frames are piling up")


@dataclass
class PendingProposal:
    """A finished generation's proposal, waiting for `proposal.accept` or `proposal.reject` (kept in the store too).

    It belongs to `owner`, the session that started the generation, while that session is connected; once it
    is gone (a dropped connection, a server restart) any session may settle it by its gen id."""

    gen: str
    owner: str  # Session.id
    doc: DocProposal  # as the document made it, at `doc.base_version`
    start: int  # the replaced range in the current text (moved over later disjoint changes)
    end: int
    stale: bool = False


@dataclass
class LiveDoc:
    doc: Document
    name: str
    snap: Snapshot
    log: ChangeLog
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    subscribers: set[Session] = field(default_factory=set)
    run: Any = None  # the running canvas.server.gens.Run, if any
    proposals: dict[str, PendingProposal] = field(default_factory=dict)  # oldest first
    unsaved: dict[str, str] = field(default_factory=dict)  # gen -> outcome settled here but not yet in the store
    # Memory may hold a change the store refused (it could not be read back to roll it back): `Hub.locked` reloads
    # the document before anyone acts on it again.
    dirty: bool = False

    @property
    def doc_id(self) -> str:
        return self.doc.doc_id


def snapshot(doc: Document) -> Snapshot:
    return Snapshot.of(doc.text, doc.window(), [(s.kind, s.start, s.end, s.slots) for s in doc.spans()])


class RecentOutcomes(OrderedDict[str, str]):
    """What became of recent generations (bounded), so late requests about them get a precise answer."""

    def __init__(self, maxlen: int = 4096) -> None:
        super().__init__()
        self.maxlen = maxlen

    def note(self, gen: str, outcome: str) -> None:
        self[gen] = outcome
        self.move_to_end(gen)
        while len(self) > self.maxlen:
            self.popitem(last=False)
