"""An OTLP/HTTP trace receiver on 127.0.0.1 for tests and benchmarks: `POST /v1/traces`
with protobuf bodies, decoded with OpenTelemetry's own `ExportTraceServiceRequest`.

`hang` makes it take requests and never answer (a collector that is down or slow) until
`close`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.daemon import LoopbackServer


@dataclass
class Span:
    """One exported span, its ids in hex."""

    trace_id: str
    span_id: str
    parent: str
    name: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    events: list[str]
    status: int
    process: str  # the resource's `turnkeeper.process`
    start_ns: int = 0
    end_ns: int = 0
    raw: str = field(default="", repr=False)  # every string the span carries, for searches


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Receiver:
    """Collects the spans it is sent; `hang`: answers nothing."""

    def __init__(self, hang: bool = False) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[Span] = []
        self.bodies: list[bytes] = []
        self.requests = 0
        self.released = threading.Event()
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with lock:
                    receiver.requests += 1
                if hang or self.path != "/v1/traces":
                    if hang:
                        receiver.released.wait(60)
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                spans = []
                for resource in request.resource_spans:
                    attrs = {a.key: _value(a.value) for a in resource.resource.attributes}
                    for scope in resource.scope_spans:
                        for s in scope.spans:
                            spans.append(
                                Span(
                                    s.trace_id.hex(),
                                    s.span_id.hex(),
                                    s.parent_span_id.hex(),
                                    s.name,
                                    {a.key: _value(a.value) for a in s.attributes},
                                    [(k.trace_id.hex(), k.span_id.hex()) for k in s.links],
                                    [e.name for e in s.events],
                                    s.status.code,
                                    str(attrs.get("turnkeeper.process", "")),
                                    s.start_time_unix_nano,
                                    s.end_time_unix_nano,
                                    str(s) + str(resource.resource),
                                )
                            )
                with lock:
                    receiver.bodies.append(body)
                    receiver.spans.extend(spans)
                data = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = LoopbackServer(Handler)

    @property
    def endpoint(self) -> str:
        """The base URL to give `telemetry.otlp_endpoint`."""
        return self.server.url()

    def named(self, prefix: str) -> list[Span]:
        return [s for s in list(self.spans) if s.name.startswith(prefix)]

    def close(self) -> None:
        self.released.set()
        self.server.close()
