"""The web client in a real browser (headless Chromium) against a real `dcanvas serve` with a tiny random model.

- mask a span selected with the mouse, generate, watch at least three intermediate grid states, replay a frame,
  accept, check the server's document over a websocket of our own (`canvas.protocol.client`), undo with the keyboard;
- a protocol error shows a banner; another session's edit arrives as a broadcast; a dropped socket reconnects;
- side by side (diffusion and AR) on a narrow window, driven from the keyboard, with no horizontal scrolling;
- a document deleted by another session, or from the page, leaves it.

Screenshots land in artifacts/web/ (`$DCANVAS_ARTIFACTS`); docs/web.png is a copy of canvas.png.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from canvas.protocol import DocState, ReplaceOp
from canvas.protocol.client import DcanvasClient
from canvas.sampling.sampler import load_sampler_defaults
from tests.web.conftest import ServeProcess, artifacts_dir
from tests.web.webfiles import protocol_tables

pytestmark = pytest.mark.timeout(240)
T = TypeVar("T")
TEXT = "The cat sat on the mat. It was a warm day and the dog ran past the open door."
GEN_TIMEOUT_MS = 90_000  # a busy 2-core CI machine runs the tiny model at a few steps per second


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine on its own thread: Playwright's sync API keeps an event loop on this one."""

    async def main() -> T:
        return await fn()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result(timeout=60)


def server_doc(server: ServeProcess, doc_id: str) -> DocState:
    async def read() -> DocState:
        async with DcanvasClient.connect(server.ws_url, token=server.token) as c:
            return await c.open(doc_id)

    return run_async(read)


def record_frames(page: Any) -> list[dict[str, Any]]:
    """Every frame the server sends to the page, parsed."""
    frames: list[dict[str, Any]] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(json.loads(payload))))
    return frames


def open_page(page: Any, server: ServeProcess) -> None:
    from playwright.sync_api import expect

    page.goto(server.base)
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")


def create_doc(page: Any, text: str) -> str:
    from playwright.sync_api import expect

    expect(page.locator("#new-doc-form")).to_be_visible()
    page.fill("#new-doc-text", text)
    page.click("#new-doc-create")
    expect(page.locator("#doc-view .pinned")).to_have_count(1)
    expect(page.locator("#new-doc-form")).to_be_hidden()
    m = re.fullmatch(r"#doc=(.+)", page.evaluate("location.hash"))
    assert m is not None
    return m.group(1)


def cell_tokens(page: Any, run: str) -> list[int | None]:
    titles = page.locator(f"#{run} .grid .cell.free").evaluate_all("cells => cells.map(c => c.title)")
    out: list[int | None] = []
    for t in titles:
        m = re.search(r"\(token (\d+)\)", t)
        out.append(int(m.group(1)) if m else None)
    return out


def test_page_modules_agree_with_the_parsed_protocol_table(page: Any, web_server: ServeProcess) -> None:
    """What the browser evaluates from protocol.js is what the schema test parsed from it."""
    open_page(page, web_server)
    in_browser = page.evaluate(
        """async () => {
            const m = await import("./protocol.js");
            const out = {};
            for (const [k, v] of Object.entries(m)) if (!Array.isArray(v)) out[k] = v;
            return out;
        }"""
    )
    assert in_browser == protocol_tables()


def drag_select(page: Any, start: int, end: int) -> None:
    """Select code points `[start, end)` of the document view by dragging the mouse across them."""
    box = page.evaluate(
        """([a, b]) => {
            const dv = window.dcanvas.docView;
            const first = dv.rangeOf(a, a + 1).getBoundingClientRect();
            const last = dv.rangeOf(b - 1, b).getBoundingClientRect();
            return [first.left + 1, first.top + first.height / 2, last.right - 1, last.top + last.height / 2];
        }""",
        [start, end],
    )
    page.mouse.move(box[0], box[1])
    page.mouse.down()
    page.mouse.move(box[2], box[3], steps=8)
    page.mouse.up()


def test_offsets_count_code_points_like_the_server(page: Any, web_server: ServeProcess) -> None:
    """JavaScript strings count UTF-16 units; the protocol counts code points. An emoji must not shift a mask."""
    from playwright.sync_api import expect

    open_page(page, web_server)
    text = "A 🐈 sat on the mat, é."
    doc_id = create_doc(page, text)
    drag_select(page, 4, 7)
    assert page.evaluate("getSelection().toString()") == "sat"
    expect(page.locator("#sel-start")).to_have_value("4")
    expect(page.locator("#sel-end")).to_have_value("7")
    page.click("button[data-op=mask]")
    expect(page.locator("#doc-view .free")).to_have_count(1)
    free = [s for s in server_doc(web_server, doc_id).spans if s.kind == "free"]
    assert len(free) == 1 and free[0].start <= 4 and free[0].end >= 7
    assert page.inner_text("#doc-view .free") == text[free[0].start : free[0].end]


def test_mask_generate_watch_replay_accept_undo(page: Any, web_server: ServeProcess) -> None:
    from playwright.sync_api import expect

    frames = record_frames(page)
    open_page(page, web_server)
    doc_id = create_doc(page, TEXT)

    # Select "cat sat on the mat" with the mouse, as a person would.
    drag_select(page, 4, 22)
    assert page.evaluate("getSelection().toString()") == "cat sat on the mat"
    expect(page.locator("#sel-start")).to_have_value("4")
    expect(page.locator("#sel-end")).to_have_value("22")
    page.click("button[data-op=mask]")
    expect(page.locator("#doc-view .free")).to_have_count(1)
    assert "cat sat on the mat" in page.inner_text("#doc-view .free")  # the mask may widen to token edges

    # Blank sampler fields show the model's own defaults (its generation_config.json) and take them.
    defaults = load_sampler_defaults(web_server.model)
    expect(page.locator("#param-max_steps")).to_have_attribute("placeholder", f"{defaults.max_steps} (model)")
    expect(page.locator("#param-max_steps")).to_have_value("")
    # The mode is the model's default (left out of gen.start, resolved by the server) unless one is chosen.
    expect(page.locator("#param-mode")).to_have_value("")
    assert page.locator("#param-mode option").first.inner_text().startswith("Model default (infill: diffusion")
    page.fill("#param-max_steps", "12")  # enough steps that frames are not all merged (30 fps) on a fast machine
    page.fill("#param-seed", "11")
    page.evaluate(
        """() => {
            window.__grid = [];
            const run = document.getElementById("run-a");
            const grid = run.querySelector(".grid");
            const record = () => window.__grid.push({
                state: run.dataset.state, frame: Number(grid.dataset.frame),
                cells: Array.from(grid.querySelectorAll(".cell.free"),
                                  (c) => c.textContent + (c.classList.contains("settled") ? "*" : "")).join("|"),
            });
            new MutationObserver(record).observe(grid, {subtree: true, childList: true, characterData: true,
                                                        attributes: true});
        }"""
    )
    page.click("#generate-btn")
    expect(page.locator("#run-a")).to_have_attribute("data-state", "completed", timeout=GEN_TIMEOUT_MS)

    # The grid changed while the generation ran: at least three different intermediate states were on screen.
    seen = page.evaluate("window.__grid")
    live = {s["cells"] for s in seen if s["state"] == "running" and s["frame"] >= 1}
    assert len(live) >= 3, f"saw {len(live)} intermediate grid states: {live}"

    progress = [f for f in frames if f["type"] == "gen.progress"]
    done = next(f for f in frames if f["type"] == "gen.done")
    assert done["status"] == "completed" and len(progress) >= 3
    assert next(f for f in frames if f["type"] == "gen.accepted")["params"]["mode"] == "diffusion"  # the default
    assert [f["seq"] for f in progress] == list(range(1, len(progress) + 1))

    # The final grid is the sum of the deltas; the replay slider shows the canvas after the first frame.
    def tokens_after(n: int) -> list[int | None]:
        state: dict[int, int] = {}
        for f in progress[:n]:
            state.update({s["i"]: s["token"] for s in f["slots"]})
        order = [int(i) for i in page.locator("#run-a .grid .cell.free").evaluate_all("cs => cs.map(c => c.dataset.i)")]
        return [state.get(i) for i in order]

    assert cell_tokens(page, "run-a") == tokens_after(len(progress))
    page.locator("#run-a input[type=range]").fill("0")
    expect(page.locator("#run-a .grid")).to_have_attribute("data-frame", "1")
    assert cell_tokens(page, "run-a") == tokens_after(1)
    page.locator("#run-a input[type=range]").fill(str(len(progress) - 1))

    # The final figures are the server's (JavaScript rounds halves up, Python to even: allow one last digit).
    stats = done["stats"]
    assert float(page.inner_text("#run-a [data-stat=tpf]")) == pytest.approx(stats["tokens_per_forward"], abs=1e-3)
    assert float(page.inner_text("#run-a [data-stat=toks]")) == pytest.approx(stats["tok_s"], abs=0.1)
    expect(page.locator("#run-a .diff del").first).to_be_visible()
    page.screenshot(path=str(artifacts_dir() / "canvas.png"), full_page=True)

    p = done["proposal"]
    before = page.locator("#doc-view").get_attribute("data-v")
    page.click("#run-a button.accept")
    expect(page.locator("#run-a")).to_have_attribute("data-state", "accepted")
    expect(page.locator("#doc-view")).not_to_have_attribute("data-v", before or "")
    expected = TEXT[: p["start"]] + p["text"] + TEXT[p["end"] :]
    on_server = server_doc(web_server, doc_id)
    assert on_server.text == expected
    assert page.evaluate("window.dcanvas.doc.text") == expected
    assert page.locator("#doc-view").text_content() == expected

    # Undo from the keyboard (focus outside any text field) takes the whole proposal back.
    page.click("#doc-heading")
    page.keyboard.press("Control+z")
    expect(page.locator("#doc-view")).to_have_attribute("data-v", str(on_server.v + 1))
    assert server_doc(web_server, doc_id).text == TEXT
    expect(page.locator("#redo-btn")).to_be_enabled()


def test_error_banner_broadcast_and_reconnect(page: Any, web_server: ServeProcess) -> None:
    from playwright.sync_api import expect

    open_page(page, web_server)
    doc_id = create_doc(page, TEXT)

    # A gap over the server's limit: the server refuses the edit, the page says so in an error banner, and the
    # document is untouched. (Not "generate with nothing masked": a model whose canvas is longer than the text
    # continues it, so that is no error with the embedded model.)
    page.fill("#sel-start", "0")
    page.fill("#sel-end", "0")
    page.fill("#gap-tokens", "1000000")
    page.click("#gap-btn")
    banner = page.locator("#banners .banner.error")
    expect(banner).to_contain_text("more than the limit")
    untouched = server_doc(web_server, doc_id)
    assert untouched.text == TEXT and untouched.v == 0
    banner.locator("button.dismiss").click()
    expect(banner).to_have_count(0)

    # Another session edits the document: the page shows the broadcast.
    async def edit_elsewhere() -> DocState:
        async with DcanvasClient.connect(web_server.ws_url, token=web_server.token) as c:
            doc = await c.open(doc_id)
            return await c.edit(doc_id, doc.v, [ReplaceOp(start=4, end=7, text="cow")])

    edited = run_async(edit_elsewhere)
    expect(page.locator("#doc-view")).to_have_attribute("data-v", str(edited.v))
    assert page.locator("#doc-view").text_content() == edited.text

    # A gap of three new tokens after "mat.", then a plain text edit in the editor; both reach the server.
    page.fill("#sel-start", "23")
    page.fill("#sel-end", "23")
    page.fill("#gap-tokens", "3")
    page.click("#gap-btn")
    expect(page.locator("#doc-view .gap")).to_have_attribute("data-slots", "3")
    gap = [s for s in server_doc(web_server, doc_id).spans if s.kind == "free" and s.start == s.end]
    assert [(g.start, g.slots) for g in gap] == [(23, 3)]
    page.click("#edit-btn")
    expect(page.locator("#doc-editor")).to_be_focused()
    page.fill("#doc-editor", edited.text.replace("warm day", "cold night"))
    page.click("#edit-save")
    expect(page.locator("#doc-editor")).to_be_hidden()
    edited = server_doc(web_server, doc_id)
    assert edited.text == TEXT.replace("cat", "cow").replace("warm day", "cold night")
    expect(page.locator("#doc-view")).to_have_attribute("data-v", str(edited.v))

    # A long generation into the gap is cancelled with Escape; Regenerate runs it again, shorter; Reject drops it.
    page.fill("#param-max_steps", "256")
    page.click("#generate-btn")
    expect(page.locator("#run-a .grid")).not_to_have_attribute("data-frame", "0", timeout=GEN_TIMEOUT_MS)
    page.keyboard.press("Escape")
    expect(page.locator("#run-a")).to_have_attribute("data-state", "cancelled")
    expect(page.locator("#run-a .run-status")).to_contain_text("cancelled")
    page.fill("#param-max_steps", "3")
    page.click("#run-a button.regenerate")
    expect(page.locator("#run-a")).to_have_attribute("data-state", "completed", timeout=GEN_TIMEOUT_MS)
    page.click("#run-a button.reject")
    expect(page.locator("#run-a")).to_have_attribute("data-state", "rejected")
    expect(page.locator("#run-a button.accept")).to_be_disabled()
    assert server_doc(web_server, doc_id).text == edited.text  # rejecting changed nothing

    # The socket drops: a banner says so, the page reconnects by itself and reads the document again.
    page.evaluate("window.dcanvas.conn._ws.close(4000, 'test')")
    expect(page.locator("#banners [data-key=conn]")).to_contain_text("Disconnected")
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open", timeout=15_000)
    expect(page.locator("#banners [data-key=conn]")).to_have_count(0)
    expect(page.locator("#banners [data-key=conn-ok]")).to_contain_text("Reconnected")
    assert page.locator("#doc-view").text_content() == edited.text
    expect(page.locator("#generate-btn")).to_be_enabled()


def test_side_by_side_on_a_narrow_window_from_the_keyboard(page: Any, web_server: ServeProcess) -> None:
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 420, "height": 800})
    open_page(page, web_server)
    doc_id = create_doc(page, TEXT)

    # Select characters 4..22 with the keyboard in the document view and mask them with "m".
    page.focus("#doc-view")
    page.keyboard.press("Control+Home")
    for _ in range(4):
        page.keyboard.press("ArrowRight")
    for _ in range(18):
        page.keyboard.press("Shift+ArrowRight")
    expect(page.locator("#sel-end")).to_have_value("22")
    page.keyboard.press("m")
    expect(page.locator("#doc-view .free")).to_have_count(1)

    page.fill("#param-max_steps", "6")
    page.check("#compare")
    expect(page.locator("#generate-btn")).to_have_text("Generate both")
    page.keyboard.press("Control+Enter")
    expect(page.locator("#compare-summary")).to_contain_text("Autoregressive", timeout=2 * GEN_TIMEOUT_MS)
    for run, mode in (("run-a", "diffusion"), ("run-b", "ar")):
        expect(page.locator(f"#{run}")).to_have_attribute("data-state", "completed")
        assert page.locator(f"#{run} .run-status").inner_text().startswith(mode)
        assert re.fullmatch(r"\d+\.\d{3}", page.locator(f"#{run} [data-stat=tpf]").inner_text())
    summary = page.inner_text("#compare-summary")
    assert summary.count("tokens per forward") == 2

    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at 420px"
    page.screenshot(path=str(artifacts_dir() / "narrow.png"), full_page=True)

    # Accepting the AR proposal drops the diffusion one.
    page.click("#run-b button.accept")
    expect(page.locator("#run-b")).to_have_attribute("data-state", "accepted")
    expect(page.locator("#run-a")).to_have_attribute("data-state", "dropped")
    assert server_doc(web_server, doc_id).text == page.evaluate("window.dcanvas.doc.text")

    page.set_viewport_size({"width": 1280, "height": 800})
    assert page.evaluate("document.documentElement.scrollWidth - window.innerWidth") <= 0


def test_a_deleted_document_leaves_the_page(page: Any, web_server: ServeProcess) -> None:
    from playwright.sync_api import expect

    sent: list[str] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)))
    open_page(page, web_server)
    # The server requires a token: the page offered it as a subprotocol, and the server selected only dcanvas.v1.
    assert page.evaluate("window.dcanvas.conn._ws.protocol") == "dcanvas.v1"
    hello = json.loads(sent[0])
    assert hello["type"] == "hello" and "token" not in hello
    doc_id = create_doc(page, TEXT)

    # Another session deletes the document on screen: the page says so and shows no document.
    async def delete_elsewhere() -> None:
        async with DcanvasClient.connect(web_server.ws_url, token=web_server.token) as c:
            await c.delete(doc_id)

    run_async(delete_elsewhere)
    expect(page.locator("#banners [data-key=doc-gone]")).to_contain_text("deleted by another session")
    expect(page.locator("#doc-meta")).to_have_text("No document open.")
    expect(page.locator("#doc-view")).to_have_text("")
    expect(page.locator("#doc-delete-btn")).to_be_disabled()
    assert doc_id not in page.evaluate("location.hash")

    # Delete from the page: it asks first; declining keeps the document, confirming deletes it on the server.
    other = create_doc(page, "A second document.")
    page.once("dialog", lambda d: d.dismiss())
    page.click("#doc-delete-btn")
    expect(page.locator("#doc-view")).to_have_text("A second document.")
    page.once("dialog", lambda d: d.accept())
    page.click("#doc-delete-btn")
    expect(page.locator("#doc-meta")).to_have_text("No document open.")

    async def listing() -> list[str]:
        async with DcanvasClient.connect(web_server.ws_url, token=web_server.token) as c:
            return [d.doc_id for d in await c.list_docs()]

    assert not {doc_id, other} & set(run_async(listing))
    expect(page.locator(f"#doc-select option[value='{other}']")).to_have_count(0)


def test_ar_infill_drafts_grow_side_by_side_then_the_chosen_one_is_marked(page: Any, web_server: ServeProcess) -> None:
    """AR mode on a masked span drafts K candidates together: the page shows every draft as a row while they grow
    (the likeliest starred), then marks the one chosen by the seam and what was kept of it, and names what wrote
    the proposal (the server's label for ar-infill)."""
    from playwright.sync_api import expect

    frames = record_frames(page)
    open_page(page, web_server)
    create_doc(page, TEXT)
    drag_select(page, 4, 40)
    page.click("button[data-op=mask]")
    expect(page.locator("#doc-view .free")).to_have_count(1)
    page.select_option("#param-mode", "ar")
    page.fill("#param-seed", "5")
    page.evaluate(
        """() => {
            window.__drafts = [];
            const section = document.querySelector("#run-a .drafts");
            const record = () => window.__drafts.push({
                hidden: section.hidden, state: section.dataset.state || "",
                rows: Array.from(section.querySelectorAll("li"), (li) => li.textContent),
                lead: section.querySelectorAll("li.lead").length, chosen: section.querySelectorAll("li.chosen").length,
            });
            new MutationObserver(record).observe(section, {subtree: true, childList: true, characterData: true,
                                                           attributes: true});
        }"""
    )
    page.click("#generate-btn")
    expect(page.locator("#run-a")).to_have_attribute("data-state", "completed", timeout=GEN_TIMEOUT_MS)

    with_drafts = [f["drafts"] for f in frames if f["type"] == "gen.progress" and f.get("drafts")]
    assert len(with_drafts) >= 2, "no frame carried the drafts"
    k = len(with_drafts[0]["texts"])
    assert k == load_sampler_defaults(web_server.model).ar_drafts > 1
    growing = [d for d in with_drafts if d.get("chosen") is None]  # dump leaves absent fields out
    assert [d["tokens"] for d in growing] == sorted({d["tokens"] for d in growing})  # one more token per frame
    final = with_drafts[-1]
    if load_sampler_defaults(web_server.model).ar_temperature > 0:  # sampled drafts differ (greedy ones cannot)
        assert len(set(final["texts"])) >= 2, final["texts"]
    assert final.get("chosen") is not None and final["texts"][final["chosen"]].startswith(final["kept"])

    # On screen: K rows growing (one starred), then the chosen one marked with its kept text.
    seen = page.evaluate("window.__drafts")
    live = [s for s in seen if not s["hidden"] and s["state"] == "growing"]
    assert live and all(len(s["rows"]) == k and s["lead"] == 1 and s["chosen"] == 0 for s in live)
    last = seen[-1]
    assert last["state"] == "chosen" and last["lead"] == 0 and last["chosen"] == 1
    size = lambda s: sum(len(r) for r in s["rows"])  # noqa: E731
    assert size(live[0]) < size(last), "the drafts did not grow on screen"
    expect(page.locator("#run-a .drafts")).to_have_attribute("data-state", "chosen")
    expect(page.locator("#run-a .drafts li")).to_have_count(k)
    chosen = page.locator("#run-a .drafts li.chosen")
    expect(chosen).to_have_count(1)
    assert chosen.get_attribute("data-draft") == str(final["chosen"])
    if final["kept"]:
        shown = page.evaluate("async (t) => (await import('./grid.js')).visible(t, {spaces: false})", final["kept"])
        assert chosen.locator("mark").text_content() == shown
    welcome = next(f for f in frames if f["type"] == "welcome")
    assert welcome["model"]["labels"]["ar-infill"] == "AR infill (K drafts, seam-scored)"
    expect(page.locator("#run-a [data-stat=writer]")).to_have_text("AR infill (K drafts, seam-scored)")
    page.screenshot(path=str(artifacts_dir() / "drafts.png"), full_page=True)
