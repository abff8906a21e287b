"""Opening the database from a URL, the database clock, and retried write transactions.

SQLite is the embedded default: WAL, `synchronous=FULL` (or NORMAL), a busy timeout and
`BEGIN IMMEDIATE` for every write transaction, so no writer ever upgrades a read lock and
"database is locked" is only ever a wait, never an error a caller sees. PostgreSQL and
MySQL/MariaDB serve several writers or hosts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import peewee
from playhouse import db_url

from supervisor.contract.clock import SYSTEM
from supervisor.core.backoff import Backoff
from supervisor.store.errors import BadStoreURL, NotAnswering, StoreBusy, StoreError

T = TypeVar("T")

# Raises a driver's exception as peewee's class of the same name (OperationalError, ...),
# as peewee's own queries do: for code that runs SQL on a DB-API cursor.
DRIVER_ERRORS = peewee.__exception_wrapper__  # type: ignore[attr-defined]

# SQLite waits this long inside one attempt for the write lock; `run_write` retries on top.
BUSY_TIMEOUT_S = 5.0
# How long a write keeps retrying transient failures (locks, deadlocks, lost connections).
WRITE_DEADLINE_S = 60.0
# The waits between those retries: 5 ms, doubling, at most half a second.
BUSY_BACKOFF = Backoff(initial=0.005, factor=2.0, cap=0.5)

SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}

# One portable type for JSON payloads: TEXT is 64 KiB on MySQL, so use LONGTEXT there.
JSON_TEXT = "JSONTEXT"


def sqlite_path(url: str) -> Path | None:
    """The file of a `sqlite:///path` URL, or None for other backends and `:memory:`."""
    parts = urlsplit(url)
    if parts.scheme != "sqlite":
        return None
    path = parts.path[1:]
    return Path(path) if path and path != ":memory:" else None


def open_database(url: str, synchronous: str = "full") -> peewee.Database:
    """A peewee database for `url` (sqlite:///, postgresql://, mysql://), not yet connected.

    For SQLite the file is created 0600 (and its directory 0700) before SQLite touches it,
    so the log never exists with wider permissions, even for an instant.
    """
    scheme = urlsplit(url).scheme
    if scheme == "sqlite":
        path = sqlite_path(url)
        if path is not None:
            _create_private_file(path)
        return peewee.SqliteDatabase(
            str(path) if path else ":memory:",
            pragmas={
                "journal_mode": "wal",
                "synchronous": SYNCHRONOUS[synchronous],
                "foreign_keys": 1,
            },
            timeout=BUSY_TIMEOUT_S,
            lock_type="IMMEDIATE",
            field_types={JSON_TEXT: "TEXT"},
        )
    kwargs = db_url.parse(url, unquote_password=True, unquote_user=True)
    if scheme in ("postgres", "postgresql"):
        return peewee.PostgresqlDatabase(field_types={JSON_TEXT: "TEXT"}, **kwargs)
    if scheme == "mysql":
        from pymysql.constants import CLIENT

        kwargs.setdefault("charset", "utf8mb4")
        # UPDATE must report rows matched, not rows changed: a lease renewal within the
        # same microsecond changes nothing and must still count as renewed.
        kwargs.setdefault("client_flag", CLIENT.FOUND_ROWS)
        # Fewer gap locks between concurrent appenders than REPEATABLE READ.
        kwargs.setdefault("init_command", "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        return peewee.MySQLDatabase(field_types={JSON_TEXT: "LONGTEXT"}, **kwargs)
    raise BadStoreURL(
        f"store.url: unsupported scheme {scheme!r}; use sqlite:///PATH, "
        "postgresql://USER@HOST/DB or mysql://USER@HOST/DB"
    )


# One try's connect timeout while a start waits for the server (the URL's own wins).
PROBE_CONNECT_TIMEOUT_S = 5
# PostgreSQL: what libpq or the server says when the server is not there yet, or not yet
# taking connections (the messages carry no SQLSTATE at connect time; these are English,
# the language libpq and the server speak unless told otherwise).
PG_NOT_ANSWERING = (
    "connection refused",
    "timeout expired",
    "timed out",
    "no such file or directory",  # its unix socket, before it starts
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    "too many clients",
    "remaining connection slots are reserved",
    "server closed the connection unexpectedly",
    "temporary failure in name resolution",  # DNS not up yet (a name that is wrong is not)
    "network is unreachable",
    "no route to host",
    "connection reset by peer",
)
# PostgreSQL: the server is up and refuses what store.url names: waiting would not help.
PG_REFUSES = ("does not exist", "authentication failed", "no pg_hba.conf entry")
# MySQL / MariaDB client and server error codes of the same two kinds.
MYSQL_NOT_ANSWERING = frozenset(
    {
        1040,  # too many connections
        1053,  # server shutdown in progress
        1203,  # the user's max_user_connections
        2002,  # cannot connect through the socket
        2003,  # cannot connect over TCP (refused, timed out)
        2006,  # server has gone away
        2013,  # lost the connection during the handshake
    }
)
MYSQL_REFUSES = frozenset({1044, 1045, 1049, 1251, 1698})  # access denied, unknown database


def probe(url: str) -> None:
    """Connect to the server database at `url` once and close (for a start that waits for
    it). Raises NotAnswering when it is not there yet, BadStoreURL when it refuses what
    `url` names (an unknown database or user, a wrong password), StoreError otherwise.
    SQLite: nothing to wait for, returns at once (a file that cannot be opened is the
    store's error, never a wait)."""
    kind = urlsplit(url).scheme
    if kind == "sqlite":
        return
    db = open_database(url)
    db.connect_params.setdefault("connect_timeout", PROBE_CONNECT_TIMEOUT_S)
    try:
        db.connect()
    except (peewee.OperationalError, peewee.InterfaceError) as exc:
        said = first_line(exc)
        if not_answering(exc, backend(db)):
            raise NotAnswering(said) from exc
        if refuses(exc, backend(db)):
            raise BadStoreURL(f"store.url: the database server refuses it: {said}") from exc
        raise StoreError(f"cannot open the database ({backend(db)}): {said}") from exc
    db.close()


def first_line(exc: BaseException) -> str:
    """A driver's error on one line: MySQL's message without its code, PostgreSQL's
    without its hint lines."""
    args = exc.args
    text = str(args[1]) if len(args) == 2 and isinstance(args[0], int) else str(exc)
    return next((line.strip() for line in text.splitlines() if line.strip()), repr(exc))


def _mysql_code(exc: BaseException) -> int | None:
    return exc.args[0] if exc.args and isinstance(exc.args[0], int) else None


def not_answering(exc: BaseException, kind: str) -> bool:
    """Whether a failed connect means the server is not there yet: worth waiting for."""
    if kind == "mysql":
        code = _mysql_code(exc)
        said = str(exc).lower()
        unknown_host = code == 2003 and ("not known" in said or "nodename" in said)
        return code in MYSQL_NOT_ANSWERING and not unknown_host
    said = str(exc).lower()
    return any(pattern in said for pattern in PG_NOT_ANSWERING)


def refuses(exc: BaseException, kind: str) -> bool:
    """Whether a failed connect means the server refuses what store.url names."""
    if kind == "mysql":
        return _mysql_code(exc) in MYSQL_REFUSES
    said = str(exc).lower()
    return any(pattern in said for pattern in PG_REFUSES)


def _create_private_file(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def backend(db: peewee.Database) -> str:
    """`sqlite`, `postgresql` or `mysql`."""
    if isinstance(db, peewee.SqliteDatabase):
        return "sqlite"
    if isinstance(db, peewee.PostgresqlDatabase):
        return "postgresql"
    return "mysql"


def now_sql(db: peewee.Database) -> peewee.SQL:
    """An SQL expression for the database clock in epoch seconds (float).

    Lease expiry is always judged by this clock, never by a writer's own clock, so hosts
    with skewed clocks still agree on who holds a lease.
    """
    return peewee.SQL(
        {
            "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
            "postgresql": "(extract(epoch from clock_timestamp())::float8)",
            "mysql": "(UNIX_TIMESTAMP(NOW(6)) + 0.0)",
        }[backend(db)]
    )


def db_now(db: peewee.Database) -> float:
    """The database clock, in epoch seconds."""
    row = db.execute_sql(f"SELECT {now_sql(db).sql}").fetchone()
    return float(row[0])


def is_transient(exc: BaseException, kind: str) -> bool:
    """Whether retrying the whole transaction may succeed.

    SQLite: only a locked or busy database. PostgreSQL and MySQL: deadlocks, serialization
    failures and lost connections. Unique-key races are handled by `run_write` apart.
    """
    if kind == "sqlite":
        text = str(exc).lower()
        return isinstance(exc, peewee.OperationalError) and ("locked" in text or "busy" in text)
    return isinstance(exc, peewee.OperationalError | peewee.InterfaceError)


def _cause(exc: peewee.DatabaseError) -> peewee.DatabaseError:
    """The error that failed a transaction, not the failed rollback it left behind.

    SQLite ends a transaction by itself on some errors (a full disk), so the rollback
    that follows fails too, and would hide the reason ("database or disk is full").
    """
    found: BaseException | None = exc
    while found is not None:
        if isinstance(found, peewee.DatabaseError) and "cannot rollback" not in str(found):
            return found
        found = found.__context__
    return exc


IN_MAX = 500  # values in one IN (...) list: well within every backend's limits


def chunks(values: Sequence[str]) -> Iterator[Sequence[str]]:
    """`values` in slices of at most `IN_MAX`, for IN lists."""
    for start in range(0, len(values), IN_MAX):
        yield values[start : start + IN_MAX]


def run_write(
    db: peewee.Database,
    work: Callable[[], T],
    *,
    deadline: float = WRITE_DEADLINE_S,
    sleep: Callable[[float], None] = SYSTEM.sleep_blocking,
    clock: Callable[[], float] = SYSTEM.monotonic,
) -> T:
    """Run `work` in one write transaction, retrying transient failures until `deadline`.

    The transaction either commits as a whole or leaves nothing behind. Only after the
    commit returned does this return, so "returned" means "durable". An IntegrityError is
    retried twice (two idempotent inserts of one key raced; the retry finds the winner's
    row), then raised.
    """

    def attempt() -> T:
        with db.atomic():
            return work()

    return _retrying(db, attempt, deadline, sleep, clock)


def run_append(
    db: peewee.Database,
    begin: str,
    work: Callable[[Any], T],
    *,
    deadline: float = WRITE_DEADLINE_S,
    sleep: Callable[[float], None] = SYSTEM.sleep_blocking,
    clock: Callable[[], float] = SYSTEM.monotonic,
) -> T:
    """`run_write` for the event log: `work` gets this thread's DB-API cursor.

    The transaction is driven with plain `begin`/COMMIT statements on the cursor: no
    query is built and no transaction object is made on the hot path. Driver errors
    arrive as peewee's, so the retries are those of `run_write`. Never called inside a
    transaction: the event log writes on its committer thread, or on the caller's thread
    only when it has none open.
    """

    def attempt() -> T:
        cursor = db.cursor()
        with DRIVER_ERRORS:
            cursor.execute(begin)
            try:
                result = work(cursor)
                cursor.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(Exception):  # a dead connection: the error above says why
                    cursor.execute("ROLLBACK")
                raise
        return result

    return _retrying(db, attempt, deadline, sleep, clock)


def _retrying(
    db: peewee.Database,
    attempt: Callable[[], T],
    deadline: float,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> T:
    give_up = clock() + deadline
    busy = 0  # transient failures so far
    integrity_retries = 2
    while True:
        try:
            return attempt()
        except peewee.IntegrityError:
            if integrity_retries == 0:
                raise
            integrity_retries -= 1
        except peewee.DatabaseError as failed:
            exc = _cause(failed)
            if not is_transient(exc, backend(db)):
                raise exc from None
            if clock() >= give_up:
                raise StoreBusy(f"database write failed for {deadline:.0f} s: {exc}") from exc
            if backend(db) != "sqlite":
                # A broken server connection is dropped so the retry opens a new one.
                db.close()
            busy += 1
            sleep(BUSY_BACKOFF.delay(busy))
