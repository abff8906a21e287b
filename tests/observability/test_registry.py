"""The gauges added for the alerts, on the registry itself: what they read at scrape time."""

from __future__ import annotations

from pathlib import Path

from supervisor.metrics import Metrics
from tests.observability.promql import value


def test_storage_is_down_while_intake_or_the_host_row_renewal_fails() -> None:
    metrics = Metrics()
    intake_ok = [True]
    metrics.state.storage = lambda: intake_ok[0]
    scrape = lambda: value(metrics.render().decode(), "turnkeeper_storage_up")  # noqa: E731
    assert scrape() == 1
    metrics.loop_pass("courier", False)  # another loop's failure is not the database's word
    assert scrape() == 1
    metrics.loop_pass("hosts", False)
    assert scrape() == 0
    metrics.loop_pass("hosts", True)
    assert scrape() == 1
    intake_ok[0] = False
    assert scrape() == 0


def test_no_storage_or_disk_sample_without_their_source(tmp_path: Path) -> None:
    metrics = Metrics()
    text = metrics.render().decode()
    assert "turnkeeper_storage_up" not in text and "turnkeeper_state_dir" not in text
    metrics.state.state_dir = str(tmp_path / "gone")
    assert "turnkeeper_state_dir" not in metrics.render().decode()  # no wrong sample
    metrics.state.state_dir = str(tmp_path)
    assert value(metrics.render().decode(), "turnkeeper_state_dir_size_bytes")
