"""Admission control below the server: the fair queue's order and positions, the engine's queue (round-robin across
owners, cancelled and superseded requests leaving at once, refusals that change nothing), and the bound, configured
or sized from the measured load."""

from __future__ import annotations

import random

import pytest
import torch

from canvas.engine.core import Done, Engine, Event, GenRequest
from canvas.engine.scheduling import EngineLoad, FairQueue, LoadStats, Placement, RowCap, alone_estimate
from canvas.model import DiffusionModel, ModelConfig
from canvas.sampling.sampler import SamplerConfig
from canvas.server.admission import Admission, AdmissionConfig, Busy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model() -> DiffusionModel:
    torch.manual_seed(0)
    return DiffusionModel(ModelConfig.from_name("tiny")).eval()


def request(seed: int) -> GenRequest:
    return GenRequest((5, 6, 7), config=SamplerConfig(max_steps=2, seed=seed))


# -- the fair queue ---------------------------------------------------------------------------------------------


def test_rows_go_round_robin_across_owners() -> None:
    q: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        q.push("a", item)
    assert q.push("b", "b1") == 1  # behind a1 only, not behind a's whole backlog
    assert q.push("c", "c1") == 2
    assert q.push("b", "b2") == 4  # b's second waits for every lane's first, and a's second (a is served before b)
    assert q.order() == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert [q.pop() for _ in range(6)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert q.pop() is None and len(q) == 0 and q.owners == 0


def test_positions_are_exact_and_removal_is_anywhere() -> None:
    """Against the order `pop` serves, over random pushes, pops and removals: a push's position is its index, and
    `position(owner, without=x)` is the index a push would get once x has gone."""
    rng = random.Random(0)
    q: FairQueue[int] = FairQueue()
    for n in range(600):
        op = rng.random()
        if op < 0.55:
            owner = rng.randrange(5)
            items = q.order()
            if items and rng.random() < 0.3:
                gone = rng.choice(items)
                predicted = q.position(owner, without=gone)
                assert q.remove(gone) and not q.remove(gone)
                assert q.position(owner) == predicted
            pos = q.push(owner, n)
            assert q.order().index(n) == pos
        elif op < 0.8:
            order = q.order()
            assert q.pop() == (order[0] if order else None)
        elif len(q):
            gone = rng.choice(q.order())
            rest = sorted(x for x in q.order() if x != gone)
            assert q.remove(gone) and sorted(q.order()) == rest  # the others may interleave anew: rounds shift
        assert len(q) == len(q.order())


# -- the engine's queue -----------------------------------------------------------------------------------------


def test_engine_admits_round_robin_across_owners(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1)
    done: list[str] = []

    def record(name: str):  # noqa: ANN202
        return lambda ev: done.append(name) if isinstance(ev, Done) else None

    for i, (owner, name) in enumerate([("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1")]):
        engine.submit(request(i), record(name), owner=owner)
    engine.run_until_idle()  # one row: generations finish in the order they got it
    assert done == ["a1", "b1", "a2", "a3"]


def test_cancelled_requests_leave_the_queue_at_once(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1)  # never stepped: everything stays queued unless it leaves by itself
    events: list[Event] = []
    first = engine.submit(request(1), owner="a")
    middle = engine.submit(request(2), events.append, owner="b")
    last = engine.submit(request(3), owner="c")
    middle.cancel()
    assert middle.wait(0).status == "cancelled" and events == [middle.result]  # Done at once, without a step
    assert engine.queue_order() == [first, last] and engine.load().queued == 2
    middle.cancel()  # idempotent: no second Done
    engine.run_until_idle()
    assert len(events) == 1 and first.wait(0).status == last.wait(0).status == "completed"


def test_a_superseding_request_takes_the_place_of_the_one_it_replaces(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1)
    engine.submit(request(1), owner="a")
    old = engine.submit(request(2), owner="b")
    engine.submit(request(3), owner="c")
    new = engine.submit(request(4), owner="b", replacing=old)
    assert old.wait(0).status == "cancelled" and old.cancelled
    # b's lane emptied when old left, so the new request joins the rotation's end.
    assert new.position == 2 and engine.queue_order()[2] is new and old not in engine.queue_order()


def test_a_refusal_changes_nothing(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1)
    old = engine.submit(request(1), owner="a")

    def refuse(p: Placement) -> None:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        engine.submit(request(2), owner="a", admit=refuse, replacing=old)
    assert engine.queue_order() == [old] and not old.cancelled


# -- the bound --------------------------------------------------------------------------------------------------


def _load(step_s: float | None, first_frame_s: float | None, recent: tuple[int, ...] = (),
          rows: tuple[tuple[int, int], ...] = ()) -> EngineLoad:
    return EngineLoad(max_batch=8, active=len(rows), queued=0, step_s=step_s, first_frame_s=first_frame_s,
                      recent_steps=recent, rows=rows)


def test_a_row_is_expected_to_run_as_long_as_recent_generations_that_got_as_far() -> None:
    load = _load(0.01, 0.04, recent=(4, 6, 8, 20))
    assert load.gen_steps == 9.5
    assert load.steps_left(done=7, left=30) == 7  # past the short ones: like the 8 and the 20, (8 + 20) / 2 - 7
    assert load.steps_left(done=7, left=3) == 2  # ...each cut at what it may still run: (8 + 10) / 2 - 7
    assert load.steps_left(done=25, left=4) == 4  # longer than any: as long as it may
    assert load.steps_left(done=0, left=1) == 1


def test_releases_come_in_bursts_when_rows_started_together() -> None:
    together = _load(0.01, 0.04, recent=(10,), rows=((0, 16),) * 8)
    assert together.release_times(9) == pytest.approx([0.1] * 8 + [0.2])  # all 8 at once, then a generation later
    assert together.release_s == pytest.approx(0.0125)  # the mean interval would promise one every 12.5 ms
    assert _load(None, None).release_times(3) is None


def test_the_bound_is_configured_or_sized_from_the_measured_load(model: DiffusionModel) -> None:
    sized = Admission(Engine(model), AdmissionConfig(max_wait_s=0.02))
    assert sized.bound(_load(None, None)) == AdmissionConfig().cold_queue  # nothing measured yet
    rows = ((9, 7), (8, 8), (2, 14)) + ((0, 16),) * 5  # rows due to stop in 1, 2, 8 and 10 steps of 10 ms
    assert sized.bound(_load(0.01, 0.04, recent=(10,), rows=rows)) == 2  # a 20 ms wait: the rows due by then
    assert sized.bound(_load(0.05, 0.04, recent=(10,), rows=rows)) == 0  # slower steps: nothing frees in time
    tenth = Admission(Engine(model), AdmissionConfig(max_wait_s=0.1))
    assert tenth.bound(_load(0.01, 0.04, recent=(10,), rows=rows)) == 8  # 100 ms: all but the next round
    # The default waits up to a second: each of the 8 rows frees up 10 times (every 100 ms) in it.
    assert Admission(Engine(model)).bound(_load(0.01, 0.04, recent=(10,), rows=rows)) == 80
    fixed = Admission(Engine(model), AdmissionConfig(max_queue=3))
    assert fixed.bound(_load(0.01, 0.04, recent=(10,), rows=rows)) == 3
    with pytest.raises(ValueError):
        AdmissionConfig(max_queue=-1)
    with pytest.raises(ValueError):
        AdmissionConfig(max_wait_s=0)


def test_a_burst_on_a_busy_server_queues_for_its_second(model: DiffusionModel) -> None:
    """Eight rows busy, generations of 10 steps of 30 ms: a burst of nine more writers waits (the last for about
    0.6 s) instead of being refused; the default bound, not a fraction of a first frame, decides."""
    engine = Engine(model, max_batch=8)
    with engine._lock:  # as if measured
        engine.stats.step_s.add(0.03)
        engine.stats.gen_steps.append(10)
        engine._active = 8
        engine._progress = ((2, 14),) * 8
    admission = Admission(engine)
    admitted = [admission.submit(request(i), None, owner=f"writer-{i}") for i in range(9)]
    assert [a.placement.releases for a in admitted] == list(range(1, 10))
    assert admission.counts == {"admitted": 9} and max(a.est_wait_s or 0 for a in admitted) <= 1.0


def test_refusal_past_the_bound_says_how_long_and_when_to_retry(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1)
    admission = Admission(engine, AdmissionConfig(max_queue=1))
    starts = admission.submit(request(1), None, owner="a")  # the free row: starts at the next step
    waits = admission.submit(request(2), None, owner="b")  # waits for that row
    assert (starts.placement.position, starts.placement.releases) == (0, 0)
    assert (waits.placement.position, waits.placement.releases) == (1, 1)
    assert starts.est_wait_s is None  # nothing measured yet
    with pytest.raises(Busy) as refused:
        admission.submit(request(3), None, owner="c")
    data = refused.value.data()
    assert data == {"queue_length": 2, "position": 2, "max_queue": 1, "est_wait_s": None, "retry_after_s": 1.0}
    err = refused.value.protocol_error()
    assert (err.code.value, err.retryable, err.data) == ("busy", True, data)
    assert engine.load().queued == 2 and admission.counts == {"admitted": 2, "refused": 1}
    # Once steps are measured, waits are estimated: the row frees every 10 steps x 40 ms = 0.4 s. The request needs
    # the second release (0.8 s) and is one short: it may try again after the first, being the first refused.
    engine.stats.step_s.add(0.04)
    engine.stats.gen_steps.append(10)
    with pytest.raises(Busy) as refused:
        admission.submit(request(4), None, owner="c")
    assert refused.value.est_wait_s == pytest.approx(2 * 0.4) and refused.value.retry_after_s == pytest.approx(0.4)


def test_the_refused_are_told_to_come_back_in_the_order_they_came(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=1)
    engine.stats.step_s.add(0.04)
    engine.stats.gen_steps.append(10)  # the row frees every 0.4 s
    admission = Admission(engine, AdmissionConfig(max_queue=0))
    admission.submit(request(1), None, owner="a")  # takes the free row: nobody else gets in until it is done
    hints = []
    for owner in ("b", "c", "d", "b"):
        with pytest.raises(Busy) as refused:
            admission.submit(request(2), None, owner=owner)
        hints.append(refused.value.retry_after_s)
    assert hints == pytest.approx([0.4, 0.8, 1.2, 0.4])  # one release apart; b keeps its place when it asks again
    assert admission.stats()["refused_waiting"] == 3


# -- the row cap ------------------------------------------------------------------------------------------------


def _ff_load(slowdown: float | None, first_frames: int) -> EngineLoad:
    return EngineLoad(max_batch=8, active=0, queued=0, step_s=0.01, first_frame_s=0.05, first_frames=first_frames,
                      slowdown=slowdown)


def _stats_load(stats: LoadStats) -> EngineLoad:
    return EngineLoad(max_batch=8, active=0, queued=0, step_s=stats.step_s.value,
                      first_frame_s=stats.first_frame_s.value, alone_first_frame_s=stats.alone_first_frame_s(),
                      first_frames=stats.first_frames, slowdown=stats.slowdown.value)


def test_the_row_cap_follows_the_measured_slowdown_one_row_at_a_time() -> None:
    cap = RowCap(8, slo=2.0, relax=0.7, settle=5)
    assert cap.update(_ff_load(None, 100)) == 8  # nothing measured alone yet: no cap
    assert cap.update(_ff_load(3.0, 10)) == 7  # 3x what it takes alone against 2x: one row less
    assert cap.update(_ff_load(3.0, 14)) == 7  # not settled: 4 first frames since the change
    assert cap.update(_ff_load(3.0, 15)) == 6
    assert cap.update(_ff_load(1.8, 30)) == 6  # between 0.7 x and 1 x the target: hold
    assert cap.update(_ff_load(1.2, 30)) == 7  # below 0.7 x the target: one row more
    for n in range(40, 200, 10):
        cap.update(_ff_load(1.2, n))
    assert cap.cap == 8  # never above max_batch
    for n in range(200, 400, 10):
        cap.update(_ff_load(100.0, n))
    assert cap.cap == 1  # never below one row
    with pytest.raises(ValueError):
        RowCap(8, slo=1.0)


def test_the_alone_baseline_is_per_token_from_comparable_requests() -> None:
    fills = [(200.0, 0.100 + 0.002 * i) for i in range(20)]  # 200-token fills alone: 0.5-0.69 ms a token
    base = alone_estimate(fills, 200)
    assert base is not None and base == pytest.approx(0.108)  # the 25th percentile of 20 (the 5th), not the fastest
    assert alone_estimate(fills, 400) == pytest.approx(2 * base)  # a request twice the size: twice the time
    # A request with an empty prefix and suffix: 2 tokens in 21 ms (slow per token: a step costs something), or one
    # fast even per token. Among a few fills it moves the quantile by one rank at most, never to its own value...
    for tiny in [(2.0, 0.021), (2.0, 0.0002)]:
        moved = alone_estimate([tiny, *fills], 200)
        assert moved is not None and 0.106 <= moved <= 0.110
    # ...and once there are enough comparable ones (ALONE_NEAREST) it is not read at all.
    many = [(200.0, 0.100 + 0.001 * i) for i in range(40)]
    assert alone_estimate([(2.0, 0.0002), *many], 200) == alone_estimate(many, 200)
    # Faster comparable fills do move it.
    assert alone_estimate(fills + [(180.0, 0.060)] * 8, 200) == pytest.approx(200 * 0.060 / 180)
    # The newest of equally comparable samples count: a baseline follows the machine as it changes.
    newer = [(200.0, 0.100 + 0.002 * i) for i in range(32)]
    assert alone_estimate([(200.0, 0.050)] * 30 + newer, 200) == pytest.approx(0.100 + 0.002 * 7)  # p25 of the 32
    assert alone_estimate([], 200) is None


def test_one_tiny_first_frame_does_not_hold_the_row_cap_down() -> None:
    """Issue 47: a 21 ms first frame of an empty request became the baseline, every later fill read as over the
    SLO and the cap fell to 1 for good. Now fills alone measure a slowdown near 1 and the cap stays."""
    stats, cap = LoadStats(), RowCap(8, slo=2.5)
    stats.add_first_frame(0.021, 2, alone=True)
    for i in range(30):
        stats.add_first_frame(0.110 + 0.01 * (i % 3), 200, alone=True)
        cap.update(_stats_load(stats))
    assert cap.cap == 8 and stats.slowdown.value is not None and stats.slowdown.value < 1.5
    assert stats.alone_first_frame_s() == pytest.approx(0.110, rel=0.1)


def test_a_cut_row_cap_recovers_once_first_frames_allow() -> None:
    stats, cap = LoadStats(), RowCap(8, slo=2.5)
    for _ in range(8):
        stats.add_first_frame(0.1, 200, alone=True)
    for _ in range(60):  # a burst: every first frame 4x what it takes alone
        stats.add_first_frame(0.4, 200, alone=False)
        cap.update(_stats_load(stats))
    assert cap.cap < 8
    low = cap.cap
    for _ in range(60):  # the rows cut, first frames come back to what they take alone
        stats.add_first_frame(0.1, 200, alone=cap.cap == 1)
        cap.update(_stats_load(stats))
    assert cap.cap == 8 > low


def test_the_engine_runs_no_more_rows_than_its_cap(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=4)
    engine.set_row_cap(2)
    handles = [engine.submit(request(i), owner=i) for i in range(4)]
    engine.step()
    assert engine.load().active == 2 and engine.load().queued == 2 and engine.load().cap == 2
    placement: list[Placement] = []
    engine.submit(request(9), owner="x", admit=placement.append)
    assert placement[0].free_rows == 0  # rows free under max_batch are not free under the cap
    engine.set_row_cap(99)
    assert engine.load().cap == 4  # clamped to max_batch
    engine.run_until_idle()
    assert all(h.wait(0).status == "completed" for h in handles)


def test_first_frames_alone_are_the_baseline(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=4)
    h = engine.submit(request(1))
    engine.run_until_idle()
    load = engine.load()
    assert h.wait(0).status == "completed" and load.first_frames == 1
    assert load.alone_first_frame_s is not None and load.alone_first_frame_s == pytest.approx(load.first_frame_s)
    assert load.slowdown == pytest.approx(1.0)  # against itself
    ((size, _),) = engine.stats.alone
    assert size == 3 + model.config.canvas_length  # its context encoded, then one step over every slot
    for i in range(3):
        engine.submit(request(10 + i), owner=i)
    engine.run_until_idle()  # three rows side by side: none of them alone
    after = engine.load()
    assert after.first_frames == 4 and len(engine.stats.alone) == 1
    assert list(engine.stats.sizes)[1:] == [model.config.canvas_length] * 3  # the context came from the cache


def test_admission_lowers_the_cap_when_first_frames_slow_down(model: DiffusionModel) -> None:
    engine = Engine(model, max_batch=8)
    admission = Admission(engine, AdmissionConfig(max_queue=100, first_frame_slo=2.0))
    with engine._lock:  # as if measured: 10 ms alone, 50 ms under load, over enough first frames
        engine.stats.add_first_frame(0.010, 100, alone=True)
        for _ in range(10):
            engine.stats.add_first_frame(0.050, 100, alone=False)
    admission.submit(request(1), None, owner="a")
    assert engine.load().cap == 7 and admission.stats()["row_cap"] == 7
    off = Admission(Engine(model, max_batch=8), AdmissionConfig(first_frame_slo=None))
    off.submit(request(2), None, owner="a")
    assert off.engine.load().cap == 8
