"""What the hub's parts may use of the hub: `HubPort`, a narrow protocol that `canvas.server.hub.Hub` implements.

The hub owns the live documents and the sessions and builds three parts that act on them: `Generations`
(`canvas.server.gens`), `Peers` (`canvas.server.peers`) and `Proposals` (`canvas.server.proposals`). Each part is
handed the hub and reaches the others through it; typing that handle as `HubPort` (this module) instead of `Hub`
keeps the imports one way: the hub imports its parts, the parts import this module, nothing here imports the hub.
Only the public members below are the parts' to call; a new need of a part is a new member here, kept as narrow.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from canvas.document import Document
from canvas.engine.backend import Backend
from canvas.protocol import DocDeleted, DocState, ServerLimits
from canvas.server.admission import Admits
from canvas.server.rebase import Change
from canvas.server.state import LiveDoc, PendingProposal, Session
from canvas.store.base import DocStore


class GensPort(Protocol):
    """What the other parts ask of the generations (`canvas.server.gens.Generations`)."""

    def resolved(self, gen: str, outcome: str) -> None: ...
    def outcome(self, gen: str) -> str | None: ...
    def after_remote_change(self, live: LiveDoc, old: Document, changes: list[Change] | None) -> None: ...


class PeersPort(Protocol):
    """What the other parts ask of the other server processes' view (`canvas.server.peers.Peers`)."""

    def guard(self, live: LiveDoc) -> AbstractAsyncContextManager[None]: ...


class ProposalsPort(Protocol):
    """What the other parts ask of the proposals (`canvas.server.proposals.Proposals`)."""

    async def add(self, live: LiveDoc, p: PendingProposal) -> None: ...


class HubPort(Protocol):
    """The hub as its parts see it: the shared state, the document lock, saving and telling a change, unloading."""

    @property
    def backend(self) -> Backend: ...
    @property
    def store(self) -> DocStore: ...
    @property
    def limits(self) -> ServerLimits: ...
    @property
    def admission(self) -> Admits: ...
    @property
    def sessions(self) -> dict[str, Session]: ...
    @property
    def docs(self) -> dict[str, LiveDoc]: ...
    @property
    def gens(self) -> GensPort: ...
    @property
    def peers(self) -> PeersPort: ...
    @property
    def proposals(self) -> ProposalsPort: ...

    def locked(self, doc_id: str) -> AbstractAsyncContextManager[LiveDoc]: ...
    def state(self, live: LiveDoc) -> DocState: ...
    def broadcast(self, live: LiveDoc, exclude: Session | None = None) -> None: ...
    async def mutate(self, live: LiveDoc, apply: Callable[[], object], ops_json: list[Any], session: Session | None,
                     *, accepting: str | None = None) -> Change | None: ...
    def maybe_unload(self, live: LiveDoc) -> None: ...
    def forget(self, live: LiveDoc, by: Session | None = None) -> DocDeleted: ...
