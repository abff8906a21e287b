"""Bearer tokens mapped to principals.

Tokens are kept only as SHA-256 hashes and compared in constant time; an empty or
whitespace token never authenticates, whatever the hashes say. On first start the daemon
writes an admin token to `<state_dir>/admin.token` (0600), which the CLI reads by itself;
its principal, `admin`, is the operator and may see and act on every session. The file is
written atomically (a temporary file, fsync, rename, fsync of the directory), so a crash
or a full disk never leaves it empty; one found empty is replaced with a fresh token.

A tokens file (`auth.tokens_file`) adds principals, one per line:

    alice sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    # comments and blank lines are ignored

Make a hash with: `printf %s "$TOKEN" | sha256sum`. A line that could only be ignored (the
principal `admin`, a principal listed twice, a hash another principal has, the hash of an
empty token) is an error naming the line. Both files are judged by `supervisor.trust`
before they are read.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from supervisor import trust
from supervisor.contract.logs import log
from supervisor.core.vocabulary import ADMIN_PRINCIPAL
from supervisor.http.answers import PRINCIPAL, TOKEN_HASH, TOKEN_VALID, error_response

ADMIN = ADMIN_PRINCIPAL
_LINE = re.compile(r"^(?P<principal>[A-Za-z0-9_.@-]{1,100})\s+sha256:(?P<hash>[0-9a-f]{64})$")


class TokensFileError(Exception):
    """The tokens file cannot be used; the message names the file and line."""


def digest(token: str) -> str:
    """The stored form of a token."""
    return hashlib.sha256(token.encode()).hexdigest()


_EMPTY = digest("")


def ensure_admin_token(path: Path, user: int) -> str:
    """The admin token in `path`, written there (0600) when missing or empty.

    Raises trust.Untrusted when the file is a symbolic link, another user's or readable by
    others, and OSError when it cannot be read or written (the old file is then unchanged).
    """
    try:
        fd = trust.open_file(path, trust.ADMIN_TOKEN, user, os.O_RDONLY)
    except FileNotFoundError:
        existed = False
        token = ""
    else:
        existed = True
        with os.fdopen(fd, "rb") as stream:
            token = stream.read().decode(errors="replace").strip()
    if token:
        return token
    token = secrets.token_urlsafe(32)
    write_atomically(path, token + "\n")
    if existed:
        log("auth").warning("the admin token {} was empty; wrote a fresh one", path)
    return token


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with a 0600 file holding `text`, all or nothing, durably.

    A temporary file beside it is written and fsynced, renamed over `path`, and the
    directory fsynced, so a crash or a full disk leaves either the old file or the new one.
    """
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a file system that cannot sync a directory
            raise
    finally:
        os.close(directory)


def read_tokens_file(path: Path, user: int, admin_hash: str = "") -> dict[str, str]:
    """principal -> token hash, from a tokens file judged by `supervisor.trust`.

    Raises TokensFileError naming the line of any entry that would be ignored, including
    one whose hash is `admin_hash` (the admin token's), and trust.Untrusted.
    """
    try:
        fd = trust.open_file(path, trust.TOKENS_FILE, user, os.O_RDONLY)
        with os.fdopen(fd, "rb") as stream:
            text = stream.read().decode()
    except UnicodeDecodeError:
        raise TokensFileError(f"auth.tokens_file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise TokensFileError(f"auth.tokens_file {path}: {exc.strerror or exc}") from exc
    hashes: dict[str, str] = {}
    lines: dict[str, int] = {}  # principal -> the line that named it
    owners = {_EMPTY: "an empty token"}  # hash -> whose it is already
    if admin_hash:
        owners[admin_hash] = "the admin token"
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        where = f"auth.tokens_file {path} line {number}"
        if match is None:
            raise TokensFileError(f"{where}: expected 'PRINCIPAL sha256:HEX'")
        principal, hash_ = match["principal"], match["hash"]
        if principal == ADMIN:
            raise TokensFileError(
                f"{where}: the principal 'admin' is reserved for the admin token "
                "(<state_dir>/admin.token); give this token another name"
            )
        if principal in lines:
            raise TokensFileError(
                f"{where}: '{principal}' is listed already on line {lines[principal]}; "
                "keep one line per principal"
            )
        if hash_ in owners:
            raise TokensFileError(
                f"{where}: this is the hash of {owners[hash_]}; give '{principal}' a token of "
                "its own"
            )
        hashes[principal] = hash_
        lines[principal] = number
        owners[hash_] = f"'{principal}' (line {number})"
    return hashes


class Tokens:
    """Who a bearer token belongs to."""

    def __init__(self, hashes: dict[str, str]) -> None:
        self._hashes = list(hashes.items())

    def principals(self) -> dict[str, str]:
        """principal -> its token's hash."""
        return dict(self._hashes)

    def take(self, other: Tokens) -> None:
        """Accept `other`'s tokens from now on (a reload read the tokens file again)."""
        self._hashes = list(other._hashes)

    def principal(self, token: str) -> str | None:
        """The principal of `token`, or None; every known hash is compared, in constant time.

        An empty or whitespace token is nobody's, even if a hash of it were configured.
        """
        if not token.strip():
            return None
        wanted = digest(token)
        found = None
        for principal, stored in self._hashes:
            if hmac.compare_digest(wanted, stored):
                found = principal
        return found


def bearer(tokens: Tokens, public: Callable[[str], bool]) -> Any:
    """The middleware that names the request's principal from its bearer token.

    A path `public` says yes to needs none; any other is a 401 without a known token.
    """

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not public(request.path):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            # Auth schemes are case-insensitive (RFC 7235 section 2.1).
            bearer = scheme.lower() == "bearer"
            principal = tokens.principal(token.strip()) if bearer else None
            if principal is None:
                return error_response(
                    401,
                    "unauthorized",
                    "send Authorization: Bearer <token>",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            request[PRINCIPAL] = principal
            held = digest(token.strip())
            request[TOKEN_HASH] = held  # a stream checks it again (app.py)
            # And a body, once read (`answers.read_body`): a reload may revoke it meanwhile.
            request[TOKEN_VALID] = lambda: tokens.principals().get(principal) == held
        return await handler(request)

    return middleware
