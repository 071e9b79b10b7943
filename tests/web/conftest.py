"""Fixtures for the browser tests: a tiny model, a real `dcanvas serve` on a free loopback port, and Chromium.

The server requires a token (`WEB_TOKEN`), which every page finds in its session storage, as a user who typed it
under Connection would: so every browser test also runs the page's token-as-subprotocol handshake.

The browser is Debian's Chromium (`/usr/bin/chromium`, or `$DCANVAS_CHROMIUM`) driven by Playwright for Python,
headless, with a fresh user-data directory. Playwright cannot download its own browser here, so when Chromium or
the `playwright` package is missing the browser tests skip and say which (`bash tests/web/ensure_chromium.sh`
installs Chromium). Screenshots go to `$DCANVAS_ARTIFACTS/web/` (default `artifacts/web/` in the repository).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.web.webfiles import REPO

CHROMIUM = Path(os.environ.get("DCANVAS_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_S = 120  # importing torch and loading the model takes ~10 s on a busy 2-core machine
WEB_TOKEN = "web-test-token-ü/+=-0123456789"  # characters that only travel as base64url


def artifacts_dir() -> Path:
    base = Path(os.environ.get("DCANVAS_ARTIFACTS", REPO / "artifacts"))
    out = base / "web"
    out.mkdir(parents=True, exist_ok=True)
    return out


class ServeProcess:
    """`dcanvas serve` in a subprocess, on 127.0.0.1 at a free port, with its log in a file (`canvas.bench.http.Server`
    starts it and waits for /health)."""

    def __init__(self, model: Path, workdir: Path, token: str | None = None) -> None:
        from canvas.bench.http import Server, ours_command
        from canvas.soak.server import free_port

        self.model = model
        self.token = token
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        self.server = Server("dcanvas serve", ours_command(model, self.port, workdir / "docs.db", token=token),
                             self.base, workdir / "serve.log", env, cwd=REPO)
        self.health: dict[str, Any] = self.server.wait_ready(SERVER_START_S)

    def log(self) -> str:
        return self.server.tail(4000)

    def stop(self) -> None:
        self.server.close()


@pytest.fixture(scope="session")
def chromium_launch() -> dict[str, Any]:
    """Launch options for Playwright, or a skip that says what is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright package is not installed (it is in the `test` extra: pip install -e '.[test]')")
    if not CHROMIUM.is_file() or not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: run `bash tests/web/ensure_chromium.sh` (apt-get install chromium)")
    return {"executable_path": str(CHROMIUM), "headless": True, "args": CHROMIUM_ARGS}


@pytest.fixture(scope="session")
def web_server(tmp_path_factory: pytest.TempPathFactory, chromium_launch: dict[str, Any]) -> Iterator[ServeProcess]:
    """A real server with a random-weight tiny model (canvas of 32 slots), or the model directory named by
    `$DCANVAS_WEB_MODEL` (e.g. the embedded default model), and a fresh document store."""
    from canvas.engine.backend import write_tiny_checkpoint
    from canvas.sampling.modes import write_extra

    chosen = os.environ.get("DCANVAS_WEB_MODEL")
    model = Path(chosen) if chosen else write_tiny_checkpoint(tmp_path_factory.mktemp("web-model"))
    if not chosen:  # AR drafts sampled, as the built models' are (greedy drafts would all be the same text)
        write_extra(model, {"ar_temperature": 0.8})
    server = ServeProcess(model, tmp_path_factory.mktemp("web-serve"), token=WEB_TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def browser_context(tmp_path_factory: pytest.TempPathFactory, chromium_launch: dict[str, Any]) -> Iterator[Any]:
    """One headless Chromium with a fresh profile for the session; each test opens its own page in it."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        try:
            context = p.chromium.launch_persistent_context(
                str(tmp_path_factory.mktemp("chromium-profile")),
                viewport={"width": 1280, "height": 800},
                **chromium_launch,
            )
        except PlaywrightError as e:
            pytest.skip(f"Chromium at {CHROMIUM} does not start under Playwright: {str(e).splitlines()[0]}")
        yield context
        context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.stash[_FAILED] = report.failed


_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def page(browser_context: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh page; fails the test on any uncaught page error, and screenshots the page when the test fails."""
    pg = browser_context.new_page()
    pg.add_init_script(f"sessionStorage.setItem('dcanvas.token', {json.dumps(WEB_TOKEN)});")
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    pg.set_default_timeout(15_000)
    yield pg
    if request.node.stash.get(_FAILED, False):
        pg.screenshot(path=str(artifacts_dir() / f"failed-{request.node.name}.png"), full_page=True)
    pg.close()
    # Console errors from a socket the test closed on purpose are expected; anything else is a page bug.
    unexpected = [e for e in errors if "WebSocket" not in e]
    assert not unexpected, f"the page reported errors: {unexpected}"
