"""The `turnkeeper` command line."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from supervisor import __version__
from supervisor.config import Config, ConfigError, load_config, render_config

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
    return obj["config"]  # type: ignore[no-any-return]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=str,
    default=None,
    help="Configuration file (default: $TURNKEEPER_CONFIG, else /etc/turnkeeper/turnkeeper.toml"
    " if present, else built-in defaults).",
)
@click.version_option(__version__, prog_name="turnkeeper")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """turnkeeper: a supervisor for AI-agent daemons whose restarts are boring."""
    ctx.ensure_object(dict)["config_path"] = config_path


@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@click.pass_context
def config_show(ctx: click.Context) -> None:
    """Print the effective configuration (defaults < file < environment), secrets masked."""
    click.echo(render_config(load(ctx)), nl=False)
