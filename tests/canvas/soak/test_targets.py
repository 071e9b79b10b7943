"""The soak's flatness judgement (issue 47): growth is what is judged, not shrinkage; an engine replica is judged
from the time its bounded context cache is full, its raw growth still reported; a leak is caught either way."""

from __future__ import annotations

from canvas.soak.targets import FLAT, processes, targets


def _series(rss: list[float], step: float = 10.0) -> list[tuple[float, float, float]]:
    return [(i * step, r, 40.0) for i, r in enumerate(rss)]


def _ramp(a: float, b: float, n: int) -> list[float]:
    return [a + (b - a) * i / (n - 1) for i in range(n)]


def test_a_process_that_shrank_did_not_grow() -> None:
    procs = processes({"postgres:1": _series([28.7] * 40 + [23.0] * 40)})  # 790 s, -20%
    p = procs["postgres:1"]
    assert p["judged"] and p["rss_growth"] < -0.1 and p["flat"] is True
    assert targets([], [], None, procs)["flat_rss_and_fds"]["held"]


def test_a_process_that_keeps_growing_is_caught() -> None:
    p = processes({"ingress#1": _series(_ramp(700, 1000, 80))})["ingress#1"]
    assert p["judged"] and p["rss_growth"] > FLAT and p["flat"] is False


def test_a_replica_is_judged_from_when_its_context_cache_is_full() -> None:
    # RSS grows with the cache for 800 s (to its 512 MiB budget), then stays: growth to a bound, flat after it.
    rss = _ramp(1800, 2800, 81) + [2800.0] * 60
    fill = [(t, min(512.0, 512.0 * t / 800), 512.0) for t, _, _ in _series(rss)]
    p = processes({"replica:7": _series(rss)}, {"replica:7": fill})["replica:7"]
    assert p["rss_growth"] > FLAT  # the raw figure stays in the report
    assert p["judged"] and p["flat"] is True and p["cache_full_at_s"] == 720.0
    assert p["judged_from_s"] == 720.0 and abs(p["rss_growth_after_cache_full"]) < FLAT / 2


def test_a_replica_leaking_after_its_cache_is_full_is_caught() -> None:
    rss = _ramp(1800, 2800, 81) + _ramp(2800, 3600, 60)
    fill = [(t, min(512.0, 512.0 * t / 800), 512.0) for t, _, _ in _series(rss)]
    p = processes({"replica:7": _series(rss)}, {"replica:7": fill})["replica:7"]
    assert p["judged"] and p["flat"] is False and p["rss_growth_after_cache_full"] > FLAT
    assert targets([], [], None, {"replica:7": p})["flat_rss_and_fds"]["grew"] == ["replica:7"]


def test_a_replica_whose_cache_never_filled_is_reported_not_judged() -> None:
    rss = _ramp(1800, 2300, 82)  # 810 s, still growing with its cache (300 of 512 MiB at the end)
    fill = [(t, 300.0 * t / 810, 512.0) for t, _, _ in _series(rss)]
    p = processes({"replica:8": _series(rss)}, {"replica:8": fill})["replica:8"]
    assert p["judged"] is False and p["flat"] is None and "still filling" in p["why"]
    assert p["rss_growth"] > FLAT and p["rss_growth_net_of_cache"] < p["rss_growth"]
