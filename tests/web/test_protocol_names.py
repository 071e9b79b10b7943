"""The web client's protocol names against the server's JSON Schema, and the static checks that need no browser.

web/protocol.js is the only module of the page that spells dcanvas/1 names. These tests pin its tables to
`canvas.protocol.json_schema()` (and the close codes to docs/protocol.md), check that no other module spells a
protocol name itself, that the parameter controls in index.html match the schema's bounds, and that every import
and every file the page loads exists.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

import pytest

from canvas.protocol import PROTOCOL, json_schema
from tests.web.webfiles import REPO, WEB, exports, html_elements, imports, js_files, protocol_tables

SCHEMA = json_schema()
DEFS: dict[str, Any] = SCHEMA["$defs"]


def _union_tags(union: str) -> set[str]:
    return set(DEFS[union]["discriminator"]["mapping"])


def _enum(definition: str, prop: str) -> set[str]:
    """The values a property may take; an optional one (`anyOf` with null) gives its non-null values."""
    spec = DEFS[definition]["properties"][prop]
    return {v for option in spec.get("anyOf", [spec]) for v in option.get("enum", [])}


def _table(name: str) -> dict[str, Any]:
    table = protocol_tables()[name]
    assert isinstance(table, dict), f"protocol.js: {name} is not a table"
    return table


def test_protocol_js_parses_into_tables() -> None:
    tables = protocol_tables()
    for name in ("REQUEST", "EVENT", "OP", "SPAN_KIND", "GEN_STATUS", "DIFF_OP", "MODE", "ERROR_CODE", "GEN_PARAM"):
        assert isinstance(tables.get(name), dict) and tables[name], f"protocol.js has no table {name}"
    with pytest.raises(ValueError, match="cannot parse"):
        protocol_tables("export const X = Object.freeze({\n  A: someVariable,\n});")


def test_protocol_version_and_subprotocol() -> None:
    from canvas.server.app import SUBPROTOCOL
    from canvas.server.security import TOKEN_SUBPROTOCOL_PREFIX

    tables = protocol_tables()
    assert tables["PROTOCOL"] == PROTOCOL == SCHEMA["protocol"]
    assert tables["SUBPROTOCOL"] == SUBPROTOCOL
    assert tables["TOKEN_SUBPROTOCOL_PREFIX"] == TOKEN_SUBPROTOCOL_PREFIX


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ("REQUEST", lambda: _union_tags("ClientMessage")),
        ("EVENT", lambda: _union_tags("ServerMessage")),
        ("OP", lambda: {DEFS[ref.split("/")[-1]]["properties"]["op"]["const"] for ref in _op_refs()}),
        ("SPAN_KIND", lambda: _enum("Span", "kind")),
        ("GEN_STATUS", lambda: _enum("GenDone", "status")),
        ("DIFF_OP", lambda: _enum("DiffSegment", "op")),
        ("MODE", lambda: _enum("GenParams", "mode")),
        ("ERROR_CODE", lambda: set(DEFS["ErrorCode"]["enum"])),
        ("GEN_PARAM", lambda: set(DEFS["GenParams"]["properties"])),
    ],
)
def test_table_matches_schema(table: str, expected: Any) -> None:
    """Each table names exactly what the schema has: nothing missing (the page handles every server message and
    knows every request), nothing extra (no name the server does not know)."""
    values = set(_table(table).values())
    want = expected()
    assert values == want, f"protocol.js {table}: missing {sorted(want - values)}, unknown {sorted(values - want)}"
    assert len(values) == len(_table(table)), f"protocol.js {table} lists a value twice"


def _op_refs() -> list[str]:
    ops = DEFS["DocEdit"]["properties"]["ops"]["items"]
    return [item["$ref"] for item in ops["oneOf"]]


def test_close_codes_match_the_protocol_doc() -> None:
    doc = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    section = doc.split("## Close codes", 1)[1].split("\n## ", 1)[0]
    documented = {int(c) for c in re.findall(r"^\| (\d{4}) \|", section, re.M)}
    assert documented, "docs/protocol.md has no close-code table"
    assert set(_table("CLOSE_CODE").values()) == documented


# Names that only the protocol uses (dotted message types, error codes with an underscore): one of these spelled
# as a string literal anywhere but protocol.js is a name that a schema change would not catch.
def _distinctive_names() -> set[str]:
    names = _union_tags("ClientMessage") | _union_tags("ServerMessage") | set(DEFS["ErrorCode"]["enum"])
    names |= {DEFS[ref.split("/")[-1]]["properties"]["op"]["const"] for ref in _op_refs()}
    return {n for n in names if "." in n or "_" in n}


def _code(path_text: str) -> str:
    """JavaScript source without its comments (which may name messages freely)."""
    text = re.sub(r"/\*.*?\*/", "", path_text, flags=re.S)
    return re.sub(r"(^|\s)//.*$", "", text, flags=re.M)


def test_no_module_but_protocol_js_spells_a_protocol_name() -> None:
    distinctive = _distinctive_names()
    keyed = {
        "type": _union_tags("ClientMessage") | _union_tags("ServerMessage"),
        "op": {DEFS[ref.split("/")[-1]]["properties"]["op"]["const"] for ref in _op_refs()},
        "code": set(DEFS["ErrorCode"]["enum"]),
    }
    problems = []
    for path in js_files():
        if path.name == "protocol.js":
            continue
        text = _code(path.read_text(encoding="utf-8"))
        for literal in re.findall(r"[\"'`]([A-Za-z_.]+)[\"'`]", text):
            if literal in distinctive:
                problems.append(f"{path.name}: {literal!r}")
        for key, value in re.findall(r"\b(type|op|code)\s*(?::|===|!==)\s*[\"'`]([A-Za-z_.]+)[\"'`]", text):
            if value in keyed[key]:
                problems.append(f"{path.name}: {key} {value!r} (use the constant from protocol.js)")
        # The two ways the page sends a request: conn.request(TYPE, ...) and app.call(what, TYPE, ...).
        for m in re.finditer(r"\brequest\(\s*[\"'`]|\bcall\(\s*[^,()]+,\s*[\"'`]", text):
            problems.append(f"{path.name}: {m.group(0)!r} (send a REQUEST constant)")
    assert not problems, "protocol names spelled outside web/protocol.js:\n" + "\n".join(problems)


def test_the_scan_finds_a_spelled_name() -> None:
    """The scan above is only worth something if it catches a literal; check it on a sample."""
    sample = 'const a = "doc.edit"; // "gen.start" in a comment is fine\nsend({ type: "ping" });'
    text = _code(sample)
    assert re.search(r"\bcall\(\s*[^,()]+,\s*[\"'`]", 'app.call("Undo", "history.undo", {})')
    assert re.findall(r"[\"'`]([A-Za-z_.]+)[\"'`]", text)[0] == "doc.edit"
    assert "gen.start" not in text and 'type: "ping"' in text


def test_parameter_controls_match_the_schema() -> None:
    props: dict[str, Any] = DEFS["GenParams"]["properties"]
    by_id = {attrs.get("id"): (tag, attrs) for tag, attrs in html_elements()}
    for field, spec in props.items():
        found = by_id.get(f"param-{field}")
        assert found is not None, f"index.html has no control #param-{field}"
        tag, attrs = found
        assert any(a.get("for") == f"param-{field}" for t, a in html_elements() if t == "label"), f"no label: {field}"
        bounds = spec["anyOf"][0] if "anyOf" in spec else spec
        if "enum" in bounds:  # a choice (optional or not) is a select
            assert tag == "select", f"#param-{field} should be a select"
            continue
        low = bounds.get("minimum", bounds.get("exclusiveMinimum"))
        high = bounds.get("maximum")
        assert attrs.get("min") is not None and float(attrs["min"] or 0) == low, f"#param-{field} min"
        html_max = float(attrs["max"] or 0)
        # The seed may go up to 2^63-1 on the wire, but a JavaScript number holds integers exactly only to 2^53-1.
        assert html_max == high or (field == "seed" and html_max == 2**53 - 1), f"#param-{field} max"
        if bounds.get("type") == "integer":
            assert attrs.get("step") == "1", f"#param-{field} should step by 1"


def test_every_import_and_loaded_file_exists() -> None:
    for path in js_files():
        for spec, names in imports(path):
            assert spec.startswith("./"), f"{path.name}: import {spec!r} leaves web/ (the page loads nothing else)"
            target = WEB / spec[2:]
            assert target.is_file(), f"{path.name}: imports missing {spec}"
            missing = set(names) - exports(target)
            assert not missing, f"{path.name}: {spec} does not export {sorted(missing)}"
    loaded = [
        attrs.get("src") or attrs.get("href")
        for tag, attrs in html_elements()
        if tag in ("script", "link") and (attrs.get("src") or attrs.get("href"))
    ]
    assert "app.js" in loaded and "style.css" in loaded
    for ref in loaded:
        assert ref is not None
        if ref.startswith("data:"):
            continue
        assert "://" not in ref and not ref.startswith("//"), f"index.html loads {ref} from elsewhere"
        assert (WEB / ref).is_file(), f"index.html loads missing {ref}"


def test_every_control_has_a_label() -> None:
    elements = html_elements()
    labelled = {a.get("for") for t, a in elements if t == "label"}
    for tag, attrs in elements:
        if tag in ("input", "select", "textarea") and attrs.get("type") != "hidden":
            ident = attrs.get("id")
            # A checkbox inside its <label> is labelled by it; those are the only unlabelled-by-id inputs we use.
            ok = (
                ident in labelled
                or bool(attrs.get("aria-label") or attrs.get("aria-labelledby"))
                or attrs.get("type") == "checkbox"
            )
            assert ok, f"index.html: <{tag} id={ident!r}> has no label"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: no JavaScript syntax check")
def test_javascript_parses() -> None:
    for path in js_files():
        result = subprocess.run(
            ["node", "--check", "--input-type=module"],
            input=path.read_text(encoding="utf-8"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, f"{path.name}: {result.stderr}"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: cannot run the page's encoder")
def test_the_page_offers_a_token_the_server_reads() -> None:
    """connection.js's `tokenSubprotocol` (run in node) against the server's decoder, on tokens that need it."""
    from canvas.server.security import subprotocol_tokens, token_subprotocol

    tokens = ["correct-horse-battery", "ünïcödé/+= token ~ 🌍", "a" * 255]
    script = (
        f"import {{ tokenSubprotocol }} from {json.dumps((WEB / 'connection.js').as_uri())};\n"
        f"console.log(JSON.stringify({json.dumps(tokens)}.map(tokenSubprotocol)));"
    )
    result = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    offered = json.loads(result.stdout)
    assert offered == [token_subprotocol(t) for t in tokens]
    assert subprotocol_tokens(offered) == tuple(tokens)


def test_ensure_chromium_script_is_valid_bash() -> None:
    script = REPO / "tests" / "web" / "ensure_chromium.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
