"""The document stores: round trips, version rules, the edit log, proposals and threads for both SQLite and
PostgreSQL (`store` is parametrised over the two); schema upgrades and durability under kill -9 for SQLite. The
PostgreSQL store's cross-process parts are in test_store_pg.py."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from canvas.store.base import DocStore, DocumentNotFound, DuplicateProposal, StoreError, VersionRegression
from canvas.store.sqlite import Store


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> DocStore:
    if request.param == "sqlite":
        s: DocStore = Store(tmp_path / "docs.db")
    else:
        from canvas.store.pg import PgStore

        s = PgStore(request.getfixturevalue("pg_url"))
    yield s  # type: ignore[misc]
    s.close()


def _state(text: str) -> dict[str, object]:
    return {"text": text, "window": [0, len(text)], "history": [{"ops": [], "v": 0}], "name": "ignored by store"}


def test_save_load_round_trip_with_unicode(store: DocStore) -> None:
    state = _state("Grüße, 世界 🌍 — ok")
    store.save("d1", 0, state, name="greeting")
    v, loaded = store.load("d1")
    assert (v, loaded) == (0, state)
    assert store.exists("d1") and not store.exists("d2")
    [rec] = store.list_docs()
    assert (rec.doc_id, rec.name, rec.v, rec.chars) == ("d1", "greeting", 0, len(state["text"]))  # type: ignore[arg-type]


def test_versions_only_grow_and_edits_are_logged(store: DocStore) -> None:
    store.save("d", 0, _state("a"))
    store.save("d", 1, _state("ab"), [{"op": "replace", "start": 1, "end": 1, "text": "b"}])
    store.save("d", 2, _state("abc"), [{"op": "replace", "start": 2, "end": 2, "text": "c"}])
    with pytest.raises(VersionRegression, match="version 2; cannot save version 1"):
        store.save("d", 1, _state("x"), [])
    with pytest.raises(VersionRegression):
        store.save("d", 2, _state("x"), [])  # same version with ops would log two edits for one v
    store.save("d", 2, _state("abc"), name="renamed")  # re-saving the same version without ops is fine
    assert store.load("d") == (2, _state("abc"))
    assert [(e.v, e.ops[0]["text"]) for e in store.edits("d")] == [(1, "b"), (2, "c")]
    assert [e.v for e in store.edits("d", since_v=1)] == [2]
    assert store.list_docs()[0].name == "renamed"


def test_failed_save_changes_nothing(store: DocStore) -> None:
    store.save("d", 3, _state("keep"))
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        store.save("d", 4, {"text": object()})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        store.save("d", 4, {"x": float("nan")})
    with pytest.raises(ValueError, match="ops is not JSON-serialisable"):
        store.save("d", 4, _state("new"), [{1, 2}])
    with pytest.raises(ValueError, match="non-negative"):
        store.save("d", -1, _state("x"))
    with pytest.raises(TypeError, match="dict"):
        store.save("d", 5, ["not", "a", "dict"])  # type: ignore[arg-type]
    assert store.load("d") == (3, _state("keep"))
    assert store.edits("d") == []


def test_missing_documents_and_delete(store: DocStore) -> None:
    with pytest.raises(DocumentNotFound, match="no document 'nope'"):
        store.load("nope")
    store.save("a", 0, _state("1"))
    store.save("a", 1, _state("12"), [{"op": "x"}])
    store.save("b", 0, _state("2"))
    assert store.count() == 2
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert [r.doc_id for r in store.list_docs()] == ["b"]
    assert store.edits("a") == []


def test_list_docs_most_recent_first(store: DocStore) -> None:
    store.save("old", 0, _state("o"))
    time.sleep(0.01)
    store.save("new", 0, _state("n"))
    time.sleep(0.01)
    store.save("old", 1, _state("oo"), [])
    assert [r.doc_id for r in store.list_docs()] == ["old", "new"]


def test_wal_mode_and_full_sync(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    with Store(path) as s:
        s.save("d", 0, _state("x"))
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_reopen_restores_everything_and_rejects_foreign_schema(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with Store(path) as s:
        for v in range(5):
            s.save("d", v, _state("x" * v), None if v == 0 else [{"v": v}])
    with Store(path) as s:
        assert s.load("d") == (4, _state("xxxx"))
        assert [e.v for e in s.edits("d")] == [1, 2, 3, 4]
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store(path)


def test_concurrent_threads_share_one_store(store: DocStore) -> None:
    errors: list[BaseException] = []

    def writer(doc: str) -> None:
        try:
            store.save(doc, 0, _state(""))
            for v in range(1, 40):
                store.save(doc, v, _state(str(v)), [{"v": v}])
                store.load(doc)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(4):
        assert store.load(f"t{i}") == (39, _state("39"))
        assert len(store.edits(f"t{i}")) == 39


_WRITER = textwrap.dedent(
    """
    import sys
    from canvas.store.sqlite import Store

    store = Store(sys.argv[1])
    store.save("doc", 0, {"text": ""})
    v = 0
    while True:
        v += 1
        store.save("doc", v, {"text": "x" * (v % 50), "v": v}, [{"op": "replace", "n": v}])
        print(v, flush=True)  # acknowledged: save() has returned
    """
)


def test_acknowledged_writes_survive_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    with subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        acked = 0
        deadline = time.monotonic() + 60
        try:
            while acked < 200 and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                acked = int(line)
        finally:
            proc.send_signal(signal.SIGKILL)  # mid-write: the writer never pauses between saves
            proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert acked >= 200, "the writer did not get going"
    with Store(path) as s:
        v, state = s.load("doc")
        assert v >= acked and state["v"] == v
        logged = [e.v for e in s.edits("doc")]
        assert logged == list(range(1, v + 1))  # every acknowledged edit, in order, none torn


def test_info(store: DocStore) -> None:
    store.save("d", 0, _state("abc"), name="n")
    info = store.info("d")
    assert (info.doc_id, info.name, info.v, info.chars) == ("d", "n", 0, 3) and info.created <= info.updated
    with pytest.raises(DocumentNotFound):
        store.info("missing")


def test_proposals_move_and_settle_in_the_transaction_of_their_edit(store: DocStore) -> None:
    store.save("d", 0, _state("abc"))
    store.add_proposal("d", "g-1", "s-a", {"any": "json"}, 1, 2)
    store.add_proposal("d", "g-2", "s-a", [1, 2], 0, 1)
    assert [(p.gen, p.start, p.end, p.stale, p.outcome) for p in store.proposals("d")] == [
        ("g-1", 1, 2, False, None),
        ("g-2", 0, 1, False, None),
    ]
    store.save("d", 1, _state("xabc"), [{"op": "x"}], change=[0, 0, 1], positions={"g-1": (2, 3, False),
               "g-2": (0, 2, True)}, resolved={})  # fmt: skip
    assert store.edits("d")[0].change == [0, 0, 1]
    with pytest.raises(VersionRegression):  # a failed save moves and settles nothing
        store.save("d", 1, _state("y"), [{"op": "y"}], positions={"g-1": (9, 9, True)}, resolved={"g-2": "accepted"})
    assert [(p.start, p.end, p.stale) for p in store.proposals("d")] == [(2, 3, False), (0, 2, True)]
    store.save("d", 2, _state("xaXc"), [{"op": "accept"}], change=[2, 3, 3], resolved={"g-1": "accepted"})
    assert [p.gen for p in store.proposals("d")] == ["g-2"]
    settled = store.proposal("g-1")
    assert settled is not None and (settled.outcome, settled.body) == ("accepted", None)
    assert store.resolve_proposal("d", "g-2", "stale") is True
    assert store.resolve_proposal("d", "g-2", "rejected") is False  # settled once only
    assert store.proposals("d") == [] and store.proposal("nope") is None


def test_adding_a_proposal_can_expire_old_ones_and_needs_its_document(store: DocStore) -> None:
    store.save("d", 0, _state(""))
    store.add_proposal("d", "g-1", "s", {}, 0, 0)
    store.add_proposal("d", "g-2", "s", {}, 0, 0, expire=["g-1"])
    assert [p.gen for p in store.proposals("d")] == ["g-2"]
    assert store.proposal("g-1").outcome == "expired"  # type: ignore[union-attr]
    with pytest.raises(DocumentNotFound):
        store.add_proposal("missing", "g-3", "s", {}, 0, 0)
    with pytest.raises(DuplicateProposal, match="g-2"):
        store.add_proposal("d", "g-2", "s", {}, 0, 0)  # a gen id is one proposal
    assert store.delete("d") is True
    assert store.proposal("g-2") is None  # deleted with its document


def test_a_version_1_file_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE documents (doc_id TEXT PRIMARY KEY, name TEXT NOT NULL DEFAULT '', v INTEGER NOT NULL,
            state TEXT NOT NULL, chars INTEGER NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE edits (seq INTEGER PRIMARY KEY AUTOINCREMENT,
            doc_id TEXT NOT NULL REFERENCES documents(doc_id) ON DELETE CASCADE,
            v INTEGER NOT NULL, ops TEXT NOT NULL, time REAL NOT NULL);
        INSERT INTO documents VALUES ('d', 'old', 1, '{"text": "ab"}', 2, 0, 0);
        INSERT INTO edits (doc_id, v, ops, time) VALUES ('d', 1, '[{"op": "replace"}]', 0);
        """
    )
    db.commit()
    db.close()
    with Store(path) as s:
        assert s.load("d") == (1, {"text": "ab"})
        [old] = s.edits("d")
        assert (old.v, old.change) == (1, None)  # logged before changes were measured
        s.save("d", 2, {"text": "abc"}, [{"op": "replace"}], change=[2, 2, 3])
        s.add_proposal("d", "g-1", "s", {}, 0, 1)
        assert s._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "2"
    with Store(path) as s:  # and opens again as a version 2 file
        assert [e.change for e in s.edits("d")] == [None, [2, 2, 3]] and len(s.proposals("d")) == 1
