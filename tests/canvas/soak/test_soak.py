"""`dcanvas bench soak` end to end: three minutes of four writers against a real server (the embedded model) while
every fault class fires at least once: store write errors, a full disk, kill -9 and restart, a client dropping
mid-generation, a client that never reads, a burst over the queue bound. The checker must find nothing, and each
fault must have been met (the store's refusals reached the writers as typed, retryable `busy`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canvas.soak.schedule import FAULTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_three_minute_soak_with_every_fault_loses_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "canvas.cli", "bench", "soak", "--minutes", "3", "--sessions", "4", "--faults", "all",
           "--seed", "3", "--threads", "1", "--workdir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    assert out.stdout.strip(), out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["violations"] == 0, report["violation_list"]
    assert set(report["faults_fired"]) == set(FAULTS) - {"ray_kill"} and report["kills"], report["faults_fired"]
    assert report["reconciles"] >= report["sessions"]  # every writer lived through the kill
    assert report["acknowledged_changes"] > 100 and report["generations"].get("completed", 0) > 10
    assert report["refusals"].get("store", 0) > 0  # the store's failures surfaced, typed and retryable
    assert report["refusals"].get("burst", 0) > 0 and report["actors"]["done"].get("drop", 0) >= 1
    assert report["server_rss_mib"]["flat"] is True and report["server_fds"]["flat"] is True, report["samples"]
    assert report["loop_lag_p99_ms"]["worst_minute"] is not None
    assert out.returncode == 0
