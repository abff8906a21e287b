"""The environment a worker gives each MCP server it starts, in one place, so that the
worker that runs the command and the checks that resolve it beforehand (`turnkeeper run`,
`turnkeeper doctor`) look it up on the same PATH."""

from __future__ import annotations

import os
from collections.abc import Mapping

INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME")
"""The only variables of the worker's environment an MCP server inherits."""


def child_environment(
    extra: Mapping[str, str], source: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of an MCP server: `INHERITED_ENV` from `source`, then `extra`."""
    source = os.environ if source is None else source
    env = {name: source[name] for name in INHERITED_ENV if name in source}
    env.update(extra)
    return env
