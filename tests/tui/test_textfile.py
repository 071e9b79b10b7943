"""Files round-trip byte for byte; saving is atomic and keeps a backup; bad files get clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tui.textfile import FROM_EDITOR, TO_EDITOR, TextFile, TextFileError, from_editor, to_editor

SAMPLES = [
    b"",
    b"no newline at the end",
    b"unix\nlines\n",
    b"windows\r\nlines\r\n",
    b"old mac\rlines\r",
    b"mixed\r\nand\nlone\rbreaks\n",
    b"\xef\xbb\xbfwith a BOM\r\n",
    "tabs\tand form\x0cfeed and \x1b[31m escapes \x85 \u2028 separators \x7f".encode(),
    "unicode: caf\u00e9 \u4e2d\u6587 \U0001f600\n".encode(),
    b"trailing spaces   \n\n\n",
]


@pytest.mark.parametrize("data", SAMPLES)
def test_decode_encode_is_exact(data: bytes) -> None:
    tf = TextFile()
    text = tf.decode(data)
    assert tf.encode(text) == data
    assert TextFile.round_trips(data)
    assert from_editor(to_editor(text)) == text
    assert len(to_editor(text)) == len(text)


@given(st.text())
def test_any_text_round_trips(text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    if "\x00" in text or any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        return  # NUL means binary; lone surrogates are not UTF-8 at all
    tf = TextFile()
    decoded = tf.decode(data)
    if tf.warnings:  # the text already holds stand-in symbols: documented as not exact
        return
    assert tf.encode(decoded) == data


def test_editor_text_has_no_control_characters() -> None:
    text = "".join(chr(c) for c in range(0x00, 0xA0)) + "\u2028\u2029"
    shown = to_editor(text)
    for ch in shown:
        assert ch in "\t\n" or (ch.isprintable() or 0xE000 <= ord(ch) <= 0xF8FF), repr(ch)
    assert "\n".join(shown.splitlines()) == shown.replace("\r", "")  # Textual splits only on \n now
    assert len(TO_EDITOR) == len(FROM_EDITOR)  # one symbol per control character: reversible


def test_line_breaks_are_detected() -> None:
    tf = TextFile()
    assert tf.decode(b"a\r\nb\r\n") == "a\nb\n" and tf.newline == "\r\n"
    assert tf.decode(b"a\rb") == "a\nb" and tf.newline == "\r"
    assert tf.decode(b"a\r\nb\n") == "a\r\nb\n" and tf.newline == "\n"  # mixed: \r stays a character
    assert tf.decode(b"\xef\xbb\xbfx") == "x" and tf.bom


def test_stand_in_symbols_in_a_file_are_reported() -> None:
    tf = TextFile()
    tf.decode("a form feed symbol \u240c in the text".encode())
    assert tf.warnings and "control characters" in tf.warnings[0]


def test_save_is_exact_keeps_mode_and_makes_a_backup(tmp_path: Path) -> None:
    path = tmp_path / "notes.md"
    original = b"first\r\nsecond\r\n"
    path.write_bytes(original)
    os.chmod(path, 0o640)
    tf, text = TextFile.load(path)
    assert text == "first\nsecond\n"
    written, backup = tf.save(text + "third\n")
    assert written == path and backup == tmp_path / "notes.md~"
    assert path.read_bytes() == b"first\r\nsecond\r\nthird\r\n"
    assert backup.read_bytes() == original
    assert path.stat().st_mode & 0o777 == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_save_new_file_has_no_backup(tmp_path: Path) -> None:
    tf, text = TextFile.load(tmp_path / "new.txt")
    assert text == "" and tf.name == "new.txt"
    written, backup = tf.save("hello")
    assert backup is None and written.read_bytes() == b"hello"


def test_save_without_a_name_is_an_error() -> None:
    with pytest.raises(TextFileError, match="no file name"):
        TextFile().save("text")


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"\x00\x01binary", "binary"), (b"caf\xe9", "not UTF-8"), ("é".encode("utf-16"), "binary|not UTF-8")],
)
def test_bad_files_are_refused_clearly(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    with pytest.raises(TextFileError, match=message):
        TextFile.load(path)


def test_directory_and_unwritable_targets(tmp_path: Path) -> None:
    with pytest.raises(TextFileError, match="directory"):
        TextFile.load(tmp_path)
    tf = TextFile(tmp_path / "x.txt")
    with pytest.raises(TextFileError, match="directory"):
        tf.save("x", tmp_path)
