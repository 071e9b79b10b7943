"""The per-connection outbox: order, latest-wins merging of progress for slow clients, frame rate, overflow."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from canvas import protocol as p
from canvas.server.outbox import Outbox, SlowConsumer

pytestmark = pytest.mark.timeout(20)


class GatedSocket:
    """A socket whose sends complete only when the test opens the gate: a client that is not reading."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def send(self, text: str) -> None:
        await self.gate.wait()
        self.frames.append(json.loads(text))


def _slot(i: int, token: int, accepted: bool = False) -> p.SlotUpdate:
    return p.SlotUpdate(i=i, token=token, text=f"t{token}", entropy=0.1, accepted=accepted)


def _progress(box: Outbox, gen: str, step: int, slots: list[p.SlotUpdate]) -> None:
    box.progress(gen, re=1, step=step, max_steps=10, slots=slots, accepted=step, free=4, elapsed_s=step / 10)


async def _drain(box: Outbox, task: asyncio.Task[None]) -> None:
    box.close()
    await asyncio.wait_for(task, 5)


async def test_messages_keep_their_order() -> None:
    sock = GatedSocket()
    box = Outbox(sock.send, max_fps=1000)
    task = asyncio.create_task(box.run())
    for i in range(50):
        box.put(p.Pong(re=i))
    await _drain(box, task)
    assert [f["re"] for f in sock.frames] == list(range(50))


async def test_slow_client_gets_merged_frames_with_the_latest_values() -> None:
    sock = GatedSocket()
    box = Outbox(sock.send, max_fps=1000)
    task = asyncio.create_task(box.run())
    sock.gate.clear()  # the client stops reading
    box.put(p.Pong(re="first"))
    await asyncio.sleep(0.01)  # the sender is now stuck in send("first")
    truth: dict[int, int] = {}
    rng = random.Random(0)
    for step in range(1, 41):
        slots = [_slot(i, rng.randrange(100), accepted=step > 30) for i in rng.sample(range(8), 3)]
        truth.update({s.i: s.token for s in slots})
        _progress(box, "g1", step, slots)
    box.put(p.GenDone(re=1, gen="g1", doc_id="d", status="completed", stats=p.GenStats(
        steps=40, tokens_per_forward=0.1, tok_s=1, wall_s=1)))  # fmt: skip
    sock.gate.set()
    await _drain(box, task)
    kinds = [f["type"] for f in sock.frames]
    assert kinds == ["pong", "gen.progress", "gen.done"]  # 40 engine frames became one
    merged = sock.frames[1]
    assert merged["seq"] == 1 and merged["merged"] == 40 and merged["step"] == 40 and merged["accepted"] == 40
    assert {s["i"]: s["token"] for s in merged["slots"]} == truth  # nothing lost: latest value of every slot
    assert box.progress_merged == 39


async def test_seq_counts_sent_frames_per_generation_and_done_comes_last() -> None:
    sock = GatedSocket()
    box = Outbox(sock.send, max_fps=1000)
    task = asyncio.create_task(box.run())
    for step in range(5):
        _progress(box, "a", step, [_slot(0, step)])
        _progress(box, "b", step, [_slot(1, step)])
        await asyncio.sleep(0.005)  # a reading client: every frame is sent on its own
    box.put(p.GenDone(gen="a", doc_id="d", status="cancelled", stats=p.GenStats(
        steps=5, tokens_per_forward=0, tok_s=0, wall_s=0.1)))  # fmt: skip
    await _drain(box, task)
    for gen in ("a", "b"):
        seqs = [f["seq"] for f in sock.frames if f.get("gen") == gen and f["type"] == "gen.progress"]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 2
    a_frames = [f["type"] for f in sock.frames if f.get("gen") == "a"]
    assert a_frames[-1] == "gen.done" and a_frames.count("gen.done") == 1


async def test_progress_rate_is_capped() -> None:
    sock = GatedSocket()
    box = Outbox(sock.send, max_fps=20)  # at most one progress frame per 50 ms
    task = asyncio.create_task(box.run())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < 0.5:
        _progress(box, "g", 1, [_slot(0, 1)])
        await asyncio.sleep(0.002)
    await _drain(box, task)
    frames = [f for f in sock.frames if f["type"] == "gen.progress"]
    assert 5 <= len(frames) <= 12  # ~10 at 20 fps over 0.5 s, never one per engine frame (~200)
    assert sum(f["merged"] for f in frames) == box.progress_sent + box.progress_merged


async def test_a_client_that_never_reads_overflows_instead_of_growing() -> None:
    sock = GatedSocket()
    box = Outbox(sock.send, max_fps=1000, max_queued=10)
    task = asyncio.create_task(box.run())
    sock.gate.clear()
    with pytest.raises(SlowConsumer):
        for i in range(100):
            box.put(p.Pong(re=i))
    # Progress never overflows: it occupies one place however many frames arrive.
    for step in range(100):
        _progress(box, "g", step, [_slot(step % 8, step)])
    assert box.progress_merged == 99
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
