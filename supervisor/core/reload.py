"""What a reload changes, and what each change needs: pure rules over two configurations'
data (`model_dump(mode="json", by_alias=True)`), no I/O.

Rules
-----
- Two configurations are compared key by key, dotted (`pool.workers`). A named list
  (`mcp.servers`, `tasks.kinds`, `delivery.targets`) is compared entry by entry, by name:
  a field of an entry in both is `mcp.servers.NAME.FIELD`; an entry added or removed is
  `mcp.servers.NAME` whole, the other side absent (None); the same names in another order
  is the list's own key, its names before and after.
- Each changed key has one effect, from `EFFECTS`: the entry that is the key's shape (a
  named entry's name read as `*`) or the longest dotted prefix of it.
  - LIVE: the supervisor applies it itself once the reload swaps the configuration in;
  - WORKERS: a worker reads it, and a worker gets the whole configuration only when it
    starts, so every worker is replaced (the rolling restart); a key both read is WORKERS;
  - RESTART: read once, at the start; left as it was, and reported.
  A key no entry names needs a restart: nothing not proven applied is called live.
- `in_force(old, new)`: the new data with each RESTART key's value taken from the
  old, so that what the daemon runs with says what is in force.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Effect = Literal["live", "workers", "restart"]
Path = tuple[str, ...]

NAMED: frozenset[Path] = frozenset(
    {("mcp", "servers"), ("tasks", "kinds"), ("delivery", "targets")}
)
"""Lists of tables told apart by their `name`."""

EFFECTS: dict[str, Effect] = {
    # Read once at the start: the database, the directories, the listener and its limits.
    "daemon": "restart",
    "store": "restart",
    "http": "restart",  # read_timeout too: the listener times request heads by it
    "http.max_streams_per_principal": "live",  # read by each attach request
    "attach": "restart",  # the listener's stop timeout, fixed when it starts
    "lease.stale_after": "restart",  # the host row's time to live, fixed at the start
    "shutdown.kill_grace": "restart",  # the stop's cap, fixed at the start
    "tasks.work_dir": "restart",  # judged against the state directory at the start
    # The supervisor's exporter is made at its start; its workers and it export alike.
    "telemetry": "restart",
    # Read anew at each use by the supervisor's parts (the reload swaps them a new one).
    "auth": "live",  # tokens file re-read and judged as at a start; metrics_public
    "pool.workers": "live",  # slots added or retired
    "pool.spare": "live",
    "pool.hang_timeout": "live",  # a worker started with the interval in force is judged by it
    "shutdown.drain_budget": "live",
    "shutdown.subagent_drain": "live",
    "recovery": "live",  # the supervisor's decisions and scans read it at each use
    "subagents": "live",
    "tasks": "live",
    "schedules": "live",
    "delivery": "live",  # the courier's next pass; targets' events synced to their sessions
    "delivery.targets.*.url": "live",
    "delivery.targets.*.timeout": "live",
    "delivery.targets.*.events": "live",
    "delivery.targets.*.principals": "live",
    # Read by the workers (the supervisor may read them too).
    "pool.heartbeat_interval": "workers",  # workers beat at it, the supervisor judges by it
    "pool.history_cache_mb": "workers",
    "agent": "workers",  # loaded by workers; the API checks a session's choice
    "model": "workers",
    "mcp": "workers",
    "tools": "workers",  # each worker cuts its tools' results
    "budget": "workers",  # each worker's turns check their budgets
    # A worker's runners take their continuation schedule at its start (recovery judges by
    # it too).
    "recovery.auto_continue": "workers",
    "recovery.attempt_delays": "workers",
    "subagents.max_depth": "workers",
    "subagents.max_children": "workers",
    "subagents.max_total_per_root": "workers",
    "tasks.kinds": "workers",  # the start_task tool; the task keeper runs them
    "tasks.max_running": "workers",
    "tasks.max_running_total": "workers",  # the keeper's claims, and the start's answer
    "tasks.max_running_per_principal": "workers",
    # An added target's secret variable is dropped from a worker's environment at its start.
    "delivery.targets.*": "workers",
    "log": "workers",  # each process sets its own logger up
    "restart": "workers",  # the restart desk reads it anew; workers offer request_restart by it
    "restart.turn_wait": "live",  # the restart desk's alone
    "restart.drain_budget": "live",  # read when a restart begins
}


@dataclass(frozen=True)
class Change:
    """One key the reload found changed: its values (secrets masked) and what it needs."""

    key: str  # dotted, e.g. "pool.workers", "mcp.servers.files.command"
    before: Any  # None: absent (an entry added)
    after: Any  # None: absent (an entry removed)
    effect: Effect

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "before": self.before, "after": self.after, "effect": self.effect}


def changes(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    shown_old: Mapping[str, Any] | None = None,
    shown_new: Mapping[str, Any] | None = None,
) -> list[Change]:
    """Every key whose value differs between `old` and `new`, in the order of the data.

    The values shown are read from `shown_old` and `shown_new` (the same data with secrets
    masked) when given; the comparison is always of `old` and `new`.
    """
    found = []
    for path, before, after in differences(old, new):
        if path not in NAMED:  # a named list's own change shows its names: no secret
            before = before if shown_old is None else value_at(shown_old, path)
            after = after if shown_new is None else value_at(shown_new, path)
        found.append(Change(".".join(path), before, after, effect_of(path)))
    return found


def differences(
    old: Mapping[str, Any], new: Mapping[str, Any], prefix: Path = ()
) -> Iterator[tuple[Path, Any, Any]]:
    """(path, before, after) of every difference; absent is None."""
    for key in dict.fromkeys([*old, *new]):
        path = (*prefix, key)
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if path in NAMED and isinstance(before, list) and isinstance(after, list):
            yield from _named(path, before, after)
        elif isinstance(before, Mapping) and isinstance(after, Mapping):
            yield from differences(before, after, path)
        else:
            yield path, before, after


def _named(path: Path, old: list[Any], new: list[Any]) -> Iterator[tuple[Path, Any, Any]]:
    before, after = _by_name(old), _by_name(new)
    if list(before) != list(after) and set(before) == set(after):
        yield path, list(before), list(after)  # the order alone (the first wins a clash)
    for name in dict.fromkeys([*before, *after]):
        entry, other = before.get(name), after.get(name)
        if entry == other:
            continue
        if isinstance(entry, Mapping) and isinstance(other, Mapping):
            yield from differences(entry, other, (*path, name))
        else:
            yield (*path, name), entry, other


def _by_name(entries: list[Any]) -> dict[str, Any]:
    return {str(entry.get("name")): entry for entry in entries if isinstance(entry, Mapping)}


def value_at(data: Mapping[str, Any], path: Path) -> Any:
    """The value at `path` (a named list's entries by name); None if there is none."""
    node: Any = data
    for depth, part in enumerate(path):
        if isinstance(node, list) and path[:depth] in NAMED:
            node = _by_name(node).get(part)
        elif isinstance(node, Mapping):
            node = node.get(part)
        else:
            return None
    return node


def shape(path: Path) -> str:
    """The key of `path` as `EFFECTS` names it: a named entry's name read as `*`."""
    return ".".join(_shape(path))


def _shape(path: Path) -> list[str]:
    return ["*" if path[:depth] in NAMED else part for depth, part in enumerate(path)]


def effect_of(path: Path) -> Effect:
    """What a change of `path` needs (see the rules in the module's docstring)."""
    parts = _shape(path)
    for end in range(len(parts), 0, -1):
        found = EFFECTS.get(".".join(parts[:end]))
        if found is not None:
            return found
    return "restart"


def in_force(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` with the old value of every key that needs a restart: what is in force.

    Raises ValueError for a restart key inside a named list (`EFFECTS` names none).
    """
    data = copy.deepcopy(dict(new))
    for path, before, _ in differences(old, new):
        if effect_of(path) != "restart":
            continue
        if any(path[:depth] in NAMED for depth in range(1, len(path))):
            raise ValueError(f"{'.'.join(path)}: a key of a named list cannot be left as it was")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if before is None:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = copy.deepcopy(before)
    return data
