"""The `[tasks]` and `[schedules]` sections: background task kinds and their settings.

A task kind is the operator's: its command is a list (no shell), and a `{name}` inside an
element is a placeholder for the argument `name`, which a request must give and which must
match the kind's pattern for it whole (`args = { name = "^[0-9]{1,4}$" }`). A request only
names a kind and gives arguments; it never adds to the command or the environment.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic import model_validator as _model_validator
from pydantic_core import PydanticCustomError

from supervisor.contract.named import unique_names
from supervisor.tasks.rules import KindRules

KIND_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
ARG_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
MAX_ARG_CHARS = 4096  # one argument's value, after it is turned into a string


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class TaskKind(_Section):
    """One kind of background task an agent may start (`[[tasks.kinds]]`)."""

    name: Annotated[str, StringConstraints(pattern=KIND_NAME)]
    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    args: dict[str, str] = Field(default_factory=dict)  # argument -> regex it must match whole
    timeout: Annotated[float, Field(gt=0)] = 3600.0
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = ""  # "": the task's own directory under tasks.work_dir
    retry_on_restart: bool = False
    allow_dash: bool = False  # an argument may start with '-' (refused otherwise)
    end_of_options: bool = False  # '--' before the first element with a placeholder

    @field_validator("args")
    @classmethod
    def _check_args(cls, args: dict[str, str]) -> dict[str, str]:
        for name, pattern in args.items():
            if not ARG_NAME.fullmatch(name):
                raise PydanticCustomError(
                    "arg_name",
                    "argument name {name!r} must be lowercase letters, digits and '_'",
                    {"name": name},
                )
            try:
                re.compile(pattern)
            except re.error as exc:
                raise PydanticCustomError(
                    "arg_pattern",
                    "argument {name!r}: its pattern is not a regular expression ({error})",
                    {"name": name, "error": str(exc)},
                ) from None
        return args

    @_model_validator(mode="after")
    def _placeholders_declared(self) -> TaskKind:
        for index, part in enumerate(self.command):
            for name in PLACEHOLDER.findall(part):
                if name not in self.args:
                    raise PydanticCustomError(
                        "placeholder",
                        "command[{index}] uses {{{name}}}, which is not one of this kind's "
                        "args (declare it with the pattern its value must match)",
                        {"index": index, "name": name},
                    )
        return self

    def rules(self) -> KindRules:
        """What the pure rules (`supervisor.tasks.rules`) need of this kind."""
        return KindRules(
            self.name,
            tuple(self.command),
            dict(self.args),
            self.retry_on_restart,
            self.allow_dash,
            self.end_of_options,
        )

    def placeholders(self) -> set[str]:
        """The argument names the command uses."""
        return {name for part in self.command for name in PLACEHOLDER.findall(part)}


class TasksConfig(_Section):
    kinds: list[TaskKind] = Field(default_factory=list, max_length=256)
    max_running: Annotated[int, Field(ge=0, le=1000)] = 8  # per session; 0 turns tasks off
    # Running at once in the daemon, and for one principal (its sessions and their
    # subagents); a task past either waits `pending`, in order.
    max_running_total: Annotated[int, Field(ge=1)] = 32
    max_running_per_principal: Annotated[int, Field(ge=1)] = 8
    keep: Annotated[float, Field(gt=0)] = 7 * 86400.0  # output files kept this long
    max_output: Annotated[int, Field(ge=1024)] = 1 << 20  # bytes of output kept per task
    kill_grace: Annotated[float, Field(gt=0)] = 5.0  # SIGTERM to SIGKILL when stopping one
    reconcile_interval: Annotated[float, Field(gt=0)] = 60.0
    lost_grace: Annotated[float, Field(gt=0)] = 60.0
    # Where tasks run, one 0700 directory each, never inside the state directory; "": the
    # service's cache directory ($CACHE_DIRECTORY/tasks), else <state_dir>-tasks beside it.
    work_dir: str = ""

    @field_validator("kinds")
    @classmethod
    def _unique_names(cls, kinds: list[TaskKind]) -> list[TaskKind]:
        unique_names(kinds, "task kind", "tasks.kinds")
        return kinds

    def kind(self, name: Any) -> TaskKind | None:
        """The kind called `name`; None when there is none."""
        return next((k for k in self.kinds if k.name == name), None)


class SchedulesConfig(_Section):
    misfire_grace: Annotated[float, Field(ge=0)] = 3600.0
    max_schedules: Annotated[int, Field(ge=0)] = 1000  # in all; 0 turns schedules off
    max_per_owner: Annotated[int, Field(ge=1)] = 100  # made by one principal
    min_interval: Annotated[float, Field(ge=0)] = 60.0  # seconds between two times, at least
