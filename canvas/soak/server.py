"""The `dcanvas serve` process of a soak: started on a loopback port, killed -9 and restarted on the same database,
stopped at the end; and what it uses (RSS, open descriptors, /health) sampled while it runs.

Invariant: at most one server process at a time, always reaped (`stop` or `kill9`); a restart reuses the port, so
clients reconnect to the same URL. With `ray_address` it serves once all its engine replicas have posted figures.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from canvas.env import STORE_FAULTS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class ServerArgs:
    db: Path | str  # a SQLite file, or a PostgreSQL URL (`postgresql://...`)
    control: Path  # the fault-injecting store's control file (canvas.server.faults)
    log: Path  # the server's stdout and stderr
    model: str | None = None
    threads: int | None = None
    max_batch: int = 4
    max_queue: str = "auto"
    ray_address: str | None = None  # engine replicas on this Ray cluster (`dcanvas serve --ray`); None: no Ray
    replicas: int = 2


class ServerProc:
    def __init__(self, args: ServerArgs, port: int | None = None) -> None:
        self.args = args
        self.port = port or free_port()
        self.url = f"ws://127.0.0.1:{self.port}/ws"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None or self.proc.poll() is not None else self.proc.pid

    def command(self) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "canvas.cli", "serve", "--port", str(self.port), "--db", str(a.db),
               "--log-level", "warning", "--max-batch", str(a.max_batch), "--max-queue", a.max_queue]  # fmt: skip
        cmd += ["--model", a.model] if a.model else []  # fmt: skip
        cmd += ["--threads", str(a.threads)] if a.threads else []  # fmt: skip
        if a.ray_address is not None:  # the application outlives a killed ingress: the next one finds it deployed
            cmd += ["--ray", "--replicas", str(a.replicas), "--ray-address", a.ray_address, "--ray-app", "soak"]
        return cmd

    def replicas(self) -> list[dict[str, Any]]:
        """The engine replicas that posted figures lately (`--ray`), each with its `replica` id and `pid`."""
        out: list[dict[str, Any]] = (self.health().get("queue") or {}).get("replicas") or []
        return out

    def start(self, timeout: float = 180.0) -> float:
        """Start the server and wait until /health answers; the seconds that took."""
        if self.pid is not None:
            raise RuntimeError("the server is already running")
        t0 = time.monotonic()
        env = {**os.environ, STORE_FAULTS.name: str(self.args.control), "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.args.log, "ab")  # noqa: SIM115 (closed in _reap)
        self.proc = subprocess.Popen(self.command(), env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.starts += 1
        while True:
            ray = self.args.ray_address is not None
            if self.health(timeout=1.0) and (not ray or len(self.replicas()) >= self.args.replicas):
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.args.log}")
            if time.monotonic() - t0 > timeout:
                self.kill9()
                raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s; see {self.args.log}")
            time.sleep(0.2)

    def health(self, timeout: float = 5.0) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=timeout) as r:
                out: dict[str, Any] = json.loads(r.read())
                return out
        except (OSError, ValueError):
            return {}

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self._reap(10.0)

    def stop(self) -> int | None:
        """SIGTERM (a graceful stop), SIGKILL after 30 s; the exit status."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = None if self.proc is None else self.proc.poll()
        self._reap(10.0)
        return code

    def _reap(self, timeout: float) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
