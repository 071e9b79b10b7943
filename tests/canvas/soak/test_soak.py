"""`dcanvas bench soak` end to end: three minutes of four writers against a real server (the embedded model) while
every fault class fires at least once: store write errors, a full disk, kill -9 and restart, a client dropping
mid-generation, a client that never reads, a burst over the queue bound; and, on Ray Serve replicas, a replica
killed. The checker must find nothing, and each fault must have been met (the store's refusals reached the writers
as typed, retryable `busy`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import canvas
from canvas.soak.schedule import FAULTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EMBEDDED = Path(canvas.__file__).resolve().parent / "assets" / "default-model"  # canvas-6m: fast enough for minutes


def _soak(tmp_path: Path, *args: str) -> tuple[dict[str, Any], int]:
    """Run `dcanvas bench soak` with `args`; its JSON report and exit status."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "canvas.cli", "bench", "soak", "--threads", "1", "--workdir", str(tmp_path),
           "--model", str(EMBEDDED), *args]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    assert out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.returncode


def test_a_three_minute_soak_with_every_fault_loses_nothing(tmp_path: Path) -> None:
    report, returncode = _soak(tmp_path, "--minutes", "3", "--sessions", "4", "--faults", "all", "--seed", "3")
    assert report["violations"] == 0, report["violation_list"]
    assert set(report["faults_fired"]) == set(FAULTS) - {"ray_kill"} and report["kills"], report["faults_fired"]
    assert report["reconciles"] >= report["sessions"]  # every writer lived through the kill
    assert report["acknowledged_changes"] > 100 and report["generations"].get("completed", 0) > 10
    assert report["refusals"].get("store", 0) > 0  # the store's failures surfaced, typed and retryable
    assert report["refusals"].get("actors", 0) > 0 and report["actors"]["done"].get("drop", 0) >= 1
    assert report["server_rss_mib"]["flat"] is True and report["server_fds"]["flat"] is True, report["samples"]
    assert report["loop_lag_p99_ms"]["worst_minute"] is not None
    assert returncode == 0


def test_a_soak_on_ray_replicas_survives_a_replica_killed(tmp_path: Path) -> None:
    """The same with the engine as two Ray Serve replicas: one replica's process and the ingress are killed -9."""
    pytest.importorskip("ray.serve")
    report, returncode = _soak(tmp_path, "--minutes", "2", "--sessions", "3", "--ray", "--replicas", "2", "--seed", "2",
                               "--faults", "ray_kill,kill,store_errors,drop")  # fmt: skip
    assert report["violations"] == 0, report["violation_list"]
    assert report["replicas_killed"] and report["kills"] and report["faults_fired"]["drop"] >= 1
    assert report["acknowledged_changes"] > 50 and report["generations"].get("completed", 0) > 5
    assert returncode == 0


def test_a_soak_on_postgresql_loses_nothing(tmp_path: Path, pg_url: str) -> None:
    """The same on a PostgreSQL store (`--db`): its write errors and full disk (psycopg's own errors), kill -9 and
    restart, a dropped client; the checker reads the PostgreSQL store."""
    report, returncode = _soak(tmp_path, "--minutes", "2", "--sessions", "3", "--seed", "5", "--db", pg_url,
                               "--faults", "store_errors,disk_full,kill,drop")  # fmt: skip
    assert report["violations"] == 0, report["violation_list"]
    assert report["store"].startswith("postgresql://") and report["kills"], report["faults_fired"]
    assert report["refusals"].get("store", 0) > 0 and report["refusals"].get("store_full", 0) > 0, report["refusals"]
    assert report["acknowledged_changes"] > 50 and report["generations"].get("completed", 0) > 5
    assert returncode == 0


def test_a_soak_refuses_a_database_that_holds_documents(tmp_path: Path, pg_url: str) -> None:
    from canvas.store.pg import PgStore

    with PgStore(pg_url) as store:
        store.save("someone-elses", 0, {"text": "x"})
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "canvas.cli", "bench", "soak", "--minutes", "1", "--db", pg_url,
           "--workdir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "already holds documents" in out.stderr, out.stderr[-2000:]
