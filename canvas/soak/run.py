"""`dcanvas bench soak`: writers against a real server while faults fire on a schedule; then the checker.

    dcanvas bench soak --minutes 60 --sessions 20 --faults all --seed 1 [--model DIR] [--db postgresql://...]
    dcanvas bench soak --ray --replicas 2 --db postgresql [--minutes 60 --sessions 8 ...]

Starts `dcanvas serve` on a free loopback port with a fault-injecting store (`canvas.server.faults`, enabled for
this process only), runs `--sessions` writers (`canvas.soak.writers`) for `--minutes`, and fires the faults of
`canvas.soak.schedule` as drawn from `--seed`. Meanwhile it samples the server's RSS, open descriptors and event-loop
lag (`/health`) every 2 s. At the end the writers finish, the faults stop, the server is stopped and started again
on the same database, every writer's document is read back through it, and the store itself is read
(`canvas.soak.checker`). Prints a summary and, as the last line, one JSON report; exits 1 on any violation or when
the server's RSS or descriptors grew by more than 10% after warm-up. Everything runs in a temporary folder (or
`--workdir`), which keeps the server's log, its database, the report and the writers' journal (`journal.json`); with
`--db URL` the documents live in that PostgreSQL database instead (empty at the start; the store's faults are then
psycopg's errors); `--db postgresql` alone starts a private PostgreSQL from Debian's binaries
(`canvas.store.pgserver`), which the PostgreSQL faults restart and stop, and removes it at the end. With `--ray` the
server's engine runs as Ray Serve replicas on a local Ray that this process starts and stops: replicas are killed
and stopped, the ingress killed and restarted (`canvas.soak.cluster`), and every replica and the postmaster are
sampled too. The report's `targets` gives one verdict per acceptance target (`canvas.soak.targets`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from canvas.cluster.remote import SILENT_S
from canvas.protocol.client import DcanvasClient
from canvas.server.faults import write_control
from canvas.soak.actors import Actors
from canvas.soak.checker import ReplicaWatch, check_actors, check_answer_times, check_final, check_store, check_writer
from canvas.soak.cluster import Deployment
from canvas.soak.schedule import FAULTS, SERVER_SIDE, Fault, draw, parse_faults
from canvas.soak.server import ServerArgs, ServerProc, open_fds, rss_mib
from canvas.soak.targets import Caches, Series, flatness, processes, targets
from canvas.soak.writers import Known, Writer, WriterLog
from canvas.store import open_store
from canvas.store.base import describe
from canvas.store.pgserver import PgServer, find_bindir

SAMPLE_S = 2.0
# Past the deadline, writers finish their action, reconnect (grace) and may wait one unanswered request (ANSWER_S):
# a writer or fault still running this long after it hangs, and is cancelled so that the run still reports.
STRAGGLE_S = 900.0


@dataclass
class Sample:
    t: float
    start: int  # which server process (1: the first, 2: after the first kill, ...)
    rss_mib: float
    fds: int
    lag_p99_ms: float | None


@dataclass
class Faults:
    """The store's faults in effect (they may overlap): the control file says the worst of them."""

    control: Path
    seed: int
    active: Counter[str] = field(default_factory=Counter)
    p: float = 0.0

    def off(self) -> None:
        self.active.clear()
        write_control(self.control, "off")

    def set(self, kind: str, on: bool, p: float = 1.0) -> None:
        self.active[kind] += 1 if on else -1
        if on and kind == "store_errors":
            self.p = p
        if self.active["disk_full"] > 0:
            write_control(self.control, "full")
        elif self.active["store_errors"] > 0:
            write_control(self.control, "error", p=self.p, seed=self.seed)
        else:
            write_control(self.control, "off")


def replica_series(series: dict[str, Series], caches: dict[str, Caches]) -> dict[str, list[list[float | None]]]:
    """Each replica's [t, RSS MiB, context cache MiB held] samples (the report's record of growth against its bound)."""
    out: dict[str, list[list[float | None]]] = {}
    for label, fill in caches.items():
        held = {t: h for t, h, _ in fill}
        out[label] = [[t, round(r, 1), held.get(t)] for t, r, _ in series.get(label, [])]
    return out


def server_flatness(samples: list[Sample], attr: str, start: int | None = None) -> dict[str, Any]:
    """`flatness` of one server process (`start`; default the last)."""
    which = samples[-1].start if start is None and samples else start
    return flatness([(s.t, float(getattr(s, attr))) for s in samples if s.start == which])


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path, ray_address: str | None = None,
                 db: str | None = None, pg: PgServer | None = None) -> None:  # fmt: skip
        self.args, self.workdir = args, workdir
        self.seconds = float(args.minutes) * 60
        self.kinds = parse_faults(args.faults, ray=args.ray, pg=pg is not None)
        self.schedule = draw(args.seed, self.seconds, self.kinds, silent_s=SILENT_S)
        self.server = ServerProc(ServerArgs(
            db=db or workdir / "docs.db", control=workdir / "faults.json", log=workdir / "server.log",
            model=args.model, threads=args.threads, max_batch=args.max_batch, max_queue=args.max_queue,
            ray_address=ray_address, replicas=args.replicas))  # fmt: skip
        self.faults = Faults(workdir / "faults.json", args.seed)
        self.kills: list[tuple[float, float]] = []
        self.samples: list[Sample] = []
        self.fired: Counter[str] = Counter()
        self.restart_s: list[float] = []
        self.harness: list[str] = []  # faults that could not be applied (counted as violations)
        self.rng = random.Random(args.seed)
        self.deployment = Deployment(self.server, pg, self.rng)
        self.windows: list[tuple[str, float, float]] = []  # server-side faults: (kind, start, end)
        self.series: dict[str, Series] = {}  # replicas and the postmaster, by label: (t, rss, fds)
        self.caches: dict[str, Caches] = {}  # replicas' context caches, by label: (t, held MiB, budget MiB)
        self.watch = ReplicaWatch()
        self.t0 = 0.0

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    async def _sample(self) -> None:
        # Until the deadline only: after it the writers disconnect one by one, which is the run ending, not a trend.
        while time.monotonic() < self.t0 + self.seconds:
            pid, start = self.server.pid, self.server.starts
            if pid is not None:
                rss, fds = rss_mib(pid), open_fds(pid)
                health = await asyncio.to_thread(self.server.health, 2.0)
                lag = (health.get("loop_lag_ms") or {}).get("p99")
                if rss is not None and fds is not None and pid == self.server.pid:
                    self.samples.append(Sample(self._now(), start, rss, fds, lag))
                queue = health.get("queue") or {}
                if self.args.ray and health:
                    self.watch.observe(self._now(), queue)
                fills = {f"replica:{r.get('pid')}": r.get("context_cache_mib") for r in queue.get("replicas") or []}
                for label, other in self.deployment.processes(queue).items():
                    rss, fds = rss_mib(other), open_fds(other)
                    if rss is not None and fds is not None:
                        now = self._now()
                        self.series.setdefault(label, []).append((now, rss, float(fds)))
                        fill = fills.get(label)
                        if isinstance(fill, list) and len(fill) == 2:
                            self.caches.setdefault(label, []).append((now, float(fill[0]), float(fill[1])))
            await asyncio.sleep(SAMPLE_S)

    async def _fire(self, f: Fault, actors: Actors, writers: list[Writer]) -> None:
        self.fired[f.kind] += 1
        start = self._now()
        try:
            await self._fire_one(f, actors, writers)
        except Exception as e:  # noqa: BLE001 (a fault that could not be applied spoils the run, not the report)
            self.harness.append(f"t={self._now()}: fault {f.kind} raised {type(e).__name__}: {e}")
        finally:
            if f.kind in SERVER_SIDE:
                self.windows.append((f.kind, start, self._now()))

    async def _fire_one(self, f: Fault, actors: Actors, writers: list[Writer]) -> None:
        d = self.deployment
        if f.kind == "kill":  # with --ray, the ingress: its replicas stay up, and the new ingress adopts them
            before = await asyncio.to_thread(d.before_ingress_kill) if self.args.ray else []
            t = self._now()
            await asyncio.to_thread(self.server.kill9)
            try:
                self.restart_s.append(await asyncio.to_thread(self.server.start))
            finally:
                self.kills.append((t, self._now()))
            if self.args.ray:
                bad = await asyncio.to_thread(d.after_ingress_restart, before, self.args.replicas)
                self.harness += [bad] if bad else []
        elif f.kind in ("store_errors", "disk_full"):
            self.faults.set(f.kind, True, f.p)
            await asyncio.sleep(f.duration_s)
            self.faults.set(f.kind, False)
        elif f.kind == "drop":
            await actors.drop()
        elif f.kind == "stall":
            await actors.stall(f.duration_s, [w.log.doc_id for w in writers if w.log.doc_id])
        elif f.kind == "ray_kill":
            await asyncio.to_thread(d.kill_replica)
        elif f.kind == "ray_stop":
            await d.stop_replica(f.duration_s)
        elif f.kind in ("pg_restart_fast", "pg_restart_immediate"):
            await d.pg_restart("fast" if f.kind == "pg_restart_fast" else "immediate")
        elif f.kind == "pg_down":
            await d.pg_down(f.duration_s)
        elif f.kind == "burst":
            queue = (await asyncio.to_thread(self.server.health)).get("queue") or {}
            await actors.burst(burst_size(queue, self.args.max_batch))

    async def _faults(self, actors: Actors, writers: list[Writer]) -> None:
        running: list[asyncio.Task[None]] = []
        for f in self.schedule:
            await asyncio.sleep(max(0.0, self.t0 + f.at_s - time.monotonic()))
            if f.kind == "kill":  # a kill waits for nothing else, but one kill at a time
                await self._fire(f, actors, writers)
            else:
                running.append(asyncio.create_task(self._fire(f, actors, writers)))
        await asyncio.gather(*running)

    async def run(self) -> dict[str, Any]:
        await asyncio.to_thread(self.faults.off)
        self.restart_s.append(await asyncio.to_thread(self.server.start))
        self.t0 = self.deployment.t0 = time.monotonic()
        deadline = self.t0 + self.seconds
        a = self.args
        steps = tuple(int(x) for x in str(a.gen_steps).split(","))
        writers = [Writer(i, self.server.url, self.t0, deadline, seed=a.seed * 1000 + i, gen_steps=steps)
                   for i in range(a.sessions)]  # fmt: skip
        actors = Actors(self.server.url, self.t0, a.seed)
        sampler = asyncio.create_task(self._sample())
        try:
            faults = asyncio.create_task(self._faults(actors, writers))
            names: dict[asyncio.Task[Any], str] = {asyncio.create_task(w.run()): w.log.name for w in writers}
            names[faults] = "the fault schedule"
            _, pending = await asyncio.wait(names, timeout=deadline + STRAGGLE_S - time.monotonic())
            for task in pending:  # hung: a client left without an answer (the writer's journal says where)
                who = names[task]
                self.harness.append(f"{who} still running {STRAGGLE_S:.0f} s after the deadline: cancelled")
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            logs = [w.log for w in writers]
        finally:
            sampler.cancel()
            await asyncio.to_thread(self.faults.off)
            await asyncio.to_thread(self.deployment.ensure_pg)
        wall = time.monotonic() - self.t0
        last_health = await asyncio.to_thread(self.server.health)
        await asyncio.to_thread(self.server.stop)
        # What the store holds, as a fresh server serves it: every writer's document read back.
        await asyncio.to_thread(self.server.start)
        try:
            finals = await self._read_back(logs)
        finally:
            await asyncio.to_thread(self.server.stop)
        store = open_store(self.server.args.db)
        try:
            violations = [v for log in logs for v in check_writer(log, self.kills)]
            violations += check_actors(actors.log, self.kills) + check_final(logs, finals) + check_store(store, logs)
            late, slowest = check_answer_times(logs, self.windows)
            violations += late + [f"replicas: {x}" for x in self.watch.violations]
            violations += [f"harness: {x}" for x in self.harness]
        finally:
            store.close()
        self._journal(logs)
        report = self._report(logs, actors, violations, wall, last_health)
        report["targets"] = targets(violations, late, slowest, report["processes"])
        report["ok"] = report["ok"] and all(t["held"] for t in report["targets"].values())
        return report

    def _journal(self, logs: list[WriterLog]) -> None:
        """`journal.json` in the workdir: each writer's generations (accepted at, answered at, status), lost
        connections, late and unanswered requests, on the soak's clock beside the fault windows: where a failed
        target's figure came from."""
        journal = {"fault_windows": [list(w) for w in self.windows], "writers": {log.name: {
            "doc_id": log.doc_id, "gens": {g: [*log.gen_times.get(g, (None, None)), s] for g, s in log.gens.items()},
            "lost": log.lost, "late": log.late, "unanswered": log.unanswered, "untyped": log.untyped}
            for log in logs}}  # fmt: skip
        (self.workdir / "journal.json").write_text(json.dumps(journal, indent=1))

    async def _read_back(self, logs: list[WriterLog]) -> dict[str, Known | None]:
        finals: dict[str, Known | None] = {}
        async with DcanvasClient.connect(self.server.url, client_name="soak-check", request_timeout=60) as c:
            for log in logs:
                if log.doc_id:
                    s = await c.open(log.doc_id)
                    finals[log.doc_id] = Known.of(s)
                    await c.close_doc(log.doc_id)  # a session may have only so many documents open
        return finals

    def _report(self, logs: list[WriterLog], actors: Actors, violations: list[str], wall: float,
                health: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        statuses: Counter[str] = Counter(s for log in logs for s in log.gens.values())
        refusals: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        for log in logs:
            refusals.update(log.refusals)
            errors.update(log.errors)
        refusals["actors"] = actors.log.refusals  # the burst's, mostly
        rss, fds = server_flatness(self.samples, "rss_mib"), server_flatness(self.samples, "fds")
        lags = [s.lag_p99_ms for s in self.samples if s.lag_p99_ms is not None]
        a = self.args
        return {
            "seed": a.seed, "minutes": a.minutes, "sessions": a.sessions, "faults": list(self.kinds),
            "model": a.model or "the server's default", "store": describe(self.server.args.db),
            "wall_s": round(wall, 1),
            "violations": len(violations), "violation_list": violations[:50],
            "ok": not violations and rss["flat"] is not False and fds["flat"] is not False,
            "faults_fired": dict(self.fired), "schedule": [[f.at_s, f.kind, f.duration_s] for f in self.schedule],
            "kills": [[round(x, 1), round(y, 1)] for x, y in self.kills],
            "replicas_killed": self.deployment.replicas_killed,
            "replicas_stopped": self.deployment.replicas_stopped, "postgres_faults": self.deployment.pg_events,
            "ingress_restarts": self.deployment.adoptions, "fault_windows": [list(w) for w in self.windows],
            "replica_watch": {"samples": self.watch.samples, "zombie_generations": self.watch.zombies_seen,
                              "diverging": len(self.watch.violations)},
            "restart_s": [round(x, 1) for x in self.restart_s],
            "acknowledged_changes": sum(1 for log in logs for s in log.steps if s.how.startswith("ack:")),
            "reconciles": sum(1 for log in logs for s in log.steps if s.how == "reconcile"),
            "in_flight_when_lost": dict(_in_flight(logs)),
            "connections_lost": sum(len(log.lost) for log in logs),
            "generations": dict(statuses),
            "generations_per_min": round(statuses.get("completed", 0) * 60 / wall, 1) if wall else None,
            "proposals_told": sum(len(log.told) for log in logs),
            "accepted": sum(len(log.accepted) for log in logs), "rejected": sum(len(log.rejected) for log in logs),
            "refusals": dict(refusals), "errors_by_code": dict(errors),
            "actors": {"done": dict(actors.log.done), "skipped": dict(actors.log.skipped),
                       "burst_admitted": actors.log.admitted, "bursts_unrefused": actors.log.unrefused_bursts,
                       "statuses": dict(actors.log.statuses),
                       "stall_closed_by_server": actors.log.stall_closed},  # fmt: skip
            "server_rss_mib": rss, "server_fds": fds,
            "processes": processes({**{f"ingress#{n}": [(s.t, s.rss_mib, float(s.fds)) for s in self.samples
                                                         if s.start == n] for n in {s.start for s in self.samples}},
                                    **self.series}, self.caches),  # fmt: skip
            "by_process": {str(n): {"rss_growth": server_flatness(self.samples, "rss_mib", n)["growth"],
                                    "fds_growth": server_flatness(self.samples, "fds", n)["growth"],
                                    "rss_mib_max": max(s.rss_mib for s in self.samples if s.start == n),
                                    "fds_max": max(s.fds for s in self.samples if s.start == n)}
                           for n in sorted({s.start for s in self.samples})},  # fmt: skip
            "late_answers": {"count": sum(len(log.late) for log in logs),
                             "slowest_s": max((x[2] for log in logs for x in log.late), default=None)},
            "loop_lag_p99_ms": {"median_of_minutes": round(statistics.median(lags), 2) if lags else None,
                                "worst_minute": max(lags) if lags else None,
                                "max_ever_last_process": (health.get("loop_lag_ms") or {}).get("max_ever")},
            "server_queue_last": health.get("queue"),
            "samples": [[s.t, s.start, s.rss_mib, s.fds, s.lag_p99_ms] for s in self.samples],
            # Each replica's RSS beside its context cache's fill, so its growth can be read against its bound.
            "replica_series": replica_series(self.series, self.caches),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }


def burst_size(queue: dict[str, Any], max_batch: int) -> int:
    """Generations at once that must overflow the queue bound of every engine: the server's (its /health `queue`),
    or with --ray the sum over the replicas that posted, each bounded by its own admission (a burst sized by one
    replica's bound fits in two)."""
    engines = [r.get("queue") or {} for r in queue.get("replicas") or []] or [queue]
    return sum(int(q.get("row_cap") or max_batch) + int(q.get("max_queue") or 8) for q in engines) + 4


def _in_flight(logs: list[WriterLog]) -> Counter[str]:
    """The requests whose answer a lost connection took, by kind, and whether the store had applied them."""
    out: Counter[str] = Counter()
    for log in logs:
        for prev, cur in zip(log.steps, log.steps[1:], strict=False):
            if cur.how == "reconcile" and cur.inflight is not None:
                applied = "applied" if cur.state.v > prev.state.v else "not applied"
                out[f"{cur.inflight.split(':')[0]} {applied}"] += 1
    return out


def _print(r: dict[str, Any]) -> None:
    print(f"soak seed {r['seed']}: {r['sessions']} writers for {r['wall_s']} s, faults {r['faults_fired']}; "
          f"{r['violations']} violations")  # fmt: skip
    for v in r["violation_list"]:
        print(f"  VIOLATION {v}")
    print(f"acknowledged changes {r['acknowledged_changes']}, reconciles {r['reconciles']} (in flight when lost: "
          f"{r['in_flight_when_lost']}), connections lost {r['connections_lost']}")
    print(f"generations {r['generations']} ({r['generations_per_min']}/min); "
          f"proposals told {r['proposals_told']}, accepted {r['accepted']}, rejected {r['rejected']}")  # fmt: skip
    print(f"refusals {r['refusals']}; errors {r['errors_by_code']}; actors {r['actors']}")
    print(f"server RSS {r['server_rss_mib']}; fds {r['server_fds']}; loop lag p99 {r['loop_lag_p99_ms']}; "
          f"restarts took {r['restart_s']} s")  # fmt: skip
    for name, t in (r.get("targets") or {}).items():
        print(f"target {name}: {'held' if t['held'] else 'MISSED'} {t}")


def _start_ray(replicas: int) -> str:
    """A local Ray owned by this process (the servers join it): a killed server leaves it, and the application it
    deployed, running for the next one; `_stop_ray` ends it, and nobody else's."""
    import ray

    ray.init(num_cpus=replicas + 1, include_dashboard=False, log_to_driver=False)
    return str(ray.get_runtime_context().gcs_address)


def _stop_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _database(words: list[str] | None) -> tuple[str | None, bool]:
    """`--db`: (the URL, or None for SQLite; whether the soak starts its own PostgreSQL). Raises ValueError."""
    if not words:
        return None, False
    if words == ["postgresql"]:
        return None, True
    url = words[-1]
    if len(words) > 2 or (len(words) == 2 and words[0] != "postgresql") or \
            not url.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"--db takes postgresql (a private PostgreSQL) or a postgresql:// URL, not {words}")
    return url, False


def _check_empty(url: str) -> str | None:
    """Why the database at `url` cannot be soaked (None: it can)."""
    try:
        store = open_store(url)
    except Exception as e:  # noqa: BLE001 (StoreError, or psycopg missing: said plainly)
        return f"--db: {e}"
    try:  # the checker reads the whole store as the writers' own
        return f"{describe(url)} already holds documents; give an empty database" if store.count() else None
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    try:
        url, private = _database(args.db)
        parse_faults(args.faults, ray=args.ray, pg=private)
    except ValueError as e:
        print(f"dcanvas bench soak: {e}", file=sys.stderr)
        return 2
    if args.minutes <= 0 or args.sessions < 1 or args.replicas < 1:
        print("dcanvas bench soak: --minutes must be > 0, --sessions and --replicas >= 1", file=sys.stderr)
        return 2
    bindir = find_bindir() if private else None
    if private and bindir is None:
        print("dcanvas bench soak: --db postgresql needs PostgreSQL's server binaries (apt-get install postgresql)",
              file=sys.stderr)  # fmt: skip
        return 2
    why = None if url is None else _check_empty(url)
    if why is not None:
        print(f"dcanvas bench soak: {why}", file=sys.stderr)
        return 2
    if args.workdir is not None:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "docs.db").unlink(missing_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="dcanvas-soak-"))
    # Enough connections for every ingress a restart may briefly overlap, and their listeners.
    pg = PgServer(bindir, max_connections=100).start() if bindir is not None else None
    try:
        url = url if pg is None else pg.database()
        ray_address = _start_ray(args.replicas) if args.ray else None
        try:
            soak = Soak(args, workdir, ray_address, db=url, pg=pg)
            try:
                report = asyncio.run(soak.run())
            finally:
                soak.server.kill9()
        finally:
            if args.ray:
                _stop_ray()
    finally:
        if pg is not None:
            pg.remove()
    report["workdir"] = str(workdir)
    if pg is not None:
        report["store"] = f"a private PostgreSQL ({pg.bindir.parent.name}), removed at the end"
    (workdir / "report.json").write_text(json.dumps(report, indent=1))
    _print(report)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--sessions", type=int, default=4, help="writers, each the only writer of its document")
    parser.add_argument("--faults", default="all", help=f"all, none, or a comma-separated list of: {', '.join(FAULTS)}")
    parser.add_argument("--seed", type=int, default=0, help="draws the schedule and every writer's choices")
    parser.add_argument("--model", default=None, help="the server's model directory (default: the server's default)")
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads")
    parser.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch")
    parser.add_argument("--max-queue", default="auto", help="the server's --max-queue")
    parser.add_argument("--ray", action="store_true", help="the server's engine as Ray Serve replicas (a local Ray)")
    parser.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas")
    parser.add_argument("--gen-steps", default="8,12,16", help="max_steps the writers ask for (comma-separated)")
    parser.add_argument("--db", nargs="+", default=None, metavar="postgresql [URL]",
                        help="the documents in PostgreSQL: `postgresql` alone starts a private one (and its faults: "
                        "restarts, downtime), removed at the end; a postgresql:// URL names an empty database "
                        "(default: a SQLite file in the workdir)")  # fmt: skip
    parser.add_argument("--workdir", default=None, help="keep the database and server log here (default: a temp dir)")
    parser.set_defaults(func=run)
