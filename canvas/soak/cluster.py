"""The soak's faults on the scale-out deployment (`--ray`, `--db postgresql`) and the processes it watches there.

Owns `Deployment`: the engine replicas (found through the ingress's /health: replica id and pid) and the private
PostgreSQL (`canvas.store.pgserver.PgServer`, when the soak started it). Its faults: `kill_replica` (kill -9, one
running a generation if any), `stop_replica` (SIGSTOP for longer than the ingress's silent-replica timeout, then
SIGCONT), `pg_restart` (`pg_ctl restart -m fast|immediate`) and `pg_down` (the postmaster stopped for a while, then
started). PostgreSQL faults run one at a time (a restart of a stopped server would fail). `processes` names every
process whose RSS and descriptors the soak samples besides the ingress: each replica and the postmaster, by pid.

Invariant: only processes of this soak are signalled (replica pids read from its own ingress, the postmaster of the
PostgreSQL it started); a stopped replica is always resumed, even when the soak is cancelled mid-fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from canvas.soak.server import ServerProc
from canvas.store.pgserver import PgServer, RestartMode


@dataclass
class Deployment:
    server: ServerProc
    pg: PgServer | None
    rng: random.Random
    t0: float = 0.0
    replicas_killed: list[str] = field(default_factory=list)
    replicas_stopped: list[list[Any]] = field(default_factory=list)  # [replica, stopped at, resumed at, stop_s]
    pg_events: list[list[Any]] = field(default_factory=list)  # [kind, at, back at, seconds]
    adoptions: list[dict[str, Any]] = field(default_factory=list)  # one per ingress restart
    _pg_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    # -- replicas ------------------------------------------------------------------------------------------------

    def replicas(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """The live replicas (each with `replica` and `pid`) and this ingress's running generations by replica."""
        queue = self.server.health().get("queue") or {}
        live = [r for r in queue.get("replicas") or [] if r.get("pid")]
        return live, {str(k): int(v) for k, v in (queue.get("running_by_replica") or {}).items()}

    def _victim(self) -> dict[str, Any]:
        live, running = self.replicas()
        if not live:
            raise RuntimeError("no engine replica posted figures lately")
        busy = [r for r in live if running.get(str(r.get("replica")))]
        return self.rng.choice(busy or live)

    def kill_replica(self) -> None:
        """kill -9 of an engine replica's process, one running a generation of this ingress if there is one."""
        victim = self._victim()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        self.replicas_killed.append(str(victim.get("replica")))

    async def stop_replica(self, seconds: float) -> None:
        """SIGSTOP a replica (a busy one if any) for `seconds`, then SIGCONT (unless Ray replaced it meanwhile)."""
        victim = await asyncio.to_thread(self._victim)
        pid, at = int(victim["pid"]), self._now()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):  # Ray's health check killed it: nothing to resume
                os.kill(pid, signal.SIGCONT)
            self.replicas_stopped.append([str(victim.get("replica")), at, self._now(), round(seconds, 1)])

    def before_ingress_kill(self) -> list[str]:
        return sorted(str(r.get("replica")) for r in self.replicas()[0])

    def after_ingress_restart(self, before: list[str], wanted: int) -> str | None:
        """Record which replicas the restarted ingress found; a violation when it serves other than `wanted`."""
        after = sorted(str(r.get("replica")) for r in self.replicas()[0])
        adopted = sorted(set(before) & set(after))
        self.adoptions.append({"at": self._now(), "before": before, "after": after, "adopted": len(adopted)})
        if len(after) != wanted:
            return f"t={self._now()}: the restarted ingress serves {len(after)} replicas, not {wanted}: {after}"
        return None

    # -- PostgreSQL ----------------------------------------------------------------------------------------------

    async def pg_restart(self, mode: RestartMode) -> None:
        pg = self._own_pg()
        async with self._pg_lock:
            at = self._now()
            await asyncio.to_thread(pg.restart, mode)
            self.pg_events.append([f"restart_{mode}", at, self._now(), round(self._now() - at, 2)])

    async def pg_down(self, seconds: float) -> None:
        pg = self._own_pg()
        async with self._pg_lock:
            at = self._now()
            await asyncio.to_thread(pg.halt)
            try:
                await asyncio.sleep(seconds)
            finally:
                await asyncio.to_thread(pg.resume)
            self.pg_events.append(["down", at, self._now(), round(self._now() - at, 2)])

    def _own_pg(self) -> PgServer:
        if self.pg is None:
            raise RuntimeError("PostgreSQL faults need the soak's own PostgreSQL (--db postgresql)")
        return self.pg

    def ensure_pg(self) -> None:
        """At the end: the database is up (a fault cancelled mid-way may have left it stopped)."""
        if self.pg is not None:
            self.pg.resume()

    # -- processes to sample ---------------------------------------------------------------------------------

    def processes(self, queue: dict[str, Any]) -> dict[str, int]:
        """Label -> pid of each process to sample besides the ingress: replicas (from `queue`) and the postmaster."""
        out = {f"replica:{r['pid']}": int(r["pid"]) for r in queue.get("replicas") or [] if r.get("pid")}
        pid = None if self.pg is None else self.pg.pid
        if pid is not None:
            out[f"postgres:{pid}"] = pid
        return out
