"""A private, throwaway PostgreSQL server from Debian's binaries: for the store tests and `dcanvas bench soak --db
postgresql`, which also restart it and take it away for a while on purpose.

`PgServer.start()` runs `initdb` and `pg_ctl` on a fresh data directory in /tmp, listening on a free loopback port
with trust authentication (nothing but this machine can reach it), as the `postgres` user when the caller runs as
root (PostgreSQL refuses to run as root). `database()` creates an empty database; `restart(mode)` is `pg_ctl
restart -m fast|immediate`; `halt()` / `resume()` stop the postmaster and start it again on the same data (clients
are refused meanwhile); `remove()` stops it and deletes everything. Without the binaries `find_bindir` is None
(`.ci/run` installs the `postgresql` package: tests/canvas/ensure_postgres.sh).

Invariant: the data directory, its socket and its log live under `root`, which `remove` deletes; nothing is
written anywhere else, and no server other than the one this object started is ever signalled.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

from canvas.env import PG_BIN

RestartMode = Literal["fast", "immediate"]


def find_bindir() -> Path | None:
    """Where initdb, pg_ctl and postgres live: $DCANVAS_PG_BIN, PATH, or Debian's /usr/lib/postgresql/N/bin."""
    explicit = PG_BIN.get()
    if explicit:
        return Path(explicit)
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[4]))
    return Path(found[-1]).parent if found else None


def _runuser() -> str:
    """util-linux's runuser: on PATH, else where Debian puts it (/usr/sbin, which a CI shell's PATH may leave out)."""
    found = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin")
    if found is None:
        raise RuntimeError("runuser (util-linux) not found: needed to run PostgreSQL as its own user under root")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    def __init__(self, bindir: Path, *, max_connections: int = 60) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="dcanvas-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user: str | None = "postgres" if os.geteuid() == 0 else None
        self.options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                        f"-c max_connections={max_connections}")  # fmt: skip

    def _run(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bindir / cmd[0]), *cmd[1:]]
        if self.user is not None:
            argv = [_runuser(), "-u", self.user, "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def _pg_ctl(self, *args: str) -> None:
        done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), *args)
        if done.returncode != 0:
            log = (self.root / "log").read_text(errors="replace") if (self.root / "log").exists() else ""
            raise RuntimeError(f"pg_ctl {' '.join(args)} failed: {done.stderr.strip()[-300:]} {log[-500:]}")

    def start(self) -> PgServer:
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        done = self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip()[-500:]}")
        self._pg_ctl("-o", self.options, "-w", "start")
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    @property
    def pid(self) -> int | None:
        """The postmaster's process id while it runs (the first line of postmaster.pid)."""
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def restart(self, mode: RestartMode) -> None:
        """`pg_ctl restart -m fast` (sessions are ended, transactions rolled back, a checkpoint) or `-m immediate`
        (every process quits at once: crash recovery from the WAL at the start); returns once it accepts again."""
        if mode not in ("fast", "immediate"):
            raise ValueError(f"mode must be fast or immediate, not {mode!r}")
        self._pg_ctl("-m", mode, "-o", self.options, "-w", "restart")

    def halt(self) -> None:
        """Stop the postmaster (fast): connections are refused until `resume`."""
        self._pg_ctl("-m", "fast", "-w", "stop")

    def resume(self) -> None:
        """Start it again on the same data, if it is not running."""
        if self._run("pg_ctl", "-D", str(self.data), "status").returncode != 0:
            self._pg_ctl("-o", self.options, "-w", "start")

    def stop(self) -> None:
        """Stop it at once and delete its data (the name the test fixtures use)."""
        self.remove()

    def remove(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
