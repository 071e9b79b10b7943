"""The editor's side of one server document: local typing turned into `doc.edit`s, and server states merged back.

The server holds the document (text, window, pinned and free spans, versions, undo history); the `TextArea` holds
what the user is typing. `DocSync` keeps the last server state seen (`state`) and sends the difference between
its text and the editor's as one `replace` op against `state.v`: the server rebases it over anything another
session changed since, so nothing is lost when two clients edit. Every request goes through one `asyncio.Lock`,
so versions are always read and advanced in order, and a request is never cancelled half way (a cancelled reply
would leave the editor unsure whether the server applied it).

Pure helpers: `text_change` (the one replace that turns a text into another: common prefix and suffix),
`shift_span` (move a span over a local edit, so highlights follow typing before the server answers) and
`merge_remote` (fold a server text into an editor that has moved on since the request was sent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from canvas.protocol import DocState, EditOp, ErrorCode, GenParams, ProtocolError, ReplaceOp
from canvas.protocol.client import DcanvasClient, Generation


@dataclass(frozen=True, slots=True)
class TextChange:
    """Replace `[start, end)` of the old text with `text`."""

    start: int
    end: int
    text: str

    def apply(self, old: str) -> str:
        return old[: self.start] + self.text + old[self.end :]


def text_change(old: str, new: str) -> TextChange | None:
    """The single replace turning `old` into `new` (None when equal)."""
    if old == new:
        return None
    n = min(len(old), len(new))
    pre = 0
    while pre < n and old[pre] == new[pre]:
        pre += 1
    suf = 0
    while suf < n - pre and old[len(old) - 1 - suf] == new[len(new) - 1 - suf]:
        suf += 1
    return TextChange(pre, len(old) - suf, new[pre : len(new) - suf])


def shift_span(start: int, end: int, change: TextChange) -> tuple[int, int]:
    """Where `[start, end)` lies after `change`: shifted when after it, stretched or clipped when they overlap."""
    delta = len(change.text) - (change.end - change.start)
    if change.end <= start and change.start < start:
        return start + delta, end + delta
    if change.start >= end and not (start == end == change.start):
        return start, end
    # Overlap (or an insert at a gap): keep the span around the edit.
    new_start = min(start, change.start)
    new_end = max(change.start + len(change.text), end + delta) if end > change.start else new_start
    return new_start, max(new_start, new_end)


def merge_remote(sent: str, remote: str, now: str) -> tuple[str, bool]:
    """The editor text after the server answered `sent` with `remote` while the editor moved on to `now`.

    Returns (text, clean): clean is False when the two changes overlapped and the editor's newest typing had to
    give way to the server's text.
    """
    theirs = text_change(sent, remote)
    mine = text_change(sent, now)
    if theirs is None:
        return now, True
    if mine is None:
        return remote, True
    if theirs.end <= mine.start and not (theirs.start == theirs.end == mine.start):
        return theirs.apply(now), True  # theirs comes first in `now` too: same offsets
    if mine.end <= theirs.start:
        shift = len(mine.text) - (mine.end - mine.start)
        moved = TextChange(theirs.start + shift, theirs.end + shift, theirs.text)
        return moved.apply(now), True
    return remote, False


class DocSync:
    """One open document on one connection. Every method that talks to the server holds `lock`."""

    def __init__(self) -> None:
        self.client: DcanvasClient | None = None
        self.state: DocState | None = None
        self.deferred: DocState | None = None  # a broadcast that arrived while a request was in flight
        # The editor text the server has already taken in (sent, or found equal), until the editor shows a newer
        # state. A push of this same text again is stale: the server has moved on from it (an undo, an accept)
        # and the editor has not redrawn yet, so sending it would undo the server's change.
        self.sent: str | None = None
        self.lock = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return self.client is not None and not self.client.closed and self.state is not None

    def require(self) -> tuple[DcanvasClient, DocState]:
        if self.client is None or self.client.closed:
            raise ConnectionError("not connected to a server")
        if self.state is None:
            raise ConnectionError("the document is not open on the server yet")
        return self.client, self.state

    def _chunk(self) -> int:
        limits = self.client.welcome.limits if self.client is not None and self.client.welcome else None
        return limits.max_text_chars if limits is not None else 200_000

    async def attach(self, client: DcanvasClient, text: str, name: str) -> DocState:
        """Open the document on `client`: the same server document again after a reconnect when the server still
        has it, else a new one with `text`. Then bring the server's text to `text`."""
        async with self.lock:
            self.client = client
            state: DocState | None = None
            if self.state is not None:
                try:
                    state = await client.open(self.state.doc_id)
                except ProtocolError as e:  # gone (a restarted embedded server keeps nothing): a new document
                    if e.code is not ErrorCode.NOT_FOUND:
                        raise
                    state = None
            if state is None:
                chunk = self._chunk()
                state = await client.open(text=text[:chunk], name=name[:200])
                while len(state.text) < len(text):  # over the frame limit: append the rest in pieces
                    part = text[len(state.text) : len(state.text) + chunk]
                    op = ReplaceOp(start=len(state.text), end=len(state.text), text=part)
                    state = await client.edit(state.doc_id, state.v, [op])
            self.state, self.sent = state, None  # the editor's text is brought to the server whatever came before
            return await self._push(text)

    async def push(self, read: Callable[[], str]) -> tuple[str, DocState]:
        """Send the editor's text (document form, read by `read` once the requests before this one are answered)
        if it differs from the server's. Returns the text read and the state after."""
        async with self.lock:
            text = read()
            return text, await self._push(text)

    async def _push(self, text: str) -> DocState:
        client, state = self.require()
        if text == self.sent:
            return state
        change = text_change(state.text, text)
        if change is not None:
            op = ReplaceOp(start=change.start, end=change.end, text=change.text)
            self.state = await client.edit(state.doc_id, state.v, [op])
        self.sent = text
        assert self.state is not None
        return self.state

    def shown(self) -> None:
        """The editor now shows the latest state (with any typing since on top): its text is new typing again."""
        self.sent = None

    async def edit(self, text: str, ops: Sequence[EditOp]) -> DocState:
        """Push `text`, then apply `ops` (offsets in `text`) as one edit."""
        async with self.lock:
            await self._push(text)
            client, state = self.require()
            self.state = await client.edit(state.doc_id, state.v, list(ops))
            return self.state

    async def history(self, text: str, redo: bool) -> DocState:
        async with self.lock:
            await self._push(text)
            client, state = self.require()
            self.state = await (client.redo(state.doc_id) if redo else client.undo(state.doc_id))
            return self.state

    async def start(self, text: str, params: GenParams, ops: Sequence[EditOp] = ()) -> tuple[DocState, Generation]:
        """Push `text`, apply `ops` (a mask or a gap made for this run), and start a generation on the result."""
        async with self.lock:
            await self._push(text)
            client, state = self.require()
            if ops:
                self.state = state = await client.edit(state.doc_id, state.v, list(ops))
            gen = client.generate(state.doc_id, state.v, params)
            await gen.start()
            return state, gen

    async def accept(self, gen: str, hunks: list[int] | None) -> DocState:
        async with self.lock:
            client, state = self.require()
            self.state = await client.accept(gen, state.v, hunks)
            return self.state

    async def reject(self, gen: str) -> None:
        async with self.lock:
            client, _ = self.require()
            await client.reject(gen)

    def adopt(self, state: DocState) -> bool:
        """Take a broadcast state when it is newer than ours; True when taken."""
        if self.state is not None and (state.doc_id != self.state.doc_id or state.v <= self.state.v):
            return False
        self.state = state
        return True

    def describe(self) -> dict[str, Any]:
        s = self.state
        if s is None:
            return {}
        free = [sp for sp in s.spans if sp.kind == "free"]
        return {
            "v": s.v,
            "masked": sum(1 for sp in free if sp.end > sp.start),
            "gaps": sum(1 for sp in free if sp.end == sp.start),
            "free_slots": sum(sp.slots for sp in free),
        }
