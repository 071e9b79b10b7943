"""The context cache's page arena (`canvas.engine.block_pool`): what is written reads back (whole and partial
pages, logits), freed pages are reused without growing the arena, and a pool never hands out more than its budget."""

from __future__ import annotations

import pytest
import torch

from canvas.engine.block_pool import PagePool, page_positions

SHAPES = [(2, 4), (1, 8)]  # (kv heads, head dim) of two layers


def pool(pages: int, page: int = 4, vocab: int = 50) -> PagePool:
    probe = PagePool(SHAPES, vocab, page, 0)
    return PagePool(SHAPES, vocab, page, pages * probe.page_bytes)


def test_page_positions_divide_the_block() -> None:
    assert page_positions(64) == 8 and page_positions(48) == 8 and page_positions(60) == 6
    assert page_positions(7) == 7 and page_positions(3) == 3 and page_positions(1) == 1


def test_written_positions_read_back_across_pages() -> None:
    p = pool(6)
    assert p.page_bytes == (2 * 2 * 4 * 4 + 2 * 1 * 4 * 8) * 4  # keys and values of 4 positions, both layers, fp32
    pages = p.take(3)
    assert pages is not None
    src = [torch.randn(h, 10, d) for h, d in SHAPES]  # 10 positions: two whole pages and half of a third
    for i, t in enumerate(src):
        p.write(pages, i, False, t)
        p.write(pages, i, True, -t)
    for i, t in enumerate(src):
        torch.testing.assert_close(p.read(pages, i, False, 0, 10), t, rtol=0, atol=0)
        torch.testing.assert_close(p.read(pages, i, True, 3, 9), -t[:, 3:9], rtol=0, atol=0)
    logits = torch.randn(50)
    lp = p.take(p.logit_pages)
    assert lp is not None
    p.write_logits(lp, logits)
    torch.testing.assert_close(p.read_logits(lp), logits, rtol=0, atol=0)


def test_freed_pages_are_reused_first_and_the_arena_never_grows() -> None:
    p = pool(4)
    a = p.take(2)
    assert a is not None
    arena = p._arena
    assert arena is not None
    ptr = arena.data_ptr()
    p.free(a)
    b = p.take(2)
    assert b is not None and sorted(b) == sorted(a)  # last in, first out: the written pages stay the hot ones
    assert p.take(3) is None and p.used == 2  # more than the budget holds: refused, nothing taken
    c = p.take(2)
    assert c is not None and p.free_pages == 0 and p.used == 4
    for _ in range(100):  # churn: take and free in varied sizes, as evictions do
        p.free(c)
        c = p.take(1 + len(c) % 2)
        assert c is not None
    assert p._arena is arena and arena.data_ptr() == ptr
    p.reset()
    assert p.used == 0 and p.free_pages == 4


def test_a_pool_with_no_budget_allocates_nothing() -> None:
    p = pool(0)
    assert p.take(1) is None and p._arena is None
    with pytest.raises(ValueError):
        PagePool([], 10, 4, 100)
