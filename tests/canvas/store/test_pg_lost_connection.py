"""PostgreSQL connections lost at the worst moments (the scale-out soak's `pg_restart_fast` / `_immediate`): a
COMMIT cut before or after it landed raises `CommitUnknown`, and `committed` then tells which; the advisory locks of
a lost connection are gone, so a write under one fails before writing and `unlock` has nothing to do (it never
raises: a failing unlock after a committed save had the client told "nothing changed, retry" and the retry made the
change twice). The connection is cut by terminating its backend from another connection, exactly what a fast
shutdown does to it."""

from __future__ import annotations

from typing import Any

import pytest

from canvas.store.base import CommitUnknown

pytestmark = pytest.mark.timeout(120)
psycopg = pytest.importorskip("psycopg", reason="the pg extra (psycopg) is not installed")

from canvas.store.pg import PgStore  # noqa: E402


def cut(url: str, store: PgStore) -> None:
    """End `store`'s database session now, from another connection (waits until it has ended)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s, 5000)", (store._conn.info.backend_pid,))


class CutCommit(PgStore):
    """Cuts its own connection at COMMIT: `after` (it landed, the answer is lost) or before it (nothing landed)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.cut: str | None = None  # "before" | "after" | None

    def _commit(self, db: Any) -> None:
        when, self.cut = self.cut, None
        if when == "before":
            cut(self.url, self)
        super()._commit(db)
        if when == "after":
            cut(self.url, self)
            db.execute("SELECT 1")  # the lost answer: the connection is found broken


def _state(text: str) -> dict[str, Any]:
    return {"text": text}


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_commit_cut_raises_commit_unknown_and_committed_tells_the_truth(pg_url: str, when: str) -> None:
    with CutCommit(pg_url) as store, PgStore(pg_url) as reader:
        store.save("d", 0, _state("a"))
        store.cut = when
        with pytest.raises(CommitUnknown) as caught:
            store.save("d", 1, _state("ab"), [{"op": "r"}])
        unknown = caught.value
        assert (unknown.doc_id, unknown.v, unknown.ops) == ("d", 1, True)
        landed = when == "after"
        assert store.committed(unknown) is landed  # reconnects, then reads the edit back
        assert reader.load("d")[0] == (1 if landed else 0)
        assert [e.v for e in reader.edits("d")] == ([1] if landed else [])
        store.save("d", 2 if landed else 1, _state("abc"), [{"op": "r"}])  # the store goes on as usual


def test_a_save_without_an_edit_is_told_by_its_time(pg_url: str) -> None:
    with CutCommit(pg_url) as store:
        store.save("d", 0, _state("a"))
        store.cut = "after"
        with pytest.raises(CommitUnknown) as caught:
            store.save("d", 0, _state("a"), name="renamed")
        assert store.committed(caught.value) and store.info("d").name == "renamed"


def test_a_failure_before_commit_is_no_commit_unknown(pg_url: str) -> None:
    with PgStore(pg_url) as store:
        store.save("d", 0, _state("a"))
        cut(pg_url, store)
        with pytest.raises(psycopg.OperationalError):  # the statement before COMMIT meets the cut: nothing written
            store.save("d", 1, _state("ab"), [{"op": "r"}])
        assert store.load("d")[0] == 0 and store.edits("d") == []


def test_a_lock_lost_with_its_connection_blocks_writes_until_released(pg_url: str) -> None:
    with PgStore(pg_url) as a, PgStore(pg_url) as b:
        a.save("d", 0, _state("a"))
        assert a.try_lock("d")
        assert not b.try_lock("d")
        cut(pg_url, a)
        with pytest.raises(psycopg.OperationalError):
            a.load("d")  # meets the cut; the next call reconnects
        assert b.try_lock("d")  # the lock went with a's session
        b.unlock("d")
        with pytest.raises(psycopg.OperationalError, match="lock was lost"):
            a.save("d", 1, _state("ab"), [{"op": "r"}])  # not written unlocked on the new connection
        assert a.load("d")[0] == 0
        a.unlock("d")  # nothing to release, and no error
        assert a.try_lock("d")
        a.save("d", 1, _state("ab"), [{"op": "r"}])
        a.unlock("d")
        assert b.try_lock("d")
        b.unlock("d")


def test_unlock_after_the_connection_was_cut_never_raises(pg_url: str) -> None:
    with PgStore(pg_url) as a, PgStore(pg_url) as b:
        a.save("d", 0, _state("a"))
        assert a.try_lock("d")
        a.save("d", 1, _state("ab"), [{"op": "r"}])
        cut(pg_url, a)  # the database restarts between the save's COMMIT and the unlock
        a.unlock("d")
        assert b.try_lock("d")
        b.unlock("d")
        assert a.load("d")[0] == 1  # reconnected
