"""Bounds that the configuration and the control plane share: a value the configuration
accepts must fit every control message that carries it."""

from __future__ import annotations

MAX_SERVERS = 256  # MCP servers of a worker (configured; in every heartbeat)
MAX_NAME = 200  # characters of an MCP server's name
PRINTABLE = r"^[^\x00-\x1f\x7f-\x9f]+$"  # a name shown to operators: no control characters
DB_THREADS = 8  # the supervisor's threads for blocking work, each with a database connection
