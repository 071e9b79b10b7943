"""A throwaway PostgreSQL server for the store tests (not a test module).

`PgServer.start()` runs Debian's `initdb` and `pg_ctl` on a fresh data directory in /tmp, listening on a free
loopback port with trust authentication (nothing but this machine can reach it), as the `postgres` user when the
tests run as root (PostgreSQL refuses to run as root). `database()` creates an empty database per test. `.ci/run`
installs the `postgresql` package when it is missing (`tests/canvas/ensure_postgres.sh`); without its binaries the
PostgreSQL tests skip and say why.
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


def find_bindir() -> Path | None:
    """Where initdb, pg_ctl and postgres live: $DCANVAS_PG_BIN, PATH, or Debian's /usr/lib/postgresql/N/bin."""
    explicit = os.environ.get("DCANVAS_PG_BIN")
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
    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="dcanvas-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user: str | None = "postgres" if os.geteuid() == 0 else None

    def _run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bindir / cmd[0]), *cmd[1:]]
        if self.user is not None:
            argv = [_runuser(), "-u", self.user, "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    def start(self) -> PgServer:
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        done = self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip()[-500:]}")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60"
        done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options, "-w", "start")
        if done.returncode != 0:
            log = (self.root / "log").read_text(errors="replace") if (self.root / "log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stderr.strip()[-300:]} {log[-500:]}")
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

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
