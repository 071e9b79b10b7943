"""llama.vim's instruction mode: a chat request that asks to edit a selection, read back as the selection and the
text around it, so that `/v1/chat/completions` can serve it as a rewrite (a gap between the text before and after
the selection) instead of continuing a transcript.

Owns `Edit` and `find_edit`. The shape (llama.vim autoload/llama.vim, `llama#inst_build`, at commit
a1c8e6e40cb45df59b78add5b65d575386832465): a first system message that holds, after llama.vim's instructions,
four sections, each a marker line (`--- CONTEXT`, `--- PREFIX`, `--- SELECTION`, `--- SUFFIX`, padded with spaces,
then dashes) followed by its lines joined by newlines and one newline more; then user messages whose content is
`INSTRUCTION: <text>` (empty in its warm-up request), and, after `inst_continue`, the assistant's earlier answers
between them. Invariant: a request is an edit only if the markers are all there, once each and in that order, and
the last message is a user's; anything else is an ordinary chat.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_MARKER = re.compile(r"^--- (CONTEXT|PREFIX|SELECTION|SUFFIX) +-{3,}\n", re.MULTILINE)
_ORDER = ("CONTEXT", "PREFIX", "SELECTION", "SUFFIX")


@dataclass(frozen=True, slots=True)
class Edit:
    instruction: str  # the users' instructions, oldest first, one per line ("" when none was given yet)
    context: str  # extra context from other buffers ("" when none)
    before: str  # the lines before the selection, each ending in a newline
    selection: str  # the text the answer replaces: the selection, or the assistant's latest answer to edit further
    after: str  # the text after the selection, from the newline that ends its last line ("" at the end of a file)


def _sections(system: str) -> dict[str, str] | None:
    marks = list(_MARKER.finditer(system))
    names = [m.group(1) for m in marks]
    if names not in (list(_ORDER), list(_ORDER[1:])):
        return None
    out = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(system)
        out[m.group(1)] = system[m.end() : end]
    return out


def _line_block(section: str) -> str:
    """A section's lines as text: llama.vim writes `join(lines, "\\n") . "\\n"`, so one trailing newline is its own."""
    return section.removesuffix("\n")


def find_edit(messages: Sequence[tuple[str, str]]) -> Edit | None:
    """The edit a chat request (`(role, text)` pairs) asks for, or None when it is not llama.vim's shape."""
    if len(messages) < 2 or messages[0][0] not in ("system", "developer") or messages[-1][0] != "user":
        return None
    sections = _sections(messages[0][1])
    if sections is None:
        return None
    rest = messages[1:]
    instruction = "\n".join(text.strip() for role, text in rest if role == "user" and text.strip())
    answers = [text for role, text in rest if role == "assistant"]
    selection = answers[-1].removesuffix("\n") if answers else _line_block(sections["SELECTION"])
    before = _line_block(sections["PREFIX"])
    suffix = _line_block(sections["SUFFIX"])
    return Edit(
        instruction=instruction,
        context=_line_block(sections.get("CONTEXT", "")).strip("\n"),
        before=before + "\n" if before else "",
        selection=selection,
        after="\n" + suffix if suffix.strip() else "",
    )


def edit_prompt(edit: Edit) -> str:
    """The text before the gap: the instruction as a prefix, then the extra context, then the lines before."""
    head = "".join(part + "\n\n" for part in (edit.instruction, edit.context) if part)
    return head + edit.before
