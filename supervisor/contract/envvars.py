"""Configuration from `TURNKEEPER_<SECTION>__<KEY>` variables, and warnings for the
variables that look like configuration but are not read (a single underscore, a
lowercase name, a misspelt section or key).

A misspelt variable in the `<SECTION>__<KEY>` form is an error (it was meant as
configuration); any other `TURNKEEPER_*` variable that the project does not use for
something else is ignored with a warning naming the nearest valid variable. The sections
and keys come from the caller (`supervisor.contract.config`), so this module knows no model.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo

ENV_PREFIX = "TURNKEEPER_"

# Variables with the prefix that are not configuration: the file, the CLI's token and
# state directory (`--state-dir`), and the test suite's and benchmarks' own settings. Add
# a new one here, or it is warned about.
OTHER_USES = ("TURNKEEPER_CONFIG", "TURNKEEPER_TOKEN", "TURNKEEPER_STATE_DIR")
OTHER_PREFIXES = ("TURNKEEPER_TEST_", "TURNKEEPER_BENCH_", "TURNKEEPER_CHAOS_")

Sections = Mapping[str, Mapping[str, FieldInfo]]
"""Each section's fields by the key that names them in the file."""


def variable(section: str, key: str) -> str:
    """The variable that sets `section.key`."""
    return f"{ENV_PREFIX}{section.upper()}__{key.upper()}"


def valid_names(sections: Sections) -> list[str]:
    """Every variable that sets a key (mcp.servers is set in the file only)."""
    return [variable(s, k) for s, keys in sections.items() if s != "mcp" for k in keys]


def from_environ(
    env: Mapping[str, str], sections: Sections
) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str]]:
    """Values from `TURNKEEPER_<SECTION>__<KEY>` variables, and which variable set each.

    Raises ValueError with a one-line message for a variable of that form that names no key.
    """
    values: dict[str, dict[str, Any]] = {}
    variables: dict[tuple[str, str], str] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        section, _, key = var.removeprefix(ENV_PREFIX).lower().partition("__")
        if not section or not key or "__" in key:
            raise ValueError(f"{var}: expected {ENV_PREFIX}<SECTION>__<KEY>")
        if section not in sections:
            raise ValueError(f"{var}: unknown section {section}{_hint(var, sections)}")
        field = sections[section].get(key)
        if field is None:
            raise ValueError(f"{var}: unknown key {section}.{key}{_hint(var, sections)}")
        if section == "mcp":
            raise ValueError(
                f"{var}: mcp.servers cannot be set from the environment; list them in the file"
            )
        values.setdefault(section, {})[key] = env_value(env[var], field)
        variables[section, key] = var
    return values, variables


def env_value(text: str, field: FieldInfo) -> Any:
    """`text` read as a TOML value if it is one, else as a plain string."""
    try:
        parsed = tomllib.loads(f"value = {text}")
    except tomllib.TOMLDecodeError:
        return text
    if set(parsed) != {"value"}:
        return text
    value = parsed["value"]
    # A string key keeps its text as written: `model = 7` means the model named "7".
    wants_text = field.annotation is str or (
        get_origin(field.annotation) is Literal
        and all(isinstance(arg, str) for arg in get_args(field.annotation))
    )
    return text if wants_text and not isinstance(value, str) else value


def env_warnings(env: Mapping[str, str], sections: Sections) -> list[str]:
    """One line for each variable that looks like configuration but is ignored."""
    warnings = []
    for var in sorted(env):
        if not var.upper().startswith(ENV_PREFIX) or _read_or_known(var):
            continue
        warnings.append(
            f"{var} is not a configuration variable and is ignored{_hint(var, sections)}"
        )
    return warnings


def _read_or_known(var: str) -> bool:
    """Read as configuration (or refused with an error), or used for something else."""
    if not var.startswith(ENV_PREFIX):
        return False  # a lowercase prefix is never read
    return "__" in var or var in OTHER_USES or var.startswith(OTHER_PREFIXES)


def _hint(var: str, sections: Sections) -> str:
    """ "; did you mean X?" for the nearest valid variable, or what the form is."""
    candidates = {_shape(name): name for name in [*valid_names(sections), *OTHER_USES]}
    found = difflib.get_close_matches(_shape(var), candidates, n=1, cutoff=0.6)
    if found:
        return f"; did you mean {candidates[found[0]]}?"
    return f" (the form is {ENV_PREFIX}<SECTION>__<KEY>)"


def _shape(name: str) -> str:
    """A name without the prefix, upper case, runs of underscores as one: what to compare."""
    rest = name.upper().removeprefix(ENV_PREFIX)
    return re.sub("_+", "_", rest)
