"""The soak's checker: what each client was told, replayed against what the server and its store hold afterwards.

Invariants checked (each broken one is a violation, named with the writer, the time and the versions):
- Versions are monotonic and move by exactly one per acknowledged change (zero for a no-op, which leaves the text
  as it was): a lone writer's change applied twice, or lost, shows as a jump.
- After a lost connection the re-read document is what the writer last saw, or that plus the one change that was in
  flight (applied once); never less (an acknowledged change lost) nor more (a phantom, or a duplicate).
- No marker appears twice in any text a writer was shown (an edit retried after a refusal that had applied).
- At the end, a server restarted on the store serves every document exactly as its writer last saw it, and the
  store's edit log holds versions 1..v of each document exactly once; every proposal a client was told of is in the
  store, every acknowledged accept is stored `accepted` (and only those), every acknowledged reject `rejected`.
- Every generation ended with a typed `gen.done` or with its connection; none `failed`; no request went unanswered;
  no `internal` error; a connection dropped without a close code only while the server was being killed.
- (Server-side faults) every generation running when a fault ended was answered (its `gen.done`, or its connection
  lost) within `ANSWER_AFTER_FAULT_S` of that end (`check_answer_times`).
- (`--ray`) no document is served by two replicas at diverging versions: the ingress streaming generations of one
  document from two replicas with different fingerprints (`canvas.cluster.records.fingerprint`: different texts) in
  `ReplicaWatch.PERSIST` samples in a row. Generations a replica runs that no ingress streams (after an ingress
  kill, or a replica resumed after the ingress gave up on it) go nowhere: they are counted, not violations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from canvas.soak.actors import ActorLog
from canvas.soak.writers import MARKER, Known, WriterLog
from canvas.store.base import DocStore

ANSWER_AFTER_FAULT_S = 30.0
KILL_SLACK_S = 2.0  # a client notices a killed server a little after the kill
CHANGES = ("replace", "pin", "mask", "unmask", "undo", "redo", "accept")  # in-flight kinds that change the document
ABNORMAL = (None, 1006)  # no close frame: the connection was cut


def explained(t: float, code: int | None, kills: Sequence[tuple[float, float]]) -> bool:
    """A lost connection is accounted for when it had a close code, or when the server was being killed."""
    if code not in ABNORMAL:
        return True
    return any(a - KILL_SLACK_S <= t <= b + KILL_SLACK_S for a, b in kills)


def _same(a: Known, b: Known) -> bool:
    return (a.v, a.text, a.can_undo, a.can_redo) == (b.v, b.text, b.can_undo, b.can_redo)


def check_writer(log: WriterLog, kills: Sequence[tuple[float, float]]) -> list[str]:
    out: list[str] = []
    w = log.name
    if not log.steps:
        return [f"{w}: never got a document"]
    for prev, cur in zip(log.steps, log.steps[1:], strict=False):
        a, b = prev.state, cur.state
        at = f"{w} t={cur.t}"
        if cur.how == "reconcile":
            changing = cur.inflight is not None and cur.inflight.split(":")[0] in CHANGES
            if b.v < a.v:
                out.append(f"{at}: acknowledged change lost: v{a.v} acknowledged, v{b.v} re-read")
            elif b.v == a.v and not _same(a, b):
                out.append(f"{at}: the document changed without a new version (v{b.v})")
            elif b.v > a.v + (1 if changing else 0):
                out.append(f"{at}: v{a.v} -> v{b.v} on re-read with {cur.inflight or 'nothing'} in flight")
        elif cur.how.startswith("ack:"):
            if b.v < a.v:
                out.append(f"{at}: version went back, v{a.v} -> v{b.v} ({cur.how})")
            elif b.v > a.v + 1:
                out.append(f"{at}: {cur.how} moved v{a.v} -> v{b.v}: a change applied twice or from nowhere")
            elif b.v == a.v and b.text != a.text:
                out.append(f"{at}: {cur.how} changed the text without a new version (v{b.v})")
        else:
            out.append(f"{at}: unexpected journal step {cur.how!r}")
    for step in log.steps:
        dup = [m for m, n in Counter(MARKER.findall(step.state.text)).items() if n > 1]
        if dup:
            out.append(f"{w} t={step.t}: marker {dup[0]} twice in v{step.state.v} ({step.how})")
            break  # one is enough: every later text repeats it
    for t, code, inflight in log.lost:
        if not explained(t, code, kills):
            out.append(f"{w} t={t}: connection dropped without a close code (code {code}; in flight: {inflight})")
    out += [f"{w}: {x}" for x in log.untyped + log.duplicates]
    out += [f"{w}: no answer: {x}" for x in log.unanswered]
    out += [f"{w}: generation {g} never ended" for g, s in log.gens.items() if s == "running"]
    return out


def check_actors(log: ActorLog, kills: Sequence[tuple[float, float]]) -> list[str]:
    out = [f"actors: {x}" for x in log.untyped + log.violations]
    for t, code, who in log.lost:
        if not explained(t, code, kills):
            out.append(f"actors t={t}: {who}: connection dropped without a close code (code {code})")
    if log.statuses.get("failed"):
        out.append(f"actors: {log.statuses['failed']} generations failed")
    return out


def check_final(logs: Sequence[WriterLog], finals: dict[str, Known | None]) -> list[str]:
    """Each writer's last view against its document as a freshly started server serves it from the store."""
    out: list[str] = []
    for log in logs:
        last = log.last
        if last is None or not log.doc_id:
            continue
        got = finals.get(log.doc_id)
        if got is None:
            out.append(f"{log.name}: document {log.doc_id} missing after the restart")
        elif not _same(got, last):
            out.append(f"{log.name}: after the restart v{got.v} (undo {got.can_undo}, redo {got.can_redo}), "
                       f"last seen v{last.v} (undo {last.can_undo}, redo {last.can_redo})"
                       + ("" if got.text == last.text else "; the text differs"))  # fmt: skip
    return out


def check_store(store: DocStore, logs: Sequence[WriterLog]) -> list[str]:
    """The store's edit log and proposals against what the writers were told."""
    out: list[str] = []
    for log in logs:
        if not log.doc_id or log.last is None:
            continue
        w, v = log.name, log.last.v
        versions = [e.v for e in store.edits(log.doc_id)]
        if versions != list(range(1, v + 1)):
            extra = [x for x, n in Counter(versions).items() if n > 1]
            missing = sorted(set(range(1, v + 1)) - set(versions))
            out.append(f"{w}: edit log is not v1..v{v} once each (twice: {extra[:5]}, missing: {missing[:5]}, "
                       f"beyond: {[x for x in versions if x > v][:5]})")  # fmt: skip
        accepted = set(log.accepted)
        for gen in log.told:
            record = store.proposal(gen)
            if record is None:
                out.append(f"{w}: proposal {gen} was told to the client and is not in the store")
            elif gen in accepted and record.outcome != "accepted":
                out.append(f"{w}: proposal {gen} acknowledged accepted, stored {record.outcome}")
            elif gen not in accepted and record.outcome == "accepted":
                out.append(f"{w}: proposal {gen} stored accepted, never acknowledged as accepted")
            elif gen in log.rejected and record.outcome != "rejected":
                out.append(f"{w}: proposal {gen} acknowledged rejected, stored {record.outcome}")
    return out


def check_answer_times(logs: Sequence[WriterLog], windows: Sequence[tuple[str, float, float]],
                       bound_s: float = ANSWER_AFTER_FAULT_S) -> tuple[list[str], float | None]:
    """Each generation running at the end of a fault window `(kind, start, end)` must have been answered within
    `bound_s` of that end. The violations, and the slowest answer after a fault's end (seconds; None: none ran)."""
    out: list[str] = []
    worst: float | None = None
    for log in logs:
        for gen, (t0, t1) in log.gen_times.items():
            for kind, _, end in windows:
                if t0 > end or (t1 is not None and t1 <= end):
                    continue  # started after the fault, or answered before its end
                took = None if t1 is None else t1 - end
                worst = max(worst or 0.0, took if took is not None else float("inf"))
                if took is None or took > bound_s:
                    said = "never answered" if took is None else f"answered {took:.1f} s after"
                    out.append(f"{log.name}: generation {gen} {said} the end of {kind} at t={end:.1f}")
                break  # the latest-ending window it overlapped decides
    return out, worst


class ReplicaWatch:
    """What the replicas serve, sampled from the ingress's /health (`queue.replicas[].serving`, `queue.running`):
    documents served by two replicas at diverging versions (violations), and generations a replica still runs that
    the ingress no longer streams (zombies: a figure, e.g. a replica resumed after the ingress gave up on it)."""

    PERSIST = 3  # samples in a row (a generation cancelled a moment ago may linger for one or two)
    FRESH_S = 2.5  # a replica's post older than this may be a dead replica's last word: not evidence of a zombie

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.samples = 0
        self.zombies_seen = 0
        self._diverging: Counter[str] = Counter()
        self._zombie: Counter[tuple[str, str, str]] = Counter()

    def observe(self, t: float, queue: dict[str, Any]) -> None:
        self.samples += 1
        ingress = {(str(d), str(r), str(f)) for d, r, f in queue.get("running") or [] if d}
        fresh = [rep for rep in queue.get("replicas") or [] if float(rep.get("age_s") or 0) <= self.FRESH_S]
        on_replicas = {(str(d), str(rep.get("replica")), str(f)) for rep in fresh for d, f in rep.get("serving") or []
                       if d}  # fmt: skip
        by_doc: dict[str, set[tuple[str, str]]] = {}
        for d, r, f in ingress:
            by_doc.setdefault(d, set()).add((r, f))
        diverging = {d for d, pairs in by_doc.items()
                     if any(r1 != r2 and f1 != f2 for r1, f1 in pairs for r2, f2 in pairs)}  # fmt: skip
        for d in list(self._diverging):
            if d not in diverging:
                del self._diverging[d]
        for d in diverging:
            self._diverging[d] += 1
            if self._diverging[d] == self.PERSIST:
                self.violations.append(f"t={t}: document {d} served by two replicas at diverging versions: "
                                       f"{sorted(by_doc[d])}")  # fmt: skip
        zombies = on_replicas - ingress
        for z in list(self._zombie):
            if z not in zombies:
                del self._zombie[z]
        for z in zombies:
            self._zombie[z] += 1
            if self._zombie[z] == self.PERSIST:
                self.zombies_seen += 1
