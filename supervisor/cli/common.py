"""What every command shares: loading the configuration once, opening the store, the
daemon's pid and a client of it, the exit codes and one-line errors, and the table and
time formats."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import secrets
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, ParamSpec, TextIO, TypeVar

import click

from supervisor import locks
from supervisor.contract.config import (
    Config,
    ConfigError,
    Paths,
    config_file,
    load_config,
    make_private_dir,
    read_file,
    resolve_paths,
)
from supervisor.contract.printable import escape

if TYPE_CHECKING:
    from supervisor.cli.client import Client
    from supervisor.cli.discovery import Search
    from supervisor.store import Store

P = ParamSpec("P")
R = TypeVar("R")

# Exit codes (systemctl's and sysexits' conventions); docs/reference/exit-codes.md is
# generated from these lines, comments included.

EX_OK = 0  # success
EX_FAILURE = 1  # the command ran and failed, or found a failure (doctor, a tripped breaker)
EX_USAGE = 2  # a usage error (click's own)
EX_NOT_RUNNING = 3  # the daemon is not running, as `systemctl is-active` says
# The command cannot tell whether the daemon runs, or may not use it: this user may not
# read its directories or its token (LSB's "status unknown" and "insufficient privilege").
EX_UNKNOWN = 4
EX_CONFIG = 78  # the configuration is wrong (sysexits' EX_CONFIG; systemd does not restart)

CONFIG_HELP = (
    "Configuration file (default: $TURNKEEPER_CONFIG, else /etc/turnkeeper/turnkeeper.toml"
    " if present, else built-in defaults). Accepted before or after the command."
)
STATE_DIR_HELP = (
    "The daemon's state directory, for every command (default: $TURNKEEPER_STATE_DIR, else"
    " daemon.state_dir; else the command line looks in the service's /var/lib/turnkeeper,"
    " then in ~/.local/state/turnkeeper). Accepted before or after the command."
)
# What `--state-dir` and $TURNKEEPER_STATE_DIR set, for `run` (and a reload's or a
# restart's reading of the file again) as for every other command.
STATE_DIR_VARIABLE = "TURNKEEPER_STATE_DIR"
STATE_DIR_KEY_VARIABLE = "TURNKEEPER_DAEMON__STATE_DIR"


def config_error(message: str) -> NoReturn:
    """Print one line naming what to fix and exit 78 (EX_CONFIG), as systemd expects."""
    click.echo(f"turnkeeper: configuration error: {message}", err=True)
    sys.exit(EX_CONFIG)


def load(ctx: click.Context, *, lenient: bool = False) -> Config:
    """The effective configuration for this invocation, loaded once.

    A file that does not load is exit 78, unless `lenient` (a command that only talks to
    the running daemon): then a warning names the file and line, and the command goes on
    with what the file's directories and address still say, and with what the daemon
    published (`supervisor.cli.discovery`). A later strict `load` still exits 78.
    """
    obj = ctx.ensure_object(dict)
    if "config" not in obj:
        try:
            obj["config"] = load_config(obj.get("config_path"))
        except ConfigError as exc:
            if not lenient:
                config_error(str(exc))
            obj["broken"] = str(exc)
            click.echo(f"turnkeeper: warning: {broken_file_warning(exc)}", err=True)
            obj["config"] = salvage(config_file(obj.get("config_path"), os.environ))
    elif not lenient and "broken" in obj:
        config_error(obj["broken"])
    config: Config = obj["config"]
    return config


def broken_file_warning(exc: ConfigError) -> str:
    """A configuration error as a warning of a command that goes on without the file: the
    message, with the line of the key it names when the message has no line of its own."""
    message = str(exc)
    key, _, rest = message.partition(": ")
    line = None if " line " in message else key_line(key, message)
    at = f" (line {line})" if line is not None else ""
    return f"{key}{at}: {rest}; going on without it, with what the running daemon published"


def key_line(key: str, message: str) -> int | None:
    """The line of `section.key` in the file a message ends with `[file PATH]`, if found."""
    match = re.search(r"\[file (.+)\]$", message)
    section, _, name = key.partition(".")
    name = re.split(r"[.\[]", name)[0]
    if match is None or not name:
        return None
    try:
        lines = Path(match[1]).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    current = ""
    for number, text in enumerate(lines, 1):
        stripped = text.strip()
        if stripped.startswith("["):
            current = stripped.strip("[] ")
        elif current == section and re.match(rf"{re.escape(name)}\s*=", stripped):
            return number
    return None


def salvage(file: Path | None) -> Config:
    """What a configuration file that does not load still says of where the daemon is:
    its `daemon.state_dir`, `daemon.runtime_dir`, `http.listen` and `store.url`, each
    when it is valid; the defaults for the rest."""
    wanted = {"daemon": ("state_dir", "runtime_dir"), "http": ("listen",), "store": ("url",)}
    raw: dict[str, object] = {}
    if file is not None:
        with contextlib.suppress(ConfigError):
            raw = read_file(file)
    good: dict[str, dict[str, str]] = {}
    for section, keys in wanted.items():
        table = raw.get(section)
        for key in keys:
            value = table.get(key) if isinstance(table, dict) else None
            if not isinstance(value, str):
                continue
            with contextlib.suppress(ValueError):  # pydantic's ValidationError is one
                Config.model_validate({section: {key: value}})
                good.setdefault(section, {})[key] = value
    config = Config.model_validate(good)
    override = os.environ.get(STATE_DIR_KEY_VARIABLE)
    if override:
        config = config.model_copy(
            update={"daemon": config.daemon.model_copy(update={"state_dir": override})}
        )
    return config


def open_store(ctx: click.Context, *, migrate: bool) -> Store:
    """The store of the configured database; errors become one line, not a traceback."""
    from supervisor.store import BadStoreURL, Store, StoreError  # only commands that need it

    cfg = load(ctx)
    paths = resolve_paths(cfg)
    try:
        if migrate:
            make_private_dir(paths.state_dir)
        return Store(paths.db_url, cfg.store.synchronous, migrate=migrate)
    except BadStoreURL as exc:
        config_error(str(exc))
    except (StoreError, OSError) as exc:
        fail(str(exc))


def daemon_pid(where: Paths | Path) -> int | None:
    """The pid of the daemon of these paths (or this state directory), from its lock;
    None: none is running."""
    state_dir = where if isinstance(where, Path) else where.state_dir
    return locks.holder(state_dir / locks.LEADER_LOCK)


def reports_errors(command: Callable[P, R]) -> Callable[P, R]:
    """A ClientError becomes one line on stderr: exit 3 when the daemon is not running
    (as `systemctl is-active` says), 4 when this user cannot tell or may not use it, 1
    for any other failure."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from supervisor.cli.client import CannotTell, ClientError, DaemonNotRunning

        try:
            return command(*args, **kwargs)
        except DaemonNotRunning as exc:
            ctx = click.get_current_context(silent=True)
            unknown = ctx.ensure_object(dict).get("unknown") if ctx is not None else None
            if unknown is not None:  # it may run elsewhere, in the place it could not read
                fail(
                    f"cannot tell whether the daemon runs: {unknown} ({exc.reason}): run as "
                    "the service user",
                    EX_UNKNOWN,
                )
            not_running(str(exc))
        except CannotTell as exc:
            fail(str(exc), EX_UNKNOWN)
        except ClientError as exc:
            fail(str(exc))

    return wrapper


def find_daemon(ctx: click.Context) -> Search:
    """Where the daemon runs, as `supervisor.cli.discovery` finds it (once a command)."""
    from supervisor.cli import discovery

    obj = ctx.ensure_object(dict)
    if "search" not in obj:
        obj["search"] = discovery.find(load(ctx, lenient=True))
    found: Search = obj["search"]
    return found


def connect(ctx: click.Context) -> Client:
    """A client of the running daemon, where it publishes that it listens, with its token.

    None found: DaemonNotRunning, unless $TURNKEEPER_TOKEN is set, which is tried at
    `http.listen` (a daemon of another host, or in a place this user may not read). A
    place this user may not read, without that token, is CannotTell.
    """
    from supervisor.cli.client import (
        TOKEN_VARIABLE,
        CannotTell,
        Client,
        DaemonNotRunning,
        token_of,
    )

    cfg = load(ctx, lenient=True)
    found = find_daemon(ctx)
    advice = found.start_advice()
    if found.running is not None:
        token, source = token_of(found.running.token_file)
        return Client(found.running.listen, token, source, advice, found.running.pid)
    told = bool(os.environ.get(TOKEN_VARIABLE, "").strip())
    if found.unknown is not None:
        if not told:
            raise CannotTell(
                f"cannot tell whether the daemon runs: {found.unknown}: run as the service "
                f"user or set ${TOKEN_VARIABLE}"
            )
        unknown = f"{found.unknown}, and nothing answers at {cfg.http.listen}"
        ctx.ensure_object(dict)["unknown"] = unknown
    elif not told:  # no process holds a lock where it could run: it does not
        raise DaemonNotRunning(found.not_running(), "not running")
    token, source = token_of(Path(), os.environ)  # $TURNKEEPER_TOKEN
    return Client(cfg.http.listen, token, source, advice)


def fail(message: str, code: int = EX_FAILURE) -> NoReturn:
    """Print one line and exit `code` (1 unless told)."""
    click.echo(f"turnkeeper: {message}", err=True)
    sys.exit(code)


def not_running(message: str = "the daemon is not running") -> NoReturn:
    """Print one line and exit 3, as `systemctl is-active` does for an inactive unit."""
    fail(message, EX_NOT_RUNNING)


def remember_state_dir(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """`--state-dir DIR`: `daemon.state_dir` for this command, whichever it is (for `run`,
    also for what a reload or a restart reads again: it goes in the environment)."""
    if value is not None:
        os.environ[STATE_DIR_KEY_VARIABLE] = str(Path(value).absolute())
    elif ctx.parent is None and os.environ.get(STATE_DIR_VARIABLE):  # once, before the command
        os.environ[STATE_DIR_KEY_VARIABLE] = str(Path(os.environ[STATE_DIR_VARIABLE]).absolute())


def state_dir_option() -> click.Option:
    """`--state-dir DIR`, before or after the command (the later one wins)."""
    return click.Option(
        ["--state-dir", "state_dir"],
        type=click.Path(file_okay=False),
        default=None,
        expose_value=False,
        is_eager=True,
        callback=remember_state_dir,
        help=STATE_DIR_HELP,
    )


def _remember_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(dict)["config_path"] = value


def config_option() -> click.Option:
    """`--config FILE` on a subcommand: the same as before it (the later one wins)."""
    return click.Option(
        ["--config", "config_path"],
        type=str,
        default=None,
        expose_value=False,
        is_eager=True,
        callback=_remember_config,
        help=CONFIG_HELP,
    )


def accept_config_everywhere(group: click.Group) -> None:
    """Give every command below `group` its own `--config` and `--state-dir`, so either
    place works."""
    for command in group.commands.values():
        if not any(getattr(p, "name", None) == "config_path" for p in command.params):
            command.params.append(config_option())
        if not any(getattr(p, "name", None) == "state_dir" for p in command.params):
            command.params.append(state_dir_option())
        if isinstance(command, click.Group):
            accept_config_everywhere(command)


def emit_json(data: object) -> None:
    """`--json` output: one JSON document on stdout, keys sorted, nothing else."""
    import json

    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON (shapes in the docs: the command line) instead of text.",
)


def colour(text: str, fg: str, *, err: bool = False) -> str:
    """`text` in colour on a terminal, plain when piped or with NO_COLOR set."""
    import os

    stream = sys.stderr if err else sys.stdout
    if os.environ.get("NO_COLOR") or not stream.isatty():
        return text
    # Our own escape codes get through `Escaped`, marked by a token no other text knows.
    return click.style(text, fg=fg).replace("\x1b", _OUR_ESCAPE)


_OUR_ESCAPE = f"<{secrets.token_hex(16)}>"


class Escaped(io.TextIOBase):
    """A text stream that shows what it is given with control characters escaped
    (`supervisor.contract.printable`; newlines and tabs kept), so that no title, message
    or reason phrase printed in a table or a line can act on the terminal. `colour`'s own
    codes are the only ones that get through."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(escape(text, keep="\n\t").replace(_OUR_ESCAPE, "\x1b"))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding


def escape_output(ctx: click.Context) -> None:
    """Print through `Escaped` for the rest of the command (stdout and stderr)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, Escaped):
            setattr(sys, name, Escaped(stream))
            ctx.call_on_close(functools.partial(setattr, sys, name, stream))


def when(epoch: float | None) -> str:
    """A local, second-precision time for tables."""
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [
        max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)
    ]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)
