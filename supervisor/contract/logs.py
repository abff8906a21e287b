"""Logging: loguru to stderr, one line per record, with the subsystem that wrote it.

A line says which process wrote it (`worker=w1.2`; the supervisor's lines have none),
which MCP server (`server=NAME`) and which session (`session=ID`) it is about, when known.
`log.format = "json"` writes one flat JSON object per line instead (`json_line`): no
loguru record, no colour, a traceback in its own `exception` field.

When stderr is journald's stream (`JOURNAL_STREAM` names stderr's device and inode, the
rule systemd documents) text lines carry `<N>` syslog priority prefixes and no timestamp,
since journald adds its own. A `JOURNAL_STREAM` inherited by a process whose stderr
goes elsewhere (a file of supervisord's, say) is ignored. Each process (supervisor, every worker)
configures its own logger; a loguru logger cannot be handed to a spawned child.

With tracing on (`supervisor.contract.telemetry`), a line written while a span is current
carries its `trace_id` and `span_id` (hex) as fields of its own: in JSON they are keys, so
a log line leads to its turn's trace and back.

The password in any URL is masked in every line written, tracebacks included: a database
driver or HTTP client may echo the URL it was given, with `user:password@` in it. Control
characters in a message are escaped (`supervisor.contract.printable`): a message is one
line, whatever text of a principal's or a peer's it quotes.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from loguru import logger

from supervisor.contract.config import mask_urls
from supervisor.contract.printable import escape

if TYPE_CHECKING:
    from loguru import Logger, Message, Record

SUPERVISOR = "supervisor"  # the `process` of the parent's lines, which name no worker

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


# Context fields, in the order a text line shows them; `turn` only in JSON (the message
# of a line about a turn names it).
_SHOWN = ("worker", "server", "session")
_INTERNAL = frozenset({"where", "priority", "process"})

# The current span's (trace id, span id) in hex, or None; set by the telemetry once it
# is on (this module imports no OpenTelemetry).
span_ids: Callable[[], tuple[str, str] | None] | None = None


def _patch(record: Record) -> None:
    # A message may quote what others wrote (a title, a webhook's reason phrase): no
    # control character of theirs forges a line or reaches the operator's terminal.
    record["message"] = escape(record["message"])
    extra = record["extra"]
    extra.setdefault("subsystem", "daemon")
    process = extra.get("process", SUPERVISOR)
    if process != SUPERVISOR:
        extra.setdefault("worker", process)
    extra["where"] = "".join(f" {name}={extra[name]}" for name in _SHOWN if extra.get(name))
    extra["priority"] = _PRIORITY.get(record["level"].name, 6)
    if span_ids is not None and (ids := span_ids()) is not None:
        extra["trace_id"], extra["span_id"] = ids


def json_line(record: Record) -> str:
    """One record as a flat JSON object: ts (RFC 3339), level, subsystem, message, the
    context fields known (session, worker, turn, server, ...) and `exception` if any."""
    line: dict[str, Any] = {
        "ts": record["time"].isoformat(timespec="milliseconds"),
        "level": record["level"].name,
        "subsystem": record["extra"].get("subsystem", "daemon"),
        "message": record["message"],
    }
    for name, value in record["extra"].items():
        if name not in _INTERNAL and value is not None and value != "":
            line[name] = value if isinstance(value, str | int | float | bool) else str(value)
    failure = record["exception"]
    if failure is not None and failure.type is not None:
        text = traceback.format_exception(failure.type, failure.value, failure.traceback)
        line["exception"] = "".join(text).rstrip()
    return json.dumps(line, ensure_ascii=False)


class _Masked:
    """A stream that masks the password of every URL in what is written to it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        self._stream.write(mask_urls(text))

    def flush(self) -> None:
        self._stream.flush()


class _JsonSink:
    """Writes each record as one masked JSON line (`json_line`) to a stream."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def __call__(self, message: Message) -> None:
        self._stream.write(mask_urls(json_line(message.record)) + "\n")
        self._stream.flush()


def setup_logging(level: str = "INFO", fmt: str = "text", process: str = SUPERVISOR) -> None:
    """Send this process's log records to stderr in the configured format.

    `process` is the worker's identity in a worker process: every line names it.
    """
    logger.remove()
    logger.configure(patcher=_patch, extra={"process": process})
    sink = _Masked(sys.stderr)
    if fmt == "json":
        logger.add(
            _JsonSink(sys.stderr),
            level=level,
            format="{message}",
            backtrace=False,
            diagnose=False,
            colorize=False,
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
    """A logger whose records name `subsystem` (and a session, turn or server, when given)."""
    return logger.bind(subsystem=subsystem, **context)
