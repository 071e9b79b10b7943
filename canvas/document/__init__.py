"""Canvas state: a document's text, its canvas window of pinned and free slots, versions and undo history.

A document is text. Its tokens split into the **context** (before the window, fed to the model's causal encoder),
the **canvas window** (`canvas_length` slots, each `pinned`: the model must keep it, or `free`: to be generated;
the engine adds a third, transient state, `accepted`, during a generation) and the text **after the window**, which
is carried unchanged: the model does not see it unless the window is moved over it.

`Document` (in `core`) is the only thing that mutates this state. Operations take character offsets (Python str
indices) and snap them outward to token boundaries (`base.Atom`); each bumps a monotonic version and is one undo
unit. The engine reads a frozen `CanvasView`, fills the free slots, and hands the ids back to `make_proposal`; the
caller accepts the resulting `Proposal` with `apply_proposal` (one undo unit) or drops it.

    doc = Document(HFTokenizer(tok), "The cat sat on the mat.", config=DocumentConfig(canvas_length=256))
    doc.mask(4, 7)                        # rewrite "cat": its tokens become free slots
    view = doc.canvas_view()              # context ids, slot ids, pinned flags, free regions, version
    proposal = doc.make_proposal(generated_ids, null_id=tok.token_to_id("<null>"))
    doc.apply_proposal(proposal)          # "The dog sat on the mat."; doc.undo() brings the cat back

Modules: `core` (`Document`), `base` (its config, atoms and operations), `views` (the read-only snapshots), `edit`,
`history`, `proposal`, `errors`, `tokenizer` (the tokenizer contract). The bottom layer: imports nothing of
the project; the engine, the server and its HTTP dialects, and the eval import it.
Imports: nothing.
Imported by: `canvas.engine`, `canvas.eval`, `canvas.server` and `canvas.server.http`.
"""

from __future__ import annotations

from canvas.document.base import (
    GAP,
    PRESETS,
    Atom,
    DocumentConfig,
    InsertGap,
    Mask,
    MoveWindow,
    Op,
    Pin,
    Replace,
    Unmask,
    Unpin,
)
from canvas.document.core import Document
from canvas.document.errors import (
    CanvasFullError,
    DocumentError,
    HistoryError,
    ProposalError,
    RangeError,
    StaleVersionError,
    StateError,
    TokenizationError,
    WindowError,
)
from canvas.document.history import FORMAT
from canvas.document.proposal import proposal_from_json, proposal_to_json
from canvas.document.tokenizer import Encoded, HFTokenizer, TextTokenizer, atoms_from_ids, atoms_from_text
from canvas.document.views import CanvasView, DiffChunk, FreeRegion, Proposal, RegionEdit, Span

__all__ = [
    "FORMAT",
    "GAP",
    "PRESETS",
    "Atom",
    "CanvasFullError",
    "CanvasView",
    "DiffChunk",
    "Document",
    "DocumentConfig",
    "DocumentError",
    "Encoded",
    "FreeRegion",
    "HFTokenizer",
    "HistoryError",
    "InsertGap",
    "Mask",
    "MoveWindow",
    "Op",
    "Pin",
    "Proposal",
    "ProposalError",
    "RangeError",
    "RegionEdit",
    "Replace",
    "Span",
    "StaleVersionError",
    "StateError",
    "TextTokenizer",
    "TokenizationError",
    "Unmask",
    "Unpin",
    "WindowError",
    "atoms_from_ids",
    "atoms_from_text",
    "proposal_from_json",
    "proposal_to_json",
]
