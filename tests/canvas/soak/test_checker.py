"""The soak's checker and schedule on journals and stores made by hand: each invariant, broken once, is reported
(a checker that passes everything would make every soak green), and a clean journal passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from canvas.soak.actors import ActorLog
from canvas.soak.checker import check_actors, check_final, check_store, check_writer, explained
from canvas.soak.schedule import FAULTS, draw, parse_faults
from canvas.soak.writers import Known, Step, WriterLog
from canvas.store.sqlite import Store

A = Known(0, "The cat sat.", False, False)
B = Known(1, "The cat sat. #w0e1#", True, False)
C = Known(2, "The cat sat. #w0e1# #w0e2#", True, False)
KILLS = [(10.0, 20.0)]


def _log(*steps: Step, **kw: object) -> WriterLog:
    log = WriterLog("w0", doc_id="d0", steps=list(steps))
    for k, v in kw.items():
        setattr(log, k, v)
    return log


def test_a_clean_journal_passes() -> None:
    log = _log(Step(0, "open", A), Step(1, "ack:replace", B), Step(12, "reconcile", C, "replace"),
               Step(13, "ack:unmask", C), lost=[(11.0, 1006, "replace")])  # fmt: skip
    assert check_writer(log, KILLS) == []


@pytest.mark.parametrize(
    ("steps", "expect"),
    [
        ([Step(0, "open", A), Step(1, "ack:replace", B), Step(5, "reconcile", A)], "acknowledged change lost"),
        ([Step(0, "open", A), Step(1, "ack:replace", C)], "applied twice"),
        ([Step(0, "open", B), Step(1, "ack:undo", A)], "went back"),
        ([Step(0, "open", A), Step(5, "reconcile", B)], "with nothing in flight"),
        ([Step(0, "open", A), Step(5, "reconcile", C, "replace")], "in flight"),
        ([Step(0, "open", A), Step(5, "reconcile", Known(0, "other", False, False))], "without a new version"),
        ([Step(0, "open", A), Step(1, "ack:pin", Known(0, "other", False, False))], "without a new version"),
        ([Step(0, "open", A), Step(1, "ack:replace", Known(1, "#w0e1# x #w0e1#", True, False))], "twice"),
    ],
)
def test_each_broken_invariant_is_reported(steps: list[Step], expect: str) -> None:
    found = check_writer(_log(*steps), KILLS)
    assert len(found) == 1 and expect in found[0], found


def test_drops_untyped_errors_and_unended_generations_are_reported() -> None:
    log = _log(Step(0, "open", A), lost=[(11.0, None, None), (30.0, None, "pin"), (31.0, 1011, None)],
               untyped=["internal"], unanswered=["replace"], gens={"g1": "running", "g2": "completed"})  # fmt: skip
    found = check_writer(log, KILLS)
    assert len(found) == 4, found
    assert any("t=30.0" in f and "close code" in f for f in found)  # outside the kill window, no code
    assert any("no answer" in f for f in found) and any("g1 never ended" in f for f in found)
    assert explained(31.0, 1011, KILLS) and explained(21.5, None, KILLS) and not explained(25.0, 1006, KILLS)
    actors = ActorLog(untyped=["x"], lost=[(50.0, None, "drop")])
    actors.statuses["failed"] = 1
    assert len(check_actors(actors, KILLS)) == 3


def test_the_final_read_back_must_match_the_last_view() -> None:
    logs = [_log(Step(0, "open", A), Step(1, "ack:replace", B))]
    assert check_final(logs, {"d0": B}) == []
    assert "differs" in check_final(logs, {"d0": Known(1, "x", True, False)})[0]
    assert "missing" in check_final(logs, {"d0": None})[0]
    assert "undo False" in check_final(logs, {"d0": Known(1, B.text, False, False)})[0]


def test_the_store_must_hold_each_version_once_and_every_told_proposal(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.save("d0", 0, {})
    store.save("d0", 1, {}, [1])
    store.add_proposal("d0", "g-acc", "s", {}, 0, 1)
    store.add_proposal("d0", "g-pending", "s", {}, 0, 1)
    store.save("d0", 2, {}, [2], resolved={"g-acc": "accepted"})
    log = _log(Step(0, "open", A), Step(1, "ack:replace", B), Step(2, "ack:accept", C),
               told={"g-acc": "x", "g-pending": "y"}, accepted=["g-acc"])  # fmt: skip
    assert check_store(store, [log]) == []
    log.told["g-lost"] = "z"
    log.accepted.append("g-pending")
    log.steps.append(Step(3, "ack:replace", Known(3, "t", True, False)))
    found = check_store(store, [log])
    assert len(found) == 3, found
    assert any("missing: [3]" in f for f in found) and any("g-lost" in f and "not in the store" in f for f in found)
    assert any("g-pending acknowledged accepted, stored None" in f for f in found)
    store.close()


def test_the_schedule_is_drawn_from_the_seed() -> None:
    a, b = draw(7, 180, FAULTS), draw(7, 180, FAULTS)
    assert a == b and a != draw(8, 180, FAULTS)
    assert {f.kind for f in a} == set(FAULTS)  # every class at least once, even in 3 minutes
    assert all(0.05 * 180 <= f.at_s <= 0.85 * 180 for f in a)
    assert all(f.at_s <= 0.6 * 180 for f in a if f.kind == "kill")
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    hour = draw(1, 3600, FAULTS)
    assert sum(f.kind == "kill" for f in hour) == 9 and len(hour) > 60
    assert parse_faults("all", ray=True, pg=True) == FAULTS and parse_faults("none") == ()
    assert "ray_kill" not in parse_faults("all") and parse_faults("kill, drop") == ("kill", "drop")
    with pytest.raises(ValueError, match="unknown fault 'replica'"):
        parse_faults("kill,replica")
    with pytest.raises(ValueError, match="needs --ray"):
        parse_faults("kill,ray_kill")


def test_replica_watch_flags_a_document_streamed_from_two_replicas_at_two_versions() -> None:
    from canvas.soak.checker import ReplicaWatch

    watch = ReplicaWatch()
    one = {"running": [["d1", "r1", "aaa"]], "replicas": [{"replica": "r2", "age_s": 0.5, "serving": [["d1", "bbb"]]}]}
    two = {"running": [["d1", "r1", "aaa"], ["d1", "r2", "bbb"]], "replicas": []}
    for t in range(ReplicaWatch.PERSIST):
        watch.observe(float(t), one)  # a zombie on r2 that no ingress streams: counted, not a violation
    assert not watch.violations and watch.zombies_seen == 1
    watch.observe(10.0, two)
    watch.observe(12.0, {"running": [], "replicas": []})  # one sample of two: a cancellation in flight
    assert not watch.violations
    for t in range(ReplicaWatch.PERSIST):
        watch.observe(20.0 + t, two)
    assert len(watch.violations) == 1 and "d1" in watch.violations[0]


def test_answer_times_after_a_fault_end() -> None:
    from canvas.soak.checker import check_answer_times
    from canvas.soak.writers import WriterLog

    log = WriterLog("w0")
    log.gen_times = {"g1": (5.0, 8.0), "g2": (9.0, 45.0), "g3": (9.5, None), "g4": (20.0, 80.0)}
    late, worst = check_answer_times([log], [("pg_down", 6.0, 10.0)])
    assert [x.split()[2] for x in late] == ["g2", "g3"] and worst == float("inf")  # g1 before, g4 after the end
    assert check_answer_times([log], []) == ([], None)
