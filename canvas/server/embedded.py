"""A dcanvas server inside the current process, on a free loopback port, in a background thread.

For the TUI (which starts its own server when no `--server` is given) and for tests that need real websockets
without starting a process. The listening socket is bound before the app is built, so the port is known to the
app (its Origin allow-list names it) and no other process can take it in between.

    with EmbeddedServer(backend=backend) as server:
        async with DcanvasClient.connect(server.url) as c: ...
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

from canvas.engine.backend import Backend
from canvas.protocol import ServerLimits
from canvas.server.app import create_app
from canvas.server.config import ServerConfig


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The uvicorn settings every dcanvas server runs with."""
    return {
        # Frames up to twice the limit reach the parser and get a typed too_large; larger ones close with 1009.
        "ws_max_size": 2 * config.limits.max_frame_bytes,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
    }


class EmbeddedServer:
    def __init__(
        self,
        *,
        backend: Backend | None = None,
        model_dir: str | None = None,
        db: str = ":memory:",
        limits: ServerLimits | None = None,
        token: str | None = None,
        web_dir: str | None = None,
        log_level: str = "warning",
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        fields: dict[str, Any] = {"host": "127.0.0.1", "port": self.port, "db": db, "token": token}
        if model_dir is not None:
            fields["model_dir"] = model_dir
        if limits is not None:
            fields["limits"] = limits
        if web_dir is not None:
            fields["web_dir"] = web_dir
        self.config = ServerConfig(**fields)
        self.app = create_app(self.config, backend=backend)
        options = uvicorn_options(self.config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, lifespan="on", **options))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> EmbeddedServer:
        def run() -> None:
            try:
                asyncio.run(self._server.serve(sockets=[self._sock]))
            except BaseException as e:  # reported by start() or stop()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"dcanvas-server-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the embedded server did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
