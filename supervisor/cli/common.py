"""What every command shares: loading the configuration once, opening the store, the
daemon's pid and a client of it, the exit codes and one-line errors, and the table and
time formats."""

from __future__ import annotations

import functools
import io
import secrets
import sys
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, NoReturn, ParamSpec, TextIO, TypeVar

import click

from supervisor import locks
from supervisor.contract.config import (
    Config,
    ConfigError,
    Paths,
    load_config,
    make_private_dir,
    resolve_paths,
)
from supervisor.contract.printable import escape

if TYPE_CHECKING:
    from supervisor.cli.client import Client
    from supervisor.store import Store

P = ParamSpec("P")
R = TypeVar("R")

# Exit codes, as the README's table gives them (systemctl's and sysexits' conventions).
EX_OK = 0
EX_FAILURE = 1  # the command ran and failed, or found a failure (doctor, a tripped breaker)
EX_USAGE = 2  # a usage error (click's own)
EX_NOT_RUNNING = 3  # the daemon is not running, as `systemctl is-active` says
EX_CONFIG = 78  # the configuration is wrong (sysexits' EX_CONFIG; systemd does not restart)

CONFIG_HELP = (
    "Configuration file (default: $TURNKEEPER_CONFIG, else /etc/turnkeeper/turnkeeper.toml"
    " if present, else built-in defaults). Accepted before or after the command."
)


def config_error(message: str) -> NoReturn:
    """Print one line naming what to fix and exit 78 (EX_CONFIG), as systemd expects."""
    click.echo(f"turnkeeper: configuration error: {message}", err=True)
    sys.exit(EX_CONFIG)


def load(ctx: click.Context) -> Config:
    """The effective configuration for this invocation, loaded once."""
    obj = ctx.ensure_object(dict)
    if "config" not in obj:
        try:
            obj["config"] = load_config(obj.get("config_path"))
        except ConfigError as exc:
            config_error(str(exc))
    config: Config = obj["config"]
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


def daemon_pid(paths: Paths) -> int | None:
    """The pid of the daemon of these paths, from its lock; None: none is running."""
    return locks.holder(paths.state_dir / locks.LEADER_LOCK)


def reports_errors(command: Callable[P, R]) -> Callable[P, R]:
    """A ClientError becomes one line on stderr: exit 3 when the daemon is not running
    (as `systemctl is-active` says), 1 for any other failure."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from supervisor.cli.client import ClientError, DaemonNotRunning

        try:
            return command(*args, **kwargs)
        except DaemonNotRunning as exc:
            not_running(str(exc))
        except ClientError as exc:
            fail(str(exc))

    return wrapper


def connect(ctx: click.Context) -> Client:
    """A client of the configured daemon."""
    from supervisor.cli.client import Client

    return Client.from_config(load(ctx))


def fail(message: str, code: int = EX_FAILURE) -> NoReturn:
    """Print one line and exit `code` (1 unless told)."""
    click.echo(f"turnkeeper: {message}", err=True)
    sys.exit(code)


def not_running(message: str = "the daemon is not running") -> NoReturn:
    """Print one line and exit 3, as `systemctl is-active` does for an inactive unit."""
    fail(message, EX_NOT_RUNNING)


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
    """Give every command below `group` its own `--config`, so either place works."""
    for command in group.commands.values():
        if not any(getattr(p, "name", None) == "config_path" for p in command.params):
            command.params.append(config_option())
        if isinstance(command, click.Group):
            accept_config_everywhere(command)


def emit_json(data: object) -> None:
    """`--json` output: one JSON document on stdout, keys sorted, nothing else."""
    import json

    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON (shape in the README) instead of text."
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
