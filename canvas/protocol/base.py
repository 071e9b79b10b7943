"""dcanvas/1 foundations: the protocol name, `ServerLimits` and its wire form, the `ErrorCode` table, and the
pydantic base every message builds on (strict JSON numbers, unknown fields ignored, frozen), with the shared field
types and the limit checks that read `ServerLimits` from the validation context.

Invariant: this module imports no other part of `canvas` (the messages and the parser build on it, not the reverse).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, model_validator

PROTOCOL = "dcanvas/1"


# --------------------------------------------------------------------------------------------------------------
# Base model and shared field types

DocId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
GenId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Offset = Annotated[int, Field(ge=0, le=2**31)]
Version = Annotated[int, Field(ge=0, le=2**53)]
Name = Annotated[str, Field(max_length=200)]
Mode = Literal["diffusion", "ar"]


class WireModel(BaseModel):
    # strict: JSON numbers must be numbers; extra="ignore": unknown fields are dropped (forward compatibility).
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True, allow_inf_nan=False)


def limits_from(info: ValidationInfo) -> ServerLimits:
    ctx = info.context
    if isinstance(ctx, dict) and isinstance(ctx.get("limits"), ServerLimits):
        return ctx["limits"]
    return DEFAULT_LIMITS


def check_text(value: str | None, info: ValidationInfo) -> str | None:
    if value is not None and len(value) > limits_from(info).max_text_chars:
        raise ValueError(f"text has {len(value)} characters, more than the limit of {limits_from(info).max_text_chars}")
    return value


class Range(WireModel):
    start: Offset
    end: Offset

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.start > self.end:
            raise ValueError(f"start ({self.start}) must be <= end ({self.end})")
        return self


class Limits(WireModel):
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


DEFAULT_LIMITS = ServerLimits()


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
    ErrorCode.BUSY: (True, "the generation queue is full (`data` says when to retry) or max_gens_per_session run"),
    ErrorCode.TOO_LARGE: (False, "a frame, text, document or count exceeds `welcome.limits`"),
    ErrorCode.RATE_LIMITED: (True, "too many messages per second on this connection"),
    ErrorCode.INTERNAL: (False, "a server bug; the message says nothing more (details are in the server log)"),
}

RequestId = Annotated[str, Field(min_length=1, max_length=64)] | Annotated[int, Field(ge=-(2**53), le=2**53)]
REQUEST_ID: TypeAdapter[str | int] = TypeAdapter(RequestId)
