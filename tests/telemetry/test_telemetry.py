"""The telemetry seam in one process: the endpoint's rules, the control plane's trace
context, dropped spans counted, flushes capped, trace ids in JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from loguru import logger

from supervisor.contract import control, logs, telemetry
from supervisor.contract.config import Config, ConfigError, load_config
from supervisor.contract.telemetry import EXPORT_TIMEOUT, endpoint, start_tracing
from supervisor.core.traces import run_root
from tests.conftest import REPO, python_env
from tests.otlp_receiver import Receiver


@pytest.fixture
def reset() -> Iterator[None]:
    yield
    telemetry.active = None
    logs.span_ids = None
    logs.setup_logging()


def test_the_endpoint_is_the_key_else_the_standard_variable() -> None:
    off = Config()
    assert endpoint(off, {}) == ""
    assert endpoint(off, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) == (
        "http://127.0.0.1:4318/v1/traces"
    )
    keyed = Config.model_validate({"telemetry": {"otlp_endpoint": "https://collector:4318/"}})
    assert endpoint(keyed, {"OTEL_EXPORTER_OTLP_ENDPOINT": "junk"}) == (
        "https://collector:4318/v1/traces"
    )
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT: must be an http"):
        endpoint(off, {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://127.0.0.1:4317"})


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("127.0.0.1:4318", "must be an http"),
        ("ftp://host/", "must be an http"),
        ("http://", "must name a host"),
        ("http://host:port/", "not a URL"),
        ("http://host/?q=1", "no query"),
    ],
)
def test_a_bad_endpoint_is_a_configuration_error_naming_the_key(value: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"telemetry.otlp_endpoint: .*{why}"):
        load_config(None, {"TURNKEEPER_TELEMETRY__OTLP_ENDPOINT": value})


def test_run_exits_78_with_one_line_for_a_bad_endpoint(tmp_path: Any) -> None:
    for env in (
        {"TURNKEEPER_TELEMETRY__OTLP_ENDPOINT": "localhost:4318"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4318"},
    ):
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", "run"],
            cwd=REPO,
            env=python_env(
                TURNKEEPER_DAEMON__STATE_DIR=str(tmp_path / "state"),
                TURNKEEPER_DAEMON__RUNTIME_DIR=str(tmp_path / "run"),
                TURNKEEPER_HTTP__LISTEN=f"unix:{tmp_path / 'api.sock'}",
                **env,
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 78, done.stderr
        name = next(iter(env))
        key = "telemetry.otlp_endpoint" if name.startswith("TURNKEEPER") else name
        lines = [line for line in done.stderr.splitlines() if key in line]
        assert lines, done.stderr


def test_a_malformed_traceparent_in_an_assignment_is_dropped_not_the_message() -> None:
    good = run_root("ab" * 16, 3).traceparent
    for given, kept in [(good, good), ("00-zz", None), (12, None), ("x" * 10_000, None)]:
        frame = json.dumps(
            {
                "type": "assign",
                "sessions": [
                    {"session": "cd" * 16, "token": 1, "reason": "new", "traceparent": given}
                ],
            }
        ).encode()
        message = control.decode([frame], control.SUPERVISOR_MESSAGES)
        assert isinstance(message, control.Assign)
        assert message.sessions[0].traceparent == kept


def test_spans_a_full_queue_or_a_silent_collector_drop_are_counted(reset: None) -> None:
    hung = Receiver(hang=True)
    try:
        config = Config.model_validate(
            {"telemetry": {"otlp_endpoint": hung.endpoint, "queue_size": 4}}
        )
        tracing = start_tracing(config, "test", {})
        assert tracing is not None
        started = time.monotonic()
        for n in range(50):
            tracing.start(f"span {n}").end()
        # Ending a span never waits for an export (one would hold it EXPORT_TIMEOUT).
        assert time.monotonic() - started < EXPORT_TIMEOUT
        assert tracing.dropped >= 40
        assert tracing.take_dropped() == tracing.dropped

        async def flush() -> float:
            began = time.monotonic()
            with pytest.raises(TimeoutError):
                await tracing.flush(0.5)
            return time.monotonic() - began

        # The cap, not the collector (which holds an export EXPORT_TIMEOUT), ends the flush.
        assert asyncio.run(flush()) < EXPORT_TIMEOUT
    finally:
        hung.close()


def test_json_log_lines_in_a_span_carry_its_ids(reset: None) -> None:
    receiver = Receiver()
    try:
        config = Config.model_validate({"telemetry": {"otlp_endpoint": receiver.endpoint}})
        tracing = start_tracing(config, "test", {})
        assert tracing is not None
        stream = io.StringIO()
        logs.setup_logging("INFO", "json")
        logger.remove()
        logger.add(logs._JsonSink(stream), format="{message}")
        span = tracing.start("work")
        with tracing.current(span):
            logs.log("agent").info("inside")
        span.end()
        logs.log("agent").info("outside")
        inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
        ids = tracing.ids(span)
        assert inside["trace_id"] == f"{ids.trace_id:032x}"
        assert inside["span_id"] == f"{ids.span_id:016x}"
        assert "trace_id" not in outside and "span_id" not in outside
    finally:
        receiver.close()


def test_importing_the_daemon_and_the_worker_imports_no_opentelemetry() -> None:
    code = (
        "import sys, supervisor.daemon, workers.main, supervisor.composition\n"
        "print([m for m in sys.modules if m.startswith('opentelemetry')])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=python_env(), capture_output=True, text=True
    )
    assert done.stdout.strip() == "[]", done.stderr
