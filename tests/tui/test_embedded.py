"""`tui.embedded.LocalServer`: a start on one thread waits for a stop under way on another (the app's reconnect loop
against whoever stops the server), so the editor never reconnects to a new server while the old one still shuts down."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from canvas.server.embedded import EmbeddedServer
from tui.embedded import LocalServer


def test_start_waits_for_a_stop_under_way(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_stop = EmbeddedServer.stop

    def slow_stop(self: EmbeddedServer) -> None:
        events.append("stop begins")
        time.sleep(1.0)  # a shutdown under load: the lifespan waits for the engine's step
        real_stop(self)
        events.append("stop ends")

    local = LocalServer(tiny_model)
    first = local.start()
    monkeypatch.setattr(EmbeddedServer, "stop", slow_stop)
    stopper = threading.Thread(target=local.stop)
    stopper.start()
    while not events:  # the stop has taken the server
        time.sleep(0.01)
    assert not local.alive
    second = local.start()  # as the reconnect loop does as soon as the server is gone
    events.append("started")
    stopper.join()
    try:
        assert events == ["stop begins", "stop ends", "started"]
        assert second != first and local.alive
    finally:
        monkeypatch.setattr(EmbeddedServer, "stop", real_stop)
        local.stop()
