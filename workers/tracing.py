"""The worker's spans of a session's runs: the agent's run, each model call, each tool call.

A run of a turn (`supervisor.core.traces`) is opened by the event its worker commits
first (`turn_started`, or a `continuation` note) and its trace is named by that event:
the worker's `invoke_agent` span is a child of the run's root, which the supervisor emits
(it outlives a SIGKILL of the worker). The model's `chat {model}` and the tools'
`execute_tool {name}` spans are children of the root too, beside the `invoke_agent` span
rather than under it: a SIGKILL loses the run's span still in flight, and the calls that
had ended and been exported stay attached to their trace. Attributes follow OpenTelemetry's
semantic conventions for generative AI (`gen_ai.*`). A continuation links to the root of
the run it continues, and to the assignment that gave this worker the session.

Contents (messages, tool arguments and results) are in the spans only with
`telemetry.capture_content`; without it, their sizes. With tracing off (`Tracing` None)
every method returns at once and nothing is imported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from supervisor.contract.telemetry import Tracing
from supervisor.core.traces import SpanIds, parse_traceparent, run_root
from supervisor.core.vocabulary import EventType
from workers.models import Message, ModelResponse, ToolCall

CONTENT_LIMIT = 16384  # characters of one captured content attribute


def _content(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= CONTENT_LIMIT else text[:CONTENT_LIMIT] + "…"


def _messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in messages]


class RunTrace:
    """The spans of one session's runs in this worker (none when `tracing` is None)."""

    def __init__(
        self,
        tracing: Tracing | None,
        session_id: str,
        *,
        provider: str = "",
        model: str = "",
        agent: str = "",
        server_of: Callable[[str], str | None] = lambda name: None,
    ) -> None:
        self.tracing = tracing
        self.session_id = session_id
        self.provider = provider
        self.model = model or provider
        self.agent = agent
        self.server_of = server_of  # the MCP server that offers a tool, if one does
        self.assigned: SpanIds | None = None  # the latest assignment's span
        self.span: Any = None  # the run in flight
        self.root: SpanIds | None = None  # its root (the supervisor's span)
        self.turn: str | None = None
        self.opened_at = 0  # the seq of the event that opened it

    def assignment(self, traceparent: str | None) -> None:
        """An `assign` with the assignment's span: the next run links to it."""
        self.assigned = parse_traceparent(traceparent)

    def committed(
        self,
        event_type: str,
        payload: dict[str, Any],
        turn_id: str | None,
        seq: int,
        log: Sequence[Any] = (),
    ) -> dict[str, Any]:
        """An event of the session was committed; what its `committed` signal says of the
        run (the turn; for a continuation the run it follows and its attempt). `log`: the
        session's events as last read, where a continuation finds the run it continues."""
        if turn_id is None or event_type not in (
            EventType.TURN_STARTED,
            EventType.CONTINUATION,
            EventType.TURN_ENDED,
            EventType.COMPACTION,
        ):
            return {}
        if event_type == EventType.COMPACTION:
            if self.span is not None:
                self.span.add_event("turnkeeper.compaction", {"turnkeeper.event.seq": seq})
            return {}
        if event_type == EventType.TURN_ENDED:
            self.ran(str(payload.get("outcome", "")))
            self.turn, self.opened_at = None, 0
            return {"turn": turn_id}
        follows: int | None = None
        attempt: int | None = 1
        if event_type == EventType.CONTINUATION:
            follows = self._opened_before(turn_id, seq, log)
            counted = payload.get("attempt")
            attempt = counted + 1 if isinstance(counted, int) and counted > 0 else None
        self._open(turn_id, seq, follows, attempt, str(payload.get("cause") or ""))
        return {"turn": turn_id, "follows": follows, "attempt": attempt}

    def _opened_before(self, turn_id: str, seq: int, log: Sequence[Any]) -> int | None:
        if self.turn == turn_id and self.opened_at:
            return self.opened_at
        opening = (EventType.TURN_STARTED, EventType.CONTINUATION)
        found = [e.seq for e in log if e.turn_id == turn_id and e.type in opening and e.seq < seq]
        return max(found) if found else None

    def _open(
        self, turn_id: str, seq: int, follows: int | None, attempt: int | None, cause: str
    ) -> None:
        if self.span is not None:
            self.cut("superseded")  # a run of ours that never ended: the next one began
        self.turn, self.opened_at = turn_id, seq
        if self.tracing is None:
            return
        root = self.root = run_root(turn_id, seq)
        links = [run_root(turn_id, follows)] if follows is not None else []
        if self.assigned is not None:
            links.append(self.assigned)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.provider.name": self.provider,
            "gen_ai.conversation.id": self.session_id,
            "gen_ai.agent.name": self.agent,
            "turnkeeper.session.id": self.session_id,
            "turnkeeper.turn.id": turn_id,
            "turnkeeper.run.opened_at": seq,
            "turnkeeper.turn.continued": follows is not None or bool(cause),
        }
        if attempt is not None:
            attributes["turnkeeper.turn.attempt"] = attempt
        if cause:
            attributes["turnkeeper.continuation.cause"] = cause
        self.span = self.tracing.start(
            f"invoke_agent {self.agent}".strip(), parent=root, attributes=attributes, links=links
        )
        if cause:
            self.span.add_event("turnkeeper.continuation", {"turnkeeper.continuation.cause": cause})

    def ran(self, outcome: str) -> None:
        """The agent's run came to `outcome` (the turn ends so, or is continued)."""
        span, self.span = self.span, None
        if span is None:
            return
        span.set_attribute("turnkeeper.turn.outcome", outcome)
        if outcome == "failed":
            Tracing.fail(span, "turn_failed")
        span.end()

    def cut(self, why: str) -> None:
        """The run stopped without ending its turn (released, fenced out, cancelled, or
        continued by a next run): its span ends, failed with `why`."""
        span, self.span = self.span, None
        if span is not None:
            Tracing.fail(span, why)
            span.end()

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The run's span is the current one inside: log lines and children name it."""
        if self.tracing is None or self.span is None:
            yield
            return
        with self.tracing.current(self.span):
            yield

    @contextlib.contextmanager
    def chat(
        self, messages: Sequence[Message], max_tokens: int = 0
    ) -> Iterator[Callable[[ModelResponse], None]]:
        """A model call's span around the block; the block reports the answer by calling
        what it is given. An exception out of the block fails the span."""
        if self.tracing is None:
            yield _ignore
            return
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": self.provider,
            "gen_ai.system": self.provider,
            "gen_ai.request.model": self.model,
            "turnkeeper.session.id": self.session_id,
            "turnkeeper.input.messages": len(messages),
        }
        if max_tokens:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        if self.tracing.capture_content:
            attributes["gen_ai.input.messages"] = _content(_messages(messages))
        span = self.tracing.start(
            f"chat {self.model}", parent=self.root, attributes=attributes, kind="client"
        )

        def answered(response: ModelResponse) -> None:
            usage = response.usage
            span.set_attribute("gen_ai.response.model", self.model)
            span.set_attribute("gen_ai.response.finish_reasons", [str(response.finish_reason)])
            for name, key in (
                ("gen_ai.usage.input_tokens", "prompt_tokens"),
                ("gen_ai.usage.output_tokens", "completion_tokens"),
            ):
                if isinstance(usage.get(key), int):
                    span.set_attribute(name, usage[key])
            if response.tool_calls:
                span.set_attribute("turnkeeper.tool_calls", len(response.tool_calls))
            if self.tracing is not None and self.tracing.capture_content:
                output = [{"role": "assistant", "content": response.text}]
                span.set_attribute("gen_ai.output.messages", _content(output))

        with self._ending(span):
            yield answered

    @contextlib.contextmanager
    def _ending(self, span: Any) -> Iterator[None]:
        """`span` is current in the block, failed by what the block raises, and ended."""
        assert self.tracing is not None
        try:
            with self.tracing.current(span):
                yield
        except BaseException as exc:
            Tracing.fail(span, type(exc).__name__)
            raise
        finally:
            span.end()

    @contextlib.contextmanager
    def tool(self, call: ToolCall) -> Iterator[Callable[[str, bool], None]]:
        """A tool call's span around the block; the block reports the result (content,
        is_error) by calling what it is given."""
        if self.tracing is None:
            yield _ignore_result
            return
        server = self.server_of(call.name)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
            "gen_ai.tool.type": "function",
            "turnkeeper.session.id": self.session_id,
        }
        if server is not None:
            attributes["turnkeeper.mcp.server"] = server
            attributes["mcp.method.name"] = "tools/call"
        if self.tracing.capture_content:
            attributes["gen_ai.tool.call.arguments"] = _content(call.arguments)
        span = self.tracing.start(
            f"execute_tool {call.name}", parent=self.root, attributes=attributes
        )

        def result(content: str, is_error: bool) -> None:
            span.set_attribute("turnkeeper.tool.outcome", "error" if is_error else "ok")
            span.set_attribute("turnkeeper.tool.result_chars", len(content))
            if is_error:
                Tracing.fail(span, "tool_error")
            if self.tracing is not None and self.tracing.capture_content:
                span.set_attribute("gen_ai.tool.call.result", _content(content))

        with self._ending(span):
            yield result


def _ignore(response: ModelResponse) -> None:
    return None


def _ignore_result(content: str, is_error: bool) -> None:
    return None
