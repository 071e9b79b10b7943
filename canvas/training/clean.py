"""Text cleaning for the training corpus: unicode/whitespace normalisation, reST to prose, paragraph dedupe.

Every cleaner returns a list of paragraphs, each one line of normalised text (NFC, no control characters, single
spaces); a document is its paragraphs joined by a blank line (`PARAGRAPH_SEP`). Wrapped lines are unwrapped
because the sources are hard-wrapped at ~72 columns and a model trained on them would learn newlines in the middle
of sentences.

`rest_to_paragraphs` keeps the English prose of a Sphinx source and drops what is not prose: code (literal and
doctest blocks, code directives), tables, section adornments, labels, comments, index/toctree/module directives and
signatures. Inline roles keep their visible text (`:func:`~os.path.join`` -> `join`).

`strip_markup` takes out what markup is left in a prose paragraph (HTML tags, comments and entities; reST roles,
literals and back-quotes): the corpus's prose is plain text, and a fill learnt from markup brings tags into plain text.
Code documents never pass through these cleaners (their lines and indentation are the text).

`ParagraphDeduper` removes exact repeats of paragraphs of at least `min_chars` characters, first occurrence wins;
short paragraphs (dialogue such as '"Yes."') repeat legitimately and are kept.
"""

from __future__ import annotations

import html
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

PARAGRAPH_SEP = "\n\n"

# Control characters other than newline/tab (which the paragraph logic consumes) carry no text.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\ufeff]")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+")


def normalize_line(text: str) -> str:
    """NFC, drop control/zero-width characters, collapse every run of spaces (incl. NBSP, tabs) to one space."""
    text = unicodedata.normalize("NFC", text)
    text = _CONTROL.sub("", text)
    return _SPACES.sub(" ", text).strip()


def unwrap(lines: Iterable[str]) -> str:
    """Join the hard-wrapped lines of one paragraph into a single normalised line."""
    return normalize_line(" ".join(line.strip() for line in lines))


def paragraphs_from_lines(lines: Iterable[str], *, indent_starts_paragraph: bool = False) -> list[str]:
    """Group hard-wrapped lines into unwrapped paragraphs at blank lines.

    With `indent_starts_paragraph`, an indented line also opens a new paragraph: fortune files (and old plain-text
    books) mark paragraphs and attributions ("\\t\\t-- Mark Twain") by indentation instead of blank lines.
    """
    out: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            text = unwrap(current)
            if text:
                out.append(text)
            current.clear()

    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line.strip():
            flush()
            continue
        if indent_starts_paragraph and line[:1] in (" ", "\t"):
            flush()
        current.append(line)
    flush()
    return out


def join_paragraphs(paragraphs: Iterable[str]) -> str:
    return PARAGRAPH_SEP.join(p for p in paragraphs if p)


def split_paragraphs(text: str) -> list[str]:
    return [p for p in text.split(PARAGRAPH_SEP) if p]


def letter_ratio(text: str) -> float:
    """Share of alphabetic characters among the non-space ones (0 for empty text): a cheap code/noise detector."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c.isalpha() for c in chars) / len(chars)


@dataclass(slots=True)
class ParagraphDeduper:
    """Drops exact repeats of paragraphs with at least `min_chars` characters (first occurrence wins)."""

    min_chars: int = 32
    seen: set[str] = field(default_factory=set)
    dropped: int = 0

    def __post_init__(self) -> None:
        if self.min_chars < 0:
            raise ValueError(f"min_chars must be >= 0, got {self.min_chars}")

    def filter(self, paragraphs: Iterable[str]) -> list[str]:
        kept: list[str] = []
        for p in paragraphs:
            if len(p) >= self.min_chars:
                if p in self.seen:
                    self.dropped += 1
                    continue
                self.seen.add(p)
            kept.append(p)
        return kept


# ---------------------------------------------------------------------------------------------------------------
# reST (Sphinx sources of the Python documentation)
# ---------------------------------------------------------------------------------------------------------------

# Directives whose header *and* indented body are not prose.
_DROP_DIRECTIVES = frozenset(
    {
        "code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "testsetup", "testcleanup",
        "productionlist", "literalinclude", "highlight", "index", "toctree", "module", "currentmodule",
        "moduleauthor", "sectionauthor", "codeauthor", "tabularcolumns", "raw", "image", "figure", "include",
        "csv-table", "list-table", "table", "audit-event", "availability", "opcode", "cmdoption", "program",
        "option", "envvar", "c:namespace", "c:namespace-push", "c:namespace-pop", "pdbcommand", "2to3fixer",
        "only", "ifconfig", "limited-api-list", "miscnews", "manpage", "maxdepth",
    }
)  # fmt: skip
# Directives whose argument is prose (the note text itself); for version directives the first word (the version) is
# dropped. Any other directive not dropped is an object description: its header (signatures, up to the first blank
# line) is dropped and its body kept.
_PROSE_ARG_DIRECTIVES = frozenset(
    {
        "note", "warning", "seealso", "tip", "important", "hint", "caution", "danger", "attention", "admonition",
        "impl-detail", "topic", "sidebar", "rubric", "centered", "deprecated", "versionadded", "versionchanged",
        "deprecated-removed", "epigraph", "highlights", "pull-quote", "container", "compound", "glossary", "hlist",
    }
)  # fmt: skip
_VERSION_DIRECTIVES = frozenset({"deprecated", "versionadded", "versionchanged", "deprecated-removed"})
_DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\.\s+(?P<name>[\w:.-]+)::(?P<arg>.*)$")
_EXPLICIT_MARKUP = re.compile(r"^(?P<indent>\s*)\.\.(\s|$)")  # comments, labels, footnotes, substitutions
_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+<>_:.])\1{2,}\s*$")
_SIMPLE_TABLE_RULE = re.compile(r"^\s*=+(\s+=+)+\s*$")
_GRID_TABLE = re.compile(r"^\s*(\+[-=+]+\+?|\|.*\|)\s*$")
_OPTION_LINE = re.compile(r"^\s+:[\w-]+:(\s.*)?$")
_FIELD = re.compile(r"^:(?P<name>[A-Za-z][\w ]*):\s+(?P<body>.*)$")  # a top-level field list (":Author: ...")
_BULLET = re.compile(r"^\s*([-*+\u2022]|\d+\.|#\.)\s+\S")

_ROLE = re.compile(r"(?::[\w.+-]+)+:`(?P<body>[^`]*)`")
_LINK = re.compile(r"`(?P<text>[^`<]*?)\s*<[^`>]*>`__?")
_REF_LINK = re.compile(r"`(?P<text>[^`]+)`__?")
_LITERAL = re.compile(r"``(?P<body>.+?)``")
_DEFAULT_ROLE = re.compile(r"`(?P<body>[^`]+)`")
_STRONG = re.compile(r"\*\*(?P<body>[^*]+)\*\*")
_EMPHASIS = re.compile(r"(?<![\w*])\*(?P<body>[^\s*](?:[^*]*[^\s*])?)\*(?![\w*])")
_FOOTNOTE_REF = re.compile(r"\s*\[(#[\w-]*|\d+|\*)\]_")
_SUBSTITUTION = re.compile(r"\|(?P<body>[\w .-]+)\|_?")
_ESCAPED_SPACE = re.compile(r"\\ ")
_ESCAPE = re.compile(r"\\(?P<char>[^\s\w])")


def _role_text(match: re.Match[str]) -> str:
    role_prefix = match.group(0)[: match.start("body") - match.start(0)]
    body = match.group("body").strip()
    titled = re.fullmatch(r"(?P<title>.*?)\s*<[^<>]*>", body, flags=re.S)
    if titled and titled.group("title"):
        return titled.group("title")
    body = body.lstrip("!")
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    if role_prefix.startswith(":pep:"):
        return f"PEP {body}"
    if role_prefix.startswith(":rfc:"):
        return f"RFC {body}"
    if role_prefix.startswith((":ref:", ":doc:")):
        # A bare label ("tut-match", "library/os") reads best as its last component in words.
        words = re.split(r"[-_/]+", body.rsplit("/", 1)[-1])
        return " ".join(w for w in words if w not in ("tut", "ref", "")) or body
    return body


def rest_inline(text: str) -> str:
    """Replace inline reST markup by its visible text."""
    text = _ROLE.sub(_role_text, text)
    text = _LITERAL.sub(lambda m: m.group("body"), text)
    text = _LINK.sub(lambda m: m.group("text"), text)
    text = _REF_LINK.sub(lambda m: m.group("text"), text)
    text = _DEFAULT_ROLE.sub(lambda m: m.group("body"), text)
    text = _STRONG.sub(lambda m: m.group("body"), text)
    text = _EMPHASIS.sub(lambda m: m.group("body"), text)
    text = _FOOTNOTE_REF.sub("", text)
    text = _SUBSTITUTION.sub(lambda m: m.group("body"), text)
    text = _ESCAPED_SPACE.sub("", text)
    return _ESCAPE.sub(lambda m: m.group("char"), text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _skip_block(lines: list[str], start: int, indent: int) -> int:
    """Index of the first line after `start` that is non-blank and indented at most `indent`."""
    i = start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
        i += 1
    return i


def _rest_prose_lines(lines: list[str]) -> Iterator[str]:
    """Yield the lines of a reST source that hold prose, with blank lines kept as paragraph breaks."""
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            yield ""
            i += 1
            continue
        directive = _DIRECTIVE.match(line)
        if directive:
            indent = len(directive.group("indent"))
            name = directive.group("name").lower()
            if name in _DROP_DIRECTIVES:
                i = _skip_block(lines, i + 1, indent)
                continue
            yield ""
            if name in _PROSE_ARG_DIRECTIVES:
                arg = directive.group("arg").strip()
                if name in _VERSION_DIRECTIVES:
                    arg = arg.partition(" ")[2].strip()
                if arg:
                    yield " " * (indent + 3) + arg
                i += 1
            else:
                # Signatures (possibly several lines, or continued with a backslash) run to the first blank line.
                i += 1
                while i < len(lines) and lines[i].strip():
                    i += 1
            continue
        explicit = _EXPLICIT_MARKUP.match(line)
        if explicit:
            i = _skip_block(lines, i + 1, len(explicit.group("indent")))
            continue
        if stripped.startswith(">>>"):
            # A doctest block runs to the next blank line.
            while i < len(lines) and lines[i].strip():
                i += 1
            continue
        if (
            _ADORNMENT.match(line)
            or _SIMPLE_TABLE_RULE.match(line)
            or _GRID_TABLE.match(line)
            or _OPTION_LINE.match(line)
        ):
            i += 1
            continue
        if stripped.endswith("::"):
            # A literal (code) block follows: the indented block after this paragraph.
            text = stripped[:-2].rstrip()
            if text:
                yield line[: _indent(line)] + (text + ":" if not stripped.endswith(" ::") else text)
            indent = _indent(line)
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and _indent(lines[j]) > indent:
                i = _skip_block(lines, j, indent)
            else:
                i += 1
            yield ""
            continue
        field_list = _FIELD.match(line)
        yield f"{field_list.group('name')}: {field_list.group('body')}" if field_list else line
        i += 1


def rest_to_paragraphs(source: str, *, min_letter_ratio: float = 0.6) -> list[str]:
    """Turn a Sphinx reST source into prose paragraphs (see the module docstring for what is dropped)."""
    lines = source.replace("\r\n", "\n").expandtabs(8).split("\n")
    paragraphs: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            text = normalize_line(rest_inline(unwrap(current)))
            if text and letter_ratio(text) >= min_letter_ratio:
                paragraphs.append(text)
            current.clear()

    for line in _rest_prose_lines(lines):
        if not line.strip():
            flush()
            continue
        if _BULLET.match(line) or (current and _indent(line) < _indent(current[0]) and _indent(current[0]) > 0):
            flush()
        current.append(line)
    flush()
    return paragraphs


# ---------------------------------------------------------------------------------------------------------------
# Markup left in prose (every prose paragraph passes `strip_markup` in `canvas.training.data.write_corpus`)
# ---------------------------------------------------------------------------------------------------------------

# HTML elements by name, so that "a < b" or "<3" in a sentence is not taken for a tag.
_HTML_TAG = re.compile(
    r"</?(?:a|abbr|b|big|blockquote|br|center|cite|code|dd|del|dfn|div|dl|dt|em|font|h[1-6]|hr|i|img|ins|kbd|li|"
    r"mark|ol|p|pre|q|s|samp|small|span|strike|strong|sub|sup|table|tbody|td|th|thead|tr|tt|u|ul|var|wbr)"
    r"(?:\s+[^<>]*)?/?>",
    re.IGNORECASE,
)
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
_HTML_ENTITY = re.compile(r"&(?:#\d{1,6}|#x[0-9a-fA-F]{1,6}|[A-Za-z]{2,8});")
# What `rest_inline` leaves when a source breaks its own markup: an unclosed role, a stray pair of back-quotes,
# a trailing `_` reference mark, a substitution or footnote reference.
_REST_ROLE = re.compile(r"(?<![\w`]):[A-Za-z][\w.+-]*(?::[\w.+-]+)*:`?")
_REST_LITERAL_MARK = re.compile(r"``|`_{1,2}|(?<=\w)`")
_REST_BACKTICK = re.compile(r"`")
_REST_DIRECTIVE = re.compile(r"^\.\.\s+[\w:.-]+::.*$")


def has_markup(text: str) -> bool:
    """Whether `text` still holds an HTML tag, comment or entity, or a reST role, directive or back-quote."""
    return bool(
        _HTML_TAG.search(text) or _HTML_COMMENT.search(text) or _HTML_ENTITY.search(text)
        or _REST_ROLE.search(text) or "`" in text or _REST_DIRECTIVE.match(text)
    )  # fmt: skip


def strip_markup(paragraph: str) -> str:
    """A prose paragraph without HTML (tags, comments, entities decoded) or reST markup (roles keep their text,
    back-quotes go); "" when nothing but markup was there. Plain prose never shows markup, so the FIM fine-tune
    must never see it in a middle (a fill brought "<i>the name of God</i>" into plain text)."""
    if _REST_DIRECTIVE.match(paragraph):
        return ""
    text = _HTML_COMMENT.sub(" ", paragraph)
    text = _HTML_TAG.sub(" ", text)
    for _ in range(2):  # "&amp;lt;" decodes in two steps
        text = _HTML_ENTITY.sub(lambda m: html.unescape(m.group(0)), text)
    text = _HTML_TAG.sub(" ", text)  # tags that were escaped ("&lt;i&gt;")
    text = rest_inline(text)
    text = _REST_ROLE.sub("", text)
    text = _REST_LITERAL_MARK.sub("", text)
    text = _REST_BACKTICK.sub("", text)
    text = normalize_line(text)
    return re.sub(r"\s+([,.;:!?])", r"\1", text) if text != paragraph else text
