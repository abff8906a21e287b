"""Where a running daemon is, as it publishes it for the command line: `daemon.json`.

Once its API listens, the daemon writes its pid, boot, version, host id, listen address,
state and runtime directories and configuration file into `daemon.json` in its runtime
directory and, for a command line that knows only the state directory, in that too. It
is written atomically (a temporary file renamed over it), so a reader sees the old file
or the new one, never half of one, and it is removed when the daemon stops. A reload
changes nothing it holds (each of its keys needs a restart), so it is written once a boot.

A reader must not trust it blindly: a daemon killed with SIGKILL leaves it behind, and
its pid may be reused. It is the daemon's only while that pid holds the state
directory's leader lock (`supervisor.cli.discovery` checks that).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PUBLISHED = "daemon.json"


@dataclass(frozen=True)
class Published:
    """What a running daemon says of itself."""

    pid: int
    boot_id: str
    version: str
    host_id: str
    listen: str  # `http.listen` as configured: HOST:PORT or unix:/path
    state_dir: str
    runtime_dir: str
    config: str | None  # the configuration file it runs from, None for built-in defaults

    @classmethod
    def from_json(cls, text: str) -> Published:
        """The document `text`; raises ValueError when it is not one of ours."""
        try:
            data: Any = json.loads(text)
            found = cls(
                pid=int(data["pid"]),
                boot_id=str(data["boot_id"]),
                version=str(data["version"]),
                host_id=str(data["host_id"]),
                listen=str(data["listen"]),
                state_dir=str(data["state_dir"]),
                runtime_dir=str(data["runtime_dir"]),
                config=None if data.get("config") is None else str(data["config"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a turnkeeper daemon file: {exc}") from None
        if found.pid <= 0:
            raise ValueError("not a turnkeeper daemon file: no pid")
        return found

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def places(state_dir: Path, runtime_dir: Path) -> list[Path]:
    """Where the daemon of these directories publishes itself."""
    return list(dict.fromkeys([runtime_dir / PUBLISHED, state_dir / PUBLISHED]))


def publish(published: Published) -> None:
    """Write `published` atomically in its runtime and state directories (0600, like
    every file there)."""
    for path in places(Path(published.state_dir), Path(published.runtime_dir)):
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(published.to_json())
        os.replace(temporary, path)


def withdraw(state_dir: Path, runtime_dir: Path, pid: int) -> None:
    """Remove the files this daemon (`pid`) published; another daemon's are left."""
    for path in places(state_dir, runtime_dir):
        with contextlib.suppress(OSError, ValueError):
            if read(path).pid == pid:
                path.unlink()


def read(path: Path) -> Published:
    """The file at `path`. Raises FileNotFoundError, PermissionError (and other OSErrors)
    and ValueError for a file that is not one of ours."""
    # O_NOFOLLOW: a link planted in a directory we may read is not ours.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as stream:
        text = stream.read(65536).decode(errors="replace")
    return Published.from_json(text)
