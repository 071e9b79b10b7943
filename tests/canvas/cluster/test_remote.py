"""`RemoteAdmission` alone, without Ray: the ingress side of a replica's stream (accepted, refused and re-spread,
invalid, no answer, died mid-generation, cancelled) over scripted streams. The real streams, from Ray Serve
replicas, are covered by tests/canvas/cluster/test_cluster.py."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import pytest

from canvas.cluster.records import Accepted, EngineRef, Invalid, Refused, coalesce, fingerprint
from canvas.cluster.remote import RemoteAdmission, RemoteHandle, Unavailable
from canvas.engine.scheduling import Placement
from canvas.engine.types import Done, Event, Frame, GenRequest
from canvas.server.admission import Busy

pytestmark = pytest.mark.timeout(30)
REQUEST = GenRequest((1, 2, 3), (5, 0, 0), (True, False, False))


def frame(gen_id: int, step: int) -> Frame:
    return Frame(gen_id, 0, step, 4, (5, 6, 7), (True, False, True), (0.0, 1.0, 0.5), 0.01 * step)


class ScriptedStream:
    """Yields `items` (an exception instance is raised instead), then waits: a generation still running."""

    def __init__(self, items: list[Any], hang: bool = True) -> None:
        self.items, self.hang = list(items), hang
        self.cancelled = asyncio.Event()

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, BaseException):
                raise item
            await asyncio.sleep(0)
            return item
        if not self.hang:
            raise StopAsyncIteration
        await self.cancelled.wait()
        raise RuntimeError("RequestCancelledError: the request was cancelled")  # what Ray raises after cancel()

    def cancel(self) -> None:
        self.cancelled.set()


class Replicas:
    def __init__(self, *streams: ScriptedStream, figures: dict[str, dict[str, Any]] | None = None) -> None:
        self.streams = list(streams)
        self.opened: list[tuple[Hashable, str, EngineRef | None]] = []
        self.posts = figures or {}

    def open(self, request: GenRequest, owner: Hashable, affinity: str, replacing: EngineRef | None) -> ScriptedStream:
        self.opened.append((owner, affinity, replacing))
        return self.streams.pop(0)

    async def figures(self) -> dict[str, dict[str, Any]]:
        return self.posts


def refused(replica: str, retry: float) -> Refused:
    return Refused(replica, Placement(3, 0, 3, 2), 1, 0.5, retry, "busy")


async def until_done(events: list[Event]) -> Done:
    while not events or not isinstance(events[-1], Done):
        await asyncio.sleep(0.01)
    done = events[-1]
    assert isinstance(done, Done) and sum(isinstance(e, Done) for e in events) == 1
    return done


def test_coalesce_keeps_each_canvas_last_frame_and_the_done() -> None:
    a1, a2, b1 = frame(1, 1), frame(1, 2), Frame(1, 1, 3, 4, (5,), (True,), (0.0,), 0.03)
    done = Done(1, "completed", ((5, 6, 7), (5,)), 3, 3, 4, 0.03)
    assert coalesce([a1, a2, b1, done]) == (a2, b1, done)
    assert coalesce([a1]) == (a1,) and coalesce([done]) == (done,)


async def test_accepted_streams_frames_then_one_done() -> None:
    done = Done(7, "completed", ((5, 6, 7),), 2, 2, 2, 0.02)
    # A replica sends tuples of events (`coalesce`); single events are read too.
    stream = ScriptedStream([Accepted("r1", 7, Placement(0, 1, 0, 0), 0.0), (frame(7, 1),), frame(7, 2), (done,)])
    events: list[Event] = []
    admission = RemoteAdmission(Replicas(stream))
    admitted = await admission.submit_async(REQUEST, events.append, owner="s1", affinity="d-1")
    assert isinstance(admitted.handle, RemoteHandle) and admitted.handle.ref == EngineRef("r1", 7)
    assert (admitted.placement.position, admitted.est_wait_s) == (0, 0.0)
    assert await until_done(events) == done and [e.step for e in events[:2] if isinstance(e, Frame)] == [1, 2]
    assert admitted.handle.wait(1) == done and admission.counts["admitted"] == 1


def two_live() -> dict[str, dict[str, Any]]:
    return {r: {"replica": r, "age_s": 0.1, "queue": {}} for r in ("r1", "r2")}


async def test_a_full_replica_respreads_once_then_busy() -> None:
    replicas = Replicas(ScriptedStream([refused("r1", 2.0)]), ScriptedStream([refused("r2", 3.0)]),
                        figures=two_live())
    admission = RemoteAdmission(replicas)
    with pytest.raises(Busy) as e:
        await admission.submit_async(REQUEST, None, owner="s1", affinity="d-1")
    assert e.value.retry_after_s == 3.0 and e.value.data()["queue_length"] == 3
    assert [a for _, a, _ in replicas.opened] == ["d-1", ""]  # the document's replica, then the router's choice
    # Without an affinity there is nothing to re-spread: one refusal is the answer.
    replicas.streams.append(ScriptedStream([refused("r1", 1.0)]))
    with pytest.raises(Busy):
        await admission.submit_async(REQUEST, None, owner="s1")
    assert len(replicas.opened) == 3 and admission.counts["refused"] == 2
    # With one live replica a second try would land on the same one: refused at once.
    alone = Replicas(ScriptedStream([refused("r1", 2.0)]), figures={"r1": two_live()["r1"]})
    with pytest.raises(Busy):
        await RemoteAdmission(alone).submit_async(REQUEST, None, owner="s1", affinity="d-1")
    assert len(alone.opened) == 1


async def test_respread_lands_on_a_replica_with_room_and_replacing_names_the_old_generation() -> None:
    accepted = ScriptedStream([Accepted("r2", 1, Placement(0, 1, 0, 0), 0.0)])
    replicas = Replicas(ScriptedStream([refused("r1", 2.0)]), accepted, figures=two_live())
    admission = RemoteAdmission(replicas)
    old = RemoteHandle(EngineRef("r1", 9), None, REQUEST, lambda h: None)
    admitted = await admission.submit_async(REQUEST, None, owner="s1", replacing=old, affinity="d-1")
    assert admitted.handle.ref == EngineRef("r2", 1)  # type: ignore[attr-defined]
    assert [r for _, _, r in replicas.opened] == [EngineRef("r1", 9)] * 2
    admitted.handle.cancel()
    assert (await asyncio.to_thread(admitted.handle.wait, 5)).status == "cancelled"


async def test_invalid_and_unanswered_requests() -> None:
    admission = RemoteAdmission(Replicas(ScriptedStream([Invalid("token id 99 is outside the vocabulary")])))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await admission.submit_async(REQUEST, None, owner="s1")
    silent = ScriptedStream([])
    admission = RemoteAdmission(Replicas(silent), first_record_s=0.05)
    with pytest.raises(Unavailable) as e:
        await admission.submit_async(REQUEST, None, owner="s1")
    assert silent.cancelled.is_set() and e.value.retry_after_s == 1.0
    assert e.value.protocol_error().retryable and "no answer" in e.value.data()["unavailable"]
    gone = RemoteAdmission(Replicas(ScriptedStream([ConnectionError("the replica died")])))
    with pytest.raises(Unavailable, match="the replica died"):
        await gone.submit_async(REQUEST, None, owner="s1")


async def test_a_replica_dying_mid_generation_ends_it_unavailable() -> None:
    died = RuntimeError("ActorDiedError: The actor died unexpectedly before finishing this task.")
    stream = ScriptedStream([Accepted("r1", 3, Placement(0, 1, 0, 0), None), frame(3, 1), died])
    events: list[Event] = []
    admission = RemoteAdmission(Replicas(stream))
    await admission.submit_async(REQUEST, events.append, owner="s1")
    done = await until_done(events)
    assert done.status == "unavailable" and done.error is not None and "r1" in done.error and "ActorDied" in done.error
    assert isinstance(events[0], Frame) and not admission._pumps
    # A stream that just stops (no Done) is the same loss.
    cut = ScriptedStream([Accepted("r1", 4, Placement(0, 1, 0, 0), None), frame(4, 1)], hang=False)
    events = []
    admission = RemoteAdmission(Replicas(cut))
    await admission.submit_async(REQUEST, events.append, owner="s1")
    assert (await until_done(events)).status == "unavailable"


async def test_cancel_cancels_the_stream_and_aclose_ends_the_rest() -> None:
    first = ScriptedStream([Accepted("r1", 1, Placement(0, 1, 0, 0), None), frame(1, 1)])
    second = ScriptedStream([Accepted("r2", 1, Placement(0, 1, 0, 0), None)])
    admission = RemoteAdmission(Replicas(first, second))
    a_events: list[Event] = []
    b_events: list[Event] = []
    a = await admission.submit_async(REQUEST, a_events.append, owner="s1")
    await admission.submit_async(REQUEST, b_events.append, owner="s2")
    await asyncio.to_thread(a.handle.cancel)  # from another thread, as a handle may be cancelled
    assert (await until_done(a_events)).status == "cancelled" and first.cancelled.is_set()
    await admission.aclose()
    assert (await until_done(b_events)).status == "cancelled" and second.cancelled.is_set()


async def test_stats_sum_the_replicas_that_posted_lately() -> None:
    def post(replica: str, started: int, active: int, age: float) -> dict[str, Any]:
        return {"replica": replica, "started": started, "age_s": age,
                "queue": {"queued": 1, "active": active, "max_batch": 4, "admitted": started, "refused": 2}}

    posts = {"a": post("a", 5, 2, 0.3), "b": post("b", 3, 1, 0.9), "gone": post("gone", 7, 4, 60.0)}
    admission = RemoteAdmission(Replicas(figures=posts), stats_ttl_s=60)
    stats = await admission.stats_async()
    assert stats["generations_by_replica"] == {"a": 5, "b": 3} and stats["replicas_live"] == 2
    assert (stats["active"], stats["max_batch"], stats["admitted"], stats["refused"]) == (3, 8, 8, 4)
    posts["c"] = post("c", 1, 0, 0.1)
    assert (await admission.stats_async())["replicas_live"] == 2  # cached
    assert admission.stats()["generations_by_replica"] == stats["generations_by_replica"]
    stream = ScriptedStream([Accepted("a", 1, Placement(0, 1, 0, 0), None)])
    admission.replicas = Replicas(stream, figures=posts)
    await admission.submit_async(REQUEST, None, owner="s1")
    assert (await admission.stats_async())["running_by_replica"] == {"a": 1}  # fresh, not cached
    await admission.aclose()


async def test_a_silent_replica_s_generation_ends_unavailable_and_its_stream_is_cancelled() -> None:
    """A stopped replica (SIGSTOP): its stream says nothing and its posted figures age. The watchdog ends the
    generation as `unavailable` (typed, retryable) after `silent_s`, and cancels the stream."""
    stream = ScriptedStream([Accepted("r1", 3, Placement(0, 1, 0, 0), 0.0), (frame(3, 1),)])
    replicas = Replicas(stream, figures={"r1": {"replica": "r1", "age_s": 9.0, "queue": {}}})
    events: list[Event] = []
    admission = RemoteAdmission(replicas, silent_s=1.5)
    admitted = await admission.submit_async(REQUEST, events.append, owner="s", affinity="doc-1")
    assert isinstance(admitted.handle, RemoteHandle) and admitted.handle.doc == "doc-1"
    running = (await admission.stats_async())["running"]
    assert running == [["doc-1", "r1", admitted.handle.fp]]
    done = await asyncio.wait_for(until_done(events), 10)
    assert done.status == "unavailable" and "stopped answering" in (done.error or "")
    assert stream.cancelled.is_set() and admission.counts["silenced"] == 1
    assert (await admission.stats_async())["running"] == []


async def test_a_quiet_generation_on_a_replica_that_posts_is_left_alone() -> None:
    """Queued behind others, a generation streams nothing for a while; its replica still posts, and lists it among
    what it serves: not ended."""
    stream = ScriptedStream([Accepted("r1", 4, Placement(2, 1, 2, 0), 3.0)])
    serving = [["", fingerprint(REQUEST)]]
    replicas = Replicas(stream, figures={"r1": {"replica": "r1", "age_s": 0.4, "queue": {}, "serving": serving}})
    events: list[Event] = []
    admission = RemoteAdmission(replicas, silent_s=1.0)
    admitted = await admission.submit_async(REQUEST, events.append, owner="s")
    await asyncio.sleep(3.0)
    assert not events and admission.counts["silenced"] == 0
    admitted.handle.cancel()
    assert (await asyncio.wait_for(until_done(events), 5)).status == "cancelled"
    await admission.aclose()


async def test_a_generation_its_live_replica_no_longer_serves_ends_unavailable() -> None:
    """The replica ended the generation, but its `Done` never came down the stream (the soak saw generations go
    unanswered for minutes while their replica posted): the replica's figures no longer list it, so after `silent_s`
    the watchdog ends it as `unavailable` instead of leaving the client waiting; another generation of the same
    replica that it still lists is left alone."""
    lost = ScriptedStream([Accepted("r1", 5, Placement(0, 1, 0, 0), 0.0), (frame(5, 1),)])
    alive = ScriptedStream([Accepted("r1", 6, Placement(0, 1, 0, 0), 0.0)])
    other = GenRequest((1, 2, 4), (5, 0, 0), (True, False, False))
    figures = {"r1": {"replica": "r1", "age_s": 0.3, "queue": {}, "serving": [["doc-2", fingerprint(other)]]}}
    events: list[Event] = []
    kept: list[Event] = []
    admission = RemoteAdmission(Replicas(lost, alive, figures=figures), silent_s=1.0)
    await admission.submit_async(REQUEST, events.append, owner="s", affinity="doc-1")
    still = await admission.submit_async(other, kept.append, owner="t", affinity="doc-2")
    done = await asyncio.wait_for(until_done(events), 10)
    assert done.status == "unavailable" and "no longer runs it" in (done.error or "")
    assert lost.cancelled.is_set() and admission.counts["silenced"] == 1
    await asyncio.sleep(1.5)
    assert not kept and not alive.cancelled.is_set()
    still.handle.cancel()
    assert (await asyncio.wait_for(until_done(kept), 5)).status == "cancelled"
    await admission.aclose()
