"""The metric-name extractor the dashboard and rules tests rely on: it finds what a query
selects, and `missing` reports a name the exposition lacks (the check can fail)."""

from __future__ import annotations

import pytest

from tests.observability.promql import exported, metric_names, missing

EXPOSITION = """\
# HELP turnkeeper_workers Worker slots by state.
# TYPE turnkeeper_workers gauge
turnkeeper_workers{state="running"} 2.0
# HELP turnkeeper_events_committed_total Events committed, by type.
# TYPE turnkeeper_events_committed_total counter
# HELP turnkeeper_append_latency_seconds Time for an event append to commit.
# TYPE turnkeeper_append_latency_seconds histogram
turnkeeper_append_latency_seconds_bucket{le="+Inf"} 3.0
turnkeeper_append_latency_seconds_count 3.0
turnkeeper_append_latency_seconds_sum 0.01
"""


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("turnkeeper_breaker_tripped == 1", {"turnkeeper_breaker_tripped"}),
        (
            'histogram_quantile(0.99, sum by (le) (rate(a_bucket{job=~"$job"}[$__rate_interval])))',
            {"a_bucket"},
        ),
        (
            "sum(rate(x_total[5m])) by (instance, le) / on (instance) group_left (v) y",
            {"x_total", "y"},
        ),
        ('max without (instance) (up{job="a}b", x!~"c"}) offset 1h30m', {"up"}),
        ("a > bool 0.5e3 and ignoring (le) b unless c or d", {"a", "b", "c", "d"}),
        ("topk without (instance) (3, m) or sum by(le)(n)", {"m", "n"}),
        ('count_values("v", a) + vector(1) * scalar(b) - Inf', {"a", "b"}),
        ("label_replace(m, 'dst', '$1', 'src', '(.*)')", {"m"}),
        ("rate(m[5m:30s]) > 0x1F", {"m"}),
        ("turnkeeper_state_dir_free_bytes < 536870912", {"turnkeeper_state_dir_free_bytes"}),
    ],
)
def test_metric_names_finds_what_an_expression_selects(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_a_broken_expression_is_an_error() -> None:
    with pytest.raises(ValueError, match="unterminated"):
        metric_names('up{job="a}')
    with pytest.raises(ValueError, match="closes"):
        metric_names("rate(up[5m)")


def test_exported_minds_the_suffixes_of_counters_and_histograms() -> None:
    have = exported(EXPOSITION)
    assert {"turnkeeper_workers", "turnkeeper_events_committed_total"} <= have
    assert {
        "turnkeeper_append_latency_seconds_bucket",
        "turnkeeper_append_latency_seconds_sum",
    } <= have
    assert "turnkeeper_events_committed" not in have  # a counter is selected with _total


def test_missing_names_an_unknown_metric() -> None:
    queries = [
        "sum by (state) (turnkeeper_workers)",
        "rate(turnkeeper_events_committed_total[5m]) / turnkeeper_nonexistent_total",
        "turnkeeper_append_latency_seconds",  # a histogram by its bare name selects nothing
    ]
    assert missing(queries, EXPOSITION) == {
        queries[1]: {"turnkeeper_nonexistent_total"},
        queries[2]: {"turnkeeper_append_latency_seconds"},
    }
