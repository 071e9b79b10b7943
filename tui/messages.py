"""The editor's custom messages: what workers and the client's callbacks tell the screen.

Workers never touch widgets; they post one of these and an `@on` handler on the screen applies it. They do not
bubble: each is meant for the screen it is posted to. Each message
about a generation carries its `gen` id so that handlers can drop results of a generation that is no longer the
current one (a stale frame after a cancel or a supersede).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual.message import Message

from canvas.protocol import DocState, GenAccepted, GenDone, GenProgress, Welcome
from tui.textfile import TextFile


@dataclass
class Connecting(Message, bubble=False):
    """A connection attempt (or the embedded server's start) is under way. `lost`: why the previous connection
    dropped, when this attempt follows a loss (it stays on screen until the editor is connected again, so a quick
    reconnect cannot hide that the connection was lost)."""

    detail: str
    lost: str | None = None


@dataclass
class Connected(Message, bubble=False):
    url: str
    welcome: Welcome


@dataclass
class Disconnected(Message, bubble=False):
    """The server is unreachable or the connection dropped; `retry_in` is None when no retry will follow."""

    reason: str
    retry_in: float | None


@dataclass
class DocUpdated(Message, bubble=False):
    """A new server state of the document (a reply to this editor, or a broadcast from another session)."""

    state: DocState
    sent: str | None = None  # for a reply: the editor text the request was based on; None for a broadcast


@dataclass
class GenStarted(Message, bubble=False):
    accepted: GenAccepted


@dataclass
class GenFrame(Message, bubble=False):
    progress: GenProgress


@dataclass
class GenFinished(Message, bubble=False):
    """The generation ended: `done` from the server, or None with `error` when the connection failed first."""

    gen: str | None
    done: GenDone | None
    error: str | None = None


@dataclass
class Problem(Message, bubble=False):
    """A request failed in a way the user should read (a typed server error, a file error)."""

    message: str
    severity: str = "error"


@dataclass
class FileLoaded(Message, bubble=False):
    file: TextFile
    text: str


@dataclass
class FileSaved(Message, bubble=False):
    path: Path
    backup: Path | None
    text: str  # what was written (document form): the editor is clean when it still holds this
