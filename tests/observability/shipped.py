"""The shipped dashboard and alert rules, read as the tests need them."""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

import yaml

from tests.conftest import REPO

RULES = REPO / "etc" / "prometheus" / "turnkeeper-alerts.yml"
RULE_TESTS = REPO / "etc" / "prometheus" / "turnkeeper-alerts.test.yml"
DASHBOARD = REPO / "etc" / "grafana" / "turnkeeper.json"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
RUNBOOK = "docs/troubleshooting.md#"


def rules() -> list[dict[str, Any]]:
    """Every rule of the shipped rule file, each with its group's name as `group`."""
    loaded = yaml.safe_load(RULES.read_text())
    return [{**r, "group": g["name"]} for g in loaded["groups"] for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    found: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return found


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's panels, rows left out, those inside collapsed rows included."""
    found = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets, and the metric
    selector of each `label_values(SELECTOR, label)` variable (Grafana's, not PromQL)."""
    queries = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        found = re.fullmatch(r"label_values\((.+),\s*[A-Za-z_][A-Za-z0-9_]*\)", text)
        assert found, f"variable {variable['name']}: not label_values(SELECTOR, label): {text}"
        queries.append(found.group(1))
    return queries


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Python-Markdown's `toc.slugify`)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def headings(markdown: str) -> list[str]:
    """The `## ` headings of a Markdown text, code blocks left out."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            found.append(line[3:])
    return found
