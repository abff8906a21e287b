"""A client of the daemon's HTTP API (docs/reference/http.md), for the command line.

Synchronous httpx over TCP or the unix socket of `http.listen`. Every failure becomes a
`ClientError` whose message is one line naming what to fix: a daemon that is not
running (`DaemonNotRunning`, exit code 3), one that is stopping or whose connection broke
(`DaemonUnavailable`), a token it refuses, or the API's own `error.message` with the HTTP
status.
"""

from __future__ import annotations

import contextlib
import errno
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import Config, parse_listen, resolve_paths
from supervisor.core.backoff import Backoff

TOKEN_VARIABLE = "TURNKEEPER_TOKEN"  # also supervisor.cli.discovery's
DELTA = "delta"  # the SSE event name of a turn's live output (not an event: no seq)
TIMEOUT = 30.0  # seconds for a request; an attach stream has no read timeout
UNIX_HOST = "http://turnkeeper"  # the host name does not matter on a unix socket
# An attach stream the daemon ends (a client too slow, a shutdown) is resumed; after this
# many resumptions in a row that bring nothing, the client gives up.
IDLE_RESUMES = 3
# Between attempts to reach a daemon that went away: 0.2 s, doubling, at most 2 s.
RECONNECT_BACKOFF = Backoff(initial=0.2, factor=2.0, cap=2.0)


class ClientError(Exception):
    """A request that failed; the message is one line for the user."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class ClientTimeout(ClientError):
    """The deadline of a stream passed."""


class DaemonUnavailable(ClientError):
    """The daemon cannot serve now (it is stopping, the connection broke); `reason` says
    why in a few words ("connection refused", "it is stopping")."""

    def __init__(
        self, message: str, reason: str, status: int | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, status, code)
        self.reason = reason


class DaemonNotRunning(DaemonUnavailable):
    """Nothing listens at the daemon's address, or a stream lost it: the CLI exits 3."""


class CannotTell(ClientError):
    """This user may not read what would tell whether the daemon runs, or its token: the
    CLI exits 4 (LSB's "status unknown" and "insufficient privilege")."""


@dataclass(frozen=True)
class Reconnect:
    """How a stream outlives a restart of the daemon: it says when it lost the daemon and
    when it is back, and waits `backoff` between attempts (`sleep` is a seam for tests)."""

    lost: Callable[[str], None]  # the reason, once per loss
    back: Callable[[int], None]  # the seq the stream resumes after
    # Also when the first connection fails: the caller knows the daemon was there (`send
    # --wait`, whose message it has just committed), so it is restarting, not absent.
    from_start: bool = False
    backoff: Backoff = RECONNECT_BACKOFF
    sleep: Callable[[float], None] = SYSTEM.sleep_blocking


@dataclass(frozen=True)
class SseMessage:
    """One Server-Sent Event: `id` is the seq, `event` the event type, `data` its JSON."""

    id: str | None
    event: str
    data: str


def parse_sse(lines: Iterable[str]) -> Iterator[SseMessage]:
    """SSE messages from the lines of a stream (line endings already removed).

    A blank line ends a message; a line starting with `:` is a comment (keep-alive); a
    message without data, or cut off by the end of the stream, is not delivered.
    """
    last_id: str | None = None
    event = ""
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield SseMessage(last_id, event or "message", "\n".join(data))
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id" and "\0" not in value:
            last_id = value


def _message(message: SseMessage) -> dict[str, Any]:
    """A message of an attach stream: an event as the API shapes it, or a delta as
    `{"type": "delta", "turn", "text", "index", "tool_call"}`."""
    data: dict[str, Any] = json.loads(message.data)
    if message.event == DELTA:
        return {"type": DELTA, **data}
    return data


def find_token(cfg: Config, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The bearer token and where it came from: $TURNKEEPER_TOKEN, else the admin token
    file of `cfg`'s state directory (see `token_of`)."""
    return token_of(resolve_paths(cfg, environ).admin_token_file, environ)


def token_of(token_file: Path, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """$TURNKEEPER_TOKEN, else the token in `token_file`, and where it came from; a token
    this user may not read is CannotTell (exit 4), any other failure a ClientError."""
    from supervisor.cli.discovery import TokenDenied, TokenError, read_token

    try:
        return read_token(token_file, environ)
    except TokenDenied as exc:
        raise CannotTell(str(exc)) from None
    except TokenError as exc:
        raise ClientError(str(exc)) from None


class Client:
    """The daemon's API, one method per route the command line uses."""

    def __init__(
        self,
        listen: str,
        token: str,
        token_source: str = "the token",
        start_advice: str = "`turnkeeper run`",
        holder: int | None = None,
    ) -> None:
        where = parse_listen(listen)
        self.address = listen
        self.token_source = token_source
        self.start_advice = start_advice  # how to start the daemon, when it is not running
        # The pid that holds the daemon's lock, when one does: nothing listening then means
        # it is starting (waiting for its database, say) or stopping, never "not running".
        self.holder = holder
        # Plain HTTP on loopback or a socket: no certificate store to load (~50 ms a command).
        if isinstance(where, Path):
            transport = httpx.HTTPTransport(uds=str(where), verify=False)
            base_url = UNIX_HOST
        else:
            transport = httpx.HTTPTransport(verify=False)
            base_url = f"http://{_connectable(where[0])}:{where[1]}"
        self._http = httpx.Client(
            base_url=base_url,
            transport=transport,
            headers={"Authorization": f"Bearer {token}"},
            timeout=TIMEOUT,
            trust_env=False,  # a proxy from the environment must not sit in front of loopback
        )

    @classmethod
    def from_config(cls, cfg: Config, environ: Mapping[str, str] | None = None) -> Client:
        """A client of the daemon `cfg` describes, with its token (see `find_token`)."""
        token, source = find_token(cfg, environ)
        return cls(cfg.http.listen, token, source)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- routes ---------------------------------------------------------------------

    def create_session(self, title: str = "", kind: str = "attached", to: str | None = None) -> Any:
        """A new session, its replies pushed to delivery target `to`; the caller is its admin."""
        return self._json(
            "POST", "/v1/sessions", json={"title": title, "kind": kind, "deliver_to": to}
        )

    def list_sessions(self, limit: int = 100) -> list[dict[str, Any]]:
        """The sessions the caller may read, newest first."""
        return list(self._json("GET", "/v1/sessions", params={"limit": limit})["sessions"])

    def get_session(self, session_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/sessions/{session_id}")

    def inject(self, session_id: str, text: str, key: str | None = None) -> int:
        """Append a user message; returns its seq once it is committed."""
        headers = {"Idempotency-Key": key} if key is not None else None
        answer = self._json(
            "POST", f"/v1/sessions/{session_id}/inject", json={"text": text}, headers=headers
        )
        return int(answer["seq"])

    def interrupt(self, session_id: str) -> int | None:
        """End the turn in flight; the seq of its `turn_ended`, or None if none was running."""
        answer = self._json("POST", f"/v1/sessions/{session_id}/interrupt")
        return None if answer["seq"] is None else int(answer["seq"])

    def close_session(self, session_id: str) -> dict[str, Any]:
        """Close a session (admin): no more turns, its history kept. Idempotent."""
        return self._json("DELETE", f"/v1/sessions/{session_id}")

    def release_session(self, session_id: str) -> dict[str, Any]:
        """Lift a quarantine (write access): the poisoned turn ends failed, never retried."""
        return self._json("POST", f"/v1/sessions/{session_id}/release")

    def status(self) -> dict[str, Any]:
        """Boot, slots, worker restarts, sessions by state, attach streams (admin only)."""
        return self._json("GET", "/v1/status")

    def grant(self, session_id: str, principal: str, permission: str | None) -> dict[str, str]:
        """Give `principal` a permission (None revokes); returns the ACL after."""
        acl: dict[str, str] = self._json(
            "PUT",
            f"/v1/sessions/{session_id}/acl",
            json={"principal": principal, "permission": permission},
        )["acl"]
        return acl

    def events(self, session_id: str, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """Stored events with seq > `after`, oldest first."""
        events: list[dict[str, Any]] = self._json(
            "GET", f"/v1/sessions/{session_id}/events", params={"after": after, "limit": limit}
        )["events"]
        return events

    def stream(
        self,
        session_id: str,
        after: int = 0,
        *,
        deadline: float | None = None,
        reconnect: Reconnect | None = None,
        deltas: bool = False,
    ) -> Iterator[dict[str, Any]]:
        """Events with seq > `after` as they are committed: the stored ones, then live.
        With `deltas`, also the live output of turns as it streams, between them: each
        `{"type": "delta", "turn", "text", "index", "tool_call"}` (no seq: never stored).

        Runs until the caller stops iterating. A stream the daemon ends is resumed at once
        with Last-Event-ID (the seq of the last event yielded), so no event is missed or
        repeated. If the daemon is gone once a stream was open (it stopped, or the
        connection broke), `reconnect` says so and tries again with its backoff until the
        daemon is back; without it, DaemonNotRunning is raised. A first connection that
        fails raises, unless `reconnect.from_start`. `deadline` (SYSTEM.monotonic()) raises
        ClientTimeout; it is checked on every line and between attempts to reconnect, and
        an idle stream carries a keep-alive comment every 15 s, so it can be passed by up
        to that much.
        """
        last, idle, failures, opened = after, 0, 0, False
        while True:
            delivered = False
            try:
                with self._attach(session_id, last, deadline) as events:
                    if failures and reconnect is not None:
                        reconnect.back(last)
                    opened, failures = True, 0
                    for event in events:
                        if event["type"] == DELTA:
                            if deltas:
                                yield event
                            continue
                        last, delivered = int(event["seq"]), True
                        yield event
            except DaemonUnavailable as exc:
                if not opened and (reconnect is None or not reconnect.from_start):
                    raise
                if reconnect is None:
                    raise DaemonNotRunning(
                        f"lost the daemon at {self.address} ({exc.reason})", exc.reason
                    ) from None
                if not failures:
                    reconnect.lost(exc.reason)
                if deadline is not None and SYSTEM.monotonic() >= deadline:
                    raise ClientTimeout("the deadline passed") from None
                failures, idle = failures + 1, 0
                reconnect.sleep(reconnect.backoff.delay(failures))
                continue
            idle = 0 if delivered else idle + 1
            if idle >= IDLE_RESUMES:
                raise ClientError(
                    f"the daemon at {self.address} keeps ending the attach stream of {session_id}"
                )

    @contextlib.contextmanager
    def _attach(
        self, session_id: str, after: int, deadline: float | None
    ) -> Iterator[Iterator[dict[str, Any]]]:
        """One attach request: its events, once the daemon has accepted it."""
        read = None if deadline is None else max(deadline - SYSTEM.monotonic(), 0.01)
        with (
            _transport_errors(self.address, deadline, self.start_advice, self.holder),
            self._http.stream(
                "GET",
                f"/v1/sessions/{session_id}/attach",
                headers={"Last-Event-ID": str(after), "Accept": "text/event-stream"},
                timeout=httpx.Timeout(TIMEOUT, read=read),
            ) as response,
        ):
            if response.status_code >= 400:
                response.read()
                raise self._api_error(response)
            lines = _until(response.iter_lines(), deadline)
            yield (_message(message) for message in parse_sse(lines))

    # --- plumbing -------------------------------------------------------------------

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        with _transport_errors(self.address, None, self.start_advice, self.holder):
            response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise self._api_error(response)
        try:
            return response.json()
        except ValueError:
            raise ClientError(
                f"the answer from {self.address} is not JSON; "
                "is a turnkeeper daemon listening there?"
            ) from None

    def _api_error(self, response: httpx.Response) -> ClientError:
        status = response.status_code
        try:
            error = response.json()["error"]
            message, code = str(error["message"]), str(error["code"])
        except (ValueError, KeyError, TypeError):
            message, code = response.reason_phrase or "error", "http_error"
        if status == 401:
            message = f"the daemon refused the token from {self.token_source}"
        elif status == 503:
            retry = response.headers.get("Retry-After")
            when = f"retry after {retry} s (Retry-After)" if retry else "retry shortly"
            if code == "stopping":
                message = f"the daemon at {self.address} is stopping; {when}"
            reason = "it is stopping" if code == "stopping" else code
            return DaemonUnavailable(f"{message} (HTTP {status})", reason, status, code)
        return ClientError(f"{message} (HTTP {status})", status, code)


@contextlib.contextmanager
def _transport_errors(
    address: str,
    deadline: float | None = None,
    start_advice: str = "`turnkeeper run`",
    holder: int | None = None,
) -> Iterator[None]:
    """Turn httpx's transport errors into one-line ClientErrors. Nothing listening is
    DaemonNotRunning, unless a process `holder` holds the daemon's lock."""
    try:
        yield
    except httpx.ConnectError as exc:
        reason = _nobody_listens(exc)
        if reason is not None and holder is not None:
            raise DaemonUnavailable(
                f"the daemon (pid {holder}) runs but does not answer at {address} ({reason}): "
                "it is starting (waiting for its database, say) or stopping; its log says which",
                "not answering yet",
            ) from None
        if reason is not None:
            raise DaemonNotRunning(
                f"the daemon is not running at {address} ({reason}); start it with {start_advice}",
                reason,
            ) from None
        raise DaemonUnavailable(
            f"cannot connect to the daemon at {address}: {exc}", "cannot connect"
        ) from None
    except httpx.ReadTimeout:
        if deadline is not None:
            raise ClientTimeout("the deadline passed") from None
        raise ClientError(
            f"the daemon at {address} did not answer within {TIMEOUT:.0f} s"
        ) from None
    except httpx.TimeoutException:
        raise ClientError(
            f"the daemon at {address} did not answer within {TIMEOUT:.0f} s"
        ) from None
    except httpx.TransportError as exc:
        raise DaemonUnavailable(
            f"the connection to the daemon at {address} failed: {exc}", "connection lost"
        ) from None


def _nobody_listens(exc: BaseException) -> str | None:
    """Why the connection failed, when that means no daemon listens there; else None."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError):
            if cause.errno == errno.ENOENT:
                return "no socket"
            if cause.errno == errno.ECONNREFUSED:
                return "connection refused"
        cause = cause.__cause__ or cause.__context__
    return None


def _until(lines: Iterator[str], deadline: float | None) -> Iterator[str]:
    for line in lines:
        if deadline is not None and SYSTEM.monotonic() >= deadline:
            raise ClientTimeout("the deadline passed")
        yield line


def _connectable(host: str) -> str:
    """A host to connect to for a listen address; a wildcard means this host."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
