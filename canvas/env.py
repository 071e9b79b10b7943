"""Every `DCANVAS_*` environment variable the project reads, in one place: each is an `EnvVar` below with its name,
what it means, its default (what unset means) and the modules that read it. A reader imports the variable's
`EnvVar` from here and asks it for the value (`get`, `text`, `word`); nothing else spells a variable's name.

- kernels: `DCANVAS_KERNELS` (Triton or the references), `DCANVAS_Q8_ISA` (the C++ build's instruction set),
  `DCANVAS_KERNEL_CACHE` (where the C++ builds live), `DCANVAS_KERNEL_LOCK_TIMEOUT` (the wait for another's build),
  `DCANVAS_Q8_AMX` (AMX tiles off; read by the C++ kernel itself);
- the model: `DCANVAS_DTYPE`, `DCANVAS_DECODE_INT8`, `DCANVAS_DECODE_COMPILE`;
- which model, and where models live: `DCANVAS_MODEL`, `DCANVAS_CACHE`, `DCANVAS_DECODER_ADAPTERS`;
- serving: `DCANVAS_TOKEN`, `DCANVAS_STORE_FAULTS` (soak tests only), `DCANVAS_PG_BIN`.
The test suite's own switches (`DCANVAS_FUZZ_EXAMPLES`, `DCANVAS_WEB_MODEL`, `DCANVAS_CHROMIUM`, `DCANVAS_ARTIFACTS`,
`DCANVAS_KERNEL_TESTS_DELEGATED`) are read and documented in tests/, where they are used.

Invariants: a value is read from `os.environ` each time it is asked for, never kept at import, so that a variable
set later in the process (a trainer's `DCANVAS_KERNELS=ref`, a test's `monkeypatch.setenv`) holds from then on. What
a value means in detail, and how a bad one is refused, stays with its reader: this module names, documents and reads.
It sits at layer 0 beside the face and imports nothing of the project, so that every layer, `kernels` included,
may read it. `tests/canvas/test_env.py` holds this list to `VARIABLES` and to the names the source mentions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["CACHE", "DECODER_ADAPTERS", "DECODE_COMPILE", "DECODE_INT8", "DTYPE", "KERNELS", "KERNEL_CACHE",
           "KERNEL_LOCK_TIMEOUT", "MODEL", "PG_BIN", "Q8_AMX", "Q8_ISA", "STORE_FAULTS", "TOKEN", "VARIABLES", "EnvVar"]


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One environment variable: `name` as set in the shell, `meaning`, `default` (what leaving it unset does) and
    `readers` (where it is read; a C++ file reads it itself)."""

    name: str
    meaning: str
    default: str
    readers: tuple[str, ...]

    def get(self) -> str | None:
        """The value as set, None where unset (an empty value is "")."""
        return os.environ.get(self.name)

    def text(self) -> str:
        """The value without surrounding whitespace; "" where unset."""
        return os.environ.get(self.name, "").strip()

    def word(self) -> str:
        """The value stripped and lower-cased, for the variables that take a word (`on`, `ref`, ...); "" where unset."""
        return self.text().lower()

    def __str__(self) -> str:
        return self.name


# ---- kernels -------------------------------------------------------------------------------------------------------
KERNELS = EnvVar(
    "DCANVAS_KERNELS", "`triton` or `ref`: what an op's impl='auto' resolves to, for the whole process",
    "`auto`: Triton on CUDA, the torch reference elsewhere (and whenever an input requires grad)",
    ("kernels._triton.resolve_impl", "set to `ref` by the trainers: the Triton kernels have no backward"))
Q8_ISA = EnvVar(
    "DCANVAS_Q8_ISA", "`avx512_vnni`, `avx2` or `scalar`: the C++ kernels' instruction-set build (one the CPU runs)",
    "the widest of the three that /proc/cpuinfo lists", ("kernels._cpp.build_isa",))
KERNEL_CACHE = EnvVar(
    "DCANVAS_KERNEL_CACHE", "the root of the C++ kernels' build directories", "`~/.cache/dcanvas/kernels`",
    ("kernels._cpp.build_dir",))
KERNEL_LOCK_TIMEOUT = EnvVar(
    "DCANVAS_KERNEL_LOCK_TIMEOUT", "seconds a process waits for another's kernel build before `LockTimeout`",
    "600 (`kernels._build_lock.DEFAULT_LOCK_TIMEOUT_S`)", ("kernels._build_lock.lock_timeout_s",))
Q8_AMX = EnvVar(
    "DCANVAS_Q8_AMX", "`off`: the q8 GEMM never runs on AMX tiles (the same output, another speed)",
    "AMX where the CPU has it and the OS grants it", ("kernels/q8_amx.h (C++, once per process)",))

# ---- the model -----------------------------------------------------------------------------------------------------
DTYPE = EnvVar(
    "DCANVAS_DTYPE", "`fp32`, `bf16` or `auto`: the dtype of a served model whose caller asks for 'auto'",
    "`auto`: the rule of `canvas.model.cpu` (small models and decoding ones stay fp32)",
    ("canvas.model.cpu.resolve_dtype",))
DECODE_INT8 = EnvVar(
    "DCANVAS_DECODE_INT8", "`off`, `weight`, `dynamic`, `q8` or `auto`: the int8 weights of the AR decode steps",
    "`auto`: q8 (else weight) for fp32 models of 50M parameters or more, none for smaller ones",
    ("canvas.model.int8.decode_scheme", "canvas.model.int8.scheme_for"))
DECODE_COMPILE = EnvVar(
    "DCANVAS_DECODE_COMPILE", "`on` or `off`: the AR decode step goes through torch.compile", "`off`",
    ("canvas.model.decode.compile_setting",))

# ---- which model, and where models live ----------------------------------------------------------------------------
MODEL = EnvVar(
    "DCANVAS_MODEL", "`embedded` or a model directory: what a command serves when --model is not given",
    "the built Gemma-3-270M conversion, else the embedded canvas-6m",
    ("canvas.convert.resolve.resolve_model", "set to `embedded` by the test suite (tests/conftest.py)"))
CACHE = EnvVar(
    "DCANVAS_CACHE", "where `dcanvas model build` keeps what it builds",
    "`$XDG_CACHE_HOME/dcanvas`, else `~/.cache/dcanvas`",
    ("canvas.convert.build.cache_root",))
DECODER_ADAPTERS = EnvVar(
    "DCANVAS_DECODER_ADAPTERS", "a gap-denoise adapter directory to serve instead of the model's, or `off`",
    "the model directory's `decoder_adapters/`, where it holds an adapter set",
    ("canvas.engine.backend.resolve_decoder_adapters",))

# ---- serving -------------------------------------------------------------------------------------------------------
TOKEN = EnvVar(
    "DCANVAS_TOKEN", "the shared secret a server asks for, and that its clients send", "none (no token)",
    ("canvas.server (dcanvas serve --token)", "canvas.eval.remote", "canvas.bench.load", "canvas.bench.typing",
     "canvas.bench.http", "tui.app"))
STORE_FAULTS = EnvVar(
    "DCANVAS_STORE_FAULTS", "a fault-control file: `dcanvas serve` wraps its store in one that fails on purpose "
    "(soak tests only)", "none: the plain store", ("canvas.server.faults.from_env", "set by canvas.soak.server"))
PG_BIN = EnvVar(
    "DCANVAS_PG_BIN", "the directory of initdb, pg_ctl and postgres", "`PATH`, then Debian's /usr/lib/postgresql/N/bin",
    ("canvas.store.pgserver",))

VARIABLES: tuple[EnvVar, ...] = (KERNELS, Q8_ISA, KERNEL_CACHE, KERNEL_LOCK_TIMEOUT, Q8_AMX, DTYPE, DECODE_INT8,
                                 DECODE_COMPILE, MODEL, CACHE, DECODER_ADAPTERS, TOKEN, STORE_FAULTS, PG_BIN)
