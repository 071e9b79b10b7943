"""The engine as a Ray Serve deployment: `EngineReplica` (one model, one engine, its own admission per replica),
`StatsBoard` (where replicas post their figures for /health) and `build_app`.

A replica's `generate` is a streaming method: it yields one record first (`canvas.cluster.records`: `Accepted`,
`Refused` or `Invalid`), then, once accepted, the engine's `Frame`s and exactly one `Done`, in tuples of the events
that arrived together (`coalesce`: one stream item each, superseded frames of a canvas dropped). When the caller
cancels the stream (the ingress's `GenHandle.cancel`, its client gone), Ray cancels this generator and the engine
handle is cancelled at once, so the row frees between two steps.

Affinity: the caller sets Ray Serve's multiplexed model id to the document id. The "model" a replica loads for it
is only its record of the documents it serves; what gains is the engine's context cache (`Engine._context`: the
encoded text before the canvas, reused while the document's prefix is unchanged). Serve's router sends a request
to a replica that holds its id while one can take it, otherwise to the replicas holding the fewest ids, which
spreads new documents. Admission stays per replica (each engine's own queue and measurements); the router's own
queue is kept out of the way (`max_ongoing_requests` well above any admitted load), so a full replica answers
`Refused` at once instead of making the ingress wait.

Invariants: every accepted stream ends with one `Done`, unless it was cancelled or the replica died (the ingress
then writes the `Done`); the figures a replica posts count every generation it accepted, by how it ended.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from canvas.cluster.records import Accepted, EngineRef, First, Invalid, Refused, coalesce, fingerprint
from canvas.engine.backend import load_backend
from canvas.engine.types import Done, Event, GenHandle, GenRequest
from canvas.server.admission import Admission, AdmissionConfig, Busy

NAMESPACE = "dcanvas"  # where the stats board is named (Serve's own actors live in "serve")
DEPLOYMENT = "EngineReplica"
MAX_DOCUMENTS = 64  # documents a replica keeps affinity for (least recently used leave first)
POST_EVERY_S = 1.0  # how often a replica posts its figures
MIB = 1 << 20
# Serve's router holds requests beyond this per replica in its own queue; admission refuses long before (its bound
# is at most `AdmissionConfig.max_sized_queue` waiting plus `max_batch` running), so this only guards a runaway.
MAX_ONGOING = 1024


def board_name(app: str) -> str:
    return f"{app}-stats"


@ray.remote(num_cpus=0)
class StatsBoard:
    """The replicas' latest figures by replica id, and when each posted. Read by the ingress for /health."""

    def __init__(self) -> None:
        self.posts: dict[str, tuple[float, dict[str, Any]]] = {}

    def post(self, replica: str, figures: dict[str, Any]) -> None:
        self.posts[replica] = (time.time(), figures)

    def read(self) -> dict[str, dict[str, Any]]:
        now = time.time()
        return {r: {**f, "age_s": round(now - t, 2)} for r, (t, f) in self.posts.items()}


class EngineReplica:
    """One engine replica (a Serve deployment: `build_app` wraps this class)."""

    def __init__(self, model_dir: str, max_batch: int, threads: int | None, admission: AdmissionConfig,
                 app: str) -> None:
        self.backend = load_backend(model_dir, max_batch=max_batch, threads=threads)
        self.engine = self.backend.engine
        self.engine.start()
        self.admission = Admission(self.engine, admission)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self.pid = os.getpid()
        self.counts: Counter[str] = Counter()  # started, and how they ended (completed, cancelled, failed, abandoned)
        self.documents: Counter[str] = Counter()  # generations per document id served here (affinity hits)
        self.live: dict[int, GenHandle] = {}  # engine id -> handle, for `replacing`
        self.serving: dict[int, tuple[str, str]] = {}  # engine id -> (document id, `fingerprint`), for /health
        self.app = app
        self._poster: asyncio.Task[None] | None = None

    @serve.multiplexed(max_num_models_per_replica=MAX_DOCUMENTS)
    async def document(self, doc_id: str) -> str:
        """'Load' a document: Serve records that this replica holds `doc_id` and routes its next requests here."""
        return doc_id

    async def generate(self, request: GenRequest, owner: Any,
                       replacing: EngineRef | None = None) -> AsyncIterator[First | tuple[Event, ...]]:
        self._start_posting()
        doc_id = serve.get_multiplexed_model_id()
        if doc_id:
            await self.document(doc_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(ev: Event) -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the replica is shutting down
                pass

        old = self.live.get(replacing.gen_id) if replacing is not None and replacing.replica == self.replica else None
        try:
            admitted = self.admission.submit(request, deliver, owner=owner, replacing=old)
        except Busy as e:
            yield Refused(self.replica, e.placement, e.max_queue, e.est_wait_s, e.retry_after_s, str(e))
            return
        except ValueError as e:
            yield Invalid(str(e))
            return
        handle = admitted.handle
        self.live[handle.id] = handle
        self.serving[handle.id] = (doc_id, fingerprint(request))
        self.counts["started"] += 1
        if doc_id:
            self.documents[doc_id] += 1
        done: Done | None = None
        try:
            yield Accepted(self.replica, handle.id, admitted.placement, admitted.est_wait_s)
            while done is None:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                last = batch[-1]
                done = last if isinstance(last, Done) else None
                yield coalesce(batch)
        finally:  # also when Ray cancels this generator (the caller cancelled the stream, or went away)
            self.live.pop(handle.id, None)
            self.serving.pop(handle.id, None)
            if done is None:
                handle.cancel()  # free the row now; its Done goes nowhere
            self.counts[done.status if done is not None else "abandoned"] += 1

    def figures(self) -> dict[str, Any]:
        """This replica's counts, its admission's queue figures, what it serves now ([document id, fingerprint]
        of each generation it runs or queues) and its context cache's fill (`context_cache_mib`: held and budget,
        the bounded memory a replica's RSS grows by until it is full; the soak's flatness judgement needs it)."""
        cache = self.engine.contexts.stats()
        return {"replica": self.replica, "actor": self.actor_name, "pid": self.pid,
                "node": ray.get_runtime_context().get_node_id(), **self.counts,
                "documents": len(self.documents), "queue": self.admission.stats(),
                "serving": [[doc, fp] for doc, fp in self.serving.values()],
                "context_cache_mib": [round(cache.bytes / MIB, 1), round(cache.budget_bytes / MIB, 1)]}

    async def stats(self) -> dict[str, Any]:
        self._start_posting()
        return self.figures()

    async def check_health(self) -> None:
        """Serve's periodic health check; also (re)starts posting figures after a replica comes up idle."""
        self._start_posting()

    def _start_posting(self) -> None:
        if self._poster is None or self._poster.done():
            self._poster = asyncio.get_running_loop().create_task(self._post())

    async def _post(self) -> None:
        board = None
        while True:
            try:
                if board is None:
                    board = ray.get_actor(board_name(self.app), namespace=NAMESPACE)
                await board.post.remote(self.replica, self.figures())
            except Exception:  # no board yet (an attached ingress), or it went: figures wait for the next one
                board = None
            await asyncio.sleep(POST_EVERY_S)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def build_app(model_dir: str, replicas: int, max_batch: int, threads: int | None, admission: AdmissionConfig, *,
              app: str = "dcanvas", num_gpus: float = 0, num_cpus: float = 1) -> serve.Application:
    """The Serve application: `replicas` engine replicas of the model in `model_dir` (a path every node can read),
    each given `num_gpus` GPUs (0 on CPUs) and `num_cpus` CPUs to schedule by."""
    deployment = serve.deployment(
        name=DEPLOYMENT,
        num_replicas=replicas,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        health_check_period_s=2,
    )(EngineReplica)
    return deployment.bind(model_dir, max_batch, threads, admission, app)
