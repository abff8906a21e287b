"""The queries that run all the time read indexes, never the whole session table.

The work query (`with_work`, `needing_turns`, `some`) is run on every dispatch pass and
lease renewal (`renew_owner`) every few seconds by every worker, and a batch of leases
(`grant`) and a worker's first reads of them (`opening`) after every death: with 100,000
stored sessions a table scan in any would cost what the database holds, not what the
query returns.
SQLite's `EXPLAIN QUERY PLAN` of the statements each one really sends is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import Grant, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path / 'plans.db'}") as s:
        for n in range(20):
            s.sessions.create("alice", title=str(n))
        yield s


def plans_of(store: Store, call: Callable[[], Any]) -> list[tuple[str, list[str]]]:
    """Each statement `call` sends to the session table, with its query plan."""
    sent: list[tuple[str, Any]] = []
    real = store.db.execute_sql

    def recording(sql: str, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        if sql.lstrip().upper().startswith(("SELECT", "UPDATE")) and '"session"' in sql:
            sent.append((sql, params))
        return real(sql, params, *args, **kwargs)

    store.db.execute_sql = recording  # type: ignore[method-assign]
    try:
        call()
    finally:
        store.db.execute_sql = real  # type: ignore[method-assign]
    return [
        (sql, [row[-1] for row in real("EXPLAIN QUERY PLAN " + sql, params).fetchall()])
        for sql, params in sent
    ]


@pytest.mark.parametrize(
    "name, call",
    [
        ("with_work", lambda s, ids: s.sessions.with_work()),
        ("needing_turns", lambda s, ids: s.sessions.needing_turns()),
        ("some", lambda s, ids: s.sessions.some(ids)),
        ("opening", lambda s, ids: s.sessions.opening(ids)),
        ("grant", lambda s, ids: s.leases.grant([Grant(i, "host/boot/w0.1") for i in ids], 30.0)),
        ("renew_owner", lambda s, ids: s.leases.renew_owner("host/boot/w0.1", 30.0)),
    ],
)
def test_the_frequent_queries_search_an_index(store: Store, name: str, call: Any) -> None:
    ids = [info.id for info in store.sessions.list(limit=10)]
    found = plans_of(store, lambda: call(store, ids))
    assert found, f"{name} sent no statement to the session table"
    for sql, plan in found:
        reads = [line for line in plan if "B-TREE" not in line and "SUBQUERY" not in line]
        assert reads and all(line.startswith("SEARCH") and "INDEX" in line for line in reads), (
            f"{name}: {sql} is planned as {plan}"
        )
