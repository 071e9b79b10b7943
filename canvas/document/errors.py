"""Typed errors of the document: every invalid operation raises a subclass of `DocumentError`.

Each class carries a short stable `code` (for the protocol's error table) and a message that names the offending
offset or value and the bound it broke. An operation that raises leaves the document exactly as it was.
"""

from __future__ import annotations


class DocumentError(Exception):
    """Base class of every error the document raises on bad input or a bad state."""

    code = "document"


class RangeError(DocumentError):
    """A character offset or range lies outside the text, is reversed or empty, or a count is out of range."""

    code = "range"


class WindowError(DocumentError):
    """An operation needs a range inside the canvas window, or would leave free slots outside it."""

    code = "window"


class CanvasFullError(DocumentError):
    """Masked regions and gaps would need more slots than the canvas window holds."""

    code = "canvas_full"


class StaleVersionError(DocumentError):
    """A proposal was made against another version (or another document) than the current one."""

    code = "stale_version"


class ProposalError(DocumentError):
    """A generated canvas does not fit the canvas view it claims to fill (length, pinned slots, token ids)."""

    code = "proposal"


class HistoryError(DocumentError):
    """Nothing to undo or redo, or a history entry does not match the document it is replayed on."""

    code = "history"


class TokenizationError(DocumentError):
    """The tokenizer returned something the document cannot map onto the text (no ids, bad offsets)."""

    code = "tokenization"


class StateError(DocumentError):
    """A persisted document (`from_dict`) is malformed or breaks an invariant."""

    code = "state"
