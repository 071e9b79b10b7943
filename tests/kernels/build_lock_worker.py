"""A process that takes part in a `kernels._build_lock` build, for the tests that kill one or race two (their own
processes: a flock is per open file, and the point is what happens when a process dies holding it).

`python -m tests.kernels.build_lock_worker MODE DIR`:
- `hold DIR SECONDS`: hold DIR's build lock, print "held", sleep, release.
- `hang DIR`: start a build of DIR/out.txt that never ends, as a compile does when its process is killed: a torch
  `lock` baton and a half-written artifact in the stage, an orphan-to-be child that keeps writing there; prints
  "compiling" and sleeps.
- `build DIR`: build DIR/out.txt the way cpp_extension does (its `FileBaton` in the build directory: a stale baton
  there would make it wait forever) and print what was loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kernels._build_lock import TORCH_BATON, build_lock, build_once

ARTIFACT = "out.txt"


def _read(path: Path) -> str:
    return path.read_text()


def _hang(stage: Path) -> str:
    (stage / TORCH_BATON).touch()  # what FileBaton.try_acquire leaves while cpp_extension builds
    (stage / ARTIFACT).write_text("half")  # a linker killed mid-write
    # An orphaned compiler: it outlives this process and keeps writing into the stage.
    subprocess.Popen(["sh", "-c", f"while :; do echo x >> '{stage}/orphan.o'; sleep 1; done"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("compiling", flush=True)
    while True:
        time.sleep(60)


def _build(stage: Path) -> str:
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(str(stage / TORCH_BATON))
    if baton.try_acquire():
        try:
            (stage / ARTIFACT).write_text(f"built by {os.getpid()}")
        finally:
            baton.release()
    else:
        baton.wait()  # torch's behaviour: waits while the file exists, however old
    return _read(stage / ARTIFACT)


def main(argv: list[str]) -> int:
    mode, directory = argv[0], Path(argv[1])
    if mode == "hold":
        with build_lock(directory, "the test build"):
            print("held", flush=True)
            time.sleep(float(argv[2]))
    elif mode == "hang":
        build_once(directory, ARTIFACT, _hang, _read, what="the test build")
    elif mode == "build":
        print(build_once(directory, ARTIFACT, _build, _read, what="the test build"), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
