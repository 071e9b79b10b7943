"""Build and load of the CPU C++ kernels (`q8_gemm.cpp`, `rmsnorm_cpu.cpp`, `attend_cpu.cpp`, `act_cpu.cpp`,
`sample_cpu.cpp`, bound in `_cpp_bindings.cpp`; `cpu_math.h` their shared vector math; `q8_amx.h` the q8 GEMM's AMX
path).

Owns `build_isa` (which instruction-set path this machine compiles), `extension` (the built module, or None) and
`build_error`. One extension module holds every CPU kernel, so a machine compiles once (~40 s with g++ on 2 cores):
`torch.utils.cpp_extension.load` with -O3 and the ISA flags read from /proc/cpuinfo (never -march=native: the
binary must not use instructions this CPU lacks, and the cache is per ISA), cached under ~/.cache/dcanvas/kernels
(`DCANVAS_KERNEL_CACHE` moves it); later processes load the cached .so, and cpp_extension rebuilds when a source
changes. A missing compiler or a failed build is not an error here: `extension` returns None and records why, and
each op's "auto" falls back to its torch reference with one warning.

Threads: the kernels use `at::parallel_for`, which in torch's CPU wheels is OpenMP; the module is compiled with
-fopenmp and links libgomp.so.1, which the loader resolves to the copy torch already loaded: one thread pool.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Literal

__all__ = ["ISA_ENV", "build_error", "build_isa", "extension"]

ISA_ENV = "DCANVAS_Q8_ISA"  # force "avx512_vnni", "avx2" or "scalar" (tests build each path the CPU can run)
_HERE = Path(__file__).parent
_SOURCES = [_HERE / "_cpp_bindings.cpp", _HERE / "q8_gemm.cpp", _HERE / "rmsnorm_cpu.cpp", _HERE / "attend_cpu.cpp",
            _HERE / "act_cpu.cpp", _HERE / "sample_cpu.cpp"]

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
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in _ISA_FLAGS:
            raise ValueError(f"{ISA_ENV} must be one of {tuple(_ISA_FLAGS)}, got {forced!r}")
        missing = _ISA_FLAGS[forced][1] - flags
        if missing:
            raise ValueError(f"{ISA_ENV}={forced} needs CPU flags this machine lacks: {sorted(missing)}")
        return forced
    return next(isa for isa, (_, need) in _ISA_FLAGS.items() if need <= flags)


_MODULES: dict[str, ModuleType | None] = {}
_ERRORS: dict[str, str] = {}


def extension(isa: str | None = None) -> ModuleType | None:
    """The built module for `isa` (default `build_isa()`), building it on first use; None where it cannot be
    built (`build_error` says why)."""
    isa = build_isa() if isa is None else isa
    if isa in _MODULES:
        return _MODULES[isa]
    mod: ModuleType | None = None
    try:
        from torch.utils import cpp_extension

        name = f"dcanvas_cpu_kernels_{isa}"
        root = Path(os.environ.get("DCANVAS_KERNEL_CACHE", Path.home() / ".cache" / "dcanvas" / "kernels"))
        build = root / name
        build.mkdir(parents=True, exist_ok=True)
        mod = cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], build_directory=str(build),
                                 extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS[isa][0]], extra_ldflags=["-fopenmp"],
                                 verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means "not available"; the ops' "auto" reports it
        lines = str(e).strip().splitlines()
        _ERRORS[isa] = f"{type(e).__name__}: {lines[-1] if lines else ''}"
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
