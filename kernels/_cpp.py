"""Build and load of the CPU C++ kernels (`q8_gemm.cpp`, `rmsnorm_cpu.cpp`, `attend_cpu.cpp`, `act_cpu.cpp`,
`sample_cpu.cpp`, bound in `_cpp_bindings.cpp`; `cpu_math.h` their shared vector math; `q8_amx.h` the q8 GEMM's AMX
path).

Owns `build_isa` (which instruction-set path this machine compiles), `extension` (the built module, or None),
`build_error`, `build_dir` (where a build lives) and `load_extension` (the build and load of any such source set).
One extension module holds every CPU kernel, so a machine compiles once (~1-2 min with g++ on 2 cores):
`torch.utils.cpp_extension.load` with -O3 and the ISA flags read from /proc/cpuinfo (never -march=native: the
binary must not use instructions this CPU lacks). Each build has its own directory,
`~/.cache/dcanvas/kernels/<isa>-<key>/` (`DCANVAS_KERNEL_CACHE` moves the root), `<key>` a hash of the sources' and
headers' names and contents (never their paths), the flags, the ISA and the torch and Python versions: two
checkouts of the same sources share one build and never rebuild over each other, and a changed source gets a new
directory instead of a stale .so. A built directory's .so is loaded directly (no compiler, no lock); a missing one is
built under `kernels._build_lock` (a flock that dies with its holder, a stage per builder, a timeout whose message
says who holds the lock), with a line on stderr before the build and while waiting for another process's build.
A missing compiler or a failed build is not an error here: `extension` returns None and records why, and each op's
"auto" falls back to its torch reference with one warning.

Threads: the kernels use `at::parallel_for`, which in torch's CPU wheels is OpenMP; the module is compiled with
-fopenmp and links libgomp.so.1, which the loader resolves to the copy torch already loaded: one thread pool.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Literal

from canvas.env import KERNEL_CACHE, Q8_ISA
from kernels._build_lock import LockTimeout, build_once

__all__ = ["build_dir", "build_error", "build_isa", "cflags", "extension", "load_extension"]

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "_cpp_bindings.cpp", _HERE / "q8_gemm.cpp", _HERE / "rmsnorm_cpu.cpp", _HERE / "attend_cpu.cpp",
            _HERE / "act_cpu.cpp", _HERE / "sample_cpu.cpp"]
_HEADERS = [_HERE / "cpu_math.h", _HERE / "q8_amx.h"]  # `#include "..."`d by the sources: part of the build key
_LDFLAGS = ["-fopenmp"]
_BUILD_CPU_S = 240  # compiler CPU-seconds of a full build (6 translation units, on a 2020s x86 core), for the notice

# Compiler flags per instruction-set path, and the /proc/cpuinfo flags each needs; widest first.
_ISA_FLAGS: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx512_vnni": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma"],
                    frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma"})),
    "avx2": (["-mavx2", "-mfma"], frozenset({"avx2", "fma"})),
    "scalar": ([], frozenset()),
}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def build_isa() -> str:
    """The instruction-set path this machine builds: `DCANVAS_Q8_ISA` if set (must be one the CPU runs), else the
    widest of avx512_vnni, avx2, scalar that /proc/cpuinfo lists."""
    flags = _cpu_flags()
    forced = Q8_ISA.word()  # tests force each path the CPU can run
    if forced:
        if forced not in _ISA_FLAGS:
            raise ValueError(f"{Q8_ISA} must be one of {tuple(_ISA_FLAGS)}, got {forced!r}")
        missing = _ISA_FLAGS[forced][1] - flags
        if missing:
            raise ValueError(f"{Q8_ISA}={forced} needs CPU flags this machine lacks: {sorted(missing)}")
        return forced
    return next(isa for isa, (_, need) in _ISA_FLAGS.items() if need <= flags)


def cflags(isa: str) -> list[str]:
    """The compiler flags of the `isa` build."""
    return ["-O3", "-fopenmp", *_ISA_FLAGS[isa][0]]


def _cache_root() -> Path:
    return Path(KERNEL_CACHE.get() or Path.home() / ".cache" / "dcanvas" / "kernels")


def _build_key(name: str, files: Sequence[Path], compile_flags: Sequence[str], link_flags: Sequence[str]) -> str:
    """16 hex digits of sha256 over everything the .so depends on but its directory: the module name, each file's
    name and contents (sorted by name, so the order sources are listed in does not matter), the flags, and the torch
    and Python builds it links against. Paths are left out on purpose: a second checkout must reuse the build."""
    import torch

    h = hashlib.sha256()

    def part(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two part lists hash alike
        h.update(data)

    for text in (name, torch.__version__, sys.implementation.cache_tag, str(torch._C._GLIBCXX_USE_CXX11_ABI),
                 os.environ.get("CXX", "c++"), *compile_flags, "--", *link_flags):
        part(text.encode())
    for path in sorted(files, key=lambda p: p.name):
        part(path.name.encode())
        part(path.read_bytes())
    return h.hexdigest()[:16]


def build_dir(isa: str, *, name: str | None = None, sources: Sequence[Path] = tuple(_SOURCES),
              headers: Sequence[Path] = tuple(_HEADERS), root: Path | None = None) -> Path:
    """The directory of the `isa` build of `sources` (+ the `headers` they include): `<root>/<isa>-<key>`."""
    name = name or f"dcanvas_cpu_kernels_{isa}"
    key = _build_key(name, [*sources, *headers], cflags(isa), _LDFLAGS)
    return (root or _cache_root()) / f"{isa}-{key}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _import(path: Path, name: str) -> ModuleType:
    """The extension module at `path` (as cpp_extension imports it; torch first, whose libraries it links)."""
    import torch  # noqa: F401 - loads libtorch, which the .so resolves its symbols against

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None  # noqa: S101 - a path and a loader always make a spec
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def load_extension(name: str, sources: Sequence[Path], *, isa: str, headers: Sequence[Path],
                   root: Path | None = None, timeout_s: float | None = None,
                   say: Callable[[str], None] = _stderr) -> ModuleType:
    """The extension `name` compiled from `sources` (which include `headers`) for `isa`: loaded from `build_dir`
    where it was built, else built there first (a line through `say` before, one after; waiting, as
    `kernels._build_lock` says, for another process that builds it now). `name` must be new to this process.
    Raises what the build raises."""
    from torch.utils import cpp_extension

    directory = build_dir(isa, name=name, sources=sources, headers=headers, root=root)
    artifact = f"{name}.so"

    def build(stage: Path) -> ModuleType:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        guess = max(10, round(_BUILD_CPU_S * len(sources) / len(_SOURCES) / min(cores, len(sources))))
        say(f"dcanvas: building the CPU kernels for {isa} (once per machine and kernel version, ~{guess} s) "
            f"in {directory}...")
        start = time.monotonic()
        mod = cpp_extension.load(name=name, sources=[str(s) for s in sources], build_directory=str(stage),
                                 extra_cflags=cflags(isa), extra_ldflags=_LDFLAGS, verbose=False)
        if Path(mod.__file__ or "").name != artifact:  # cpp_extension renames a second build of one name (name_v1)
            raise RuntimeError(f"cpp_extension built {mod.__file__}, not {artifact}: {name} was built before in "
                               f"this process")
        say(f"dcanvas: built the CPU kernels for {isa} in {time.monotonic() - start:.0f} s")
        return mod

    mod = build_once(directory, artifact, build, lambda path: _import(path, name),
                     what=f"the {isa} CPU kernel build", timeout_s=timeout_s, say=say)
    mod.__file__ = str(directory / artifact)  # a fresh build was imported from its stage, since moved here
    return mod


_MODULES: dict[str, ModuleType | None] = {}
_ERRORS: dict[str, str] = {}
_BUILDING = threading.Lock()  # one build per process at a time; other processes wait on the file lock


def extension(isa: str | None = None) -> ModuleType | None:
    """The built module for `isa` (default `build_isa()`), building it on first use; None where it cannot be
    built (`build_error` says why)."""
    isa = build_isa() if isa is None else isa
    if isa in _MODULES:  # every op call asks: no lock once it is settled
        return _MODULES[isa]
    with _BUILDING:
        if isa in _MODULES:
            return _MODULES[isa]
        mod: ModuleType | None = None
        try:
            mod = load_extension(f"dcanvas_cpu_kernels_{isa}", _SOURCES, isa=isa, headers=_HEADERS)
        except Exception as e:  # noqa: BLE001 - any build failure means "not available"; the ops' "auto" reports it
            lines = str(e).strip().splitlines()
            _ERRORS[isa] = f"{type(e).__name__}: {lines[-1] if lines else ''}"
            if isinstance(e, LockTimeout):  # the waiting lines were on stderr: so is their end
                _stderr(f"dcanvas: {e}; the CPU kernels fall back to torch's ops")
        _MODULES[isa] = mod
        return mod


def build_error(isa: str | None = None) -> str | None:
    """Why `extension(isa)` is None (None when it built or was not tried)."""
    return _ERRORS.get(build_isa() if isa is None else isa)


_WARNED: set[str] = set()  # the kernels whose fallback has been reported (once per process each)


def auto_impl(eligible: bool, built: bool, what: str) -> Literal["cpp", "ref"]:
    """What an op's `impl="auto"` runs: "cpp" where the call can take the built kernel (`eligible`: no gradient
    wanted, dtypes and device it handles) and it built, else "ref"; where only the build stands in the way, warns
    once per kernel (`what` names it) with the reason, so a machine without g++ runs on, slower, and says so."""
    if eligible and built:
        return "cpp"
    if eligible and what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"{what} unavailable ({build_error()}); using the torch reference", RuntimeWarning,
                      stacklevel=3)
    return "ref"
