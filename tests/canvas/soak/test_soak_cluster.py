"""`dcanvas bench soak --ray --replicas 2 --db postgresql` end to end, three minutes on the embedded model: engine
replicas on Ray Serve behind one ingress, documents in a private PostgreSQL the soak starts and removes, and every
fault class of that deployment fired at least once beside the others: a replica killed -9 and one stopped past the
ingress's silent-replica timeout, PostgreSQL restarted fast and immediate and taken down for a while, the ingress
killed -9 with its replicas left running. The checker must find nothing and every acceptance target must hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import canvas
from canvas.soak.schedule import FAULTS
from canvas.store.pgserver import find_bindir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
EMBEDDED = Path(canvas.__file__).resolve().parent / "assets" / "default-model"


def test_three_minutes_on_replicas_and_a_private_postgresql_lose_nothing(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve")
    pytest.importorskip("psycopg")
    if find_bindir() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "canvas.cli", "bench", "soak", "--threads", "1", "--workdir", str(tmp_path),
           "--model", str(EMBEDDED), "--minutes", "3", "--sessions", "4", "--ray", "--replicas", "2",
           "--db", "postgresql", "--faults", "all", "--seed", "4"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1140)
    assert out.stdout.strip(), out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["violations"] == 0, report["violation_list"]
    assert set(report["faults_fired"]) == set(FAULTS), report["faults_fired"]
    assert all(t["held"] for t in report["targets"].values()), report["targets"]
    assert report["replicas_killed"] and report["replicas_stopped"] and report["ingress_restarts"]
    assert {e[0] for e in report["postgres_faults"]} == {"restart_fast", "restart_immediate", "down"}
    assert report["replica_watch"]["samples"] > 30 and report["reconciles"] >= report["sessions"]
    assert report["acknowledged_changes"] > 50 and report["generations"].get("completed", 0) > 10
    assert report["refusals"].get("store", 0) > 0  # PostgreSQL's absence reached the writers as a typed busy
    assert "private PostgreSQL" in report["store"]
    assert out.returncode == 0
