"""dcanvas/1 messages: parsing, typed errors that name the field, limits, round trips and the JSON Schema."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from canvas import protocol as p
from canvas.protocol import ErrorCode, ProtocolError, ServerLimits


def _parse_error(raw: str | bytes, limits: ServerLimits | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        p.parse_client_message(raw, limits)
    return info.value


def _frame(**fields: Any) -> str:
    return json.dumps(fields)


# -- valid requests --------------------------------------------------------------------------------------------

VALID_REQUESTS: list[dict[str, Any]] = [
    {"type": "hello", "id": 1, "protocol": "dcanvas/1", "client": {"name": "vim", "version": "0.1"}, "token": "t"},
    {"type": "doc.open", "id": "a", "text": "Once upon a time", "name": "story"},
    {"type": "doc.open", "id": 2, "doc_id": "d-1f"},
    {"type": "doc.close", "doc_id": "d1"},
    {"type": "doc.delete", "doc_id": "d1"},
    {"type": "doc.delete", "doc_id": "d1", "base_v": 4},
    {
        "type": "doc.edit",
        "id": 3,
        "doc_id": "d1",
        "base_v": 4,
        "ops": [
            {"op": "replace", "start": 0, "end": 4, "text": "Twice"},
            {"op": "pin", "start": 0, "end": 5},
            {"op": "unpin", "start": 1, "end": 2},
            {"op": "mask", "start": 6, "end": 10},
            {"op": "unmask", "start": 6, "end": 6},
            {"op": "insert_gap", "at": 3, "n_tokens": 16},
            {"op": "move_window", "start": 0},
        ],
    },
    {"type": "gen.start", "id": 5, "doc_id": "d1", "base_v": 4},
    {
        "type": "gen.start",
        "doc_id": "d1",
        "base_v": 4,
        "params": {
            "mode": "ar",
            "max_steps": 256,
            "entropy_bound": 2,
            "t_max": 1,
            "t_min": 1,
            "seed": 7,
            "stream_every": 3,
        },
    },  # fmt: skip
    {"type": "gen.cancel", "gen": "g1"},
    {"type": "proposal.accept", "gen": "g1", "base_v": 9},
    {"type": "proposal.accept", "gen": "g1", "base_v": 9, "hunks": [0, 2]},
    {"type": "proposal.reject", "gen": "g1"},
    {"type": "history.undo", "doc_id": "d1"},
    {"type": "history.redo", "doc_id": "d1"},
    {"type": "doc.list"},
    {"type": "ping", "id": "p"},
]


def test_every_request_type_has_a_valid_example() -> None:
    assert {m["type"] for m in VALID_REQUESTS} == set(p.CLIENT_MESSAGES)


@pytest.mark.parametrize("msg", VALID_REQUESTS, ids=lambda m: m["type"])
def test_valid_requests_parse_and_round_trip(msg: dict[str, Any]) -> None:
    parsed = p.parse_client_message(json.dumps(msg))
    assert parsed.type == msg["type"]  # type: ignore[attr-defined]
    assert parsed.id == msg.get("id")
    again = p.parse_client_message(p.dump(parsed))
    assert again == parsed
    # Every field the client sent comes back with the same value (defaults may add more).
    dumped = json.loads(p.dump(parsed))
    for key, value in msg.items():
        if isinstance(value, dict):
            assert dumped[key] | value == dumped[key]
        else:
            assert dumped[key] == value


def test_bytes_frames_parse_like_text() -> None:
    assert p.parse_client_message(b'{"type":"ping","id":3}') == p.Ping(id=3)


def test_unknown_fields_are_ignored() -> None:
    msg = p.parse_client_message(_frame(type="ping", id=1, future_field={"x": 1}, v=3))
    assert msg == p.Ping(id=1)


def test_gen_params_mode_null_is_the_model_default() -> None:
    msg = p.parse_client_message(_frame(type="gen.start", doc_id="d", base_v=0, params={"mode": None}))
    assert isinstance(msg, p.GenStart) and msg.params.mode is None
    welcome = p.ModelInfo(name="m", canvas_length=8, modes=["diffusion", "ar"])
    assert welcome.default_modes == p.DefaultModes(infill="diffusion", continuation="diffusion")  # an older server


def test_gen_params_left_out_are_none_for_the_server_to_fill() -> None:
    msg = p.parse_client_message(_frame(type="gen.start", doc_id="d", base_v=0))
    assert isinstance(msg, p.GenStart)
    assert msg.params == p.GenParams() and msg.params.mode is None  # the server resolves the model's default
    sampler = (msg.params.max_steps, msg.params.entropy_bound, msg.params.t_max, msg.params.t_min, msg.params.seed)
    assert sampler == (None,) * 5 and msg.params.stream_every == 1
    with pytest.raises(ValidationError, match="t_max"):  # both given: checked at the wire
        p.GenParams(t_max=0.2, t_min=0.3)


# -- bad frames: codes, messages, re ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "code", "fragment"),
    [
        ("not json", ErrorCode.INVALID_MESSAGE, "not valid JSON"),
        ("", ErrorCode.INVALID_MESSAGE, "not valid JSON"),
        ("[1, 2]", ErrorCode.INVALID_MESSAGE, "JSON object"),
        ('"ping"', ErrorCode.INVALID_MESSAGE, "JSON object"),
        ('{"id": 1}', ErrorCode.INVALID_MESSAGE, "type"),
        ('{"type": 5}', ErrorCode.INVALID_MESSAGE, "type"),
        ('{"type": "ping", "id": {"a": 1}}', ErrorCode.INVALID_MESSAGE, "id"),
        ('{"type": "ping", "id": ""}', ErrorCode.INVALID_MESSAGE, "id"),
        ('{"type": "ping", "id": true}', ErrorCode.INVALID_MESSAGE, "id"),
        ('{"type": "gen.start", "doc_id": "d", "base_v": NaN}', ErrorCode.INVALID_MESSAGE, "NaN"),
        ('{"type": "ping", "id": 1e400}', ErrorCode.INVALID_MESSAGE, "Infinity"),
        ('{"type": "ping", "id": ' + "9" * 5000 + "}", ErrorCode.INVALID_MESSAGE, "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, ErrorCode.INVALID_MESSAGE, "nested"),
        ('{"type": "doc.open", "text": "\\ud800"}', ErrorCode.INVALID_MESSAGE, "Unicode"),
        (b"\xff\xfe\x00", ErrorCode.INVALID_MESSAGE, "not valid JSON"),
        ('{"type": "launch.missiles", "id": 9}', ErrorCode.UNKNOWN_TYPE, "launch.missiles"),
        ('{"type": "welcome", "id": 9}', ErrorCode.UNKNOWN_TYPE, "welcome"),
    ],
)
def test_malformed_frames_get_typed_errors(raw: str | bytes, code: ErrorCode, fragment: str) -> None:
    err = _parse_error(raw)
    assert err.code is code
    assert fragment in err.message
    assert err.retryable is False


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        ({"type": "hello", "id": 1}, "protocol"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": []}, "ops"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": -1, "ops": [{"op": "pin", "start": 0, "end": 1}]},
         "base_v"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": "3", "ops": [{"op": "pin", "start": 0, "end": 1}]},
         "base_v"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": [{"op": "pin", "start": 2.5, "end": 3}]},
         "ops.0.start"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": [{"op": "mask", "start": -1, "end": 3}]},
         "ops.0.start"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": [{"op": "mask", "start": 5, "end": 3}]},
         "start (5) must be <= end (3)"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": [{"op": "explode", "start": 0}]}, "ops.0"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": [{"start": 0, "end": 1}]}, "ops.0"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": [{"op": "replace", "start": 0, "end": 0}]},
         "ops.0.text"),
        ({"type": "doc.edit", "id": 1, "doc_id": "d", "base_v": 0, "ops": [{"op": "insert_gap", "at": 0,
                                                                            "n_tokens": 0}]}, "ops.0.n_tokens"),
        ({"type": "doc.edit", "id": 1, "doc_id": "../etc", "base_v": 0, "ops": [{"op": "pin", "start": 0, "end": 1}]},
         "doc_id"),
        ({"type": "doc.open", "id": 1, "doc_id": "d", "text": "x"}, "not both"),
        ({"type": "doc.open", "id": 1, "name": "n" * 201}, "name"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"mode": "beam"}}, "params.mode"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"max_steps": 0}}, "params.max_steps"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"max_steps": 257}},
         "params.max_steps"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"entropy_bound": 0}},
         "params.entropy_bound"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"t_min": -0.1}}, "params.t_min"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"t_min": 0}}, "params.t_min"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"t_max": 0.2, "t_min": 0.3}},
         "t_max (0.2) must be >= t_min (0.3)"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"stream_every": 0}},
         "params.stream_every"),
        ({"type": "gen.start", "id": 1, "doc_id": "d", "base_v": 0, "params": {"seed": -1}}, "params.seed"),
        ({"type": "gen.cancel", "id": 1}, "gen"),
        ({"type": "proposal.accept", "id": 1, "gen": "g", "base_v": 0, "hunks": [-1]}, "hunks.0"),
        ({"type": "history.undo", "id": 1, "doc_id": 7}, "doc_id"),
    ],
)  # fmt: skip
def test_invalid_params_name_the_field_and_echo_the_id(msg: dict[str, Any], field: str) -> None:
    err = _parse_error(json.dumps(msg))
    assert err.code is ErrorCode.INVALID_PARAMS
    assert err.re == 1
    assert field in err.message, err.message
    assert err.message.startswith(msg["type"])


def test_no_pydantic_error_escapes_for_any_json_value() -> None:
    values: list[Any] = [None, True, 0, -1, 2**70, 1.5, "", "x" * 70, [], {}, [1], {"a": None}]
    for kind in p.CLIENT_MESSAGES:
        fields = {name for name in p.CLIENT_MESSAGES[kind].model_fields} - {"type"}
        for name in fields:
            for value in values:
                try:
                    p.parse_client_message(json.dumps({"type": kind, name: value}))
                except ProtocolError:
                    pass


# -- limits ----------------------------------------------------------------------------------------------------


def test_frame_size_limit() -> None:
    limits = ServerLimits.tiny()
    ok = _frame(type="doc.open", text="a" * 500)
    p.parse_client_message(ok, limits)
    err = _parse_error(_frame(type="doc.open", id=1, text="a" * limits.max_frame_bytes), limits)
    assert err.code is ErrorCode.TOO_LARGE
    assert str(limits.max_frame_bytes) in err.message
    # Multi-byte characters count as bytes, not characters.
    raw = '{"type": "doc.open", "text": "' + "é" * 2100 + '"}'
    assert len(raw) < limits.max_frame_bytes < len(raw.encode())
    assert _parse_error(raw, limits).code is ErrorCode.TOO_LARGE


def test_text_ops_and_gap_limits_come_from_the_server_limits() -> None:
    limits = ServerLimits.tiny()
    err = _parse_error(_frame(type="doc.open", id=1, text="a" * (limits.max_text_chars + 1)), limits)
    assert err.code is ErrorCode.INVALID_PARAMS and "text" in err.message and "1000" in err.message
    pin = {"op": "pin", "start": 0, "end": 1}
    p.parse_client_message(_frame(type="doc.edit", doc_id="d", base_v=0, ops=[pin] * 4), limits)
    err = _parse_error(_frame(type="doc.edit", doc_id="d", base_v=0, ops=[pin] * 5), limits)
    assert "ops" in err.message and "5 ops" in err.message
    gap = {"op": "insert_gap", "at": 0, "n_tokens": 33}
    err = _parse_error(_frame(type="doc.edit", doc_id="d", base_v=0, ops=[gap]), limits)
    assert "ops.0.n_tokens" in err.message
    replace = {"op": "replace", "start": 0, "end": 0, "text": "b" * 1001}
    err = _parse_error(_frame(type="doc.edit", doc_id="d", base_v=0, ops=[replace]), limits)
    assert "ops.0.text" in err.message
    # The default limits accept what the tiny ones refuse.
    p.parse_client_message(_frame(type="doc.edit", doc_id="d", base_v=0, ops=[gap, replace]))


def test_server_limits_validate_and_match_the_wire_form() -> None:
    with pytest.raises(ValueError, match="max_ops_per_edit"):
        ServerLimits(max_ops_per_edit=0)
    with pytest.raises(ValueError, match="max_text_chars"):
        ServerLimits(max_text_chars=10, max_doc_chars=5)
    limits = ServerLimits()
    assert {f.name for f in dataclasses.fields(limits)} == set(p.Limits.model_fields)
    assert limits.to_wire().model_dump() == dataclasses.asdict(limits)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_docs = 3  # type: ignore[misc]


# -- errors ----------------------------------------------------------------------------------------------------


def test_error_table_covers_every_code() -> None:
    assert set(p.ERROR_TABLE) == set(ErrorCode)
    assert {c for c, (retry, _) in p.ERROR_TABLE.items() if retry} == {
        ErrorCode.STALE_VERSION,
        ErrorCode.BUSY,
        ErrorCode.RATE_LIMITED,
    }


def test_protocol_error_round_trips_through_the_wire() -> None:
    err = ProtocolError(ErrorCode.STALE_VERSION, "document moved on", "r1", data={"current_v": 7})
    msg = p.parse_server_message(p.dump(err.to_message()))
    assert isinstance(msg, p.ErrorReply)
    back = ProtocolError.from_message(msg)
    assert (back.code, back.message, back.re, back.data, back.retryable) == (
        ErrorCode.STALE_VERSION,
        "document moved on",
        "r1",
        {"current_v": 7},
        True,
    )


def test_domain_exceptions_map_to_codes_and_unknown_ones_leak_nothing() -> None:
    from canvas.store.base import DocumentNotFound

    class MoreSpecific(DocumentNotFound):
        pass

    err = p.error_for_exception(DocumentNotFound("d9"), re=4)
    assert (err.code, err.re) == (ErrorCode.NOT_FOUND, 4) and "d9" in err.message
    assert p.error_for_exception(MoreSpecific("x")).code is ErrorCode.NOT_FOUND
    secret = RuntimeError("/home/user/.ssh/id_rsa exploded at line 3")
    err = p.error_for_exception(secret, re="q")
    assert err.code is ErrorCode.INTERNAL and "ssh" not in err.message and err.re == "q"
    original = ProtocolError(ErrorCode.BUSY, "full")
    assert p.error_for_exception(original, re=5).re == 5
    assert p.error_for_exception(ProtocolError(ErrorCode.BUSY, "full", 3), re=5).re == 3


# -- server messages -------------------------------------------------------------------------------------------


def test_server_messages_round_trip() -> None:
    params = p.GenParams(seed=3)
    examples: list[p.ServerReply] = [
        p.Welcome(
            re=1,
            session="s1",
            server=p.ServerInfo(name="dcanvas", version="0.1.0"),
            model=p.ModelInfo(name="tiny", canvas_length=256, modes=["diffusion", "ar"]),
            limits=ServerLimits().to_wire(),
        ),
        p.DocState(
            doc_id="d1",
            v=3,
            text="héllo wörld",
            window=p.Window(start=0, end=11),
            spans=[p.Span(kind="pinned", start=0, end=5), p.Span(kind="free", start=5, end=5, slots=8)],
            can_undo=True,
            gen="g2",
        ),  # fmt: skip
        p.DocDeleted(re=2, doc_id="d1"),
        p.DocListing(re="x", docs=[p.DocSummary(doc_id="d1", name="a", v=3, chars=11, updated=1.5)]),
        p.Ack(re=4),
        p.GenAccepted(re=5, gen="g2", doc_id="d1", base_v=3, params=params),
        p.GenProgress(
            re=5,
            gen="g2",
            seq=1,
            step=0,
            max_steps=48,
            merged=2,
            accepted=1,
            free=8,
            slots=[p.SlotUpdate(i=5, token=17, text=" the", entropy=0.25, accepted=True)],
        ),  # fmt: skip
        p.GenDone(
            re=5,
            gen="g2",
            doc_id="d1",
            status="completed",
            proposal=p.Proposal(base_v=3, start=5, end=5, text=" big", diff=[p.DiffSegment(op="insert", text=" big")]),
            stats=p.GenStats(steps=12, tokens_per_forward=0.7, tok_s=40.0, wall_s=0.2),
        ),  # fmt: skip
        p.GenDone(
            gen="g3",
            doc_id="d1",
            status="stale",
            message="edited",
            stats=p.GenStats(steps=1, tokens_per_forward=0, tok_s=0, wall_s=0.01),
        ),  # fmt: skip
        p.Pong(re="p"),
        ProtocolError(ErrorCode.NOT_FOUND, "no document 'x'").to_message(),
    ]
    assert {m.type for m in examples} == set(p.SERVER_MESSAGES)  # type: ignore[attr-defined]
    for msg in examples:
        assert p.parse_server_message(p.dump(msg)) == msg
        assert "null" not in p.dump(msg)  # absent optionals are left out, not sent as null


def test_parse_server_message_rejects_junk() -> None:
    with pytest.raises(ProtocolError) as info:
        p.parse_server_message('{"type": "doc.state", "doc_id": "d"}')
    assert info.value.code is ErrorCode.INVALID_MESSAGE and "v" in info.value.message
    with pytest.raises(ProtocolError) as info:
        p.parse_server_message('{"type": "hello", "protocol": "dcanvas/1"}')
    assert info.value.code is ErrorCode.UNKNOWN_TYPE


def test_parse_op() -> None:
    assert p.parse_op({"op": "mask", "start": 1, "end": 2}) == p.MaskOp(start=1, end=2)
    assert p.parse_op(p.PinOp(start=0, end=3)) == p.PinOp(start=0, end=3)
    with pytest.raises(ProtocolError, match="start"):
        p.parse_op({"op": "mask", "start": 3, "end": 2})
    with pytest.raises(ProtocolError):
        p.parse_op({"op": "mask", "start": object()})


# -- schema ----------------------------------------------------------------------------------------------------


def test_json_schema_lists_every_message_and_requires_the_tag() -> None:
    schema = p.json_schema()
    defs = schema["$defs"]
    client = defs["ClientMessage"]["discriminator"]["mapping"]
    server = defs["ServerMessage"]["discriminator"]["mapping"]
    assert set(client) == set(p.CLIENT_MESSAGES)
    assert set(server) == set(p.SERVER_MESSAGES)
    for ref in [*client.values(), *server.values()]:
        name = ref.removeprefix("#/$defs/")
        assert "type" in defs[name]["required"], name
    ops = defs["DocEdit"]["properties"]["ops"]["items"]["discriminator"]["mapping"]
    assert set(ops) == {"replace", "pin", "unpin", "mask", "unmask", "insert_gap", "move_window"}
    assert set(defs["ErrorCode"]["enum"]) == {c.value for c in ErrorCode}
    assert schema["protocol"] == p.PROTOCOL == "dcanvas/1"
    json.dumps(schema)  # serialisable


def test_schema_command_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    p.register(parser)
    args = parser.parse_args(["--indent", "0"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == p.json_schema()


def test_dcanvas_schema_cli_writes_the_schema(tmp_path: Any) -> None:
    target = tmp_path / "schema.json"
    subprocess.run([sys.executable, "-m", "canvas.cli", "schema", "-o", str(target)], check=True)
    assert json.loads(target.read_text()) == p.json_schema()


# -- property: arbitrary frames never escape as anything but ProtocolError ------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(sorted(p.CLIENT_MESSAGES)) | st.text(max_size=10),
    body=st.dictionaries(st.sampled_from(["id", "doc_id", "base_v", "ops", "params", "gen", "text", "hunks"]), _json),
)
def test_random_frames_parse_or_fail_typed(kind: str, body: dict[str, Any]) -> None:
    raw = json.dumps({"type": kind, **body})
    try:
        msg = p.parse_client_message(raw)
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode) and e.message
    else:
        assert p.parse_client_message(p.dump(msg)) == msg


# -- the plugin authors' page ----------------------------------------------------------------------------------


def test_docs_example_session_is_valid() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "protocol.md").read_text(encoding="utf-8")
    block = page.split("## Example session", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    sent: list[p.ClientRequest] = []
    received: list[p.ServerReply] = []
    refused: dict[Any, ProtocolError] = {}
    for line in block.strip().splitlines():
        if line.startswith("> "):
            try:
                sent.append(p.parse_client_message(line[2:]))
            except ProtocolError as e:  # the example shows a malformed request: its reply must be this error
                refused[json.loads(line[2:])["id"]] = e
        elif line.startswith("< "):
            received.append(p.parse_server_message(line[2:]))
        else:
            assert line.startswith("#"), line
    assert {m.type for m in sent} >= {"hello", "doc.open", "doc.edit", "gen.start", "proposal.accept"}  # type: ignore[attr-defined]
    # Every request has exactly one direct reply with its id, in order; events carry the gen.start id.
    replies = [m for m in received if not isinstance(m, p.GenProgress | p.GenDone)]
    assert sorted(m.re for m in replies) == sorted([m.id for m in sent] + list(refused))  # type: ignore[type-var]
    for reply in replies:
        if reply.re in refused:
            assert isinstance(reply, p.ErrorReply)
            assert (reply.code, reply.message) == (refused[reply.re].code, refused[reply.re].message)
    assert {m.re for m in received if isinstance(m, p.GenProgress | p.GenDone)} == {4}
    welcome = received[0]
    assert isinstance(welcome, p.Welcome) and welcome.limits == ServerLimits().to_wire()
    # The error codes table on the page lists every code.
    for code in ErrorCode:
        assert f"| `{code.value}` |" in page
