"""The shipped Grafana dashboard: valid JSON of the classic model, every panel a query on
the `${datasource}` variable, a row for each subject of the metrics."""

from __future__ import annotations

from tests.observability.promql import metric_names
from tests.observability.shipped import dashboard, dashboard_queries, panels

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROWS = [
    "Turns",
    "Latency",
    "Model",
    "Workers",
    "Breaker and recovery",
    "Deliveries",
    "Tasks and subagents",
    "Schedules",
    "Hosts and storage",
]


def test_the_dashboard_is_a_classic_model_with_its_variables() -> None:
    board = dashboard()
    assert board["uid"] == "turnkeeper" and board["title"] == "turnkeeper"
    assert board["schemaVersion"] >= 39  # Grafana 11 and later
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"] and variables[name]["multi"]


def test_every_panel_has_a_query_on_the_datasource_variable() -> None:
    board = dashboard()
    found = panels(board)
    assert len(found) >= 30
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "two panels share an id"
    for panel in found:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel.get("description"), panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert metric_names(target["expr"]), (panel["title"], target["expr"])
            # Every query is narrowed to the chosen job (and instance, but the database's
            # hosts: every daemon reports them all).
            assert 'job=~"$job"' in target["expr"], (panel["title"], target["expr"])


def test_the_rows_cover_every_subject_and_the_panels_do_not_overlap() -> None:
    board = dashboard()
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ROWS
    taken: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        columns, lines = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        cells = {(x, y) for x in columns for y in lines}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_latency_panels_are_percentiles_of_histograms() -> None:
    queries = dashboard_queries(dashboard())
    quantiles = [q for q in queries if q.startswith("histogram_quantile(")]
    assert {q.split(",")[0] for q in quantiles} == {
        "histogram_quantile(0.5",
        "histogram_quantile(0.99",
    }
    for query in quantiles:
        assert all(name.endswith("_bucket") for name in metric_names(query)), query
        assert "by (le)" in query, query
