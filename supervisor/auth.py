"""Bearer tokens mapped to principals.

Tokens are kept only as SHA-256 hashes and compared in constant time. On first start the
daemon writes an admin token to `<state_dir>/admin.token` (0600), which the CLI reads by
itself; its principal, `admin`, is the operator and may see and act on every session.

A tokens file (`auth.tokens_file`) adds principals, one per line:

    alice sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    # comments and blank lines are ignored

Make a hash with: `printf %s "$TOKEN" | sha256sum`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

ADMIN = "admin"
_LINE = re.compile(r"^(?P<principal>[A-Za-z0-9_.@-]{1,100})\s+sha256:(?P<hash>[0-9a-f]{64})$")


class TokensFileError(Exception):
    """The tokens file cannot be used; the message names the file and line."""


def digest(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def ensure_admin_token(path: Path) -> str:
    """The admin token, generated into `path` (0600) the first time."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token + "\n")
        return token


def read_tokens_file(path: Path) -> dict[str, str]:
    """principal -> token hash, from a tokens file."""
    hashes: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise TokensFileError(f"auth.tokens_file {path}: {exc.strerror or exc}") from exc
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise TokensFileError(
                f"auth.tokens_file {path} line {number}: expected 'PRINCIPAL sha256:HEX'"
            )
        hashes[match["principal"]] = match["hash"]
    return hashes


class Tokens:
    """Who a bearer token belongs to."""

    def __init__(self, hashes: dict[str, str]) -> None:
        self._hashes = list(hashes.items())

    def principal(self, token: str) -> str | None:
        """The principal of `token`, or None; every known hash is compared, in constant time."""
        wanted = digest(token)
        found = None
        for principal, stored in self._hashes:
            if hmac.compare_digest(wanted, stored):
                found = principal
        return found
