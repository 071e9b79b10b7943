"""`RemoteAdmission`: the ingress's admission when generations run on Ray Serve engine replicas.

It offers the server what the local `canvas.server.admission.Admission` does (`Admits`: `submit_async`,
`stats_async`, `aclose`), so the websocket's `gen.start` and the HTTP routes do not know where the engine is. A
submission opens a stream on a replica (`Replicas.open`, keyed by the document for affinity) and waits for its
first record:
- `Accepted`: returns `Admitted` with a `RemoteHandle` whose `cancel` cancels the stream (the replica then cancels
  the engine's handle), and a task that feeds the stream's `Frame`s and `Done` to the handle;
- `Refused`: with an affinity and another replica live, asked once more without one (Serve's router then takes
  the less loaded of two replicas), so a document sticks to its replica while that one has room and spreads when it
  is full; a (second) refusal raises `Busy`, rebuilt from the replica's;
- `Invalid`: raises ValueError, as the local engine's validation does;
- no answer within `first_record_s`, or an error (no replica alive, one dying): raises `Unavailable`, a `Busy`
  with a short `retry_after_s`, so the client retries as it does a full queue (`busy` is retryable on the
  websocket, HTTP 429 with Retry-After).

A stream that fails after acceptance without having been cancelled (the replica died: Ray's ActorDiedError, or any
other error) ends the generation with `Done(status="unavailable")`: retryable, nothing in the document is lost,
and the next `gen.start` lands on a live replica. So does a replica that went silent: a watchdog (running while any
stream is open) ends a generation whose stream sent nothing for `silent_s` while its replica posted no figures for
as long (a stopped or wedged process: Ray sees no error until its health check gives up, much later), or while its
replica, posting, no longer lists it among what it serves (it ended there, and the stream lost its `Done`), and
cancels its stream, so whatever that replica does when it wakes goes nowhere. Every handle gets exactly one `Done`,
whatever happens.

Invariant: this module imports no Ray; `canvas.cluster.deploy` adapts a Serve handle to `Replicas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from canvas.cluster.records import Accepted, EngineRef, First, Invalid, Refused, fingerprint
from canvas.engine.scheduling import Placement
from canvas.engine.types import Done, Event, GenHandle, GenRequest, cancelled_done
from canvas.server.admission import Admitted, Busy

log = logging.getLogger("canvas.cluster")
# A generation whose stream and replica (its posted figures) have both said nothing for this long is ended as
# `unavailable`: a replica posts every second and a running generation streams every step, so only a stopped or
# wedged process stays this quiet (a queued generation is quiet too, but its replica keeps posting).
SILENT_S = 15.0


class Stream(Protocol):
    """One replica's answer to `generate`: its first record, then events (Ray's DeploymentResponseGenerator)."""

    def __aiter__(self) -> Stream: ...

    async def __anext__(self) -> Any: ...

    def cancel(self) -> None: ...


class Replicas(Protocol):
    def open(self, request: GenRequest, owner: Hashable, affinity: str, replacing: EngineRef | None) -> Stream:
        """Start `generate` on a replica chosen by the router (`affinity` "" for none)."""
        ...

    async def figures(self) -> dict[str, dict[str, Any]]:
        """Each live replica's latest figures (`EngineReplica.figures`, with `age_s`)."""
        ...


class Unavailable(Busy):
    """No replica answered (none alive, one dying, all starting): retryable after `retry_after_s`."""

    def __init__(self, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(Placement(0, 0, 0, 0), 0, None, retry_after_s)
        self.reason = reason
        self.args = (f"no engine replica could take the generation ({reason}); retry in {retry_after_s:.1f} s",)

    def data(self) -> dict[str, Any]:
        return {**super().data(), "unavailable": self.reason}


class RemoteHandle(GenHandle):
    """A generation on a replica: `ref` says which (for `replacing`); `doc` and `fp` what it serves (/health)."""

    def __init__(self, ref: EngineRef, on_event: Callable[[Event], None] | None, request: GenRequest,
                 withdraw: Callable[[GenHandle], None], doc: str = "") -> None:
        super().__init__(ref.gen_id, on_event, request, withdraw)
        self.ref, self.doc, self.fp = ref, doc, fingerprint(request)
        self.heard = time.monotonic()  # when its stream last sent anything


class RemoteAdmission:
    """`Admits` over engine replicas. Runs on the ingress's event loop."""

    def __init__(self, replicas: Replicas, *, first_record_s: float = 30.0, stats_timeout_s: float = 2.0,
                 stats_ttl_s: float = 1.0, stale_after_s: float = 5.0, silent_s: float = SILENT_S) -> None:
        self.replicas = replicas
        self.first_record_s = first_record_s  # a replica starting up or a full router queue answers within this
        self.stats_timeout_s, self.stats_ttl_s, self.stale_after_s = stats_timeout_s, stats_ttl_s, stale_after_s
        self.silent_s = silent_s
        self._silenced: dict[GenHandle, str] = {}  # generations the watchdog ended: why
        self._watchdog: asyncio.Task[None] | None = None
        self.counts: dict[str, int] = {"admitted": 0, "refused": 0, "unavailable": 0, "respread": 0, "silenced": 0}
        self._pumps: dict[GenHandle, tuple[Stream, asyncio.Task[None]]] = {}
        self._stats: tuple[float, dict[str, Any]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit_async(self, request: GenRequest, on_event: Callable[[Event], None] | None, *, owner: Hashable,
                           replacing: GenHandle | None = None, affinity: str | None = None) -> Admitted:
        self._loop = asyncio.get_running_loop()
        ref = replacing.ref if isinstance(replacing, RemoteHandle) else None
        stream, first = await self._first(request, owner, affinity or "", ref)
        if isinstance(first, Refused) and affinity and await self._replicas_live() > 1:
            self.counts["respread"] += 1  # its replica is full: let the router pick the less loaded of two
            stream, first = await self._first(request, owner, "", ref)
        if isinstance(first, Refused):
            self.counts["refused"] += 1
            raise Busy(first.placement, first.max_queue, first.est_wait_s, first.retry_after_s)
        if isinstance(first, Invalid):
            raise ValueError(first.message)
        handle = RemoteHandle(EngineRef(first.replica, first.gen_id), on_event, request, self._withdraw,
                              doc=affinity or "")  # fmt: skip
        handle.position = first.placement.position
        task = asyncio.create_task(self._pump(handle, stream), name=f"dcanvas-remote-{first.replica}-{first.gen_id}")
        self._pumps[handle] = (stream, task)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch(), name="dcanvas-remote-watchdog")
        self.counts["admitted"] += 1
        return Admitted(handle, first.placement, first.est_wait_s)

    async def _first(self, request: GenRequest, owner: Hashable, affinity: str,
                     ref: EngineRef | None) -> tuple[Stream, First]:
        try:
            stream = self.replicas.open(request, owner, affinity, ref)
        except Exception as e:
            self.counts["unavailable"] += 1
            raise Unavailable(f"{type(e).__name__}: {e}"[:200]) from e
        try:
            first = await asyncio.wait_for(stream.__anext__(), self.first_record_s)
        except BaseException as e:
            with contextlib.suppress(Exception):
                stream.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            self.counts["unavailable"] += 1
            reason = f"no answer within {self.first_record_s:.0f} s" if isinstance(e, TimeoutError) \
                else f"{type(e).__name__}: {e}"[:200]
            raise Unavailable(reason) from e
        if not isinstance(first, Accepted | Refused | Invalid):
            stream.cancel()
            raise Unavailable(f"the replica answered {type(first).__name__} first")
        return stream, first

    async def _replicas_live(self) -> int:
        """Replicas that posted lately (the figures of at most `stats_ttl_s` ago): re-spreading needs two."""
        live: int = (await self.stats_async()).get("replicas_live", 0)
        return live

    def _withdraw(self, handle: GenHandle) -> None:
        """`handle.cancel()`, from any thread: cancel its stream on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._cancel_stream(handle)
        else:
            loop.call_soon_threadsafe(self._cancel_stream, handle)

    def _cancel_stream(self, handle: GenHandle) -> None:
        entry = self._pumps.get(handle)
        if entry is not None:
            entry[0].cancel()

    async def _pump(self, handle: RemoteHandle, stream: Stream) -> None:
        """Feed the stream's events to the handle; end it with one `Done` whatever the stream does."""
        done: Done | None = None
        try:
            async for item in stream:
                handle.heard = time.monotonic()
                for ev in item if isinstance(item, tuple) else (item,):  # a replica sends events in tuples
                    if isinstance(ev, Done):
                        done = ev
                        break
                    handle.emit(ev)
                if done is not None:
                    break
            if done is None:
                raise RuntimeError("the replica's stream ended without a Done")
        except asyncio.CancelledError:  # the ingress shutting down, or the watchdog (`_watch`)
            stream.cancel()
            silenced = self._silenced.pop(handle, None)
            done = cancelled_done(handle) if silenced is None else Done(
                handle.id, "unavailable", (), 0, 0, 0, 0.0, error=silenced)
        except Exception as e:
            if handle.cancelled:  # we cancelled the stream: Ray reports it as an error
                done = cancelled_done(handle)
            else:
                log.warning("generation %s on replica %s: the stream failed: %s", handle.id, handle.ref.replica, e)
                done = Done(handle.id, "unavailable", (), 0, 0, 0, 0.0,
                            error=f"the engine replica {handle.ref.replica} failed: {type(e).__name__}: {e}"[:300])
        finally:
            self._pumps.pop(handle, None)
            if done is not None:
                handle.emit(done)

    async def _watch(self) -> None:
        """While streams are open: every second, end the generations whose stream and replica both went silent
        for `silent_s` (`Done(status="unavailable")`, retryable), and cancel their streams."""
        while self._pumps:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            quiet = [h for h in self._pumps if isinstance(h, RemoteHandle) and not h.cancelled
                     and now - h.heard > self.silent_s and h not in self._silenced]  # fmt: skip
            if not quiet:
                continue
            try:
                posts = await asyncio.wait_for(self.replicas.figures(), self.stats_timeout_s)
            except Exception:  # noqa: BLE001 (the board is unreachable: no evidence against any replica)
                continue
            for handle in quiet:
                post = posts.get(handle.ref.replica) or {}
                age, serving = post.get("age_s"), post.get("serving")
                entry = self._pumps.get(handle)
                if entry is None:
                    continue
                if age is not None and float(age) <= self.silent_s:
                    # Its replica is alive (posted after the stream last spoke): a long queue wait or a slow step,
                    # unless the replica no longer has the generation at all (it ended there, and its Done never
                    # came down the stream): then nothing more will come.
                    if serving is None or [handle.doc, handle.fp] in [list(x) for x in serving]:
                        continue
                    why = f"the engine replica {handle.ref.replica} no longer runs it and its stream went quiet"
                else:
                    seen = "never posted" if age is None else f"silent for {float(age):.0f} s"
                    why = f"the engine replica {handle.ref.replica} stopped answering ({seen})"
                log.warning("generation %s: %s; ending it", handle.id, why)
                self._silenced[handle] = why
                self.counts["silenced"] += 1
                entry[1].cancel()

    def stats(self) -> dict[str, Any]:
        """The figures of the last `stats_async` (replicas are asked there)."""
        return self._stats[1] if self._stats is not None else {"replicas": [], **self.counts}

    async def stats_async(self) -> dict[str, Any]:
        """Summed queue figures over the replicas that posted lately, and each one's (asked at most every
        `stats_ttl_s`, waiting at most `stats_timeout_s`); and this ingress's running generations by replica."""
        now = time.monotonic()
        running: dict[str, int] = {}  # this ingress's generations by replica, as of now (not cached)
        for handle in self._pumps:
            if isinstance(handle, RemoteHandle):
                running[handle.ref.replica] = running.get(handle.ref.replica, 0) + 1
        # What each of its generations serves: [document id, replica, `fingerprint`] (`dcanvas bench soak` checks).
        serving = [[h.doc, h.ref.replica, h.fp] for h in self._pumps if isinstance(h, RemoteHandle) and not h.cancelled]
        if self._stats is not None and now - self._stats[0] < self.stats_ttl_s:
            return {**self._stats[1], "running_by_replica": running, "running": serving}
        try:
            posts = await asyncio.wait_for(self.replicas.figures(), self.stats_timeout_s)
            error = None
        except Exception as e:
            posts, error = {}, f"{type(e).__name__}: {e}"[:200]
        live = sorted((f for f in posts.values() if f.get("age_s", 0) <= self.stale_after_s),
                      key=lambda f: str(f.get("replica")))
        out: dict[str, Any] = {k: sum(int(f["queue"].get(k) or 0) for f in live)
                               for k in ("queued", "active", "max_batch", "admitted", "refused")}
        out.update({f"ingress_{k}": v for k, v in self.counts.items()})
        out["replicas"] = live
        out["replicas_live"] = len(live)
        out["generations_by_replica"] = {str(f["replica"]): int(f.get("started", 0)) for f in live}
        if error is not None:
            out["error"] = error
        self._stats = (now, out)
        return {**out, "running_by_replica": running, "running": serving}

    async def aclose(self) -> None:
        """Cancel whatever still streams (the server stopped its generations already)."""
        entries = list(self._pumps.values())
        if self._watchdog is not None:
            self._watchdog.cancel()
        for stream, task in entries:
            stream.cancel()
            task.cancel()
        await asyncio.gather(*(t for _, t in entries), return_exceptions=True)
