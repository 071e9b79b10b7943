"""The dcanvas/1 wire protocol: every message as a pydantic v2 model, the error table, parsing and the schema.

Owns: the client->server request union and the server->client reply/event union (both discriminated on `type`),
the `doc.edit` op union, generation parameters, the `ErrorCode` table and the single mapping from domain
exceptions to codes, `ServerLimits`, `parse_client_message` / `parse_server_message`, `dump` and `json_schema`.

Invariants:
- Parsing never leaks a pydantic `ValidationError`: every bad frame becomes a `ProtocolError(code, message, re)`
  whose message names the offending field (`ops.0.start: ...`), and `re` echoes the request id when it was readable.
- Unknown fields are ignored (forward compatibility); an unknown `type` is `unknown_type`.
- Numbers are strict JSON numbers (no `"1"` for 1, no NaN/Infinity); every string and list is bounded.
- Offsets are character offsets into the document text (Python `str` indices); ranges are half-open `[start, end)`.

`dcanvas schema` prints `json_schema()`; the server serves the same document at `GET /schema`. The protocol is
written up for plugin authors in docs/protocol.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

PROTOCOL = "dcanvas/1"


# --------------------------------------------------------------------------------------------------------------
# Limits


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds the server enforces; sent to clients in `welcome.limits`. Defaults suit one machine, a few users."""

    max_frame_bytes: int = 1 << 20  # 1 MiB: a whole document of max_text_chars ASCII fits with room for JSON
    max_text_chars: int = 200_000  # one text field (doc.open text, a replace op's text)
    max_doc_chars: int = 500_000  # a document after an edit; edits growing past it get too_large
    max_ops_per_edit: int = 64  # one doc.edit; a client with more sends several edits
    max_gap_tokens: int = 256  # one insert_gap: more than one canvas window cannot be generated at once
    max_docs: int = 1000  # documents in the store; doc.open of a new document past it gets too_large
    max_sessions: int = 128  # concurrent websocket sessions (the load bench runs 50)
    max_open_docs: int = 32  # documents one session may have open (subscribed to broadcasts)
    max_gens_per_session: int = 4  # running generations one session may own
    rate_per_s: float = 100.0  # token-bucket refill: sustained messages per second per connection
    rate_burst: int = 200  # token-bucket size: a burst this long is accepted at once
    max_fps: float = 30.0  # progress frames per second per connection; faster frames are coalesced

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"ServerLimits.{f.name} must be > 0 (got {value!r})")
        if self.max_text_chars > self.max_doc_chars:
            raise ValueError(
                f"ServerLimits.max_text_chars ({self.max_text_chars}) must be <= max_doc_chars ({self.max_doc_chars})"
            )

    @classmethod
    def tiny(cls) -> ServerLimits:
        """Small limits that tests can reach quickly."""
        return cls(
            max_frame_bytes=4096, max_text_chars=1000, max_doc_chars=2000, max_ops_per_edit=4, max_gap_tokens=32,
            max_docs=8, max_sessions=4, max_open_docs=4, max_gens_per_session=2, rate_per_s=20.0, rate_burst=20,
        )  # fmt: skip

    def to_wire(self) -> Limits:
        return Limits(**dataclasses.asdict(self))


# --------------------------------------------------------------------------------------------------------------
# Errors


class ErrorCode(StrEnum):
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_PARAMS = "invalid_params"
    UNSUPPORTED_PROTOCOL = "unsupported_protocol"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    STALE_VERSION = "stale_version"
    CONFLICT = "conflict"
    BUSY = "busy"
    TOO_LARGE = "too_large"
    RATE_LIMITED = "rate_limited"
    INTERNAL = "internal"


# code -> (retryable, when). `retryable` says whether the same request may succeed later unchanged, or (for
# stale_version) after the client re-reads the document; docs/protocol.md renders this table.
ERROR_TABLE: dict[ErrorCode, tuple[bool, str]] = {
    ErrorCode.INVALID_MESSAGE: (False, "the frame is not a JSON object with a string `type`, or `id` is malformed"),
    ErrorCode.UNKNOWN_TYPE: (False, "`type` names no dcanvas/1 request"),
    ErrorCode.INVALID_PARAMS: (False, "a field is missing, has the wrong type or is out of range"),
    ErrorCode.UNSUPPORTED_PROTOCOL: (False, "`hello.protocol` is not dcanvas/1 (the server then closes with 4409)"),
    ErrorCode.UNAUTHORIZED: (False, "no `hello` yet, or a missing or wrong token (the server then closes, 1008)"),
    ErrorCode.NOT_FOUND: (False, "no such document or generation"),
    ErrorCode.STALE_VERSION: (True, "`base_v` is old and the request overlaps what changed since; `data.current_v`"),
    ErrorCode.CONFLICT: (False, "the request contradicts the document (pinned text, nothing to undo, resolved)"),
    ErrorCode.BUSY: (True, "too many running generations; try again when one is done"),
    ErrorCode.TOO_LARGE: (False, "a frame, text, document or count exceeds `welcome.limits`"),
    ErrorCode.RATE_LIMITED: (True, "too many messages per second on this connection"),
    ErrorCode.INTERNAL: (False, "a server bug; the message says nothing more (details are in the server log)"),
}

RequestId = Annotated[str, Field(min_length=1, max_length=64)] | Annotated[int, Field(ge=-(2**53), le=2**53)]
_REQUEST_ID: TypeAdapter[str | int] = TypeAdapter(RequestId)


class ProtocolError(Exception):
    """A request failed with a dcanvas/1 error code. Raised by parsing, by the server's handlers and by the client."""

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        re: str | int | None = None,
        *,
        data: dict[str, Any] | None = None,
        retryable: bool | None = None,
    ) -> None:
        self.code = ErrorCode(code)
        self.message = message
        self.re = re
        self.data = data
        self.retryable = ERROR_TABLE[self.code][0] if retryable is None else retryable
        super().__init__(f"{self.code.value}: {message}")

    def to_message(self) -> ErrorReply:
        return ErrorReply(re=self.re, code=self.code, message=self.message, retryable=self.retryable, data=self.data)

    @classmethod
    def from_message(cls, msg: ErrorReply) -> ProtocolError:
        return cls(msg.code, msg.message, msg.re, data=msg.data, retryable=msg.retryable)


# The one place that maps domain exceptions to codes. Keys are `module.QualName` so that this module stays light
# (importing it must not import torch); the lookup walks the exception's MRO, so subclasses inherit their code.
EXCEPTION_CODES: dict[str, ErrorCode] = {
    "canvas.store.DocumentNotFound": ErrorCode.NOT_FOUND,
    "canvas.document.errors.RangeError": ErrorCode.INVALID_PARAMS,
    "canvas.document.errors.TokenizationError": ErrorCode.INVALID_PARAMS,
    "canvas.document.errors.WindowError": ErrorCode.CONFLICT,
    "canvas.document.errors.HistoryError": ErrorCode.CONFLICT,
    "canvas.document.errors.CanvasFullError": ErrorCode.TOO_LARGE,
    "canvas.document.errors.StaleVersionError": ErrorCode.STALE_VERSION,
    # ProposalError and StateError mean a bug or a corrupt store, not a bad request: they stay `internal`.
}


def error_for_exception(exc: BaseException, re: str | int | None = None) -> ProtocolError:
    """The wire error for an exception. Unmapped exceptions become `internal` with a message that leaks nothing."""
    if isinstance(exc, ProtocolError):
        if exc.re is None and re is not None:
            return ProtocolError(exc.code, exc.message, re, data=exc.data, retryable=exc.retryable)
        return exc
    for cls in type(exc).__mro__:
        code = EXCEPTION_CODES.get(f"{cls.__module__}.{cls.__qualname__}")
        if code is not None:
            return ProtocolError(code, str(exc) or cls.__name__, re)
    return ProtocolError(ErrorCode.INTERNAL, "internal server error", re)


# --------------------------------------------------------------------------------------------------------------
# Shared pieces

DocId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
GenId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Offset = Annotated[int, Field(ge=0, le=2**31)]
Version = Annotated[int, Field(ge=0, le=2**53)]
Name = Annotated[str, Field(max_length=200)]
Mode = Literal["diffusion", "ar"]


class _Model(BaseModel):
    # strict: JSON numbers must be numbers; extra="ignore": unknown fields are dropped (forward compatibility).
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True, allow_inf_nan=False)


def _limits(info: ValidationInfo) -> ServerLimits:
    ctx = info.context
    if isinstance(ctx, dict) and isinstance(ctx.get("limits"), ServerLimits):
        return ctx["limits"]
    return _DEFAULT_LIMITS


def _check_text(value: str | None, info: ValidationInfo) -> str | None:
    if value is not None and len(value) > _limits(info).max_text_chars:
        raise ValueError(f"text has {len(value)} characters, more than the limit of {_limits(info).max_text_chars}")
    return value


class _Range(_Model):
    start: Offset
    end: Offset

    @model_validator(mode="after")
    def _ordered(self) -> _Range:
        if self.start > self.end:
            raise ValueError(f"start ({self.start}) must be <= end ({self.end})")
        return self


# --------------------------------------------------------------------------------------------------------------
# doc.edit ops


class ReplaceOp(_Range):
    """Replace the characters `[start, end)` with `text` (insert when start == end, delete when text is empty)."""

    op: Literal["replace"] = "replace"
    text: str

    @field_validator("text")
    @classmethod
    def _bounded_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _check_text(value, info)


class PinOp(_Range):
    """Pin `[start, end)`: the model must keep this text."""

    op: Literal["pin"] = "pin"


class UnpinOp(_Range):
    op: Literal["unpin"] = "unpin"


class MaskOp(_Range):
    """Mask `[start, end)`: its text becomes free slots that the next generation rewrites."""

    op: Literal["mask"] = "mask"


class UnmaskOp(_Range):
    op: Literal["unmask"] = "unmask"


class InsertGapOp(_Model):
    """Insert `n_tokens` free slots at character offset `at` (infill)."""

    op: Literal["insert_gap"] = "insert_gap"
    at: Offset
    n_tokens: Annotated[int, Field(ge=1)]

    @field_validator("n_tokens")
    @classmethod
    def _gap_limit(cls, value: int, info: ValidationInfo) -> int:
        if value > _limits(info).max_gap_tokens:
            raise ValueError(f"n_tokens ({value}) is more than the limit of {_limits(info).max_gap_tokens}")
        return value


class MoveWindowOp(_Model):
    """Move the canvas window so that it starts at (the token containing) character offset `start`."""

    op: Literal["move_window"] = "move_window"
    start: Offset


EditOp = Annotated[
    ReplaceOp | PinOp | UnpinOp | MaskOp | UnmaskOp | InsertGapOp | MoveWindowOp, Field(discriminator="op")
]
EDIT_OP: TypeAdapter[EditOp] = TypeAdapter(EditOp)


class GenParams(_Model):
    """Sampler parameters of one generation. A sampler field left out (None) takes the model's default (its
    `generation_config.json`, announced in `welcome.model.defaults`); `gen.accepted` echoes the resolved values."""

    mode: Mode = "diffusion"
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


class GenDefaults(_Model):
    """The model's sampler defaults: what a `gen.start` gets for the GenParams fields it leaves out."""

    max_steps: int
    entropy_bound: float
    t_max: float
    t_min: float


# --------------------------------------------------------------------------------------------------------------
# Client -> server


class _Request(_Model):
    id: RequestId | None = None


class ClientInfo(_Model):
    name: Annotated[str, Field(max_length=64)]
    version: Annotated[str, Field(max_length=32)] = ""


class Hello(_Request):
    type: Literal["hello"] = "hello"
    protocol: Annotated[str, Field(max_length=32)]
    client: ClientInfo | None = None
    token: Annotated[str, Field(max_length=256)] | None = None


class DocOpen(_Request):
    """Open document `doc_id`, or (without it) create a new document from `text` (default empty)."""

    type: Literal["doc.open"] = "doc.open"
    doc_id: DocId | None = None
    text: str | None = None
    name: Name | None = None

    @field_validator("text")
    @classmethod
    def _bounded_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        return _check_text(value, info)

    @model_validator(mode="after")
    def _one_source(self) -> DocOpen:
        if self.doc_id is not None and self.text is not None:
            raise ValueError("give doc_id (open) or text (create), not both")
        return self


class DocClose(_Request):
    """Stop receiving `doc.state` broadcasts of a document."""

    type: Literal["doc.close"] = "doc.close"
    doc_id: DocId


class DocEdit(_Request):
    type: Literal["doc.edit"] = "doc.edit"
    doc_id: DocId
    base_v: Version
    ops: Annotated[list[EditOp], Field(min_length=1)]

    @field_validator("ops")
    @classmethod
    def _op_limit(cls, value: list[EditOp], info: ValidationInfo) -> list[EditOp]:
        if len(value) > _limits(info).max_ops_per_edit:
            raise ValueError(f"{len(value)} ops is more than the limit of {_limits(info).max_ops_per_edit}")
        return value


class GenStart(_Request):
    type: Literal["gen.start"] = "gen.start"
    doc_id: DocId
    base_v: Version
    params: GenParams = GenParams()


class GenCancel(_Request):
    type: Literal["gen.cancel"] = "gen.cancel"
    gen: GenId


class ProposalAccept(_Request):
    """Apply a finished generation's proposal as one undo unit; `hunks` picks changed hunks (default: all)."""

    type: Literal["proposal.accept"] = "proposal.accept"
    gen: GenId
    base_v: Version
    hunks: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=4096)] | None = None


class ProposalReject(_Request):
    type: Literal["proposal.reject"] = "proposal.reject"
    gen: GenId


class HistoryUndo(_Request):
    type: Literal["history.undo"] = "history.undo"
    doc_id: DocId


class HistoryRedo(_Request):
    type: Literal["history.redo"] = "history.redo"
    doc_id: DocId


class DocList(_Request):
    type: Literal["doc.list"] = "doc.list"


class Ping(_Request):
    type: Literal["ping"] = "ping"


ClientMessage = Annotated[
    Hello
    | DocOpen
    | DocClose
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
CLIENT_MESSAGES: dict[str, type[_Request]] = {
    m.model_fields["type"].default: m
    for m in (Hello, DocOpen, DocClose, DocEdit, GenStart, GenCancel, ProposalAccept, ProposalReject, HistoryUndo,
              HistoryRedo, DocList, Ping)
}  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Server -> client


class _Reply(_Model):
    re: RequestId | None = None


class ServerInfo(_Model):
    name: str
    version: str


class ModelInfo(_Model):
    name: str
    canvas_length: Annotated[int, Field(ge=1)]
    modes: list[Mode]
    # A server that predates model defaults sends none: it used the reference defaults.
    defaults: GenDefaults = Field(
        default_factory=lambda: GenDefaults(max_steps=48, entropy_bound=0.1, t_max=0.8, t_min=0.4)
    )


class Limits(_Model):
    """The wire form of `ServerLimits` (same fields)."""

    max_frame_bytes: int
    max_text_chars: int
    max_doc_chars: int
    max_ops_per_edit: int
    max_gap_tokens: int
    max_docs: int
    max_sessions: int
    max_open_docs: int
    max_gens_per_session: int
    rate_per_s: float
    rate_burst: int
    max_fps: float


class Welcome(_Reply):
    type: Literal["welcome"] = "welcome"
    protocol: str = PROTOCOL
    session: str
    server: ServerInfo
    model: ModelInfo
    limits: Limits


class Window(_Range):
    """The canvas window in character offsets of the text."""


class Span(_Range):
    """A run of window text: `pinned` text the model keeps, or `free` text it rewrites. `slots` is the number of
    canvas slots the run takes; a gap is a zero-width free span (`start == end`) with `slots` new tokens."""

    kind: Literal["pinned", "free"]
    slots: Annotated[int, Field(ge=0)] = 0


class DocState(_Reply):
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


class DocSummary(_Model):
    doc_id: DocId
    name: str = ""
    v: Version
    chars: Annotated[int, Field(ge=0)]
    updated: float  # seconds since the epoch


class DocListing(_Reply):
    type: Literal["doc.listing"] = "doc.listing"
    docs: list[DocSummary]


class Ack(_Reply):
    """The reply to requests that have no other result (doc.close, gen.cancel, proposal.reject)."""

    type: Literal["ack"] = "ack"


class GenAccepted(_Reply):
    type: Literal["gen.accepted"] = "gen.accepted"
    gen: GenId
    doc_id: DocId
    base_v: Version
    params: GenParams  # resolved: the seed is filled in


class SlotUpdate(_Model):
    i: Annotated[int, Field(ge=0)]  # slot index inside the canvas window
    token: int
    text: str
    entropy: Annotated[float, Field(ge=0)] | None = None
    accepted: bool


class GenProgress(_Reply):
    """Changed slots since the previous frame of this generation. Frames are coalesced latest-wins: `merged` engine
    frames went into this one. `seq` counts frames sent for the generation (1, 2, ...); a gap means a frame was lost
    and the client must resynchronise (`doc.open`)."""

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


class DiffSegment(_Model):
    op: Literal["equal", "insert", "delete"]
    text: str


class Proposal(_Model):
    """Replace `[start, end)` of the text at `base_v` with `text`; `diff` goes from the old to the new text.
    A hunk is a maximal run of non-equal segments; `proposal.accept.hunks` indexes hunks from 0."""

    base_v: Version
    start: Offset
    end: Offset
    text: str
    diff: list[DiffSegment]


class GenStats(_Model):
    steps: Annotated[int, Field(ge=0)]
    tokens_per_forward: Annotated[float, Field(ge=0)]
    tok_s: Annotated[float, Field(ge=0)]
    wall_s: Annotated[float, Field(ge=0)]


GenStatus = Literal["completed", "cancelled", "superseded", "stale", "failed"]


class GenDone(_Reply):
    """The one terminal event of every accepted generation, whatever happened to it."""

    type: Literal["gen.done"] = "gen.done"
    gen: GenId
    doc_id: DocId
    status: GenStatus
    proposal: Proposal | None = None  # present when status is completed
    stats: GenStats
    message: str | None = None  # why, for stale and failed


class Pong(_Reply):
    type: Literal["pong"] = "pong"


class ErrorReply(_Reply):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    retryable: bool
    data: dict[str, Any] | None = None


ServerMessage = Annotated[
    Welcome | DocState | DocListing | Ack | GenAccepted | GenProgress | GenDone | Pong | ErrorReply,
    Field(discriminator="type"),
]
SERVER_MESSAGES: dict[str, type[_Reply]] = {
    m.model_fields["type"].default: m
    for m in (Welcome, DocState, DocListing, Ack, GenAccepted, GenProgress, GenDone, Pong, ErrorReply)
}
_DEFAULT_LIMITS = ServerLimits()


# --------------------------------------------------------------------------------------------------------------
# Parsing and encoding


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is too large for a number (it would be Infinity)")
    return value


def describe_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors(include_url=False)[:5]:
        # Discriminated unions put the tag in the path (`ops.0.replace.start`); the tag is noise to a reader.
        loc = [str(p) for p in e["loc"] if not (isinstance(p, str) and p in _TAGS)]
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc) or 'message'}: {msg}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _load_object(raw: str | bytes, max_bytes: int | None) -> dict[str, Any]:
    size = len(raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw)
    if max_bytes is not None and size > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {size} bytes is over the limit of {max_bytes}")
    try:
        obj = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "frame is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, over-long integers
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"frame is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"frame must be a JSON object, not {type(obj).__name__}")
    return obj


def _request_id(obj: dict[str, Any]) -> str | int | None:
    rid = obj.get("id")
    if rid is None or isinstance(rid, bool):
        return None
    try:
        return _REQUEST_ID.validate_python(rid)
    except ValidationError:
        return None


def parse_client_message(raw: str | bytes, limits: ServerLimits | None = None) -> ClientRequest:
    """Parse one client frame. Raises `ProtocolError` (with `re` set when the id was readable) on any problem."""
    limits = limits or _DEFAULT_LIMITS
    obj = _load_object(raw, limits.max_frame_bytes)
    re = _request_id(obj)
    if "id" in obj and obj["id"] is not None and re is None:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "id: must be a string of 1-64 characters or an integer")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "type: missing, or not a string", re)
    model = CLIENT_MESSAGES.get(kind)
    if model is None:
        shown = kind if len(kind) <= 40 else kind[:40] + "..."
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"type: unknown message type {shown!r}", re)
    try:
        # Validate the already-decoded object; JSON strictness (no "1" for 1) comes from strict=True, which in
        # python mode would also demand model instances for nested models, hence the JSON round trip for those.
        return model.model_validate_json(json.dumps(obj), context={"limits": limits})
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors(include_url=False)):
            # json.loads accepts escapes of unpaired surrogates ("\ud800"); such strings cannot be stored or sent.
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE, "frame holds a string that is not valid Unicode", re
            ) from None
        raise ProtocolError(ErrorCode.INVALID_PARAMS, f"{kind}: {describe_error(e)}", re) from None


def parse_server_message(raw: str | bytes) -> ServerReply:
    """Parse one server frame (for clients). Raises `ProtocolError(invalid_message)` on anything malformed."""
    obj = _load_object(raw, None)
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in SERVER_MESSAGES:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"type: unknown server message type {kind!r}")
    try:
        return SERVER_MESSAGES[kind].model_validate_json(json.dumps(obj))
    except ValidationError as e:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"{kind}: {describe_error(e)}") from None


def parse_op(obj: dict[str, Any] | BaseModel) -> EditOp:
    """Validate one edit op given as a dict (for client code building ops by hand)."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump()
    try:
        return EDIT_OP.validate_json(json.dumps(obj))
    except (TypeError, ValueError) as e:
        detail = describe_error(e) if isinstance(e, ValidationError) else str(e)
        raise ProtocolError(ErrorCode.INVALID_PARAMS, f"op: {detail}") from None


def dump(msg: BaseModel) -> str:
    """Encode a message as one JSON text frame (absent optional fields are left out)."""
    return msg.model_dump_json(exclude_none=True)


# Each base class is what parsing returns; the Annotated unions above are for the schema and for type hints.
ClientRequest = _Request
ServerReply = _Reply
_TAGS = frozenset(CLIENT_MESSAGES) | frozenset(SERVER_MESSAGES) | {
    "replace", "pin", "unpin", "mask", "unmask", "insert_gap", "move_window",
}  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Schema and CLI


def json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of every dcanvas/1 message, generated from the models above."""
    defs: dict[str, Any] = {}
    top: dict[str, Any] = {}
    adapters: dict[str, TypeAdapter[Any]] = {
        "ClientMessage": TypeAdapter(ClientMessage),
        "ServerMessage": TypeAdapter(ServerMessage),
    }
    for name, adapter in adapters.items():
        schema = adapter.json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        top[name] = schema
    defs.update(top)
    for schema in defs.values():
        # The tag fields have defaults (so Python code need not spell them), but on the wire they are required.
        props = schema.get("properties", {})
        tags = [k for k in ("type", "op") if "const" in props.get(k, {})]
        if tags:
            schema["required"] = sorted(set(schema.get("required", [])) | set(tags))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:dcanvas:1",
        "title": f"{PROTOCOL} messages",
        "description": "One JSON text frame per message. Client requests: ClientMessage; server replies and "
        "events: ServerMessage. Unknown fields are ignored. See docs/protocol.md.",
        "protocol": PROTOCOL,
        "oneOf": [{"$ref": "#/$defs/ClientMessage"}, {"$ref": "#/$defs/ServerMessage"}],
        "$defs": dict(sorted(defs.items())),
    }


def _print_schema(args: argparse.Namespace) -> int:
    text = json.dumps(json_schema(), indent=args.indent, sort_keys=False) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    """`dcanvas schema [--indent N] [-o FILE]`."""
    parser.add_argument("--indent", type=int, default=2, help="JSON indent (default 2)")
    parser.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    parser.set_defaults(func=_print_schema)
