"""One builder at a time per build directory, and a build that a killed process cannot wedge.

Owns `build_lock` (an exclusive `fcntl.flock` on `<dir>/build.lock`), `build_once` (load the artifact a directory
holds, or build it under that lock and move it into place), `lock_timeout_s` and `LockTimeout`. `kernels._cpp` builds
the CPU kernels through it; nothing here knows what is built.

Invariants:
- The lock dies with its holder: the kernel drops a flock when the last descriptor of it closes, however the process
  ends (SIGKILL, OOM, power loss of the process), so a killed build never leaves a lock behind. The descriptor is
  close-on-exec, so compilers the build starts (which may outlive a killed builder) never hold it. The lock file is
  never deleted (deleting a flocked file lets two processes lock two different inodes); while held it holds the
  holder's pid, for the waiting line and the timeout's message.
- `<dir>/<artifact>` exists only complete: a build writes into `<dir>/stage-<pid>/` and `os.replace`s the artifact
  into place, so a reader needs no lock and never sees a half-linked file. A builder killed mid-compile leaves only
  its stage, and its orphaned compilers write only there.
- Holding the flock proves that no live builder uses the directory, so the holder removes every stage and torch's
  `lock` baton files (cpp_extension's `FileBaton`: created with O_EXCL in the build directory and waited on forever
  while it exists, even when its creator is long dead) before it builds. Torch's baton is only ever created in a
  fresh stage, so it can never make us wait.
- No wait is silent: a waiter prints a line on stderr at once and every `NOTICE_EVERY_S`, and gives up after
  `DCANVAS_KERNEL_LOCK_TIMEOUT` seconds (default `DEFAULT_LOCK_TIMEOUT_S`, 10 minutes) with `LockTimeout`, whose
  one-line message names the lock file, the pid holding it and how to clear it.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from canvas.env import KERNEL_LOCK_TIMEOUT

__all__ = ["DEFAULT_LOCK_TIMEOUT_S", "LOCK_NAME", "NOTICE_EVERY_S", "STAGE_PREFIX", "TORCH_BATON",
           "LockTimeout", "build_lock", "build_once", "clear_stale", "lock_timeout_s"]

DEFAULT_LOCK_TIMEOUT_S = 600.0  # a full build takes ~1-4 min; a holder past 10 is stuck, not slow
NOTICE_EVERY_S = 20.0
LOCK_NAME = "build.lock"
STAGE_PREFIX = "stage-"
TORCH_BATON = "lock"  # torch.utils.file_baton.FileBaton's file, as cpp_extension._jit_compile names it
_POLL_S = 0.2

T = TypeVar("T")


class LockTimeout(TimeoutError):
    """The build lock stayed held for longer than the timeout; the message says by whom and what to do."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def lock_timeout_s() -> float:
    """How long a process waits for another's build: `DCANVAS_KERNEL_LOCK_TIMEOUT` seconds, else 600."""
    raw = KERNEL_LOCK_TIMEOUT.text()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{KERNEL_LOCK_TIMEOUT} must be a number of seconds, got {raw!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{KERNEL_LOCK_TIMEOUT} must be a finite number of seconds >= 0, got {raw!r}")
    return value


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote (None: not written yet, or an empty file)."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _describe(pid: int | None) -> str:
    return f"pid {pid}" if pid is not None else "another process (it has not written its pid yet)"


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _acquire(fd: int, path: Path, what: str, timeout_s: float, say: Callable[[str], None],
             notice_every_s: float) -> None:
    if _try_lock(fd):
        return
    start = time.monotonic()
    deadline, next_notice = start + timeout_s, start + notice_every_s
    say(f"dcanvas: waiting for {what}: {path} is held by {_describe(_holder(fd))} "
        f"(gives up after {timeout_s:g} s; {KERNEL_LOCK_TIMEOUT} sets that)")
    while True:
        now = time.monotonic()
        if now >= deadline:
            pid = _holder(fd)
            clear = (f"if it is stuck, stop it (kill {pid})" if pid is not None
                     else f"if it is stuck, stop it (`fuser {path}` names it)")
            raise LockTimeout(
                f"gave up after {timeout_s:g} s waiting for {what}: {path} is held by {_describe(pid)}; {clear}. "
                f"The lock is released when its holder exits, so never delete the file; "
                f"{KERNEL_LOCK_TIMEOUT}=SECONDS waits longer")
        if now >= next_notice:
            say(f"dcanvas: still waiting for {what} ({now - start:.0f} s): {path} is held by "
                f"{_describe(_holder(fd))}")
            next_notice += notice_every_s
        time.sleep(min(_POLL_S, max(0.0, deadline - now), max(0.0, next_notice - now)))
        if _try_lock(fd):
            return


@contextlib.contextmanager
def build_lock(directory: Path, what: str, *, timeout_s: float | None = None, say: Callable[[str], None] = _stderr,
               notice_every_s: float = NOTICE_EVERY_S) -> Iterator[Path]:
    """Hold the exclusive lock of `directory` (created if missing) for the `with` block; yields the lock file.
    Waits at most `timeout_s` (default `lock_timeout_s()`), saying so through `say` (`what` names the build in those
    lines), then raises `LockTimeout`."""
    timeout_s = lock_timeout_s() if timeout_s is None else timeout_s
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _acquire(fd, path, what, timeout_s, say, notice_every_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # the pid is there only while the lock is held
    finally:
        os.close(fd)  # drops the flock


def clear_stale(directory: Path) -> list[str]:
    """Remove what dead builders left in `directory`: stages and torch baton files. Only while holding
    `build_lock(directory)`, which proves their builders dead. Returns the names removed."""
    removed = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(STAGE_PREFIX) and entry.is_dir():
            # An orphaned compiler may still write into it; what it adds after the walk is left for the next one.
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
        elif entry.name == TORCH_BATON:
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def build_once(directory: Path, artifact: str, build: Callable[[Path], T], load: Callable[[Path], T], *, what: str,
               timeout_s: float | None = None, say: Callable[[str], None] = _stderr) -> T:
    """`load(directory / artifact)` where it exists; else, under `build_lock(directory)`, `build(stage)` (which
    must write `stage / artifact` and return it loaded), then the artifact is moved into place. A build that raises
    leaves nothing in place; its stage is removed by the next builder."""
    final = directory / artifact
    if final.is_file():
        return load(final)
    with build_lock(directory, what, timeout_s=timeout_s, say=say):
        if final.is_file():  # the holder we waited for built it
            return load(final)
        clear_stale(directory)
        stage = directory / f"{STAGE_PREFIX}{os.getpid()}"
        stage.mkdir()
        result = build(stage)
        built = stage / artifact
        if not built.is_file():
            raise RuntimeError(f"the build of {what} wrote no {artifact} in {stage}")
        os.replace(built, final)  # atomic: readers see no artifact or the whole one
        shutil.rmtree(stage, ignore_errors=True)
    return result
