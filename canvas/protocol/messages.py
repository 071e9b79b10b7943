"""dcanvas/1 messages: the `doc.edit` op union, generation parameters, the client->server requests and the
server->client replies and events, each a pydantic model discriminated on `type` (ops on `op`).

Invariants: every string and list is bounded (by a `Field` or by `ServerLimits` from the validation context);
offsets are character offsets into the document text, ranges half-open `[start, end)`; `CLIENT_MESSAGES` and
`SERVER_MESSAGES` map each `type` tag to its model and are what the parser dispatches on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationInfo, field_validator, model_validator

from canvas.protocol.base import (
    PROTOCOL,
    DocId,
    ErrorCode,
    GenId,
    Limits,
    Mode,
    Name,
    Offset,
    Range,
    RequestId,
    Version,
    WireModel,
    check_text,
    limits_from,
)

# --------------------------------------------------------------------------------------------------------------
# doc.edit ops


class ReplaceOp(Range):
    """Replace the characters `[start, end)` with `text` (insert when start == end, delete when text is empty)."""

    op: Literal["replace"] = "replace"
    text: str

    @field_validator("text")
    @classmethod
    def _bounded_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        return check_text(value, info)


class PinOp(Range):
    """Pin `[start, end)`: the model must keep this text."""

    op: Literal["pin"] = "pin"


class UnpinOp(Range):
    op: Literal["unpin"] = "unpin"


class MaskOp(Range):
    """Mask `[start, end)`: its text becomes free slots that the next generation rewrites."""

    op: Literal["mask"] = "mask"


class UnmaskOp(Range):
    op: Literal["unmask"] = "unmask"


class InsertGapOp(WireModel):
    """Insert `n_tokens` free slots at character offset `at` (infill)."""

    op: Literal["insert_gap"] = "insert_gap"
    at: Offset
    n_tokens: Annotated[int, Field(ge=1)]

    @field_validator("n_tokens")
    @classmethod
    def _gap_limit(cls, value: int, info: ValidationInfo) -> int:
        if value > limits_from(info).max_gap_tokens:
            raise ValueError(f"n_tokens ({value}) is more than the limit of {limits_from(info).max_gap_tokens}")
        return value


class MoveWindowOp(WireModel):
    """Move the canvas window so that it starts at (the token containing) character offset `start`."""

    op: Literal["move_window"] = "move_window"
    start: Offset


EditOp = Annotated[
    ReplaceOp | PinOp | UnpinOp | MaskOp | UnmaskOp | InsertGapOp | MoveWindowOp, Field(discriminator="op")
]
EDIT_OP: TypeAdapter[EditOp] = TypeAdapter(EditOp)


class GenParams(WireModel):
    """Sampler parameters of one generation. A sampler field left out (None) takes the model's default (its
    `generation_config.json`, announced in `welcome.model.defaults`); `gen.accepted` echoes the resolved values.
    `mode` left out takes the model's default mode for the request's kind (`welcome.model.default_modes`): infill
    when the canvas has pinned text after a free slot, else continuation."""

    mode: Mode | None = None
    max_steps: Annotated[int, Field(ge=1, le=256)] | None = None
    entropy_bound: Annotated[float, Field(gt=0, le=1e6)] | None = None
    t_max: Annotated[float, Field(ge=0, le=100)] | None = None
    t_min: Annotated[float, Field(gt=0, le=100)] | None = None  # > 0: the last step divides the logits by it
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None  # None: the server picks one
    stream_every: Annotated[int, Field(ge=1, le=256)] = 1  # send a progress frame every this many steps

    @model_validator(mode="after")
    def _temperatures(self) -> GenParams:
        if self.t_max is not None and self.t_min is not None and self.t_max < self.t_min:
            raise ValueError(f"t_max ({self.t_max}) must be >= t_min ({self.t_min})")
        return self


class GenDefaults(WireModel):
    """The model's sampler defaults: what a `gen.start` gets for the GenParams fields it leaves out."""

    max_steps: int
    entropy_bound: float
    t_max: float
    t_min: float


# --------------------------------------------------------------------------------------------------------------
# Client -> server


# The base of every client frame: what `parse_client_message` returns (the Annotated unions are for the schema and
# for type hints). A comment, not a docstring: the schema would carry it.
class ClientRequest(WireModel):
    id: RequestId | None = None


class ClientInfo(WireModel):
    name: Annotated[str, Field(max_length=64)]
    version: Annotated[str, Field(max_length=32)] = ""


class Hello(ClientRequest):
    type: Literal["hello"] = "hello"
    protocol: Annotated[str, Field(max_length=32)]
    client: ClientInfo | None = None
    token: Annotated[str, Field(max_length=256)] | None = None


class DocOpen(ClientRequest):
    """Open document `doc_id`, or (without it) create a new document from `text` (default empty)."""

    type: Literal["doc.open"] = "doc.open"
    doc_id: DocId | None = None
    text: str | None = None
    name: Name | None = None

    @field_validator("text")
    @classmethod
    def _bounded_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        return check_text(value, info)

    @model_validator(mode="after")
    def _one_source(self) -> DocOpen:
        if self.doc_id is not None and self.text is not None:
            raise ValueError("give doc_id (open) or text (create), not both")
        return self


class DocClose(ClientRequest):
    """Stop receiving `doc.state` broadcasts of a document."""

    type: Literal["doc.close"] = "doc.close"
    doc_id: DocId


class DocDelete(ClientRequest):
    """Delete a document: its text, history and proposals. A generation running on it is cancelled. With `base_v`,
    only if the document is still at that version (so a change the client has not seen is never deleted)."""

    type: Literal["doc.delete"] = "doc.delete"
    doc_id: DocId
    base_v: Version | None = None


class DocEdit(ClientRequest):
    type: Literal["doc.edit"] = "doc.edit"
    doc_id: DocId
    base_v: Version
    ops: Annotated[list[EditOp], Field(min_length=1)]

    @field_validator("ops")
    @classmethod
    def _op_limit(cls, value: list[EditOp], info: ValidationInfo) -> list[EditOp]:
        if len(value) > limits_from(info).max_ops_per_edit:
            raise ValueError(f"{len(value)} ops is more than the limit of {limits_from(info).max_ops_per_edit}")
        return value


class GenStart(ClientRequest):
    type: Literal["gen.start"] = "gen.start"
    doc_id: DocId
    base_v: Version
    params: GenParams = GenParams()


class GenCancel(ClientRequest):
    type: Literal["gen.cancel"] = "gen.cancel"
    gen: GenId


class ProposalAccept(ClientRequest):
    """Apply a finished generation's proposal as one undo unit; `hunks` picks changed hunks (default: all)."""

    type: Literal["proposal.accept"] = "proposal.accept"
    gen: GenId
    base_v: Version
    hunks: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=4096)] | None = None


class ProposalReject(ClientRequest):
    type: Literal["proposal.reject"] = "proposal.reject"
    gen: GenId


class HistoryUndo(ClientRequest):
    type: Literal["history.undo"] = "history.undo"
    doc_id: DocId


class HistoryRedo(ClientRequest):
    type: Literal["history.redo"] = "history.redo"
    doc_id: DocId


class DocList(ClientRequest):
    type: Literal["doc.list"] = "doc.list"


class Ping(ClientRequest):
    type: Literal["ping"] = "ping"


ClientMessage = Annotated[
    Hello
    | DocOpen
    | DocClose
    | DocDelete
    | DocEdit
    | GenStart
    | GenCancel
    | ProposalAccept
    | ProposalReject
    | HistoryUndo
    | HistoryRedo
    | DocList
    | Ping,
    Field(discriminator="type"),
]
CLIENT_MESSAGES: dict[str, type[ClientRequest]] = {
    m.model_fields["type"].default: m
    for m in (Hello, DocOpen, DocClose, DocDelete, DocEdit, GenStart, GenCancel, ProposalAccept, ProposalReject,
              HistoryUndo, HistoryRedo, DocList, Ping)
}  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Server -> client


# The base of every server frame, what `parse_server_message` returns.
class ServerReply(WireModel):
    re: RequestId | None = None


class ServerInfo(WireModel):
    name: str
    version: str


class DefaultModes(WireModel):
    """The mode a `gen.start` without one runs in, per kind: infill (and rewrite), or continuation."""

    infill: Mode = "diffusion"
    continuation: Mode = "diffusion"


class ModelInfo(WireModel):
    name: str
    canvas_length: Annotated[int, Field(ge=1)]
    modes: list[Mode]
    # A server that predates default modes sends none: it ran diffusion when a request named no mode.
    default_modes: DefaultModes = Field(default_factory=DefaultModes)
    # How to name a mode or what wrote a text (`gen.done.stats.mode`) to a user: "default" (no mode named),
    # "diffusion", "ar", "ar-infill" -> label (`canvas.sampling.modes.LABELS`). Empty from servers that predate it.
    labels: dict[Annotated[str, Field(max_length=32)], Annotated[str, Field(max_length=200)]] = Field(
        default_factory=dict, max_length=32)
    # A server that predates model defaults sends none: it used the reference defaults.
    defaults: GenDefaults = Field(
        default_factory=lambda: GenDefaults(max_steps=48, entropy_bound=0.1, t_max=0.8, t_min=0.4)
    )


class Welcome(ServerReply):
    type: Literal["welcome"] = "welcome"
    protocol: str = PROTOCOL
    session: str
    server: ServerInfo
    model: ModelInfo
    limits: Limits


class Window(Range):
    """The canvas window in character offsets of the text."""


class Span(Range):
    """A run of window text: `pinned` text the model keeps, or `free` text it rewrites. `slots` is the number of
    canvas slots the run takes; a gap is a zero-width free span (`start == end`) with `slots` new tokens."""

    kind: Literal["pinned", "free"]
    slots: Annotated[int, Field(ge=0)] = 0


class DocState(ServerReply):
    type: Literal["doc.state"] = "doc.state"
    doc_id: DocId
    v: Version
    name: str = ""
    text: str
    window: Window
    spans: list[Span] = []
    can_undo: bool = False
    can_redo: bool = False
    gen: GenId | None = None  # the generation running on this document, if any


class DocDeleted(ServerReply):
    """A document is gone: the reply to `doc.delete`, and (without `re`) the news to every other session that had it
    open, which no longer has it open."""

    type: Literal["doc.deleted"] = "doc.deleted"
    doc_id: DocId


class DocSummary(WireModel):
    doc_id: DocId
    name: str = ""
    v: Version
    chars: Annotated[int, Field(ge=0)]
    updated: float  # seconds since the epoch


class DocListing(ServerReply):
    type: Literal["doc.listing"] = "doc.listing"
    docs: list[DocSummary]


class Ack(ServerReply):
    """The reply to requests that have no other result (doc.close, gen.cancel, proposal.reject)."""

    type: Literal["ack"] = "ack"


class GenAccepted(ServerReply):
    type: Literal["gen.accepted"] = "gen.accepted"
    gen: GenId
    doc_id: DocId
    base_v: Version
    params: GenParams  # resolved: the seed is filled in
    # Generations that will start before this one in the engine's queue (0: next in line, or started at once when
    # an engine row is free), and the estimated wait before its first step (null until the server has measured one).
    queue_position: Annotated[int, Field(ge=0)] = 0
    est_wait_s: Annotated[float, Field(ge=0)] | None = None


class SlotUpdate(WireModel):
    """One slot's state in a `gen.progress` frame. `written` false: the model has not reached the slot yet (AR mode
    writes left to right); it carries no text: `token` -1, `text` "", `accepted` false."""

    i: Annotated[int, Field(ge=0)]  # slot index inside the canvas window
    token: int
    text: str
    entropy: Annotated[float, Field(ge=0)] | None = None
    accepted: bool
    written: bool = True  # absent (older servers): true


class GenDrafts(WireModel):
    """An AR infill's K drafts of one gap, side by side: the gap being drafted (all drafts grow a token per step),
    or, once scored, the last gap with the draft `chosen` and the `kept` text written from it (the rest of the gap
    became null). Whole state, not a delta: a frame's drafts replace the previous ones. Sent only in AR infills with
    more than one draft, and only by servers that have it (older ones never send the field)."""

    start: Annotated[int, Field(ge=0)]  # the gap's slots [start, end) in the canvas window
    end: Annotated[int, Field(ge=0)]
    texts: list[str]  # each draft's text so far, its tokens' texts joined (as `SlotUpdate.text` shows them)
    tokens: Annotated[int, Field(ge=0)]  # tokens per draft so far
    lead: Annotated[int, Field(ge=0)]  # the draft the slots show while they grow: the likeliest so far
    chosen: Annotated[int, Field(ge=0)] | None = None
    kept: str | None = None  # with `chosen`: the text written into the gap, a prefix of texts[chosen]


class GenProgress(ServerReply):
    """Changed slots since the previous frame of this generation. Frames are coalesced latest-wins: `merged` engine
    frames went into this one. `seq` counts frames sent for the generation (1, 2, ...); a gap means a frame was lost
    and the client must resynchronise (`doc.open`). `drafts`: see `GenDrafts` (absent when there are none)."""

    type: Literal["gen.progress"] = "gen.progress"
    gen: GenId
    seq: Annotated[int, Field(ge=1)]
    step: Annotated[int, Field(ge=0)]
    max_steps: Annotated[int, Field(ge=1)]
    slots: list[SlotUpdate]
    accepted: Annotated[int, Field(ge=0)] = 0  # free slots the sampler accepted at this step
    free: Annotated[int, Field(ge=0)] = 0  # slots being generated
    merged: Annotated[int, Field(ge=1)] = 1
    elapsed_s: Annotated[float, Field(ge=0)] = 0.0
    drafts: GenDrafts | None = None


class DiffSegment(WireModel):
    op: Literal["equal", "insert", "delete"]
    text: str


class Proposal(WireModel):
    """Replace `[start, end)` of the text at `base_v` with `text`; `diff` goes from the old to the new text.
    A hunk is a maximal run of non-equal segments; `proposal.accept.hunks` indexes hunks from 0."""

    base_v: Version
    start: Offset
    end: Offset
    text: str
    diff: list[DiffSegment]


class GenStats(WireModel):
    steps: Annotated[int, Field(ge=0)]
    tokens_per_forward: Annotated[float, Field(ge=0)]
    tok_s: Annotated[float, Field(ge=0)]
    wall_s: Annotated[float, Field(ge=0)]
    # What wrote the text: the diffusion decoder, the plain AR fill, or AR drafts chosen by how they join the text after
    # the gap ("ar-infill"). Absent from servers that predate it, and when nothing ran.
    mode: Literal["diffusion", "ar", "ar-infill"] | None = None


GenStatus = Literal["completed", "cancelled", "superseded", "stale", "failed", "unavailable"]


class GenDone(ServerReply):
    """The one terminal event of every accepted generation, whatever happened to it."""

    type: Literal["gen.done"] = "gen.done"
    gen: GenId
    doc_id: DocId
    status: GenStatus
    proposal: Proposal | None = None  # present when status is completed
    stats: GenStats
    message: str | None = None  # why, for stale, failed and unavailable


class Pong(ServerReply):
    type: Literal["pong"] = "pong"


class ErrorReply(ServerReply):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    retryable: bool
    data: dict[str, Any] | None = None


ServerMessage = Annotated[
    Welcome | DocState | DocDeleted | DocListing | Ack | GenAccepted | GenProgress | GenDone | Pong | ErrorReply,
    Field(discriminator="type"),
]
SERVER_MESSAGES: dict[str, type[ServerReply]] = {
    m.model_fields["type"].default: m
    for m in (Welcome, DocState, DocDeleted, DocListing, Ack, GenAccepted, GenProgress, GenDone, Pong, ErrorReply)
}
