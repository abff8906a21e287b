"""`turnkeeper config`: the effective configuration."""

from __future__ import annotations

import click

from supervisor.cli.budget import SHIPPED_STOP_TIMEOUT, check_stop_timeout, teardown_budget
from supervisor.cli.common import load
from supervisor.contract.config import render_config


def register(group: click.Group) -> None:
    """Add the commands of this module to `group`."""
    group.add_command(config_group)


@click.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@click.pass_context
def config_show(ctx: click.Context) -> None:
    """Print the effective configuration (defaults < file < environment), secrets masked.

    Comment lines at the end give the teardown budget: the worst case of a stop, which the
    service manager's stop timeout must be above.
    """
    cfg = load(ctx)
    click.echo(render_config(cfg), nl=False)
    budget = teardown_budget(cfg)
    click.echo("\n# teardown budget (worst case of a stop):")
    for line in budget.lines():
        click.echo(f"#   {line}")
    problem = check_stop_timeout(budget, SHIPPED_STOP_TIMEOUT, "the shipped unit's TimeoutStopSec")
    if problem:
        click.echo(f"# WARNING: {problem}")
