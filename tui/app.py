"""`dcanvas tui [FILE] [--server ws://...] [--model DIR]`: the Textual editor for the diffusion canvas.

`DcanvasApp` owns what outlives a screen: the settings, the file being edited, the server connection and, without
`--server`, the embedded server (`tui.embedded`). One exclusive worker keeps the connection: it starts the
embedded server if there is none (in a thread: loading the model must not freeze the UI), connects, and when the
connection drops tells the screen why and reconnects with backoff (restarting the embedded server if it died).
The screens live in `tui.screens`, the widgets in `tui.widgets`, the styles in `app.tcss`.

Quitting with unsaved changes asks for a second Ctrl+Q. Errors reach the user as sentences, never tracebacks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import ClassVar

from textual import work
from textual.app import App
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.screen import Screen

from canvas.env import TOKEN
from canvas.protocol import DocState, ProtocolError
from canvas.protocol.client import ConnectionLost, DcanvasClient
from tui.embedded import EmbeddedServerError, LocalServer
from tui.messages import Connected, Connecting, Disconnected
from tui.screens.help import HelpScreen
from tui.screens.main import MainScreen
from tui.screens.settings import SettingsScreen
from tui.settings import Settings, load_settings, mode_label, save_settings
from tui.textfile import TextFile, TextFileError

log = logging.getLogger("tui")
RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # reconnect backoff, then every 8 s
QUIT_CONFIRM_S = 3.0


class DcanvasApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "dcanvas"
    ENABLE_COMMAND_PALETTE = False  # Ctrl+P pins
    BINDINGS: ClassVar[list[BindingType]] = [  # fmt: skip
        Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="Quit (twice when there are unsaved changes)"),
        Binding("f1", "help", "Help", tooltip="This help: every key"),
        Binding(
            "f2",
            "settings",
            "Settings",
            tooltip="Generation settings: mode, max steps, entropy bound, temperatures, seed, gap size",
        ),
        Binding(
            "f8",
            "toggle_diffusion",
            "Diffusion",
            tooltip="Diffusion decoder on / off (off: the model's default "
            "mode; the converted model's diffusion decoder is untrained for denoising)",
        ),
    ]

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        server: str | None = None,
        model: str | Path | None = None,
        token: str | None = None,
        settings_path: Path | None = None,
        connect: bool = True,
    ) -> None:
        super().__init__()
        self.server_url = server
        self.token = token
        self.settings_path = settings_path
        self.settings, settings_problem = load_settings(settings_path)
        self.textfile = TextFile()
        self.start_problems = [settings_problem] if settings_problem else []
        text = ""
        if path is not None:
            try:
                self.textfile, text = TextFile.load(path)
                self.start_problems += self.textfile.warnings
            except TextFileError as e:  # start empty and untitled: saving must not overwrite what we could not read
                self.start_problems.append(f"Cannot open {path}: {e}")
        self.embedded = LocalServer(model) if server is None else None
        self.client: DcanvasClient | None = None
        self.connect = connect
        self._main = MainScreen(text)
        self._quit_armed = 0.0

    def get_default_screen(self) -> Screen[None]:
        return self._main

    @property
    def main(self) -> MainScreen:
        return self._main

    def on_mount(self) -> None:
        for problem in self.start_problems:
            self.notify(problem, severity="warning", timeout=10)
        if self.connect:
            self.keep_connected()

    def _tell(self, message: Message) -> None:
        self._main.post_message(message)

    # -- connection --------------------------------------------------------------------------------------------

    def _on_state(self, state: DocState) -> None:
        self._main.on_state(state)

    async def _server_url(self, lost: str | None) -> str | None:
        if self.server_url is not None:
            return self.server_url
        assert self.embedded is not None
        if self.embedded.alive:
            return self.embedded.url
        self._tell(Connecting("Starting the embedded server (loading the model)", lost))
        try:
            return await asyncio.to_thread(self.embedded.start)
        except EmbeddedServerError as e:
            self._tell(Disconnected(f"The embedded server did not start: {e}", None))
            return None

    @work(exclusive=True, group="connection", exit_on_error=False)
    async def keep_connected(self) -> None:
        attempt = 0
        lost: str | None = None  # why the last connection dropped, until the next one is made
        while True:
            url = await self._server_url(lost)
            if url is None:
                return
            self._tell(Connecting(f"Connecting to {url}", lost))
            try:
                client = await DcanvasClient.connect(
                    url, token=self.token, client_name="dcanvas-tui", on_state=self._on_state, open_timeout=5
                )
            except ProtocolError as e:  # refused at hello (wrong token, wrong protocol): retrying will not help
                self._tell(Disconnected(f"The server at {url} refused this editor: {e.message}", None))
                return
            except Exception as e:  # refused, unreachable, not a websocket, timed out
                delay = RETRY_S[min(attempt, len(RETRY_S) - 1)]
                attempt += 1
                self._tell(Disconnected(f"Cannot reach the server at {url}: {_reason(e)}", delay))
                await asyncio.sleep(delay)
                continue
            attempt = 0
            self.client = client
            assert client.welcome is not None  # connect() completed the handshake
            lost = None
            self._tell(Connected(url, client.welcome))
            try:
                while not client.closed:
                    await asyncio.sleep(0.2)
                try:
                    await client.ping()
                    why = "closed"
                except ConnectionLost as e:
                    why = str(e)
            finally:
                if self.client is client:
                    self.client = None
            delay = RETRY_S[0]
            lost = f"Lost the connection to the server ({why})"
            self._tell(Disconnected(lost, delay))
            await asyncio.sleep(delay)

    # -- app actions ---------------------------------------------------------------------------------------------

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_settings(self) -> None:
        if isinstance(self.screen, SettingsScreen):
            return

        def answer(result: Settings | None) -> None:
            if result is not None:
                self._apply_settings(result)

        self.push_screen(SettingsScreen(self.settings), answer)

    def action_toggle_diffusion(self) -> None:
        """One key between the diffusion decoder and the model's default mode (saved like any setting)."""
        mode = None if self.settings.mode == "diffusion" else "diffusion"
        self._apply_settings(self.settings.model_copy(update={"mode": mode}), quiet=True)
        self.notify(f"Mode: {mode_label(mode)}.")

    def _apply_settings(self, result: Settings, *, quiet: bool = False) -> None:
        self.settings = result
        self._main.set_run(mode=mode_label(result.mode))
        self._main.update_status()
        try:
            where = save_settings(result, self.settings_path)
            if not quiet:
                self.notify(f"Settings saved to {where}.")
        except OSError as e:
            self.notify(f"Settings apply now but could not be saved: {e}", severity="warning")

    async def action_quit(self) -> None:
        if self._main.is_mounted and self._main.dirty and time.monotonic() - self._quit_armed > QUIT_CONFIRM_S:
            self._quit_armed = time.monotonic()
            self.notify(
                "Unsaved changes: press Ctrl+Q again to quit without saving (Ctrl+S saves).", severity="warning"
            )
            return
        self.exit(0)

    async def on_unmount(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)


def _reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (is `dcanvas serve` running?)"
    if isinstance(e, TimeoutError):
        return "timed out"
    text = str(e) or type(e).__name__
    return text[:200]


# -- command line ----------------------------------------------------------------------------------------------


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", default=None, help="text or Markdown file to edit (created on save)")
    parser.add_argument("--server", default=None, help="connect to this server (ws://HOST:PORT/ws) instead of "
                        "starting an embedded one")  # fmt: skip
    parser.add_argument("--model", default=None, help="model directory for the embedded server (default: "
                        "$DCANVAS_MODEL, else the built Gemma-3-270M conversion, building it if its packages are "
                        "installed, else canvas-6m)")  # fmt: skip
    parser.add_argument("--token", default=None, help="token for a server off loopback (default $DCANVAS_TOKEN)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    server = args.server
    if server is not None and not server.startswith(("ws://", "wss://")):
        print(f"dcanvas tui: --server must be a websocket URL like ws://127.0.0.1:8765/ws, not {server!r}")
        return 2
    if args.model is not None and server is not None:
        print("dcanvas tui: --model is for the embedded server; a --server loads its own model")
        return 2
    # Logs go to a file: the terminal belongs to the UI.
    log_dir = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "dcanvas"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        logging.basicConfig(filename=log_dir / "tui.log", level=logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    except OSError:
        logging.disable(logging.CRITICAL)
    token = args.token or TOKEN.get() or None
    model, fallback = args.model, None
    if server is None:  # the model is chosen (and the why of a fallback said, a build shown) before the UI starts
        from canvas.convert.resolve import ModelUnavailable, resolve_model

        try:
            resolved = resolve_model(args.model)
        except ModelUnavailable as e:
            print(f"dcanvas tui: {e}")
            return 2
        model = str(resolved.path)
        fallback = resolved.note if resolved.origin == "embedded" else None
    app = DcanvasApp(args.file, server=server, model=model, token=token)
    if fallback is not None:  # the terminal's line is hidden once the UI starts: say it in the UI too
        app.start_problems.append(fallback.removeprefix("dcanvas: "))
    result = app.run()
    return int(result or 0)
