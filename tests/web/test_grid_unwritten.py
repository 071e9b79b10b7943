"""The grid of an AR infill in a real browser: slots the writer has not reached are blanks, never noise text.

The page's websocket is routed through Playwright to the real `dcanvas serve` (the `web_server` fixture), so the
page opens, edits and masks a real document; only `gen.start` is answered by the test, which then sends the
generation's frames itself, one at a time, and checks the grid after each.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.web.conftest import ServeProcess, artifacts_dir
from tests.web.test_browser import TEXT, create_doc, drag_select, open_page, server_doc

pytestmark = pytest.mark.timeout(240)


NOISE = ("Sele", " Deliver", " Syrian", "sport']])", " Quarterly", "Vue")  # noise tokens' text, never to be shown


def test_ar_slots_not_yet_written_show_blanks_not_their_noise(page: Any, web_server: ServeProcess) -> None:
    """The page's socket runs through a route to the real server, except `gen.start`: the test answers it and
    then sends an AR infill's frames one at a time, as the server does: slots not reached carry `written: false`
    (and, here, their noise tokens' text, as servers that predate the field sent it). The grid draws them as
    blanks, never as that text, and shows each slot's text once a frame writes it."""
    from playwright.sync_api import expect

    from canvas.protocol import GenAccepted, GenParams, GenProgress, SlotUpdate
    from canvas.protocol.wire import dump

    routes: list[Any] = []
    starts: list[dict[str, Any]] = []

    def route(ws: Any) -> None:
        server = ws.connect_to_server()
        routes.append(ws)

        def from_page(message: str | bytes) -> None:
            msg = json.loads(message)
            if msg.get("type") == "gen.start":
                starts.append(msg)  # answered below, from the test's thread
            else:
                server.send(message)

        ws.on_message(from_page)

    page.route_web_socket(re.compile(r"/ws$"), route)
    open_page(page, web_server)
    doc_id = create_doc(page, TEXT)
    drag_select(page, 4, 40)
    page.click("button[data-op=mask]")
    expect(page.locator("#doc-view .free")).to_have_count(1)
    page.select_option("#param-mode", "ar")
    page.click("#generate-btn")
    for _ in range(200):  # the route hands the request over while the page's event loop runs
        if starts:
            break
        page.wait_for_timeout(50)
    assert starts, "the page sent no gen.start"
    start = starts[0]
    doc = server_doc(web_server, doc_id)
    free: list[int] = []
    slot = 0
    for span in doc.spans:
        if span.kind == "free":
            free.extend(range(slot, slot + span.slots))
        slot += span.slots
    assert len(free) >= 3, doc.spans
    params = GenParams(mode="ar", max_steps=len(free), seed=5)
    routes[0].send(dump(GenAccepted(re=start["id"], gen="g-ar", doc_id=doc_id, base_v=start["base_v"], params=params)))
    expect(page.locator("#run-a")).to_have_attribute("data-state", "running")

    words = [f" w{k}" for k in range(len(free))]
    noise = {i: NOISE[k % len(NOISE)] for k, i in enumerate(free)}
    grid = page.locator("#run-a .grid")
    for step in range(1, len(free)):
        written = {free[step - 1]: words[step - 1]}  # the writer's slot at this step: a delta, as the server sends
        ups = [SlotUpdate(i=i, token=300 + i, text=t, entropy=0.4, accepted=True) for i, t in written.items()]
        if step == 1:  # the first frame carries every slot; the ones not written yet hold noise
            ups += [SlotUpdate(i=i, token=4000 + i, text=noise[i], accepted=False, written=False) for i in free[1:]]
        frame = GenProgress(gen="g-ar", seq=step, step=step, max_steps=len(free), slots=ups, accepted=1,
                            free=len(free), elapsed_s=0.1 * step)  # fmt: skip
        routes[0].send(dump(frame))
        expect(grid).to_have_attribute("data-frame", str(step))
        cells = grid.locator(".cell.free").evaluate_all(
            "cs => cs.map(c => ({i: Number(c.dataset.i), text: c.textContent, cls: c.className, title: c.title}))"
        )
        by_slot = {c["i"]: c for c in cells}
        assert sorted(by_slot) == free
        for k, i in enumerate(free):
            c = by_slot[i]
            if k < step:  # written: its text, drawn as a token
                assert c["text"] == words[k].replace(" ", "·") and "unwritten" not in c["cls"], c
            else:  # not reached: a blank, not noise (no flicker), and nothing of the token it holds
                assert c["text"] == "▁" and "unwritten" in c["cls"].split() and "noise" not in c["cls"].split(), c
                assert "not written yet" in c["title"] and str(4000 + i) not in c["title"], c
        shown = grid.inner_text()
        assert not [t for t in NOISE if t.strip() in shown], shown
    page.screenshot(path=str(artifacts_dir() / "ar-unwritten.png"), full_page=True)
