"""What every command shares: loading the configuration once, opening the store, the
exit codes and one-line errors, and the table and time formats."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import NoReturn

import click

from supervisor.contract.config import (
    Config,
    ConfigError,
    load_config,
    make_private_dir,
    resolve_paths,
)
from supervisor.store import BadStoreURL, Store, StoreError

EX_CONFIG = 78


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


def fail(message: str) -> NoReturn:
    """Print one line and exit 1."""
    click.echo(f"turnkeeper: {message}", err=True)
    sys.exit(1)


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
