"""A claim with an expiry on SQLite, PostgreSQL and MariaDB, on a table of its own: of two
owners taking a row at once one wins; a claim that ran out, or an earlier boot's of the
same host, is taken over; a renewal keeps it; a release frees it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import peewee
import pytest

from supervisor.store.claims import Claims
from supervisor.store.db import db_now, open_database, run_write
from tests.conftest import BACKENDS

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)

A1, A2, B1 = "host-a/boot0001", "host-a/boot0002", "host-b/boot0001"
TTL = 60.0


class Claimed(peewee.Model):
    """A row that daemons claim, as the registry's and the outbox's are."""

    id = peewee.CharField(max_length=64, primary_key=True)
    claimed_by = peewee.CharField(max_length=64, null=True)
    claim_expires_at = peewee.DoubleField(null=True)

    class Meta:
        table_name = "claimed"


CLAIMS = Claims(Claimed)


@pytest.fixture
def db(db_url: str) -> Iterator[peewee.Database]:
    database = open_database(db_url)
    database.bind([Claimed])
    database.create_tables([Claimed])
    try:
        yield database
    finally:
        database.close()


def rows(db: peewee.Database, *ids: str) -> None:
    run_write(db, lambda: Claimed.insert_many([{"id": i} for i in ids]).execute())


def take(db: peewee.Database, ids: list[str], owner: str, **options: float | str) -> int:
    """`owner` takes the rows of `ids` for TTL seconds, in a transaction of its own."""

    def work() -> int:
        now = float(options.get("now", db_now(db)))
        mine = options.get("mine")
        return CLAIMS.take(ids, owner, now + TTL, now, None if mine is None else str(mine))

    return int(run_write(db, work))


def holder(db: peewee.Database, row_id: str) -> str | None:
    found: str | None = Claimed.get_by_id(row_id).claimed_by
    return found


def race(db: peewee.Database, row_id: str, owners: tuple[str, ...]) -> dict[str, int]:
    """Each of `owners` takes the row at the same instant, on a connection of its own: how
    many rows each took."""
    start = threading.Barrier(len(owners))
    taken: dict[str, int] = {}

    def one(owner: str) -> None:
        start.wait()
        try:
            taken[owner] = take(db, [row_id], owner)
        finally:
            db.close()

    racers = [threading.Thread(target=one, args=(owner,)) for owner in owners]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(30)
    return taken


def test_of_two_owners_taking_a_row_at_once_one_wins(db: peewee.Database) -> None:
    ids = [f"r{n}" for n in range(5)]
    rows(db, *ids)
    for row_id in ids:
        taken = race(db, row_id, (A1, B1))
        assert sorted(taken.values()) == [0, 1]
        [winner] = [owner for owner, count in taken.items() if count]
        assert holder(db, row_id) == winner


def test_a_held_claim_is_not_taken_and_one_that_ran_out_is(db: peewee.Database) -> None:
    rows(db, "r1", "r2")
    now = db_now(db)
    assert take(db, ["r1", "r2"], A1, now=now) == 2
    assert take(db, ["r1"], B1, now=now + TTL - 1) == 0
    assert take(db, ["r1"], B1, now=now + TTL + 1) == 1
    assert (holder(db, "r1"), holder(db, "r2")) == (B1, A1)
    row = Claimed.get_by_id("r1")
    assert row.claim_expires_at == pytest.approx(now + 2 * TTL + 1)
    assert CLAIMS.holds(row, now + 2 * TTL) and not CLAIMS.holds(row, now + 2 * TTL + 2)


def test_an_earlier_boot_of_the_same_host_is_free_to_a_later_one(db: peewee.Database) -> None:
    rows(db, "a", "b")
    take(db, ["a"], A1)
    take(db, ["b"], B1)
    assert take(db, ["a", "b"], A2) == 0
    assert take(db, ["a", "b"], A2, mine="host-a/") == 1
    assert (holder(db, "a"), holder(db, "b")) == (A2, B1)
    assert take(db, ["a"], A2, mine="host-a/") == 0  # its own claim holds: nothing to take


def test_a_renewal_keeps_the_claim_and_only_its_owner_renews(db: peewee.Database) -> None:
    rows(db, "r1")
    now = db_now(db)
    take(db, ["r1"], A1, now=now)
    assert run_write(db, lambda: CLAIMS.renew(["r1"], B1, now + 10 * TTL)) == 0
    assert run_write(db, lambda: CLAIMS.renew(["r1"], A1, now + 10 * TTL)) == 1
    assert take(db, ["r1"], B1, now=now + 5 * TTL) == 0
    assert holder(db, "r1") == A1
    assert Claimed.get_by_id("r1").claim_expires_at == pytest.approx(now + 10 * TTL)


def test_a_release_frees_the_owners_claims_only(db: peewee.Database) -> None:
    rows(db, "a1", "a2", "b1")
    take(db, ["a1", "a2"], A1)
    take(db, ["b1"], B1)
    assert run_write(db, lambda: CLAIMS.release(A1, Claimed.id == "a2")) == 1
    assert run_write(db, lambda: CLAIMS.release(A1)) == 1
    assert [holder(db, i) for i in ("a1", "a2", "b1")] == [None, None, B1]
    assert Claimed.get_by_id("a1").claim_expires_at is None
    assert take(db, ["a1", "a2", "b1"], A2) == 2


def test_the_conditions_select_the_rows_they_name(db: peewee.Database) -> None:
    rows(db, "free", "a1", "a2", "b1")
    now = db_now(db)
    take(db, ["a1"], A1, now=now - 2 * TTL)  # ran out
    take(db, ["a2"], A2, now=now)
    take(db, ["b1"], B1, now=now)

    def ids(condition: object) -> list[str]:
        return sorted(r.id for r in Claimed.select(Claimed.id).where(condition))

    assert ids(CLAIMS.free(now)) == ["a1", "free"]
    assert ids(CLAIMS.free(now, A2, "host-a/")) == ["a1", "free"]
    assert ids(CLAIMS.free(now, A1, "host-a/")) == ["a1", "a2", "free"]
    assert ids(CLAIMS.held_by(A2)) == ["a2"]
    assert ids(CLAIMS.not_held_by(A2)) == ["a1", "b1", "free"]
