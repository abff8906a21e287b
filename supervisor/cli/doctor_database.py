"""`turnkeeper doctor`'s look at the database: reachable, durable, and what it says about
the daemon (quarantined sessions, the restart breaker, stale leases)."""

from __future__ import annotations

from supervisor.cli.doctor import FAIL, PASS, WARN, Finding, check_sqlite
from supervisor.contract.config import Config
from supervisor.store import BadStoreURL, SchemaMissing, Store, StoreError


def check_database(cfg: Config, url: str, *, daemon_running: bool) -> list[Finding]:
    """Open the database without migrating it (that is the daemon's job) and judge it.

    A bad `store.url` fails as `run` fails on it; a database not created yet is only a
    warning, since `run` creates it.
    """
    try:
        store = Store(url, cfg.store.synchronous, migrate=False)
    except BadStoreURL as exc:
        return [Finding(FAIL, "store.url", str(exc).removeprefix("store.url: "), "correct it")]
    except SchemaMissing as exc:
        return [Finding(WARN, "database", str(exc), "the daemon creates it at its first start")]
    except (StoreError, OSError) as exc:
        return [Finding(FAIL, "database", str(exc), "check store.url and the database server")]
    with store:
        findings = [
            Finding(PASS, "database", f"{store.backend} reachable, schema {store.schema_version}")
        ]
        if store.backend == "sqlite":
            mode = store.db.execute_sql("PRAGMA journal_mode").fetchone()[0]
            level = store.db.execute_sql("PRAGMA synchronous").fetchone()[0]
            findings += check_sqlite(str(mode), int(level))
        findings.append(_quarantine(store))
        findings.append(_breaker(store, cfg))
        findings.append(_leases(store, daemon_running))
    return findings


def _quarantine(store: Store) -> Finding:
    quarantined = store.sessions.counts().get("quarantined", 0)
    if not quarantined:
        return Finding(PASS, "quarantine", "no session quarantined")
    return Finding(
        WARN,
        "quarantine",
        f"{quarantined} sessions quarantined",
        "see `turnkeeper sessions list`; lift with `turnkeeper sessions release ID`",
    )


def _breaker(store: Store, cfg: Config) -> Finding:
    from supervisor.cli.store_commands import breaker_state

    state = breaker_state(store, cfg)
    if state.tripped:
        return Finding(
            WARN,
            "breaker",
            f"tripped: {state.reason}",
            "find why the daemon keeps dying (`turnkeeper boots`, the log); once fixed, "
            "`turnkeeper breaker reset`",
        )
    if state.fails_open:
        return Finding(WARN, "breaker", state.reason, "check the database")
    return Finding(PASS, "breaker", f"clear: {state.reason}")


def _leases(store: Store, running: bool) -> Finding:
    stale = [
        s
        for s in store.sessions.with_work()
        if s.active_turn_id and s.owner and (s.lease_expires_at or 0) < store.now()
    ]
    if stale and running:
        return Finding(
            WARN,
            "leases",
            f"{len(stale)} turns in flight with a stale lease while the daemon runs",
            "check the log for workers that stopped responding",
        )
    idle = "" if running else " (the daemon is not running: they are continued at its next start)"
    return Finding(PASS, "leases", f"{len(stale)} stale leases{idle}")
