"""The editor's own server: `canvas.server.embedded.EmbeddedServer`, started on demand and restarted if it dies.

`dcanvas tui` without `--server` runs one in this process (a background thread, a free loopback port, documents in
memory: the file on disk is the editor's truth, not the server's store), so that `make run` alone gives a working
editor. `LocalServer` serves `--model DIR`, else `canvas.convert.resolve`'s choice, turns every way starting can
fail into an `EmbeddedServerError` whose message says what to do, and can tell whether the server still answers.

`start()` blocks while the model loads: the app calls it from a thread (`asyncio.to_thread`). `start()` and `stop()`
hold one lock, as they run on different threads (the app's reconnect loop starts a server as soon as it sees the old
one gone, while whoever stopped it may still be waiting for it to shut down): a start waits for a stop under way to
finish, so two servers never hold a model at once and the editor never reconnects before the old server is gone.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from canvas.server.embedded import EmbeddedServer


log = logging.getLogger("tui.embedded")


class EmbeddedServerError(RuntimeError):
    """The embedded server could not start (no model, a broken model directory, no free port)."""


class LocalServer:
    def __init__(self, model_dir: str | Path | None = None) -> None:
        self.model_dir = None if model_dir is None else str(model_dir)
        self._server: EmbeddedServer | None = None
        self._lock = threading.RLock()  # start and stop, each whole (see the module docstring)

    @property
    def url(self) -> str:
        if self._server is None:
            raise EmbeddedServerError("the embedded server has not been started")
        return self._server.url

    @property
    def alive(self) -> bool:
        """The server was started, not stopped, and accepts connections."""
        server = self._server  # read once: a stop on another thread may clear it
        if server is None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=0.5):
                return True
        except OSError:
            return False

    def start(self) -> str:
        """Start a server (a fresh one if a previous one died) and return its websocket URL."""
        with self._lock:
            return self._start()

    def _start(self) -> str:
        from canvas.convert.resolve import ModelUnavailable, resolve_model
        from canvas.server.embedded import EmbeddedServer

        if self.alive:
            return self.url
        self.stop()
        try:
            # `dcanvas tui` resolves before the UI owns the terminal; here only for callers that did not, and the
            # fallback's line goes to the log, not over the UI.
            model_dir = self.model_dir or str(resolve_model(say=log.warning).path)
        except ModelUnavailable as e:
            raise EmbeddedServerError(f"{e}, or connect to a running server with --server ws://HOST:PORT/ws") from e
        if not (Path(model_dir) / "config.json").is_file():
            raise EmbeddedServerError(f"{model_dir} is not a dcanvas model directory (it has no config.json)")
        try:
            server = EmbeddedServer(model_dir=str(model_dir))
        except Exception as e:  # a broken model directory: say what and where, not how deep in the stack
            raise EmbeddedServerError(f"could not load the model in {model_dir}: {e}") from e
        try:
            server.start()
        except RuntimeError as e:
            raise EmbeddedServerError(str(e)) from e
        self._server = server
        return server.url

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            if server is not None:
                server.stop()
