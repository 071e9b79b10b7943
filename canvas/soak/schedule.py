"""The faults of a soak and when each fires, drawn from one seed: the same seed and arguments, the same schedule.

Fault classes (`FAULTS`): `store_errors` (a share of the store's writes fail as I/O errors for a while), `disk_full`
(SQLite finds the disk full for a while), `kill` (the server is killed -9 and restarted on the same database),
`drop` (a client drops its connection mid-generation), `stall` (a client that never reads its socket, for a while),
`burst` (many clients start generations at once, over the queue bound), `ray_kill` (with `--ray`: an engine replica's
process is killed -9, mid-generation where one runs; Ray Serve replaces it), `ray_stop` (with `--ray`: a replica is
stopped with SIGSTOP for longer than the ingress's silent-replica timeout, then resumed with SIGCONT), `pg_restart_fast`
and `pg_restart_immediate` (with the soak's own PostgreSQL: `pg_ctl restart -m fast` / `-m immediate`, while the
writers write), `pg_down` (the same PostgreSQL stopped for a while, refusing connections, then started). With `--ray`,
`kill` is the ingress killed -9 with its replicas left running: the restarted ingress adopts them.

Invariants: every requested class fires at least once; events fire inside (5%, 85%) of the run, and kills only in
its first 60%, so the last server process lives long enough for its memory and descriptors to be judged flat.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULTS = ("store_errors", "disk_full", "kill", "drop", "stall", "burst", "ray_kill", "ray_stop", "pg_restart_fast",
          "pg_restart_immediate", "pg_down")
RAY_ONLY = ("ray_kill", "ray_stop")
PG_ONLY = ("pg_restart_fast", "pg_restart_immediate", "pg_down")  # need a PostgreSQL the soak started itself
# Events per minute of run for each class (at least one each): a 60-minute soak kills the server 9 times.
RATES = {"store_errors": 0.3, "disk_full": 0.2, "kill": 0.15, "drop": 0.6, "stall": 0.15, "burst": 0.25,
         "ray_kill": 0.2, "ray_stop": 0.15, "pg_restart_fast": 0.15, "pg_restart_immediate": 0.15, "pg_down": 0.12}
SERVER_SIDE = ("store_errors", "disk_full", "kill", "ray_kill", "ray_stop", *PG_ONLY)  # faults generations must outlive
STOP_PAST_S = (3.0, 12.0)  # ray_stop: a replica stays stopped this much longer than the ingress's silent timeout
KILL_BEFORE = 0.6  # kills happen in this first share of the run


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds after the writers start
    kind: str
    duration_s: float  # how long it lasts (0 for an instant: kill, drop, burst)
    p: float = 1.0  # store_errors: the share of writes that fail


def parse_faults(text: str, ray: bool = False, pg: bool = False) -> tuple[str, ...]:
    """`all`, `none` or a comma-separated list of `FAULTS` (`all` holds `RAY_ONLY` only with `ray`, `PG_ONLY` only
    with `pg`: a PostgreSQL the soak started, `--db postgresql`)."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    if text == "all":
        return tuple(k for k in FAULTS if (ray or k not in RAY_ONLY) and (pg or k not in PG_ONLY))
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}: choose from {', '.join(FAULTS)} (or all, none)")
    if not ray and any(k in RAY_ONLY for k in kinds):
        raise ValueError(f"{', '.join(RAY_ONLY)} needs --ray (a server whose engine runs as Ray Serve replicas)")
    if not pg and any(k in PG_ONLY for k in kinds):
        raise ValueError(f"{', '.join(PG_ONLY)} needs --db postgresql (a PostgreSQL the soak starts, and restarts)")
    return tuple(dict.fromkeys(kinds))


def draw(seed: int, seconds: float, kinds: tuple[str, ...], silent_s: float = 15.0) -> list[Fault]:
    """The schedule of a `seconds`-long soak with faults `kinds`, in time order."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    rng = random.Random(seed)
    out: list[Fault] = []
    for kind in kinds:
        n = max(1, round(RATES[kind] * seconds / 60))
        hi = KILL_BEFORE if kind == "kill" else 0.85
        for _ in range(n):
            at = rng.uniform(0.05, hi) * seconds
            if kind in ("store_errors", "disk_full", "stall", "pg_down"):
                duration = min(rng.uniform(4.0, 15.0), 0.1 * seconds + 2)
            elif kind == "ray_stop":  # past the ingress's timeout (`silent_s`), so the generation must end typed
                duration = silent_s + rng.uniform(*STOP_PAST_S)
            else:
                duration = 0.0
            p = round(rng.uniform(0.2, 0.6), 2) if kind == "store_errors" else 1.0
            out.append(Fault(round(at, 2), kind, round(duration, 2), p))
    return sorted(out, key=lambda f: (f.at_s, f.kind))
