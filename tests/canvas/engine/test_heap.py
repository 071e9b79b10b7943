"""`canvas.engine.heap.Trimmer`: at most one trim per interval, on a fake clock; the real glibc trim (where there is
one) is harmless to live tensors."""

from __future__ import annotations

import platform

import pytest
import torch

from canvas.engine.heap import Trimmer


def test_trims_at_most_once_per_interval() -> None:
    now = [100.0]
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    t = Trimmer(10.0, clock=lambda: now[0], trim=trim)
    assert t.maybe() and calls == [0]
    for dt in (1.0, 5.0, 9.9):
        now[0] = 100.0 + dt
        assert not t.maybe()
    now[0] = 110.0
    assert t.maybe() and t.calls == 2 and calls == [0, 0]
    with pytest.raises(ValueError):
        Trimmer(-1)


def test_without_glibc_it_does_nothing() -> None:
    t = Trimmer(0.0, trim=None)
    t._trim = None  # as on musl or macOS
    assert not t.available and not t.maybe() and t.calls == 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_real_trim_keeps_live_tensors() -> None:
    t = Trimmer(0.0)
    assert t.available
    keep = torch.arange(1 << 16, dtype=torch.float32)
    junk = [torch.ones(1 << k) for k in range(10, 20)]
    del junk
    assert t.maybe() and t.maybe()  # interval 0: every call trims
    torch.testing.assert_close(keep, torch.arange(1 << 16, dtype=torch.float32))
