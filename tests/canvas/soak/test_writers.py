"""The soak's writer on slow and missing answers (found by the 5-minute dry run on the 96k model, where a reply or a
generation's next frame can take many seconds): a late answer is journalled as late and is no failure; no answer at
all within the bound is a violation, and a generation that goes silent cannot hang the writer (and with it the
soak, which then never reports)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from canvas.soak import writers
from canvas.soak.checker import check_writer
from canvas.soak.writers import Known, Step, Writer

pytestmark = pytest.mark.timeout(30)


def _writer(request_timeout: float = 5.0) -> Writer:
    now = time.monotonic()
    w = Writer(0, "ws://127.0.0.1:9/ws", now, now + 60, seed=0, gen_steps=(8,), request_timeout=request_timeout)
    w.log.doc_id = "d0"
    w.log.steps.append(Step(0.0, "open", Known(0, "The cat sat.", False, False)))
    return w


class _SilentGen:
    """A generation whose next frame never comes."""

    gen = "g-silent"

    async def __anext__(self) -> Any:
        await asyncio.sleep(3600)


class _FakeClient:
    closed = False

    async def close(self) -> None:
        self.closed = True


def test_a_late_answer_is_journalled_late_and_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writers, "LATE_S", 0.01)
    w = _writer()
    assert asyncio.run(w._ask("replace", asyncio.sleep(0.05, result=7))) == 7
    assert [what for _, what, _ in w.log.late] == ["replace"] and w.log.late[0][2] >= 0.05
    assert asyncio.run(w._ask("pin", asyncio.sleep(0, result=1))) == 1 and len(w.log.late) == 1  # fast: not late
    assert w.log.unanswered == [] and check_writer(w.log, []) == []


def test_a_generation_that_goes_silent_times_out_naming_it() -> None:
    w = _writer(request_timeout=0.05)
    with pytest.raises(TimeoutError, match="g-silent: no frame"):
        asyncio.run(w._next(_SilentGen()))  # type: ignore[arg-type]


def test_no_answer_is_a_violation_and_the_writer_moves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop journals the request without an answer, drops that connection and reconnects (to reconcile)."""
    w = _writer()
    client = _FakeClient()
    w.client = client  # type: ignore[assignment]
    calls: list[str] = []

    async def act() -> None:
        w.inflight = "replace"
        w.deadline = time.monotonic()  # one action, then the loop ends
        raise TimeoutError

    async def connect() -> bool:
        calls.append(f"connect with {w.inflight} in flight")
        return False

    monkeypatch.setattr(w, "_act", act)
    monkeypatch.setattr(w, "_connect", connect)
    log = asyncio.run(w.run())
    assert len(log.unanswered) == 1 and log.unanswered[0].endswith("replace"), log.unanswered
    assert client.closed and calls == ["connect with replace in flight"]
    found = check_writer(log, [])
    assert len(found) == 1 and "no answer" in found[0], found
