"""`turnkeeper sessions`: list and show sessions from the database (they work while the
daemon is down), close one through the daemon, release a quarantined one.

`show` reads like `tail`: the newest events by default, `--follow` for the ones still
to come (polling the database, so it needs no daemon and no token).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import connect, find_daemon, json_option, load, reports_errors, when
from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import SessionCount, SessionStatus, SubagentStatus

if TYPE_CHECKING:
    from supervisor.store import EventRecord, SessionInfo, Store, SubagentInfo

DEFAULT_TAIL = 20  # events `sessions show` prints when told neither --tail nor --after
POLL_INTERVAL = 0.2  # seconds between two reads of the log by `sessions show --follow`
PAGE = 1000  # events read from the database at a time


@click.group("sessions")
def sessions_group() -> None:
    """Sessions: list and show them (from the database), close or release one."""


@sessions_group.command("list")
@click.option("--limit", default=50, show_default=True, help="Show at most this many.")
@json_option
@click.pass_context
def sessions_list(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List sessions, newest first."""
    from supervisor.cli.common import emit_json, open_store

    with open_store(ctx, migrate=False) as store:
        sessions = store.sessions.list(limit=limit)
    if as_json:
        emit_json({"sessions": [session_json(s) for s in sessions]})
    elif not sessions:
        click.echo("no sessions")
    else:
        click.echo(_sessions_table(sessions, SYSTEM.time()))


def _sessions_table(sessions: list[SessionInfo], now: float) -> str:
    """ID, STATE, EVENTS, UPDATED, and the title in what is left of the terminal."""
    from supervisor.cli.common import table

    rows = [[s.id, state_of(s), str(s.last_seq), ago(now - s.updated_at)] for s in sessions]
    widths = [
        max(len(r[i]) for r in [["ID", "STATE", "EVENTS", "UPDATED"], *rows]) for i in range(4)
    ]
    room = max(_columns() - sum(widths) - 2 * len(widths), 10)
    for row, info in zip(rows, sessions, strict=True):
        row.append(clip(info.title, room))
    return table(["ID", "STATE", "EVENTS", "UPDATED", "TITLE"], rows)


def state_of(info: SessionInfo) -> str:
    """A session's status, with open ones told apart: running (a turn in flight), pending
    (input waiting for a turn) or open (idle)."""
    if info.status != SessionStatus.OPEN:
        return info.status
    if info.active_turn_id:
        return SessionCount.RUNNING
    return SessionCount.PENDING if info.pending else SessionStatus.OPEN


def session_json(info: SessionInfo) -> dict[str, Any]:
    """The API's shape of a session, plus what only the operator sees."""
    return {
        **info.to_dict(),
        "state": state_of(info),
        "owner": info.owner,
        "attempt_count": info.attempt_count,
        "quarantined_at": info.quarantined_at,
        "quarantine_reason": info.quarantine_reason,
    }


@sessions_group.command("show")
@click.argument("session_id", metavar="ID")
@click.option(
    "--tail",
    metavar="N",
    type=click.IntRange(min=0),
    default=None,
    help=f"Show the newest N events [default: {DEFAULT_TAIL}, unless --after is given].",
)
@click.option(
    "--after",
    metavar="SEQ",
    type=click.IntRange(min=0),
    default=None,
    help="Only events with a larger seq; all of them unless --tail is given too "
    "(--after 0: the whole history).",
)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events; Ctrl-C ends.")
@click.option("--full", is_flag=True, help="Do not truncate: whole texts and payloads.")
@json_option
@click.pass_context
def sessions_show(
    ctx: click.Context,
    session_id: str,
    tail: int | None,
    after: int | None,
    follow: bool,
    full: bool,
    as_json: bool,
) -> None:
    """Show one session and its events, readably: by default the newest 20.

    Before the events: the session's parent, if it is a subagent, and the subagents it
    spawned, theirs indented below each. With both --after and --tail: the newest N of
    the events after that seq. With --follow --json: one event a line (JSON Lines), the
    session itself not printed.
    """
    from supervisor.cli.common import emit_json, fail, open_store
    from supervisor.store import SessionNotFound
    from supervisor.store.waiting import waiting_for

    with open_store(ctx, migrate=False) as store:
        try:
            info = store.sessions.get(session_id)
        except SessionNotFound as exc:
            fail(str(exc))
        config = load(ctx)
        use = store.events.context_use(session_id, config.model.context_window)
        waiting = waiting_for(store, info, tuple(config.recovery.attempt_delays))
        if tail is None and after is None:
            tail = DEFAULT_TAIL
        start = _start(info.last_seq, tail, after)
        events = _read_all(store, session_id, start, limit=tail)
        omitted = start - (after or 0)
        tree = subagent_tree(store, session_id)
        if as_json and not follow:
            emit_json(
                {
                    "session": {
                        **session_json(info),
                        "acl": store.acl.entries(session_id),
                        "context": use,
                    },
                    "subagents": [child.to_dict() for _, child in tree],
                    "events": [e.to_dict() for e in events],
                    "omitted": omitted,
                }
            )
            return
        show = _json_line if as_json else _line_printer(full)
        if not as_json:
            acl = store.acl.entries(session_id)
            _header(info, acl, omitted, _tree_lines(store, info, tree), use, waiting)
        for event in events:
            show(event)
        if follow:
            _follow(store, session_id, events[-1].seq if events else start, show)


def _start(last_seq: int, tail: int | None, after: int | None) -> int:
    """The seq after which to show events: --after, moved up to leave only --tail."""
    first = after or 0
    return first if tail is None else max(first, last_seq - tail)


def _read_all(store: Store, session_id: str, after: int, limit: int | None) -> list[EventRecord]:
    """Events after `after`, oldest first, at most `limit` (None: all), a page at a time."""
    found: list[EventRecord] = []
    while limit is None or len(found) < limit:
        want = PAGE if limit is None else min(PAGE, limit - len(found))
        page = store.events.read(session_id, after=found[-1].seq if found else after, limit=want)
        found.extend(page)
        if len(page) < want:
            break
    return found


def _follow(store: Store, session_id: str, after: int, show: Callable[[EventRecord], None]) -> None:
    """Print events as they are committed, polling the log, until Ctrl-C (exit 0)."""
    try:
        while True:
            page = store.events.read(session_id, after=after, limit=PAGE)
            for event in page:
                show(event)
                after = event.seq
            if len(page) < PAGE:
                SYSTEM.sleep_blocking(POLL_INTERVAL)
    except KeyboardInterrupt:
        return


def subagent_tree(store: Store, session_id: str) -> list[tuple[int, SubagentInfo]]:
    """The session's subagents and theirs, depth first, oldest first among siblings, each
    with its level below the session (1: a child)."""
    found: list[tuple[int, SubagentInfo]] = []

    def visit(parent_id: str, level: int) -> None:
        for child in store.subagents.children(parent_id):
            found.append((level, child))
            visit(child.id, level + 1)

    visit(session_id, 1)
    return found


def _tree_lines(store: Store, info: SessionInfo, tree: list[tuple[int, SubagentInfo]]) -> list[str]:
    """The session's parent, if it is a subagent, and its own subagents, indented by level."""
    lines: list[str] = []
    if info.parent:
        me = store.subagents.get(info.id)
        role = "" if me is None else f"  (subagent at depth {me.depth}, {me.status})"
        lines.append(f"parent   {info.parent}{role}")
    if tree:
        running = sum(child.status == SubagentStatus.RUNNING for _, child in tree)
        lines.append(f"subagents {len(tree)} ({running} running)")
    width = _columns()
    for level, child in tree:
        title = " ".join((child.title or child.task).split())
        lines.append(clip(f"{'  ' * level}- {child.id}  {child.status:<9}  {title}", width))
    return lines


def _header(
    info: SessionInfo,
    acl: dict[str, str],
    omitted: int,
    tree: list[str],
    use: dict[str, Any],
    waiting: str | None = None,
) -> None:
    """The session's row, one labelled line per fact, as `systemctl status` does; its
    context use; what it waits for; its parent and subagents; then how many earlier
    events the listing leaves out."""
    click.echo(f"session  {info.id}  ({info.kind}, {state_of(info)})")
    if info.title:
        click.echo(f"title    {info.title}")
    click.echo(f"created  {when(info.created_at)}   updated {when(info.updated_at)}")
    click.echo(f"events   {info.last_seq}   active turn {info.active_turn_id or '-'}")
    click.echo(f"owner    {info.owner or '-'} (lease token {info.lease_token})")
    click.echo("acl      " + ", ".join(f"{p}={perm}" for p, perm in sorted(acl.items())))
    click.echo("context  " + context_line(use))
    if waiting is not None:
        click.echo(f"waiting: {waiting}")
    if info.quarantined_at is not None:
        click.echo(f"quarantined {when(info.quarantined_at)}: {info.quarantine_reason}")
    if info.resend_requested_at is not None:
        click.echo(
            f"asked the user to resend {when(info.resend_requested_at)} "
            "(recovery could not continue a turn)"
        )
    for line in tree:
        click.echo(line)
    if omitted:
        click.echo(
            f"({omitted} earlier event{'' if omitted == 1 else 's'} not shown: "
            "--tail N for more, --after 0 for all)"
        )


def context_line(use: dict[str, Any]) -> str:
    """`context_use` in one line: `812 / 1024 tokens (79%), 3 compactions, last at ...`."""
    tokens, window = use["last_prompt_tokens"], use["window"]
    if tokens is None:
        head = "no prompt yet"
    else:
        head = f"{tokens} / {window or 'unknown window'} tokens in the last prompt"
        head += f" ({use['used']:.0%})" if use["used"] is not None else ""
    count = use["compactions"]
    line = f"{head}, {count} compaction{'' if count == 1 else 's'}"
    last = use["last_compaction"]
    if last is not None:
        line += (
            f", the last {when(last['at'])} up to seq {last['to_seq']} "
            f"({last['tokens_before']} -> {last['tokens_after']} tokens)"
        )
    return line


def _line_printer(full: bool) -> Callable[[EventRecord], None]:
    """How `show` prints an event: one line fitted to the terminal, or whole (--full)."""
    width = None if full else _columns()

    def show(event: EventRecord) -> None:
        click.echo(
            event_line(event.seq, event.created_at, event.type, event.turn_id, event.payload, width)
        )

    return show


def _json_line(event: EventRecord) -> None:
    click.echo(json.dumps(event.to_dict(), sort_keys=True, ensure_ascii=False))


def event_line(
    seq: int,
    created_at: float,
    type_: str,
    turn_id: str | None,
    payload: dict[str, Any],
    width: int | None,
) -> str:
    """One event: seq, time, type, and its text fitted into `width` columns; with `width`
    None the whole text (its lines indented) and the turn id."""
    head = event_head(seq, created_at, type_)
    if width is None:
        turn = f"turn={turn_id}  " if turn_id else ""
        return f"{head}  {turn}{_text(payload)}".replace("\n", "\n        ")
    return f"{head}  {summarize(payload, max(width - len(head) - 2, 20))}"


def event_head(seq: int, created_at: float, type_: str) -> str:
    """The columns every event line starts with: seq, time, type."""
    return f"{seq:>6}  {when(created_at)}  {type_:<15}"


def summarize(payload: dict[str, object], width: int = 100) -> str:
    """One line of an event payload: its text if it has one, else compact JSON."""
    return clip(" ".join(_text(payload).split()), width)


def _text(payload: dict[str, object]) -> str:
    text = payload.get("text")
    if isinstance(text, str) and text:
        return text
    return json.dumps(payload, ensure_ascii=False, sort_keys=True)


def clip(text: str, width: int) -> str:
    """`text` cut to `width` columns, an ellipsis marking the cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def ago(seconds: float) -> str:
    """A short age, as `docker ps` and `kubectl get` show them: 45s, 12m, 3h, 2d."""
    seconds = max(seconds, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def _columns() -> int:
    """The terminal's width; 80 when there is none (piped), or $COLUMNS."""
    return shutil.get_terminal_size((80, 24)).columns


@sessions_group.command("close")
@click.argument("session_id", metavar="ID")
@json_option
@click.pass_context
@reports_errors
def sessions_close(ctx: click.Context, session_id: str, as_json: bool) -> None:
    """Close a session through the daemon: it takes no more turns; its history is kept.

    Needs the running daemon (exit 3 without it) and admin access to the session.
    """
    from supervisor.cli.common import not_running

    found = find_daemon(ctx)
    if found.running is None and found.unknown is None:  # unknown: connect says why
        not_running("the daemon is not running; `sessions close` needs it (`turnkeeper run`)")
    with connect(ctx) as client:
        already = client.get_session(session_id)["status"] == SessionStatus.CLOSED
        if not already:
            client.close_session(session_id)
    _report(
        as_json,
        {"id": session_id, "status": SessionStatus.CLOSED, "already_closed": already},
        f"session {session_id} was already closed"
        if already
        else f"closed session {session_id}: it takes no more turns; its history is kept",
    )


@sessions_group.command("release")
@click.argument("session_id", metavar="ID")
@json_option
@click.pass_context
@reports_errors
def sessions_release(ctx: click.Context, session_id: str, as_json: bool) -> None:
    """Lift a session's quarantine; the user can then send a message again.

    Through the daemon when it runs (for anyone with write access to the session, e.g.
    its owner with $TURNKEEPER_TOKEN); else in the database, as the operator.
    """
    found = find_daemon(ctx)
    if found.running is None and found.unknown is None:
        released, status = _release_in_database(ctx, session_id)
        via = "database"
    else:
        released, status = _release_through_api(ctx, session_id)
        via = "api"
    if released:
        text = f"released session {session_id}: the next message starts a new turn"
    else:
        text = f"session {session_id} is not quarantined ({status}); nothing to release"
    if via == "database":
        text += " (the daemon is not running: done in the database)"
    _report(as_json, {"id": session_id, "released": released, "status": status, "via": via}, text)


def _release_through_api(ctx: click.Context, session_id: str) -> tuple[bool, str]:
    with connect(ctx) as client:
        answer = client.release_session(session_id)
    return bool(answer["released"]), str(answer["status"])


def _release_in_database(ctx: click.Context, session_id: str) -> tuple[bool, str]:
    from supervisor.cli.common import fail, open_store
    from supervisor.store import SessionNotFound

    with open_store(ctx, migrate=False) as store:
        try:
            released = bool(store.sessions.release(session_id))
        except SessionNotFound as exc:
            fail(str(exc))
        return released, store.sessions.get(session_id).status


def _report(as_json: bool, data: dict[str, Any], text: str) -> None:
    from supervisor.cli.common import emit_json

    if as_json:
        emit_json(data)
    else:
        click.echo(text)
