"""Logging: loguru to stderr, one line per record, with the subsystem that wrote it.

When stderr is journald's stream (`JOURNAL_STREAM` names stderr's device and inode, the
rule systemd documents) text lines carry `<N>` syslog priority prefixes and no timestamp,
since journald adds its own. A `JOURNAL_STREAM` inherited by a process whose stderr
goes elsewhere (a file of supervisord's, say) is ignored. Each process (supervisor, every worker)
configures its own logger; a loguru logger cannot be handed to a spawned child.

The password in any URL is masked in every line written, tracebacks included: a database
driver or HTTP client may echo the URL it was given, with `user:password@` in it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, TextIO

from loguru import logger

from supervisor.contract.config import mask_urls

if TYPE_CHECKING:
    from loguru import Logger, Record

# loguru level -> syslog priority (sd-daemon(3)).
_PRIORITY = {
    "TRACE": 7,
    "DEBUG": 7,
    "INFO": 6,
    "SUCCESS": 5,
    "WARNING": 4,
    "ERROR": 3,
    "CRITICAL": 2,
}

_TEXT = "{time:YYYY-MM-DD HH:mm:ss.SSS} {level: <7} [{extra[subsystem]}]{extra[where]} {message}"
_JOURNAL = "<{extra[priority]}>{level: <7} [{extra[subsystem]}]{extra[where]} {message}"


def _patch(record: Record) -> None:
    extra = record["extra"]
    extra.setdefault("subsystem", "daemon")
    session = extra.get("session")
    extra["where"] = f" session={session}" if session else ""
    extra["priority"] = _PRIORITY.get(record["level"].name, 6)


class _Masked:
    """A stream that masks the password of every URL in what is written to it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        self._stream.write(mask_urls(text))

    def flush(self) -> None:
        self._stream.flush()


def setup_logging(level: str = "INFO", fmt: str = "text", process: str = "supervisor") -> None:
    """Send this process's log records to stderr in the configured format."""
    logger.remove()
    logger.configure(patcher=_patch, extra={"process": process})
    sink = _Masked(sys.stderr)
    if fmt == "json":
        logger.add(
            sink, level=level, serialize=True, backtrace=False, diagnose=False, colorize=False
        )
    else:
        line = _JOURNAL if to_journal() else _TEXT
        logger.add(sink, level=level, format=line, backtrace=False, diagnose=False, colorize=False)


def to_journal(environ: dict[str, str] | None = None, fd: int | None = None) -> bool:
    """True when stderr is the journal stream systemd connected (`JOURNAL_STREAM=dev:ino`)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        stat = os.fstat(sys.stderr.fileno() if fd is None else fd)
        return (stat.st_dev, stat.st_ino) == (int(device), int(inode))
    except (ValueError, OSError, AttributeError):
        return False


def log(subsystem: str, **context: object) -> Logger:
    """A logger whose records name `subsystem` (and a session, when given)."""
    return logger.bind(subsystem=subsystem, **context)
