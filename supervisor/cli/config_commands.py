"""`turnkeeper config`: the effective configuration."""

from __future__ import annotations

import click

from supervisor.cli.common import config_error, emit_json, json_option, load
from supervisor.contract.config import ignored_variables
from supervisor.teardown import SHIPPED_STOP_TIMEOUT, check_stop_timeout, teardown_budget


def register(group: click.Group) -> None:
    """Add the commands of this module to `group`."""
    group.add_command(config_group)


@click.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@click.option(
    "--origin",
    "with_origins",
    is_flag=True,
    help="Say where each value came from: default, file:PATH:LINE or env:VARIABLE.",
)
@json_option
@click.pass_context
def config_show(ctx: click.Context, with_origins: bool, as_json: bool) -> None:
    """Print the effective configuration (defaults < file < environment), secrets masked.

    The directories and the database URL are the ones the daemon would use. A configuration
    `run` would refuse (an agent class that cannot be loaded, say) is an error here too
    (exit 78). Comment lines at the end give the teardown budget: each step of a stop at
    its cap, in the order they run, and their sum (the worst case of a stop), which the
    service manager's stop timeout must be above; and a warning for each environment
    variable that looks like configuration but is ignored, and for a budget not below the
    shipped unit's TimeoutStopSec and program file's stopwaitsecs.
    """
    from supervisor.contract.origins import effective, origins, render_effective, source_name
    from supervisor.preflight import PluginError, check_plugins

    cfg = load(ctx)
    try:
        check_plugins(cfg)
    except PluginError as exc:
        config_error(str(exc))
    budget = teardown_budget(cfg)
    problem = check_stop_timeout(
        budget, SHIPPED_STOP_TIMEOUT, "the shipped stop timeout (TimeoutStopSec, stopwaitsecs)"
    )
    warnings = [*ignored_variables(), *([problem] if problem else [])]
    if as_json:
        shown = {
            "file": str(cfg.source) if cfg.source is not None else None,
            "config": effective(cfg),
            "teardown_budget": budget.total,
            "teardown_steps": [
                {"step": step.name, "seconds": step.seconds, "setting": step.setting or None}
                for step in budget.steps
            ],
            "warnings": warnings,
        }
        emit_json({**shown, "origins": origins(cfg)} if with_origins else shown)
        return
    click.echo(f"# from {source_name(cfg.source)}")
    click.echo(render_effective(cfg, with_origins=with_origins), nl=False)
    click.echo("\n# teardown budget (each step of a stop at its cap, in order; the worst case):")
    for line in budget.lines():
        click.echo(f"#   {line}")
    for warning in warnings:
        click.echo(f"# WARNING: {warning}")
