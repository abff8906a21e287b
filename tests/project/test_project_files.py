"""The files a packager and an operator look for: the license pyproject.toml names, and a
changelog whose newest version is the package's."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_license_pyproject_names() -> None:
    assert PYPROJECT["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert re.search(r"^\s*Apache License\s*\n\s*Version 2\.0, January 2004", text, re.M)
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not its first page


def test_the_changelog_opens_with_unreleased_then_the_packages_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## (\S+)", text, re.M)
    assert versions[:2] == ["Unreleased", PYPROJECT["version"]], versions
    released = re.search(
        rf"^## {re.escape(PYPROJECT['version'])} - (\d{{4}}-\d\d-\d\d)$", text, re.M
    )
    assert released, "the version's heading has no date"


def test_the_docs_say_how_to_upgrade_and_roll_back() -> None:
    section = (REPO / "docs" / "how-to" / "upgrade.md").read_text()
    for needed in ("turnkeeper db migrate", "pg_dump", "mysqldump", "admin.token", "Roll back"):
        assert needed in section, needed
