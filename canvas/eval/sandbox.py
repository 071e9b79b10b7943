"""Running a code task's test on a program the model helped write: its function's doctests, in a subprocess.

Owns `run_doctests` and `TestResult`. The program is untrusted (a model wrote part of it), so it runs:
- in a fresh interpreter (`python -I`: no user site, no PYTHON* variables, the working directory not importable)
  whose working directory and HOME are a new temporary directory, removed afterwards, with an environment of PATH
  alone;
- without network: in a new user and network namespace (`unshare -rn`: only a loopback that is down) where the
  system allows one, and in any case with `socket.socket`/`create_connection` replaced before anything is imported;
- under limits: CPU seconds, address space, file size, and a wall-clock timeout after which its whole process group
  is killed.
The test execs the program in a copy of its module's namespace (so the module's private helpers resolve), runs
the task's `globs` there (imports the doctests assume), and runs the function's own doctests (ELLIPSIS and
NORMALIZE_WHITESPACE, as the source projects run them). It passes when at least one example ran and none failed.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Protocol

MEMORY_BYTES = 4 << 30
FILE_BYTES = 16 << 20

_SCRIPT = r"""
import json, socket, sys
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the code-eval sandbox")
socket.socket = _no_network
socket.create_connection = _no_network
socket.socketpair = _no_network
req = json.loads(sys.stdin.read())
out = {"attempted": 0, "failed": 0, "error": ""}
try:
    import doctest, importlib
    ns = dict(vars(importlib.import_module(req["module"])))
    exec(req["globs"], ns)
    exec(compile(req["program"], "<task>", "exec"), ns)
    fn = ns[req["function"]]
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    for test in doctest.DocTestFinder(recurse=False).find(fn, req["function"], globs=ns):
        runner.run(test, out=lambda s: None)
    result = runner.summarize(verbose=False)
    out["attempted"], out["failed"] = result.attempted, result.failed
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"[:300]
sys.stdout.write("\n" + json.dumps(out) + "\n")
"""


class TaskLike(Protocol):
    @property
    def module(self) -> str: ...
    @property
    def function(self) -> str: ...
    @property
    def globs(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TestResult:
    __test__ = False  # not a pytest class

    attempted: int
    failed: int
    error: str  # why the test did not run to the end ("" when it did)
    seconds: float

    @property
    def passed(self) -> bool:
        return not self.error and self.attempted > 0 and self.failed == 0


@functools.cache
def _unshare() -> list[str]:
    """`unshare -rn` where it works here (a user namespace may be refused), else nothing."""
    exe = shutil.which("unshare")
    if exe is None:
        return []
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return [exe, "-rn"] if ok else []


def _limits(cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_doctests(task: TaskLike, program: str, *, timeout_s: float = 20.0) -> TestResult:
    """Run `task.function`'s doctests on `program` in the sandbox (see the module docstring)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    request = json.dumps({"module": task.module, "function": task.function, "globs": task.globs, "program": program})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dcanvas-code-") as tmp:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp,
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}  # fmt: skip
        cmd = [*_unshare(), sys.executable, "-I", "-c", _SCRIPT]
        cpu = int(timeout_s) + 1
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                cwd=tmp, env=env, text=True, start_new_session=True,
                                preexec_fn=lambda: _limits(cpu))  # fmt: skip
        try:
            stdout, _ = proc.communicate(request, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return TestResult(0, 0, f"timed out after {timeout_s:g} s", time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    last = stdout.strip().rsplit("\n", 1)[-1] if stdout.strip() else ""
    try:
        out = json.loads(last)
        return TestResult(int(out["attempted"]), int(out["failed"]), str(out["error"]), seconds)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return TestResult(0, 0, f"the test process exited with {proc.returncode} and no result", seconds)
