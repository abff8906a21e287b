"""The errors of a start that every layer may raise or catch: each message is one line."""

from __future__ import annotations


class StartupError(Exception):
    """The daemon cannot start; the message says why (one line)."""


class PluginError(Exception):
    """A configuration the daemon cannot run with (exit 78); the message names the key."""
