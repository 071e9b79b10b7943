"""`Banner`: one line at the top that says when the server cannot be used, and what happens next.

Hidden while connected. The text is the reason in words (never a traceback) and the retry plan.
"""

from __future__ import annotations

from textual.widgets import Static


class Banner(Static):
    def show(self, text: str, kind: str = "error") -> None:
        self.set_classes(f"-{kind}")
        self.update(text)
        self.display = True

    def hide(self) -> None:
        self.display = False
