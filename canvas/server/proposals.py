"""Pending proposals: keeping a finished generation's proposal, and `proposal.accept` / `proposal.reject`.

Owns the lifecycle of a `PendingProposal` after its generation's `gen.done`: it is stored (`Store.add_proposal`)
before the client is told of it, moved over later disjoint changes by `Hub.mutate` (in the same transaction as
each change), and settled exactly once: accepted (in the transaction of the edit that applies it), rejected,
found stale, expired (a document keeps at most `MAX_PENDING`) or deleted with its document. A settled proposal's
outcome is remembered (in memory and in the store), so a late request about it gets `conflict` with the reason.

Ownership: a proposal belongs to the session that started its generation while that session is connected; once
that session is gone (a dropped connection, a restart) any session may settle it by its gen id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from canvas.document import Op, Replace, Unmask, proposal_to_json
from canvas.protocol import Ack, DocState, ErrorCode, ProposalAccept, ProposalReject, ProtocolError
from canvas.server.state import LiveDoc, PendingProposal, Session

if TYPE_CHECKING:
    from canvas.server.hub_port import HubPort

MAX_PENDING = 32  # pending proposals per document; a new one beyond it expires the oldest


class Proposals:
    def __init__(self, hub: HubPort) -> None:
        self.hub = hub

    async def add(self, live: LiveDoc, p: PendingProposal) -> None:
        """Keep a new proposal (the caller holds the document's lock): stored first, then held in memory."""
        expire = list(live.proposals)[: max(0, len(live.proposals) + 1 - MAX_PENDING)]
        body = proposal_to_json(p.doc)
        await asyncio.to_thread(
            self.hub.store.add_proposal, live.doc_id, p.gen, p.owner, body, p.start, p.end, expire=expire
        )
        for gen in expire:
            del live.proposals[gen]
            self.hub.gens.resolved(gen, "expired")
        live.proposals[p.gen] = p

    async def accept(self, session: Session, msg: ProposalAccept) -> DocState:
        doc_id = await self._find(session, msg.gen)
        try:
            return await self._accept(session, msg, doc_id)
        finally:
            self._unload(doc_id)

    async def _accept(self, session: Session, msg: ProposalAccept, doc_id: str) -> DocState:
        hub = self.hub
        async with hub.locked(doc_id) as live:
            p = self._pending(live, msg.gen)
            v = live.doc.version
            if msg.base_v > v:
                raise ProtocolError(ErrorCode.INVALID_PARAMS, f"base_v: {msg.base_v} is newer than the document (v{v})")
            if p.stale:
                await self._settle(live, msg.gen, "stale")
                raise ProtocolError(
                    ErrorCode.STALE_VERSION,
                    f"the text this proposal replaces was changed after generation {msg.gen}",
                    data={"current_v": v},
                )
            doc = live.doc
            if msg.hunks is None and doc.version == p.doc.base_version:
                apply: Callable[[], object] = lambda: doc.apply_proposal(p.doc)  # noqa: E731 - exact tokens
            else:
                text = p.doc.new_text if msg.hunks is None else compose(p.doc.diff, msg.hunks)
                # Over later disjoint changes the proposal lands as text: unmask its region, then replace it.
                ops: list[Op] = [Unmask(p.start, p.end), Replace(p.start, p.end, text)]
                apply = lambda: doc.apply(ops, label="generation")  # noqa: E731
            record = {"op": "accept", "gen": msg.gen, "start": p.start, "end": p.end, "hunks": msg.hunks}
            await hub.mutate(live, apply, [record], session, accepting=msg.gen)
            hub.gens.resolved(msg.gen, "accepted")
            return hub.state(live)

    async def reject(self, session: Session, msg: ProposalReject) -> Ack:
        doc_id = await self._find(session, msg.gen)
        try:
            async with self.hub.locked(doc_id) as live:
                self._pending(live, msg.gen)
                await self._settle(live, msg.gen, "rejected")
            return Ack()
        finally:
            self._unload(doc_id)

    def _unload(self, doc_id: str) -> None:
        # Settling a proposal may load its document (after a restart, or once its owner left); nobody may have it
        # open, so let it go again.
        live = self.hub.docs.get(doc_id)
        if live is not None:
            self.hub.maybe_unload(live)

    async def _settle(self, live: LiveDoc, gen: str, outcome: str) -> None:
        """Settle a proposal without an edit (the caller holds the document's lock)."""
        await asyncio.to_thread(self.hub.store.resolve_proposal, live.doc_id, gen, outcome)
        del live.proposals[gen]
        self.hub.gens.resolved(gen, outcome)

    def _pending(self, live: LiveDoc, gen: str) -> PendingProposal:
        p = live.proposals.get(gen)
        if p is None:  # settled by another session while this request waited for the lock
            outcome = self.hub.gens.outcome(gen) or "settled"
            raise ProtocolError(ErrorCode.CONFLICT, f"generation {gen} has no pending proposal ({outcome})")
        return p

    async def _find(self, session: Session, gen: str) -> str:
        """The document that holds `gen`'s pending proposal, if `session` may settle it."""
        hub = self.hub
        for live in hub.docs.values():
            p = live.proposals.get(gen)
            if p is not None:
                return self._claim(session, gen, p.owner, live.doc_id)
        record = await asyncio.to_thread(hub.store.proposal, gen)  # a document not in memory, or a restart
        if record is not None and record.outcome is None:
            return self._claim(session, gen, record.owner, record.doc_id)
        outcome = hub.gens.outcome(gen) or (record.outcome if record is not None else None)
        if outcome is not None:
            raise ProtocolError(ErrorCode.CONFLICT, f"generation {gen} has no pending proposal ({outcome})")
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no generation {gen!r} on this connection")

    def _claim(self, session: Session, gen: str, owner: str, doc_id: str) -> str:
        if owner != session.id and owner in self.hub.sessions:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no generation {gen!r} on this connection")
        return doc_id


def compose(diff_chunks: tuple[Any, ...], hunks: list[int]) -> str:
    """The new text with only the chosen hunks (maximal runs of non-equal chunks, numbered from 0) applied."""
    chosen = set(hunks)
    out: list[str] = []
    hunk = -1
    in_hunk = False
    for chunk in diff_chunks:
        if chunk.op == "equal":
            in_hunk = False
            out.append(chunk.text)
            continue
        if not in_hunk:
            hunk, in_hunk = hunk + 1, True
        take = hunk in chosen
        if (chunk.op == "insert") == take:
            out.append(chunk.text)
    if chosen and max(chosen) > hunk:
        raise ProtocolError(
            ErrorCode.INVALID_PARAMS, f"hunks: the proposal has {hunk + 1} hunks, not {max(chosen) + 1}"
        )
    return "".join(out)
