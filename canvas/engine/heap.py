"""Giving the allocator's free pages back to the OS, at most every so often (glibc's `malloc_trim`).

Owns `Trimmer`: an engine allocates and frees tensors of many sizes on several threads (restored caches, encode
activations); glibc keeps what is freed in per-thread arenas, and pages in the middle of an arena stay resident
(counted in RSS) until `malloc_trim(0)` hands them back. `Trimmer.maybe()` calls it when `interval_s` has passed
since the last call, so a steady server pays one trim (a few ms) per interval, not one per request. Elsewhere than
glibc (musl, macOS) it does nothing: `available` is False.

Invariant: trimming only returns free memory; it never changes what any live allocation holds, so calling it at
any time from any thread is harmless.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0


def _glibc_trim() -> Callable[[int], int] | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class Trimmer:
    """Rate-limited `malloc_trim(0)`. `clock` and `trim` are for tests."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, *, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._trim = trim if trim is not None else _glibc_trim()
        self._lock = threading.Lock()
        self._last: float | None = None
        self.calls = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe(self) -> bool:
        """Trim if `interval_s` has passed since the last trim (or there was none); whether it did."""
        if self._trim is None:
            return False
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last < self.interval_s:
                return False
            self._last = now
            self.calls += 1
        self._trim(0)  # outside our lock: glibc takes its own arena locks
        return True


TRIMMER = Trimmer()  # the process's: trimming is process-wide, so every cache shares one rate limit
