"""`kernels._build_lock`: a build killed mid-compile never wedges the next one, a stale torch baton is never waited
on, a held lock is waited on aloud and given up on with a message that says what to do. The builds here are fakes
(a text file, torch's own `FileBaton` around it) in worker processes (`build_lock_worker.py`), so each test takes
about a second; `test_cpp_build.py` does the same with real compiles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from canvas.env import KERNEL_LOCK_TIMEOUT
from kernels._build_lock import (
    DEFAULT_LOCK_TIMEOUT_S,
    LOCK_NAME,
    TORCH_BATON,
    LockTimeout,
    build_lock,
    build_once,
    clear_stale,
    lock_timeout_s,
)
from tests.kernels.build_lock_worker import ARTIFACT

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "tests.kernels.build_lock_worker"]


def _start(*args: str) -> subprocess.Popen[str]:
    """A worker in its own process group (so its orphans can be killed with it), its stdout piped."""
    return subprocess.Popen([*WORKER, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and whatever it left running
    except ProcessLookupError:
        pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding `tmp_path`'s build lock for a minute."""
    proc = _start("hold", str(tmp_path), "60")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    _stop(proc)


def _build(directory: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh process's build of `directory` (torch's baton inside); fails the test instead of hanging."""
    return subprocess.run([*WORKER, "build", str(directory)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_killed_build_recovers_in_a_fresh_process(tmp_path: Path) -> None:
    hung = _start("hang", str(tmp_path))
    try:
        assert hung.stdout is not None and hung.stdout.readline().strip() == "compiling"
        stage = tmp_path / f"stage-{hung.pid}"
        assert (stage / TORCH_BATON).exists() and not (tmp_path / ARTIFACT).exists()
        os.kill(hung.pid, signal.SIGKILL)  # the builder only: its "compiler" lives on, writing into its stage
        hung.wait()
        out = _build(tmp_path, **{KERNEL_LOCK_TIMEOUT.name: "30"})
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("built by ") and "waiting" not in out.stderr  # the dead holder's lock is free
        assert (tmp_path / ARTIFACT).read_text() == out.stdout.strip()  # the new build, not the half-written one
        assert not (stage / TORCH_BATON).exists() and not (stage / ARTIFACT).exists()
    finally:
        _stop(hung)


def test_stale_torch_baton_does_not_hang(tmp_path: Path) -> None:
    (tmp_path / TORCH_BATON).touch()  # as the old layout's killed build left it
    (tmp_path / "stage-1").mkdir()
    (tmp_path / "stage-1" / TORCH_BATON).touch()
    out = _build(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("built by ")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ARTIFACT, LOCK_NAME])


def test_stale_baton_in_a_reused_stage_does_not_hang(tmp_path: Path) -> None:
    """A dead builder whose pid this process now has: its stage is ours by name, its baton must not count."""
    stage = tmp_path / f"stage-{os.getpid()}"
    stage.mkdir()
    (stage / TORCH_BATON).touch()
    (stage / ARTIFACT).write_text("half")

    def build(stage: Path) -> str:
        assert not (stage / TORCH_BATON).exists() and not (stage / ARTIFACT).exists()
        (stage / ARTIFACT).write_text("whole")
        return "whole"

    assert build_once(tmp_path, ARTIFACT, build, Path.read_text, what="t", timeout_s=0) == "whole"
    assert (tmp_path / ARTIFACT).read_text() == "whole" and not stage.exists()


def test_lock_wait_times_out_with_a_clear_message(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(LockTimeout) as caught:
        with build_lock(tmp_path, "the test build", timeout_s=0.7, say=lines.append, notice_every_s=0.25):
            pytest.fail("took a lock another process holds")
    assert 0.7 <= time.monotonic() - start < 10
    lock = str(tmp_path / LOCK_NAME)
    message = str(caught.value)
    assert "\n" not in message  # the ops' fallback warning shows the last line of a build error
    for part in ("gave up after 0.7 s waiting for the test build", lock, f"held by pid {holder.pid}",
                 f"kill {holder.pid}", "never delete", KERNEL_LOCK_TIMEOUT.name):
        assert part in message
    assert lines[0].startswith("dcanvas: waiting for the test build: ") and lock in lines[0]
    assert f"pid {holder.pid}" in lines[0]
    assert len(lines) >= 2 and all(line.startswith("dcanvas: still waiting for the test build") for line in lines[1:])
    os.kill(holder.pid, signal.SIGKILL)  # the lock dies with its holder: the next taker does not wait
    holder.wait()
    after: list[str] = []
    with build_lock(tmp_path, "the test build", timeout_s=5, say=after.append) as path:
        assert path.read_text() == f"{os.getpid()}\n"
    assert after == [] and path.read_text() == ""


def test_waiter_takes_the_lock_when_the_holder_finishes(tmp_path: Path) -> None:
    proc = _start("hold", str(tmp_path), "1")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        lines: list[str] = []
        with build_lock(tmp_path, "the test build", timeout_s=30, say=lines.append):
            assert proc.poll() is not None or proc.wait(timeout=5) == 0
        assert len(lines) == 1 and lines[0].startswith("dcanvas: waiting for the test build")
    finally:
        _stop(proc)


def test_a_built_artifact_loads_while_the_lock_is_held(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    (tmp_path / ARTIFACT).write_text("done")

    def build(stage: Path) -> str:
        raise AssertionError("rebuilt a finished artifact")

    assert build_once(tmp_path, ARTIFACT, build, Path.read_text, what="t", timeout_s=0) == "done"


def test_a_failed_build_leaves_nothing_and_the_next_succeeds(tmp_path: Path) -> None:
    def failing(stage: Path) -> str:
        (stage / ARTIFACT).write_text("half")
        raise RuntimeError("compiler error")

    with pytest.raises(RuntimeError, match="compiler error"):
        build_once(tmp_path, ARTIFACT, failing, Path.read_text, what="t", timeout_s=0)
    assert not (tmp_path / ARTIFACT).exists()

    def forgetful(stage: Path) -> str:
        return "nothing written"

    with pytest.raises(RuntimeError, match=f"wrote no {ARTIFACT}"):
        build_once(tmp_path, ARTIFACT, forgetful, Path.read_text, what="t", timeout_s=0)

    def good(stage: Path) -> str:
        (stage / ARTIFACT).write_text("ok")
        return "ok"

    assert build_once(tmp_path, ARTIFACT, good, Path.read_text, what="t", timeout_s=0) == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ARTIFACT, LOCK_NAME])


def test_clear_stale_keeps_what_is_not_a_builder_leftover(tmp_path: Path) -> None:
    for name in ("stage-12", "stage-345"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.o").touch()
    for name in (TORCH_BATON, LOCK_NAME, ARTIFACT):
        (tmp_path / name).touch()
    assert clear_stale(tmp_path) == [TORCH_BATON, "stage-12", "stage-345"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([LOCK_NAME, ARTIFACT])


def test_lock_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNEL_LOCK_TIMEOUT.name, raising=False)
    assert lock_timeout_s() == DEFAULT_LOCK_TIMEOUT_S == 600
    monkeypatch.setenv(KERNEL_LOCK_TIMEOUT.name, "2.5")
    assert lock_timeout_s() == 2.5
    for bad in ("ten", "-1", "inf", "nan"):
        monkeypatch.setenv(KERNEL_LOCK_TIMEOUT.name, bad)
        with pytest.raises(ValueError, match=KERNEL_LOCK_TIMEOUT.name):
            lock_timeout_s()
