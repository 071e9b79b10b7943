"""`python -m tui.keydoc`: the editor's key table (`tui.keys`) as the Markdown that `docs/tui.md` embeds.

Above `tui.app` (it reads the app's bindings), so that the key table itself stays below the app that shows it.
"""

from __future__ import annotations

from tui.app import DcanvasApp
from tui.keys import sections


def markdown() -> str:
    out: list[str] = []
    for title, table in sections(DcanvasApp):
        out += [f"### {title}", "", "| Keys | Action |", "| ---- | ------ |"]
        out += ["| " + keys.replace("|", "\\|") + f" | {what} |" for keys, what in table]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
