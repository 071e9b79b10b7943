"""Mouse selection in the text and on proposal hunks, the key table in docs/tui.md, and every binding's action."""

from __future__ import annotations

from pathlib import Path

from textual.binding import Binding

from tests.tui.scenes import app_for, opened, proposal_shown
from tui import keydoc, keys
from tui.app import DcanvasApp
from tui.screens.main import MainScreen
from tui.widgets.canvas_view import CanvasView
from tui.widgets.editor import CanvasEditor

DOC = Path(__file__).resolve().parents[2] / "docs" / "tui.md"


async def test_mouse_drag_selects_text(tmp_path: Path) -> None:
    app = app_for(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await opened(pilot)
        editor = app.main.editor
        x0 = editor.region.x - app.main.region.x + 1  # the text starts after one cell of padding
        await pilot.mouse_down(CanvasEditor, offset=(x0 + 4, 0))
        await pilot.hover(CanvasEditor, offset=(x0 + 11, 0))
        await pilot.mouse_up(CanvasEditor, offset=(x0 + 11, 0))
        await pilot.pause()
        assert editor.selected_range == (4, 11)  # "cat sat"


async def test_click_and_drag_on_hunks(tmp_path: Path) -> None:
    app = app_for(tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await proposal_shown(pilot)
        screen = app.main
        view = screen.canvas
        proposal = screen.proposal
        assert proposal is not None and proposal.n_hunks == 2 and proposal.current == 0

        def cell_of(hunk: int) -> tuple[int, int]:
            for y, line in enumerate(view._lines):
                x = 0
                for text, _, tag in line:
                    if tag == hunk:
                        return x + 1, y  # + the view's left padding
                    x += len(text)
            raise AssertionError(f"hunk {hunk} is not on screen")

        await pilot.click(CanvasView, offset=cell_of(1))
        assert proposal.current == 1 and not proposal.marked
        await pilot.mouse_down(CanvasView, offset=cell_of(0))
        await pilot.mouse_up(CanvasView, offset=cell_of(1))
        await pilot.pause()
        assert proposal.marked == {0, 1} and proposal.chosen() == [0, 1]
        assert "marked 1, 2" in str(screen.query_one("#mode-line").render())


def test_docs_key_table_matches_the_code() -> None:
    text = DOC.read_text(encoding="utf-8")
    start, end = "<!-- keys:start -->\n", "<!-- keys:end -->"
    assert start in text and end in text, "docs/tui.md lost its key table markers"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table.strip() == keydoc.markdown().strip(), "regenerate the table with `python -m tui.keydoc`"


def test_every_binding_has_an_action() -> None:
    owners: list[tuple[type, list[Binding]]] = [
        (DcanvasApp, list(Binding.make_bindings(DcanvasApp.BINDINGS))),
        (MainScreen, list(Binding.make_bindings(MainScreen.BINDINGS))),
        (CanvasView, list(Binding.make_bindings(CanvasView.BINDINGS))),
        (CanvasEditor, list(Binding.make_bindings(CanvasEditor.BINDINGS))),
    ]
    for owner, bindings in owners:
        for b in bindings:
            namespace, _, action = b.action.rpartition(".")
            target = MainScreen if namespace == "screen" else owner
            name = action.split("(")[0]
            assert callable(getattr(target, f"action_{name}", None)), f"{owner.__name__}: {b.key} -> {b.action}"
    for b in Binding.make_bindings(MainScreen.BINDINGS):
        assert b.action in MainScreen.ACTION_PHASES, f"{b.action} has no phase rule"
    rows = [row for _, table in keys.sections(DcanvasApp) for row in table]
    assert len(rows) > 40 and all(k and what for k, what in rows)
