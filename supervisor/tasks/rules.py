"""Background tasks: the rules, as pure code.

A task is a command of an operator-defined kind (`[[tasks.kinds]]`) that a turn starts.
A request gives only the kind's name and its arguments; nothing from it becomes part of
the command but an argument's value, whole, as one element of the argument list (no shell),
and only once it matched the kind's pattern for it. Whatever the pattern admits, a value
never becomes an option (one that starts with `-` is refused unless the kind says
`allow_dash`) and never climbs out of a directory (one with a `..` path segment is
refused): a pattern written carelessly (`^[A-Za-z0-9_./-]+$`) must not hand out files
above the task's directory or flags the kind did not write.

Where a task is (`TaskStatus`) and what a reconcile pass does with it:

  status    facts                                          action
  --------  ---------------------------------------------  --------------------------------
  pending   no daemon has started its runner               START: claim it, start a runner
  running   its runner was heard from within lost_grace    none
  running   not heard from for lost_grace, kind retries,   RETRY: pending again (attempt 2),
            first attempt, no cancel asked                 the session told by a notice
  running   not heard from for lost_grace, otherwise       LOST: outcome `lost` (`cancelled`
                                                           if a cancel was asked), reported
  final     outcome recorded, not reported yet             REPORT: `task_result`, once
  final     reported                                       none

A running task falls due for a pass when its runner has gone unheard for `lost_grace`
(`look_at`, by the database clock): the task keeper rests until the earliest such time
(`supervisor.core.timers`), so a task is lost at its deadline, after a restart too. A live
runner of the daemon's own stops its command by itself once it cannot renew its heartbeat
(the database is away); only if it stays unheard for `hung_after` is it hung, killed, and
the task judged as any other.

A runner records the outcome itself when the command ends (exit status, duration, the tail
of its output); the report to the session is a separate step any daemon may take, once,
guarded by the row (its `result_seq`), so an outcome recorded while no daemon ran is
reported after the restart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.core.vocabulary import TaskAction, TaskStatus

HUNG_MARGIN = 30.0  # seconds past lost_grace + kill_grace before a silent runner of ours is hung
TAIL_CHARS = 2000  # of a task's output, kept in its row and told to its session
MAX_ARG_CHARS = 4096  # one argument's value
MAX_ARGS = 64
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


class TaskRefused(Exception):
    """A task that may not start, and why, in words the caller or the model can act on."""


@dataclass(frozen=True)
class KindRules:
    """What the rules need of a kind: its command and its arguments' patterns."""

    name: str
    command: tuple[str, ...]
    args: Mapping[str, str]  # argument -> the regular expression its value must match whole
    retry_on_restart: bool = False
    allow_dash: bool = False  # a value may start with '-' (the kind handles it as an option)
    end_of_options: bool = False  # '--' goes before the first element with a placeholder


def check_args(kind: KindRules, args: Any) -> dict[str, str]:
    """The arguments as strings, each checked against its pattern; TaskRefused saying
    which one is wrong. Every declared argument is needed and no other is taken."""
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise TaskRefused(f"arguments must be a JSON object, not {type(args).__name__}")
    if len(args) > MAX_ARGS:
        raise TaskRefused(f"too many arguments ({len(args)}; at most {MAX_ARGS})")
    unknown = sorted(str(name)[:64] for name in args if name not in kind.args)
    if unknown:
        expected = ", ".join(sorted(kind.args)) or "none"
        raise TaskRefused(
            f"task kind {kind.name!r} takes no argument {unknown[0]!r} (it takes: {expected})"
        )
    checked: dict[str, str] = {}
    for name, pattern in sorted(kind.args.items()):
        if name not in args:
            raise TaskRefused(f"task kind {kind.name!r} needs the argument {name!r}")
        checked[name] = _check_value(kind.name, name, args[name], pattern)
        _check_shape(kind, name, checked[name])
    return checked


def _check_shape(kind: KindRules, name: str, text: str) -> None:
    """Refuse what no pattern may admit: an option the kind did not write, a `..` path."""
    if text.startswith("-") and not kind.allow_dash:
        raise TaskRefused(
            f"argument {name!r} of task kind {kind.name!r} may not start with '-' "
            "(it would be read as an option; the kind may allow it with allow_dash)"
        )
    if ".." in text.replace("\\", "/").split("/"):
        raise TaskRefused(
            f"argument {name!r} of task kind {kind.name!r} may not hold a '..' path segment"
        )


def _check_value(kind: str, name: str, value: Any, pattern: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise TaskRefused(
            f"argument {name!r} of task kind {kind!r} must be a string or a number, "
            f"not {type(value).__name__}"
        )
    text = str(value)
    if not text or len(text) > MAX_ARG_CHARS or "\x00" in text:
        raise TaskRefused(
            f"argument {name!r} of task kind {kind!r} must be 1 to {MAX_ARG_CHARS} "
            "characters, with no NUL"
        )
    if re.fullmatch(pattern, text) is None:
        raise TaskRefused(
            f"argument {name!r} of task kind {kind!r} does not match its pattern {pattern!r}"
        )
    return text


def render(
    command: tuple[str, ...] | list[str], args: Mapping[str, str], end_of_options: bool = False
) -> list[str]:
    """The argument list: each `{name}` replaced by its checked value, in place (a value
    never splits into more elements, and a value's own braces are never read again).

    With `end_of_options`, `--` goes right before the first element that holds a
    placeholder (not before the program), so no value after it is read as an option.
    """
    argv: list[str] = []
    for index, part in enumerate(command):
        if end_of_options and index > 0 and "--" not in argv and PLACEHOLDER.search(part):
            argv.append("--")
        argv.append(PLACEHOLDER.sub(lambda match: args[match.group(1)], part))
    return argv


def waits(
    running_total: int, running_of_principal: int, *, max_total: int, max_per_principal: int
) -> str | None:
    """Why a pending task may not start now (the daemon's or its principal's share of
    running tasks is taken), or None: it may. A task that waits stays pending, in order;
    it is never dropped."""
    if running_total >= max_total:
        return (
            f"{running_total} tasks run or wait already, and the daemon runs at most "
            f"{max_total} at once (tasks.max_running_total)"
        )
    if running_of_principal >= max_per_principal:
        return (
            f"{running_of_principal} tasks of this session's principal run or wait already, "
            f"and one principal runs at most {max_per_principal} at once "
            "(tasks.max_running_per_principal)"
        )
    return None


def decide(
    status: TaskStatus | str,
    *,
    reported: bool,
    heard_ago: float | None,
    lost_grace: float,
    retry_on_restart: bool,
    attempt: int,
    cancel_requested: bool,
) -> TaskAction | None:
    """What a reconcile pass does with a task (the table in the module docstring).

    `heard_ago`: seconds since its runner was last heard from (its heartbeat, or its
    start), by the database clock; None when never (it counts as long ago).
    """
    status = TaskStatus(status)
    if status is TaskStatus.PENDING:
        return TaskAction.START
    if status.final:
        return None if reported else TaskAction.REPORT
    if heard_ago is not None and heard_ago < lost_grace:
        return None
    if retry_on_restart and attempt <= 1 and not cancel_requested:
        return TaskAction.RETRY
    return TaskAction.LOST


def hung_after(lost_grace: float, kill_grace: float) -> float:
    """Seconds a live runner of the daemon's own may go unheard before it counts as hung:
    by then it should have stopped its command and itself (`tasks.lost_grace`, then
    `tasks.kill_grace`), with a margin for a loaded machine."""
    return lost_grace + kill_grace + HUNG_MARGIN


def look_at(
    heartbeat_at: float | None, *, ours: bool, lost_grace: float, kill_grace: float
) -> float | None:
    """When a pass must look at a running task again, by the database clock: once its
    runner, last heard from at `heartbeat_at`, is lost; for a live runner of the daemon's
    own (`ours`), once it is hung. None if it was never heard from: it is due now."""
    if heartbeat_at is None:
        return None
    return heartbeat_at + (hung_after(lost_grace, kill_grace) if ours else lost_grace)


def outcome_of(exit_code: int | None, timed_out: bool, cancelled: bool) -> TaskStatus:
    """The outcome of a command that ended (a negative exit code: killed by that signal)."""
    if cancelled:
        return TaskStatus.CANCELLED
    if timed_out:
        return TaskStatus.TIMED_OUT
    return TaskStatus.SUCCEEDED if exit_code == 0 else TaskStatus.FAILED


def tail(text: str, limit: int = TAIL_CHARS) -> str:
    """The last `limit` characters of `text`, NULs dropped."""
    text = text.replace("\x00", "")
    return text if len(text) <= limit else text[-limit:]


def result_text(
    task_id: str,
    kind: str,
    status: TaskStatus | str,
    *,
    exit_code: int | None = None,
    duration: float | None = None,
    reason: str = "",
    output_tail: str = "",
) -> str:
    """A task's outcome in words, for its session (`task_result`'s text)."""
    status = TaskStatus(status)
    head = f"task {task_id} ({kind}) {_VERB[status]}"
    if exit_code is not None and status is not TaskStatus.SUCCEEDED:
        head += f" (exit status {exit_code})" if exit_code >= 0 else f" (signal {-exit_code})"
    if duration is not None:
        head += f" after {duration:.1f} s"
    parts = [head + "."]
    if reason:
        parts.append(reason.rstrip(".") + ".")
    if output_tail.strip():
        parts.append("Output (its end):\n" + output_tail)
    return "\n".join(parts)


_VERB = {
    TaskStatus.PENDING: "is waiting to start",
    TaskStatus.RUNNING: "is running",
    TaskStatus.SUCCEEDED: "succeeded",
    TaskStatus.FAILED: "failed",
    TaskStatus.TIMED_OUT: "ran past its time limit and was stopped",
    TaskStatus.CANCELLED: "was cancelled",
    TaskStatus.LOST: "was lost",
}

LOST_REASON = (
    "its runner stopped without recording an outcome (the daemon or its host restarted "
    "while it ran); whatever the command did before is not known"
)
RETRY_NOTICE = (
    "Task {task} ({kind}) was interrupted by a restart before it finished; it was started "
    "again (its second and last attempt)."
)
LOST_NOTICE = "Task {task} ({kind}) was lost: " + LOST_REASON + "."
