"""Traces: this process's spans, exported with OpenTelemetry's SDK over OTLP/HTTP.

Off unless `telemetry.otlp_endpoint` is set (or, when it is empty, the standard
`OTEL_EXPORTER_OTLP_ENDPOINT`): with it off, `start_tracing` returns None and no
OpenTelemetry module is ever imported (a worker's start and memory stay as they were).
The endpoint is the OTLP/HTTP base URL; spans go to its `/v1/traces`, and nowhere else.

Each process exports its own spans (the supervisor and every worker): a batch processor
with a bounded queue (`telemetry.queue_size`) feeds the exporter from its own thread, so
a turn never waits for a collector. What cannot be exported is counted, never waited for:
a span that finds the queue full (the SDK drops the oldest silently; the count is ours)
and the spans of a batch the collector refused or did not answer within
`EXPORT_TIMEOUT`. Workers report their count in their heartbeats, and the supervisor
serves the sum as `turnkeeper_spans_dropped`. The supervisor's stop flushes what is
queued as a capped step (`supervisor.teardown.FLUSH_CAP`); a worker flushes on its own clean exit
(`WORKER_FLUSH`); a SIGKILL loses what its process had queued.

The OpenTelemetry standard variables for the batch processor (`OTEL_BSP_SCHEDULE_DELAY`,
...) are read as the SDK reads them; `OTEL_EXPORTER_OTLP_HEADERS` too. The SDK's own
`atexit` flush is off (it could hold an exit for 30 s): only the steps above flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from supervisor.contract import logs
from supervisor.contract.logs import log
from supervisor.contract.sections import check_endpoint
from supervisor.core.traces import SpanIds

if TYPE_CHECKING:
    from supervisor.contract.config import Config

ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_PATH = "/v1/traces"
EXPORT_TIMEOUT = 2.0  # seconds an export of one batch may take, its retries included
WORKER_FLUSH = 1.0  # a worker's flush on its clean exit


def endpoint(config: Config, environ: Mapping[str, str] | None = None) -> str:
    """Where this daemon's spans go: the traces URL, or "" when tracing is off.

    `telemetry.otlp_endpoint` (checked when the configuration loads), else the standard
    variable; a variable that is no URL is a ValueError naming it (exit 78).
    """
    env = os.environ if environ is None else environ
    base = config.telemetry.otlp_endpoint
    if not base:
        base = env.get(ENDPOINT_VARIABLE, "").strip()
        problem = check_endpoint(base) if base else None
        if problem is not None:
            raise ValueError(f"{ENDPOINT_VARIABLE}: {problem} (or set telemetry.otlp_endpoint)")
    if not base:
        return ""
    base = base.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


# The ids the next span started in this context takes: a run's root, whose ids are
# derived (`supervisor.core.traces.run_root`), not drawn.
_FIXED: ContextVar[SpanIds | None] = ContextVar("turnkeeper_fixed_span_ids", default=None)
active: Tracing | None = None  # this process's, once started: log lines name its spans


class Tracing:
    """This process's tracer and its export queue (built by `start_tracing`).

    Spans are OpenTelemetry spans (typed `Any` here, so that importing this module
    imports no OpenTelemetry); parents and links are named by `SpanIds`.
    """

    def __init__(self, tracer: Any, processor: Any, exporter: Any, capture_content: bool) -> None:
        self.tracer = tracer
        self.processor = processor
        self.exporter = exporter
        self.capture_content = capture_content
        self._reported = 0  # dropped spans already told in a heartbeat

    @property
    def dropped(self) -> int:
        """Spans this process could not export since it started."""
        return int(self.processor.dropped + self.exporter.dropped)

    def take_dropped(self) -> int:
        """Spans dropped since the last take (a worker's heartbeat carries it)."""
        total = self.dropped
        delta, self._reported = total - self._reported, total
        return delta

    def start(
        self,
        name: str,
        *,
        parent: SpanIds | None = None,
        ids: SpanIds | None = None,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[SpanIds] = (),
        kind: str = "internal",
        start_ns: int | None = None,
    ) -> Any:
        """A span, started: a child of `parent` (a span of this or another process), or of
        the current span; with `ids`, a root whose trace and span ids are those."""
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        if ids is not None:
            ctx = otel_context.Context()  # a root: no parent, whatever is current
        elif parent is not None:
            ctx = trace.set_span_in_context(trace.NonRecordingSpan(_context(parent)))
        else:
            ctx = None
        token = _FIXED.set(ids)
        try:
            return self.tracer.start_span(
                name,
                context=ctx,
                kind=getattr(trace.SpanKind, kind.upper()),
                attributes=dict(attributes or {}),
                links=[trace.Link(_context(link)) for link in links],
                start_time=start_ns,
            )
        finally:
            _FIXED.reset(token)

    @staticmethod
    @contextlib.contextmanager
    def current(span: Any) -> Iterator[None]:
        """`span` is the current span inside (log lines and child spans name it)."""
        from opentelemetry import trace

        with trace.use_span(span, end_on_exit=False):
            yield

    @staticmethod
    def ids(span: Any) -> SpanIds:
        ctx = span.get_span_context()
        return SpanIds(ctx.trace_id, ctx.span_id)

    @staticmethod
    def fail(span: Any, error_type: str, description: str = "") -> None:
        """Mark `span` failed: status error and `error.type`, as the conventions say."""
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, description or error_type))

    async def flush(self, cap: float) -> None:
        """Export what is queued, for at most `cap` seconds (TimeoutError past it).

        The export runs in a daemon thread of its own: one that is still waiting for a
        collector when the cap is up holds neither the event loop nor the exit.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def flush() -> None:
            try:
                self.processor.force_flush()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(_settle, done)

        threading.Thread(target=flush, name="turnkeeper-telemetry-flush", daemon=True).start()
        await asyncio.wait_for(done, cap)


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def current_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids (hex), when tracing is on and one is."""
    if active is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def _context(ids: SpanIds) -> Any:
    from opentelemetry.trace import SpanContext, TraceFlags

    return SpanContext(ids.trace_id, ids.span_id, is_remote=True, trace_flags=TraceFlags(1))


def start_tracing(
    config: Config, process: str, environ: Mapping[str, str] | None = None
) -> Tracing | None:
    """This process's tracing, or None (nothing imported) when no endpoint is set.

    `process` names it in every span's resource (`turnkeeper.process`: supervisor, or the
    worker's name). ValueError for an `OTEL_EXPORTER_OTLP_ENDPOINT` that is not a URL.
    """
    global active
    url = endpoint(config, environ)
    if not url:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    from supervisor import __version__

    # The SDK logs every failed export through `logging`; ours says it once (below).
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    say = log("telemetry")

    class Ids(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            fixed = _FIXED.get()
            return fixed.trace_id if fixed is not None else super().generate_trace_id()

        def generate_span_id(self) -> int:
            fixed = _FIXED.get()
            return fixed.span_id if fixed is not None else super().generate_span_id()

    class Counted(SpanExporter):
        """The OTLP exporter, with the spans it could not export counted."""

        def __init__(self, inner: SpanExporter) -> None:
            self.inner = inner
            self.dropped = 0
            self.failing = False

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            try:
                result = self.inner.export(spans)
            except Exception as exc:  # the SDK's thread would log it; we count it
                result, why = SpanExportResult.FAILURE, str(exc)
            else:
                why = "refused or unanswered"
            if result is SpanExportResult.SUCCESS:
                if self.failing:
                    say.info("spans reach {} again", url)
                self.failing = False
            else:
                self.dropped += len(spans)
                if not self.failing:
                    say.warning(
                        "cannot export spans to {} ({}); dropping them until it answers",
                        url,
                        why,
                    )
                self.failing = True
            return result

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(self.inner.force_flush(timeout_millis))

    size = config.telemetry.queue_size

    class Bounded(BatchSpanProcessor):
        """A batch processor that counts the spans a full queue makes it drop."""

        dropped = 0

        def on_end(self, span: Any) -> None:
            queue = getattr(getattr(self, "_batch_processor", None), "_queue", None)
            if queue is not None and len(queue) >= size:
                self.dropped += 1  # the SDK drops the oldest queued span for it
            super().on_end(span)

    exporter = Counted(OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT))
    processor = Bounded(exporter, max_queue_size=size, max_export_batch_size=min(512, size))
    resource = Resource.create(
        {
            "service.name": config.telemetry.service_name,
            "service.version": __version__,
            "service.instance.id": f"{os.uname().nodename}/{os.getpid()}",
            "turnkeeper.process": process,
        }
    )
    provider = TracerProvider(resource=resource, id_generator=Ids(), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("turnkeeper", __version__)
    active = Tracing(tracer, processor, exporter, config.telemetry.capture_content)
    logs.span_ids = current_ids
    return active
