"""What the CPU is good at: the compute dtype and the thread count a served model runs with, chosen at run time.

Owns `cpu_features` (the flags of /proc/cpuinfo that decide the dtype), `cpu_kind`, `bf16_probe` (a one-off
matmul timing, cached per process), `resolve_dtype` (with `parameter_count` for its small-model rule),
`usable_cores` / `configure_threads`, `release_openmp_pool` (one OpenMP team for the engine's thread), and
`configure_allocator` (glibc keeps large freed blocks for reuse).

Rule for `dtype="auto"` (nothing is assumed, everything is read or measured):
- bf16 only on a CPU with native bf16 matmuls (AMX `amx_bf16`, x86 `avx512_bf16`, Arm `bf16`) *and* where the probe
  measures bf16 faster than fp32; elsewhere fp32 (AVX2-only CPUs emulate bf16 GEMMs, ~250x slower than fp32);
- fp32 for models under `AUTO_BF16_MIN_PARAMS` parameters: they step in milliseconds in either dtype (the embedded
  canvas-6m included), so bf16's rounding buys nothing that matters, and fp32 keeps their results (the embedded
  model's sampler defaults were tuned in fp32; the tiny random test models) the same on every machine;
- fp32 for a model that decodes left to right by default (`decodes`: its default modes are AR) where the q8 decode
  kernel builds: its one-token steps then run the fp32 path's fused kernels with q8 weights, which the bf16 path
  has no counterpart of. On an AMX CPU that makes the AR step several times faster than bf16's, although bf16 GEMMs
  beat fp32's there; prefill and the diffusion decoder lose a little speed, which a one-token-a-step infill never
  makes up for (BENCHMARKS.md, "The served dtype on a bf16 CPU").
`DCANVAS_DTYPE=fp32|bf16|auto` overrides "auto" process-wide; an explicit "fp32"/"bf16" argument wins over it (as
`DCANVAS_KERNELS` does for kernels). Only callers that serve a model ask for "auto" (`load_backend`): the loaders
default to fp32, so parity tests and every comparison against transformers stay fp32.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from canvas.env import DTYPE
from kernels import q8_gemm

if TYPE_CHECKING:
    from canvas.model.config import ModelConfig

DtypeChoice = Literal["auto", "fp32", "bf16"]
CpuKind = Literal["amx", "avx512_bf16", "arm_bf16", "avx2", "other"]
# Below this many parameters "auto" stays fp32 (see the module docstring); the converted Gemma-3-270M has 268M,
# the embedded canvas-6m 6M.
AUTO_BF16_MIN_PARAMS = 50_000_000
# bf16 must beat fp32 by this factor on the probe: a margin against timing noise on a shared machine.
_PROBE_MARGIN = 0.8
_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX-512 BF16, Arm (the `Features` line)
_KNOWN_FLAGS = (*_BF16_FLAGS, "amx_tile", "avx512f", "avx2", "fma")


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of `_KNOWN_FLAGS` the CPU reports (from `cpuinfo` text, or /proc/cpuinfo; empty where unreadable,
    e.g. macOS, which then counts as "other" and runs fp32)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            return frozenset(value.split()) & frozenset(_KNOWN_FLAGS)
    return frozenset()


def cpu_kind(features: frozenset[str] | None = None) -> CpuKind:
    """The CPU class that decides bf16: "amx" / "avx512_bf16" / "arm_bf16" (native bf16 matmuls), "avx2" (fp32 SIMD
    only), "other"."""
    f = cpu_features() if features is None else features
    if "amx_bf16" in f:
        return "amx"
    if "avx512_bf16" in f:
        return "avx512_bf16"
    if "bf16" in f:
        return "arm_bf16"
    return "avx2" if "avx2" in f else "other"


@dataclass(frozen=True, slots=True)
class Probe:
    """One timing of the same GEMM in fp32 and bf16 (best of a few repeats each, at the current thread count)."""

    fp32_s: float
    bf16_s: float

    @property
    def bf16_faster(self) -> bool:
        return self.bf16_s < _PROBE_MARGIN * self.fp32_s


@functools.cache
def bf16_probe() -> Probe:
    """Time x (64, 1024) @ w.T (2048, 1024), the size of a decoder projection: ~0.3 GFLOP, a few ms in all.

    Cached per process. Call it only where `cpu_kind` reports native bf16: an AVX2-only CPU would spend seconds."""
    g = torch.Generator().manual_seed(0)
    x32, w32 = torch.randn(64, 1024, generator=g), torch.randn(2048, 1024, generator=g)
    best: dict[torch.dtype, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = x32.to(dtype), w32.to(dtype)
        F.linear(x, w)  # warm-up: first-call packing and thread-pool start
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            F.linear(x, w)
            times.append(time.perf_counter() - t0)
        best[dtype] = min(times)  # the least-disturbed run: other processes only ever add time
    return Probe(best[torch.float32], best[torch.bfloat16])


def prefers_bf16() -> bool:
    """Whether this CPU runs bf16 GEMMs natively and measurably faster than fp32."""
    return cpu_kind() in ("amx", "avx512_bf16", "arm_bf16") and bf16_probe().bf16_faster


def resolve_dtype(choice: DtypeChoice | str = "auto", *, params: int | None = None,
                  decodes: bool = False) -> torch.dtype:
    """The torch dtype for `choice`; "auto" reads `DCANVAS_DTYPE`, then decides by the rule of the module docstring
    (`params`: the model's parameter count, for the small-model rule, None skips it; `decodes`: the model's default
    modes decode left to right, for the decode rule)."""
    if choice not in ("auto", *_DTYPES):
        raise ValueError(f"dtype must be 'auto', 'fp32' or 'bf16', got {choice!r}")
    if choice == "auto":
        env = DTYPE.word() or "auto"
        if env not in ("auto", *_DTYPES):
            raise ValueError(f"{DTYPE} must be 'fp32', 'bf16' or 'auto', got {env!r}")
        choice = env
    if choice != "auto":
        return _DTYPES[choice]
    if params is not None and params < AUTO_BF16_MIN_PARAMS:
        return torch.float32
    if decodes and q8_gemm.available():  # builds the kernel on the first call
        return torch.float32
    return torch.bfloat16 if prefers_bf16() else torch.float32


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a model of `config`, from its shapes alone (built on the meta device: no memory)."""
    from canvas.model.model import DiffusionModel

    with torch.device("meta"):
        return sum(p.numel() for p in DiffusionModel(config, init=False).parameters())


def dtype_name(dtype: torch.dtype) -> str:
    return next((k for k, v in _DTYPES.items() if v == dtype), str(dtype).removeprefix("torch."))


# ---- allocator ------------------------------------------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
_KEEP_BELOW = 1 << 30  # blocks under 1 GiB come from (and go back to) the heap


@functools.cache
def configure_allocator() -> bool:
    """Keep freed large blocks in glibc's heap for reuse instead of unmapping them: a step's vocabulary-sized
    temporaries (a (32, 262144) fp32 logits block is 33 MB) are otherwise mmapped afresh on every allocation and
    page-faulted in, and those faults, not the arithmetic, were most of a CPU sampler step over such a block. The
    cost: the process keeps its peak heap (it no longer returns it to the OS). Once per process; False
    where the C library has no `mallopt` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BELOW)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


# ---- threads --------------------------------------------------------------------------------------------------------
def _core_of(cpu: int) -> tuple[int, int] | int:
    """(package, core) of a logical CPU, so SMT siblings count once; the CPU itself where sysfs does not say."""
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())
    except (OSError, ValueError):
        return cpu


def _cgroup_cpu_limit() -> int | None:
    """CPUs a cgroup v2 quota allows (`cpu.max`: "quota period", or "max"), rounded up; None without a quota."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def usable_cores() -> int:
    """Physical cores this process may run on: its CPU affinity (`os.sched_getaffinity`), SMT siblings counted once
    (GEMM threads on two siblings of one core contend for the same FMA units), capped by a cgroup CPU quota."""
    try:
        cpus: set[int] = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not on Linux
        cpus = set(range(os.cpu_count() or 1))
    cores = len({_core_of(c) for c in cpus})
    limit = _cgroup_cpu_limit()
    return max(1, min(cores, limit) if limit is not None else cores)


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (libgomp's `omp_pause_resource_all`), so that the next thread to
    run torch's parallel ops owns the only team. Returns whether a libgomp pool could be released (False where torch
    runs no libgomp: another OpenMP runtime, or not Linux).

    Why: libgomp counts every worker of every thread's team, and once they outnumber the CPUs it stops spinning in its
    barriers (100 spins, then a futex sleep and wake-up per parallel region). A server loads its model on one thread
    and steps it on another, so with 2 threads on 2 cores both teams live and every one of a decode step's hundreds of
    parallel regions pays a sleep and a wake: 17-24 ms an AR step against 12-16 ms with one team (the EPYC, the
    default build, a 257-token context, the process at real-time priority to stand in for an idle machine; issue 52).
    A thread that runs torch again after this gets a new pool (correct, only slower: both teams live again).
    The price of spinning: where other processes oversubscribe the cores, a thread spinning at a barrier waits out
    the time slices of a worker that is not running, as llama.cpp's threads do (the same A/B with a load average of
    6-8: 37-56 ms a step throttled, 143-420 ms spinning); so `dcanvas` caps the spin at 1,000 rounds before a
    barrier sleeps (`canvas.cli.GOMP_SPINCOUNT`, with its measurements), which keeps both speeds."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]), None)
    except OSError:
        return False
    if path is None:
        return False
    import ctypes

    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all  # OpenMP 5.0 (GCC >= 9)
    except (OSError, AttributeError):
        return False
    pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
    return pause(_OMP_PAUSE_SOFT) == 0


_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: soft pause frees the threads, keeps nothing the next region needs


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads`, or to `usable_cores()` when None; returns the count set."""
    n = usable_cores() if threads is None else threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
