"""`kernels._cpp`'s build: its directory is keyed by what the .so is made of (never where the sources are), a real
cpp_extension build in it ignores a stale torch baton and is reused by the next process, and (slow) a build of the
CPU kernels killed mid-compile is recovered by the next process on its own."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canvas.env import KERNEL_CACHE, KERNEL_LOCK_TIMEOUT
from kernels import _cpp
from kernels._build_lock import LOCK_NAME, TORCH_BATON
from kernels._cpp import _HEADERS, _SOURCES, build_dir, build_isa

ROOT = Path(__file__).resolve().parents[2]
TINY = """#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


def _copy_tree(dest: Path) -> tuple[list[Path], list[Path]]:
    dest.mkdir(parents=True)
    for path in (*_SOURCES, *_HEADERS):
        shutil.copy(path, dest / path.name)
    return [dest / p.name for p in _SOURCES], [dest / p.name for p in _HEADERS]


def test_identical_sources_share_a_build_dir_and_changed_ones_do_not(tmp_path: Path) -> None:
    src_a, hdr_a = _copy_tree(tmp_path / "checkout-a" / "kernels")
    src_b, hdr_b = _copy_tree(tmp_path / "elsewhere" / "b")
    root = tmp_path / "cache"
    shared = build_dir("avx2", sources=src_a, headers=hdr_a, root=root)
    assert shared.parent == root and shared.name.startswith("avx2-")
    assert build_dir("avx2", sources=src_b, headers=hdr_b, root=root) == shared
    assert build_dir("avx2", sources=src_b[::-1], headers=hdr_b, root=root) == shared  # order is not content
    assert build_dir("avx2", root=root) == shared  # the installed kernels: the same files
    assert build_dir("scalar", sources=src_a, headers=hdr_a, root=root) != shared  # other flags
    header = hdr_b[0]
    header.write_text(header.read_text() + "\n// changed\n")
    changed = build_dir("avx2", sources=src_b, headers=hdr_b, root=root)
    assert changed != shared and changed.name.startswith("avx2-")
    source = src_b[1]
    source.write_text(source.read_text() + " ")
    assert build_dir("avx2", sources=src_b, headers=hdr_b, root=root) not in (shared, changed)


def test_the_key_covers_every_file_the_sources_include() -> None:
    """A header missing from `_HEADERS` would let an edit to it load the stale .so."""
    hashed = {p.name for p in (*_SOURCES, *_HEADERS)}
    included = {name for path in (*_SOURCES, *_HEADERS)
                for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.MULTILINE)}
    assert included <= hashed, included - hashed
    on_disk = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == hashed  # a new kernel file is built and hashed, or it is dead


def test_a_held_build_lock_makes_the_kernels_fall_back_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """Another process stuck in the build: `extension` gives up after the timeout, says so, and records why."""
    isa = build_isa()
    directory = build_dir(isa, root=tmp_path)
    holder = subprocess.Popen([sys.executable, "-m", "tests.kernels.build_lock_worker", "hold", str(directory), "60"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        monkeypatch.setenv(KERNEL_CACHE.name, str(tmp_path))
        monkeypatch.setenv(KERNEL_LOCK_TIMEOUT.name, "0.3")
        monkeypatch.delitem(_cpp._MODULES, isa, raising=False)
        monkeypatch.delitem(_cpp._ERRORS, isa, raising=False)
        assert _cpp.extension(isa) is None
        error = _cpp.build_error(isa)
        assert error is not None and error.startswith("LockTimeout: gave up after 0.3 s")
        assert str(directory / LOCK_NAME) in error and f"pid {holder.pid}" in error
        err = capfd.readouterr().err
        assert f"dcanvas: waiting for the {isa} CPU kernel build: {directory / LOCK_NAME}" in err
        assert "the CPU kernels fall back to torch's ops" in err
        assert not list(directory.glob("stage-*"))  # it never started building
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def _tiny_process(source: Path, root: Path, name: str, prepare: str = "") -> subprocess.CompletedProcess[str]:
    """A fresh process that loads (building if need be) the tiny extension; `prepare` runs first, with `d` its
    build directory. Fails the test instead of hanging."""
    code = (f"import os\nfrom pathlib import Path\nfrom kernels._cpp import build_dir, load_extension\n"
            f"src, root = [Path({str(source)!r})], Path({str(root)!r})\n"
            f"d = build_dir('scalar', name={name!r}, sources=src, headers=(), root=root)\n{prepare}\n"
            f"print(load_extension({name!r}, src, isa='scalar', headers=(), root=root, timeout_s=30).answer())\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_real_build_ignores_stale_batons_and_is_reused(tmp_path: Path) -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    root = tmp_path / "cache"
    # What a build killed under cpp_extension leaves: its baton, in the directory and in a stage this pid reuses.
    stale = ("d.mkdir(parents=True)\n(d / 'lock').touch()\n"
             "(d / f'stage-{os.getpid()}').mkdir()\n(d / f'stage-{os.getpid()}' / 'lock').touch()")
    first = _tiny_process(source, root, "dcanvas_tiny_build", stale)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "42"
    assert "dcanvas: building the CPU kernels for scalar" in first.stderr and "dcanvas: built" in first.stderr
    (built,) = root.iterdir()
    assert sorted(p.name for p in built.iterdir()) == sorted([LOCK_NAME, "dcanvas_tiny_build.so"])
    again = _tiny_process(source, root, "dcanvas_tiny_build")
    assert again.returncode == 0 and again.stdout.strip() == "42"
    assert "building" not in again.stderr  # loaded as built, no compiler run


def _kill_builds_in(root: Path) -> None:
    """SIGKILL every process working in `root` (ninja runs each compile in a process group of its own, so the
    killed build's orphans are found by their working directory, which cpp_extension sets to the stage)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:  # gone, or not ours to read
            continue
        if cwd.is_relative_to(root):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kernel_build(env: dict[str, str]) -> subprocess.Popen[str]:
    code = "from kernels._cpp import build_error, extension\nm = extension()\nprint(m.isa() if m else build_error())"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.slow
def test_a_killed_kernel_build_is_recovered_by_the_next_process(tmp_path: Path) -> None:
    """`dcanvas serve` killed while it compiled the CPU kernels: its compilers live on in their stage, and the next
    process builds (and loads) the kernels on its own, without waiting on anything the dead one left."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    env = {**os.environ, KERNEL_CACHE.name: str(tmp_path), KERNEL_LOCK_TIMEOUT.name: "60"}
    directory = build_dir(build_isa(), root=tmp_path)
    killed = _kernel_build(env)
    recovery: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 120
        while not list(directory.glob(f"stage-{killed.pid}/build.ninja")):  # cpp_extension has started ninja
            assert killed.poll() is None and time.monotonic() < deadline, "the build did not start"
            time.sleep(0.2)
        time.sleep(3)  # into the compile
        assert (directory / f"stage-{killed.pid}" / TORCH_BATON).exists()  # torch's baton, held
        assert not list(directory.glob("*.so"))
        os.kill(killed.pid, signal.SIGKILL)  # the builder only; ninja and the compilers are orphaned
        killed.wait()
        started = time.monotonic()
        recovery = _kernel_build(env)
        out, err = recovery.communicate(timeout=1200)
        assert recovery.returncode == 0, err
        assert out.strip() == build_isa(), err
        assert "waiting" not in err and "dcanvas: built the CPU kernels" in err, err
        assert list(directory.glob("*.so")) == [directory / f"dcanvas_cpu_kernels_{build_isa()}.so"]
        print(f"recovered in {time.monotonic() - started:.0f} s")
    finally:
        _kill_builds_in(tmp_path)  # the killed build's orphaned compilers; a recovery that failed
        for proc in (killed, recovery):
            if proc is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            if proc.stderr is not None:
                proc.stderr.close()
