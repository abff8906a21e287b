"""Seeding large databases fast: templates written through the store, copied by SQL.

A template session is written with `supervisor.store.Store`, as turnkeeper writes one
(or taken from a real turn of a running daemon); its rows are then copied with sqlite3
in one transaction, every column of the live table copied as it is except the ones a
copy must change (ids, seqs, turn ids, times, the lease). So a copy has whatever columns
the schema has today, filled the way the store fills them.

- `history`: one session gets N events, copies of a completed turn (the seqs, turn ids
  and `read_to` of each copy shifted);
- `sessions`: N copies of a session (its row, ACL rows and events), either idle (a
  completed turn) or interrupted (a turn in flight, its lease held by a worker of an
  earlier boot of this host and expired a minute ago; the events a minute old, well in
  recovery's freshness window).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from contextlib import closing
from pathlib import Path
from typing import Any

from supervisor.store import Store
from tests.conftest import this_host_id

EARLIER_BOOT = "0ldb00t0"  # the boot part of an interrupted session's lease owner
INTERRUPTED_AGE_S = 60.0


def _rows(conn: sqlite3.Connection, query: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    cursor = conn.execute(query, params)
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _insert(conn: sqlite3.Connection, table: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    names = list(rows[0])
    quoted = ", ".join(f'"{n}"' for n in names)
    conn.executemany(
        f'INSERT INTO "{table}" ({quoted}) VALUES ({", ".join("?" * len(names))})',
        [tuple(row[n] for n in names) for row in rows],
    )


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=60)
    conn.execute("PRAGMA busy_timeout=60000")
    return conn


# --- one long history --------------------------------------------------------------


def history(path: Path, source: str, target: str, events: int) -> int:
    """Give the empty session `target` about `events` events: copies of `source`'s first
    completed turn (from its first event to its first `turn_ended`). Returns how many."""
    with closing(_connect(path)) as conn:
        template = _rows(conn, "SELECT * FROM event WHERE session_id = ? ORDER BY seq", (source,))
        end = next(i for i, e in enumerate(template) if e["type"] == "turn_ended")
        turn = template[: end + 1]
        copies = max(1, events // len(turn))
        start = time.time() - copies * 0.05
        rows: list[dict[str, Any]] = []
        for k in range(copies):
            offset = k * len(turn)
            turn_id = uuid.uuid4().hex
            for i, event in enumerate(turn):
                row = {name: value for name, value in event.items() if name != "id"}
                row["session_id"] = target
                row["seq"] = event["seq"] + offset
                row["turn_id"] = turn_id if event["turn_id"] else None
                row["created_at"] = start + k * 0.05 + i * 0.001
                row["payload"] = _shifted(event["type"], event["payload"], k, offset)
                rows.append(row)
        conn.execute("BEGIN IMMEDIATE")
        _insert(conn, "event", rows)
        conn.execute(
            "UPDATE session SET last_seq = ?, updated_at = ? WHERE id = ?",
            (len(rows), time.time(), target),
        )
        conn.execute("COMMIT")
    return len(rows)


def _shifted(kind: str, payload_json: str, k: int, offset: int) -> str:
    payload = json.loads(payload_json)
    if kind == "turn_started" and isinstance(payload.get("read_to"), int):
        payload["read_to"] += offset
    elif kind == "user_message":
        payload["text"] = f"history {k}"
    elif kind == "model_response" and not payload.get("tool_calls"):
        payload["text"] = f"echo: history {k}"
    return json.dumps(payload, ensure_ascii=False)


# --- many sessions -----------------------------------------------------------------


def templates(url: str) -> tuple[str, str]:
    """Write (idle, interrupted) template sessions through the store; their ids.

    Idle: one completed turn, no lease. Interrupted: a user message and the
    `turn_started` of its turn, leased to a worker of an earlier boot of this host.
    """
    owner = f"{this_host_id()}/{EARLIER_BOOT}/w1.1"
    with Store(url) as store:
        ids = []
        for completed in (True, False):
            sid = store.sessions.create("bench", title="seeded").id
            store.events.append(sid, "user_message", {"text": "hello"}, writer="intake")
            lease = store.leases.acquire(sid, owner, ttl=60.0)
            assert lease is not None  # a new session's lease is free
            turn = uuid.uuid4().hex
            options: dict[str, Any] = {"token": lease.token, "turn_id": turn}
            store.events.append(sid, "turn_started", {"read_to": 1}, **options)
            if completed:
                usage = {"prompt_tokens": 1, "completion_tokens": 2}
                response = {"text": "echo: hello", "tool_calls": [], "finish_reason": "stop"}
                store.events.append(sid, "model_response", response | {"usage": usage}, **options)
                store.events.append(sid, "turn_ended", {"outcome": "completed"}, **options)
                store.leases.release(lease)
            ids.append(sid)
    return ids[0], ids[1]


def sessions(path: Path, template: str, count: int, *, chunk: int = 20_000) -> list[str]:
    """`count` copies of the session `template` (row, ACL rows, events); their ids.

    An interrupted template's copies keep its owner and token, with the lease expired
    `INTERRUPTED_AGE_S` ago and every time that long ago.
    """
    ids = sorted(uuid.uuid4().hex for _ in range(count))  # in index order: fast inserts
    with closing(_connect(path)) as conn:
        session = _rows(conn, "SELECT * FROM session WHERE id = ?", (template,))[0]
        acl = _rows(conn, "SELECT * FROM session_acl WHERE session_id = ?", (template,))
        events = _rows(conn, "SELECT * FROM event WHERE session_id = ? ORDER BY seq", (template,))
        then = time.time() - INTERRUPTED_AGE_S
        interrupted = session["active_turn_id"] is not None
        if interrupted:  # the template's own lease expires too, like its copies'
            conn.execute("UPDATE session SET lease_expires_at = ? WHERE id = ?", (then, template))
        for start in range(0, count, chunk):
            part = ids[start : start + chunk]
            session_rows, acl_rows, event_rows = [], [], []
            for n, sid in enumerate(part):
                stamp = then + (start + n) * 1e-6
                turn = uuid.uuid4().hex
                row = session | {"id": sid, "created_at": stamp, "updated_at": stamp}
                if interrupted:
                    row |= {"active_turn_id": turn, "attempt_turn_id": turn}
                    row["lease_expires_at"] = stamp
                session_rows.append(row)
                acl_rows += [a | {"session_id": sid} for a in acl]
                for e in events:
                    copy = {k: v for k, v in e.items() if k != "id"}
                    copy |= {"session_id": sid, "created_at": stamp}
                    copy["turn_id"] = turn if e["turn_id"] else None
                    event_rows.append(copy)
            conn.execute("BEGIN IMMEDIATE")
            _insert(conn, "session", session_rows)
            _insert(conn, "session_acl", acl_rows)
            _insert(conn, "event", event_rows)
            conn.execute("COMMIT")
    return ids


def seed(path: Path, url: str, idle: int, interrupted: int) -> dict[str, Any]:
    """A database at `url` (created through the store) with `idle` idle sessions and
    `interrupted` interrupted ones (at least one of each: the templates); what was
    written."""
    started = time.monotonic()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    idle_template, interrupted_template = templates(url)
    interrupted_ids = [interrupted_template]
    if idle > 1:
        sessions(path, idle_template, idle - 1)
    if interrupted > 1:
        interrupted_ids += sessions(path, interrupted_template, interrupted - 1)
    return {
        "idle_sessions": idle,
        "interrupted_sessions": interrupted,
        "interrupted_ids": interrupted_ids,
        "seed_s": round(time.monotonic() - started, 1),
    }
