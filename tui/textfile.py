"""Plain-text files in and out of the editor, byte for byte.

Owns the three forms of a document's text and the maps between them:
- the **file bytes** (UTF-8, an optional BOM, LF, CRLF or CR line breaks);
- the **document text** that the server and the model see: the file decoded with line breaks as `\\n`;
- the **editor text** that the Textual `TextArea` shows: the document text with every control character except
  tab and newline replaced by a visible stand-in (`\\x0c` -> `␌`). Textual splits lines on `\\x0b \\x0c \\x1c-\\x1e
  \\x85 \\u2028 \\u2029` as well as `\\n` and a terminal must never receive raw control codes, so the editor gets
  one printable character per control character: offsets stay the same in both forms.

Invariants: `decode` then `encode` gives back the exact bytes (`TextFile.round_trips`), whatever the line breaks
(a file that mixes them keeps its `\\r` as characters), unless the file already holds one of the stand-in symbols,
which `TextFile.warnings` then reports. `save` writes atomically (temporary file + rename, mode kept) and copies
the previous content to `NAME~` first when it overwrites a file.
"""

from __future__ import annotations

import codecs
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Newline = Literal["\n", "\r\n", "\r"]
MAX_FILE_BYTES = 8 << 20  # far more text than a canvas editor is for; a larger file is refused, not loaded


class TextFileError(Exception):
    """A file cannot be opened or saved; the message says why, for people."""


def _stand_ins() -> dict[int, str]:
    table = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}  # ␀ … ␟ (control pictures)
    table[0x7F] = "\u2421"  # ␡
    table[0x85] = "\u2424"  # ␤ next line
    table[0x2028] = "\u21b2"  # ↲ line separator
    table[0x2029] = "\u2761"  # ❡ paragraph separator
    for c in range(0x80, 0xA0):  # C1 controls (0x9b is an 8-bit CSI): private-use stand-ins
        table.setdefault(c, chr(0xE000 + c))
    return table


TO_EDITOR: dict[int, str] = _stand_ins()
FROM_EDITOR: dict[int, str] = {ord(v): chr(k) for k, v in TO_EDITOR.items()}
_STAND_IN_CHARS = frozenset(TO_EDITOR.values())


def to_editor(text: str) -> str:
    """Document text -> editor text (same length)."""
    return text.translate(TO_EDITOR)


def from_editor(text: str) -> str:
    """Editor text -> document text (same length)."""
    return text.translate(FROM_EDITOR)


def display(text: str) -> str:
    """Text safe to put on a terminal: control characters shown as symbols, lengths unchanged."""
    return text.translate(TO_EDITOR)


@dataclass
class TextFile:
    """Where a document comes from and how to write it back exactly."""

    path: Path | None = None
    newline: Newline = "\n"
    bom: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name if self.path is not None else "untitled"

    # -- bytes <-> document text -----------------------------------------------------------------------------

    def decode(self, data: bytes) -> str:
        """File bytes -> document text; sets `newline`, `bom` and `warnings`."""
        self.warnings = []
        if b"\x00" in data[:8192]:
            raise TextFileError("this is a binary file or UTF-16 text (it contains NUL bytes); the editor reads UTF-8")
        self.bom = data.startswith(codecs.BOM_UTF8)
        try:
            text = data.decode("utf-8-sig" if self.bom else "utf-8")
        except UnicodeDecodeError as e:
            raise TextFileError(
                f"not UTF-8 text (byte {e.start} cannot be decoded); convert it to UTF-8 first"
            ) from None
        crlf = text.count("\r\n")
        lone_lf = text.count("\n") - crlf
        lone_cr = text.count("\r") - crlf
        if crlf and not lone_lf:
            self.newline = "\r\n"  # lone \r stay characters (shown as ␍): still exact
            text = text.replace("\r\n", "\n")
        elif lone_cr and not crlf and not lone_lf:
            self.newline = "\r"
            text = text.replace("\r", "\n")
        else:
            self.newline = "\n"  # LF, or a mix: every \r stays a character, so the bytes come back exactly
        if any(c in _STAND_IN_CHARS for c in text):
            self.warnings.append(
                "the file contains symbols the editor uses to show control characters (such as ␌); "
                "they will be saved as the control characters they stand for"
            )
        return text

    def encode(self, text: str) -> bytes:
        """Document text -> file bytes (the inverse of `decode`)."""
        if self.newline != "\n":
            text = text.replace("\n", self.newline)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TextFileError(f"character {e.start} cannot be written as UTF-8 (a lone surrogate)") from None
        return codecs.BOM_UTF8 + data if self.bom else data

    @staticmethod
    def round_trips(data: bytes) -> bool:
        probe = TextFile()
        try:
            return probe.encode(probe.decode(data)) == data
        except TextFileError:
            return False

    # -- disk ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> tuple[TextFile, str]:
        """Read `path` (a missing file is a new, empty document) and return it with its document text."""
        p = Path(path).expanduser()
        tf = cls(path=p)
        if not p.exists():
            return tf, ""
        if p.is_dir():
            raise TextFileError(f"{p} is a directory")
        try:
            size = p.stat().st_size
            if size > MAX_FILE_BYTES:
                raise TextFileError(f"{p} is {size / (1 << 20):.1f} MiB; the editor opens files up to 8 MiB")
            data = p.read_bytes()
        except OSError as e:
            raise TextFileError(f"cannot read {p}: {e.strerror or e}") from None
        return tf, tf.decode(data)

    def save(self, text: str, path: str | Path | None = None) -> tuple[Path, Path | None]:
        """Write `text` to `path` (default: where it came from). Returns the path written and the backup made."""
        target = Path(path).expanduser() if path is not None else self.path
        if target is None:
            raise TextFileError("no file name: save with a name first")
        data = self.encode(text)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            mode: int | None = None
            backup: Path | None = None
            if target.exists():
                if target.is_dir():
                    raise TextFileError(f"{target} is a directory")
                mode = target.stat().st_mode & 0o7777
                backup = target.with_name(target.name + "~")
                shutil.copy2(target, backup)  # the backup of what we overwrite
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if mode is not None:
                    os.chmod(tmp, mode)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise TextFileError(f"cannot write {target}: {e.strerror or e}") from None
        self.path = target
        return target, backup
