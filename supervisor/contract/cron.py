"""Cron expressions and time zones of schedules: checked once, then stepped through.

cronsim parses and steps (a maintained library, not a parser of ours). An expression has
5 fields (minute hour day-of-month month day-of-week) or 6 with the seconds FIRST
(`*/2 * * * * *`: every 2 seconds). Its times are wall-clock times of the schedule's time
zone (an IANA name read by zoneinfo: `UTC`, `Europe/Paris`), handed in and out as epoch
seconds. A `Cron` is what `supervisor.schedules.rules` calls `Times`.

A bad expression or an unknown time zone is a `CronError` naming the field (`cron`,
`timezone`) and what is wrong with it, for the caller to read.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError

from supervisor.contract.clock import SYSTEM

MAX_CRON = 200  # characters of an expression (its column's width)
MAX_TIMEZONE = 64  # characters of a time zone's name (its column's width)
FIELDS = "5 fields (minute hour day-of-month month day-of-week), or 6 with seconds first"


class CronError(ValueError):
    """A schedule's expression or time zone is wrong; `field` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def zone(name: str) -> tzinfo:
    """The time zone called `name`; CronError if there is none."""
    if name == "UTC":
        return UTC
    if not 0 < len(name) <= MAX_TIMEZONE or not name.isprintable():
        raise CronError("timezone", f"unknown time zone {name[:MAX_TIMEZONE]!r}")
    try:
        return ZoneInfo(name)
    except Exception:  # not found, not a relative path, a directory: all unknown to us
        raise CronError(
            "timezone", f"unknown time zone {name!r}; use an IANA name such as UTC or Europe/Paris"
        ) from None


class Cron:
    """A checked expression in its time zone: its times before and after a moment."""

    def __init__(self, expr: str, timezone: str = "UTC") -> None:
        """CronError unless `expr` is a cron expression that fires and `timezone` a zone."""
        self.expr = " ".join(expr.split())
        if not 0 < len(expr) <= MAX_CRON or not self.expr or not self.expr.isprintable():
            raise CronError("cron", f"a cron expression is 1 to {MAX_CRON} printable characters")
        self.timezone = timezone
        self.zone = zone(timezone)
        try:
            first = next(self._steps(SYSTEM.time(), reverse=False), None)
        except CronSimError as exc:
            raise CronError("cron", f"{expr!r} is not a cron expression: {exc}; {FIELDS}") from None
        if first is None:
            raise CronError("cron", f"{expr!r} names no time in the next 50 years")

    def after(self, moment: float) -> float | None:
        """The first time strictly after `moment`; None if none comes in 50 years."""
        return next(self._steps(moment, reverse=False), None)

    def upcoming(self, moment: float, count: int) -> list[float]:
        """Its first `count` times after `moment`, oldest first (fewer if none comes in 50
        years after one of them)."""
        return list(itertools.islice(self._steps(moment, reverse=False), count))

    def back(self, upto: float, since: float, limit: int) -> tuple[list[float], bool]:
        """The times in (since, upto], newest first, at most `limit`; and whether older
        ones in that span were left out."""
        found: list[float] = []
        for moment in self._steps(upto, reverse=True):
            if moment <= since:
                return found, False
            if len(found) == limit:
                return found, True
            found.append(moment)
        return found, False

    def _steps(self, moment: float, *, reverse: bool) -> Iterator[float]:
        # cronsim steps from whole seconds: forwards its first time is after the second
        # of `moment`, backwards before it; so backwards starts a second past it.
        start = math.floor(moment) + (1 if reverse else 0)
        local = datetime.fromtimestamp(start, UTC).astimezone(self.zone)
        steps = CronSim(self.expr, local, reverse=reverse)
        while True:
            try:
                yield next(steps).timestamp()
            except StopIteration:  # none within cronsim's 50 years
                return


def check(expr: str, timezone: str = "UTC") -> Cron:
    """`Cron(expr, timezone)`: the checked expression, or CronError saying what is wrong."""
    return Cron(expr, timezone)
