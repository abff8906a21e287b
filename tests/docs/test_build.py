"""The docs site builds with `mkdocs build --strict`: every internal link and anchor
resolves, every page is in the nav. Skipped without MkDocs (the `docs` extra), unless
TURNKEEPER_TEST_REQUIRE_DOCS=1 (.ci/run sets it), where its absence fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def mkdocs() -> list[str] | None:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "mkdocs"]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    command = mkdocs()
    if command is None:
        if os.environ.get("TURNKEEPER_TEST_REQUIRE_DOCS") == "1":
            pytest.fail("mkdocs-material is not installed: pip install -e '.[docs]'")
        pytest.skip("mkdocs-material is not installed (the `docs` extra)")
    site = tmp_path / "site"
    proc = subprocess.run(
        [*command, "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (site / "index.html").exists()
    assert (site / "explanation" / "restarts.html").exists()
    shutil.rmtree(site)
