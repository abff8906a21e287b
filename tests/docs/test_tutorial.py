"""Every shell block the docs mark as a command that runs (the line `<!-- run -->` right
before the fence) runs against a real daemon, in the order of its page.

The blocks of one page run in one `bash -e` shell, so that what one block sets (`SID=...`)
is there for the next; `turnkeeper` on the PATH is this checkout's command line and
`TURNKEEPER_CONFIG` names the daemon's file, as a reader's shell would after the first
run. A block that exits non-zero fails the test naming its page and line. docs/
contributing.md says which commands are not marked (installs, the foreground daemon).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon, daemons, tokens_file
from tests.support import cli_env

__all__ = ["daemons"]  # the fixture

DOCS = REPO / "docs"
MARK = "<!-- run -->"
FENCE = re.compile(r"^```(?:sh|bash|console)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def marked_blocks(page: Path) -> list[Block]:
    """The shell blocks of `page` that follow the marker line, in order."""
    lines = page.read_text().splitlines()
    blocks = []
    for number, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = number + 1
        if fence >= len(lines) or not FENCE.match(lines[fence]):
            pytest.fail(
                f"{page.relative_to(REPO)}:{number + 1}: {MARK} is not followed by a "
                "```sh, ```bash or ```console fence"
            )
        end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
        blocks.append(Block(page, fence + 1, "\n".join(lines[fence + 1 : end])))
    return blocks


PAGES = sorted(page for page in DOCS.rglob("*.md") if MARK in page.read_text())


def test_the_tutorial_marks_commands() -> None:
    """The marker is in use where the issue asks for it: a change that drops it fails."""
    names = {page.relative_to(DOCS).as_posix() for page in PAGES}
    assert {"tutorial/first-run.md", "tutorial/first-session.md"} <= names, names


def script(blocks: list[Block]) -> str:
    """One bash script running `blocks` in order, each announced before it runs on the
    descriptor $TK_DOCS_FD (not its output, which the commands own)."""
    parts = ["set -euo pipefail"]
    for block in blocks:
        parts.append(f'echo {shlex.quote(block.where)} >&"$TK_DOCS_FD"')
        parts.append(block.text)
    return "\n".join(parts) + "\n"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_the_marked_commands_run(
    page: Path, daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    blocks = marked_blocks(page)
    tokens = tokens_file(tmp_path / "tokens", {})
    daemon = daemons(
        agent={"class": "workers.agents.tool_loop:ToolLoopAgent"},
        auth={"tokens_file": str(tokens)},
    ).start()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "turnkeeper"
    command.write_text(f'#!/bin/sh\nexec {shlex.quote(PYTHON)} -m supervisor "$@"\n')
    command.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = cli_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        TURNKEEPER_CONFIG=str(daemon.config_path),
        TOKENS_FILE=str(tokens),  # the how-to's tokens file, the one the daemon reads
        COLUMNS="80",
        HOME=str(tmp_path),
    )
    read, write = os.pipe()
    env["TK_DOCS_FD"] = str(write)
    try:
        proc = subprocess.run(
            ["bash", "-c", script(blocks)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=90,
            pass_fds=(write,),
        )
    finally:
        os.close(write)
        with os.fdopen(read) as stream:
            started = stream.read().split()
    if proc.returncode != 0:
        where = started[-1] if started else page.relative_to(REPO).as_posix()
        pytest.fail(
            f"{where}: a command of this block exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
            f"\ndaemon log:\n{daemon.log()[-3000:]}"
        )
    assert len(started) == len(blocks)
