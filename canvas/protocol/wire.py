"""dcanvas/1 on the wire: `ProtocolError` and the one mapping from domain exceptions to error codes, parsing of
client and server frames, `dump`, the JSON Schema and the `dcanvas schema` command.

Invariant: parsing never leaks a pydantic `ValidationError`. Every bad frame becomes a `ProtocolError(code,
message, re)` whose message names the offending field (`ops.0.start: ...`), and `re` echoes the request id when it
was readable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from canvas.protocol.base import DEFAULT_LIMITS, ERROR_TABLE, PROTOCOL, REQUEST_ID, ErrorCode, ServerLimits
from canvas.protocol.messages import (
    CLIENT_MESSAGES,
    EDIT_OP,
    SERVER_MESSAGES,
    ClientMessage,
    ClientRequest,
    EditOp,
    ErrorReply,
    ServerMessage,
    ServerReply,
)

# --------------------------------------------------------------------------------------------------------------
# Errors


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
    "canvas.store.base.DocumentNotFound": ErrorCode.NOT_FOUND,
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
        return REQUEST_ID.validate_python(rid)
    except ValidationError:
        return None


def parse_client_message(raw: str | bytes, limits: ServerLimits | None = None) -> ClientRequest:
    """Parse one client frame. Raises `ProtocolError` (with `re` set when the id was readable) on any problem."""
    limits = limits or DEFAULT_LIMITS
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
