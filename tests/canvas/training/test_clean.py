from __future__ import annotations

import unicodedata

import pytest

from canvas.training.clean import (
    ParagraphDeduper,
    normalize_line,
    paragraphs_from_lines,
    rest_inline,
    rest_to_paragraphs,
)


def test_normalize_line_nfc_whitespace_and_controls() -> None:
    decomposed = unicodedata.normalize("NFD", "café naïve")
    assert decomposed != "café naïve"
    out = normalize_line(f"  {decomposed}\t\u00a0 end\x07\u200b  ")
    assert out == "café naïve end"
    assert unicodedata.is_normalized("NFC", out)


def test_paragraphs_unwrap_hard_wrapped_lines() -> None:
    lines = ["It is a truth universally", "acknowledged, that a single man", "", "", "Second   paragraph."]
    assert paragraphs_from_lines(lines) == [
        "It is a truth universally acknowledged, that a single man",
        "Second paragraph.",
    ]


def test_indent_starts_paragraph_for_attributions() -> None:
    lines = ["A dream will always triumph over", "reality.", "\t\t-- Stanislaw Lem"]
    assert paragraphs_from_lines(lines) == ["A dream will always triumph over reality. -- Stanislaw Lem"]
    assert paragraphs_from_lines(lines, indent_starts_paragraph=True) == [
        "A dream will always triumph over reality.",
        "-- Stanislaw Lem",
    ]


def test_deduper_drops_long_repeats_keeps_short_ones() -> None:
    d = ParagraphDeduper(min_chars=10)
    first = d.filter(["Yes.", "This paragraph is long enough.", "Other text here, long too."])
    second = d.filter(["Yes.", "This paragraph is long enough.", "A new long paragraph appears."])
    assert first == ["Yes.", "This paragraph is long enough.", "Other text here, long too."]
    assert second == ["Yes.", "A new long paragraph appears."]
    assert d.dropped == 1


def test_deduper_rejects_negative_threshold() -> None:
    with pytest.raises(ValueError, match="min_chars"):
        ParagraphDeduper(min_chars=-1)


@pytest.mark.parametrize(
    ("markup", "text"),
    [
        (":func:`~os.path.join` joins", "join joins"),
        (":keyword:`!if` statements", "if statements"),
        (":ref:`the tutorial <tut-intro>`", "the tutorial"),
        (":ref:`tut-match`", "match"),
        (":pep:`8` and :rfc:`7159`", "PEP 8 and RFC 7159"),
        ("use ``None`` or **bold** or *emphasis*", "use None or bold or emphasis"),
        ("see `JSON <https://json.org>`_ now", "see JSON now"),
        ("a footnote [#f1]_ here", "a footnote here"),
        ("keep *args alone", "keep *args alone"),
    ],
)
def test_rest_inline(markup: str, text: str) -> None:
    assert normalize_line(rest_inline(markup)) == text


REST = """\
.. _tut-intro:

****************
An Informal Tour
****************

.. index::
   single: tour

The :keyword:`while` loop repeats while its
condition holds.  For example::

   >>> while x:
   ...     x -= 1

.. note::
   Notes are prose and
   stay.

.. function:: dumps(obj, *, skipkeys=False, \\
              indent=None)

   Serialize *obj* to a string.

   .. versionchanged:: 3.6 Now faster.

.. code-block:: python

   print("dropped")

>>> 1 + 1
2

+------+------+
| grid | cell |
+------+------+

* first item
  continues here
* second item

.. This is a comment
   spanning two lines.

:Author: Someone
"""


def test_rest_to_paragraphs_keeps_prose_drops_code_and_markup() -> None:
    assert rest_to_paragraphs(REST) == [
        "An Informal Tour",
        "The while loop repeats while its condition holds. For example:",
        "Notes are prose and stay.",
        "Serialize obj to a string.",
        "Now faster.",
        "* first item continues here",
        "* second item",
        "Author: Someone",
    ]


def test_rest_drops_symbol_heavy_paragraphs() -> None:
    assert rest_to_paragraphs("x = {1: [2, 3]} + (4 * 5) // 6 % 7\n\nPlain words stay here.\n") == [
        "Plain words stay here."
    ]
