"""The shipped alert rules: promtool checks and unit-tests them, each alert has a test
that fires it and a runbook section in docs/troubleshooting.md."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from tests.observability.shipped import (
    RULE_TESTS,
    RULES,
    RUNBOOK,
    TROUBLESHOOTING,
    github_slug,
    headings,
    mkdocs_slug,
    rules,
)

REQUIRED = "TURNKEEPER_TEST_REQUIRE_PROMTOOL"
MISSING = "promtool is not installed: apt-get install prometheus (Debian's package has it)"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """promtool with `args`, in the rules' directory; skips (fails where CI requires it)
    when it is not installed."""
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get(REQUIRED):
            pytest.fail(f"{REQUIRED} is set, but {MISSING}")
        pytest.skip(MISSING)
    return subprocess.run(
        [path, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=60
    )


def test_promtool_checks_the_rules() -> None:
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_promtool_unit_tests_pass() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_is_fired_by_a_unit_test_and_quiet_on_healthy_series() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for test in tests:
        for case in test.get("alert_rule_test", []):
            (fired if case["exp_alerts"] else quiet).add(case["alertname"])
    alerts = {r["alert"] for r in rules()}
    assert alerts - fired == set(), "alerts no unit test fires"
    healthy = [t for t in tests if t["name"] == "a healthy daemon fires nothing"]
    assert len(healthy) == 1
    assert {c["alertname"] for c in healthy[0]["alert_rule_test"]} == alerts
    assert all(not c["exp_alerts"] for c in healthy[0]["alert_rule_test"])


def test_every_alert_has_a_wait_a_severity_and_its_annotations() -> None:
    for rule in rules():
        assert rule["alert"].startswith("Turnkeeper"), rule
        assert rule.get("for"), f"{rule['alert']}: no `for:`: one bad scrape would page"
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(annotations), rule["alert"]
        assert annotations["runbook_url"].startswith(RUNBOOK), rule["alert"]


def test_every_runbook_anchor_is_a_heading_of_the_troubleshooting_page() -> None:
    titles = headings(TROUBLESHOOTING.read_text())
    github = {github_slug(t) for t in titles}
    mkdocs = {mkdocs_slug(t) for t in titles}
    assert github == mkdocs, "a heading whose anchor differs on GitHub and in MkDocs"
    anchors = [r["annotations"]["runbook_url"].removeprefix(RUNBOOK) for r in rules()]
    assert [a for a in anchors if a not in github] == []
    assert len(set(anchors)) == len(anchors), "two alerts share a runbook section"


def test_the_slugs_are_those_of_github_and_mkdocs() -> None:
    # The anchor rules themselves, on headings where the two could differ.
    assert github_slug("The breaker tripped") == "the-breaker-tripped"
    assert github_slug("What `turnkeeper doctor` says?") == "what-turnkeeper-doctor-says"
    assert mkdocs_slug("What `turnkeeper doctor` says?") == "what-turnkeeper-doctor-says"
    assert github_slug("A - B") == "a---b" and mkdocs_slug("A - B") == "a-b"
    assert headings("## One\n```\n## not a heading\n```\n### Two\n## Three") == ["One", "Three"]
