"""A session's use of the model's context window, as `GET /v1/sessions/{id}` and
`sessions show` report it: the tokens of its last prompt against the window, and its
compactions (`workers.context`). Pure code over the events the callers read."""

from __future__ import annotations

from typing import Any, Protocol


class EventRecord(Protocol):
    """What is read of an event here (`supervisor.store.EventRecord` is one)."""

    @property
    def seq(self) -> int: ...
    @property
    def created_at(self) -> float: ...
    @property
    def payload(self) -> dict[str, Any]: ...


def context_use(
    last_answer: EventRecord | None,
    newest_compaction: EventRecord | None,
    compactions: int,
    configured_window: int,
) -> dict[str, Any]:
    """`{"last_prompt_tokens", "window", "used", "compactions", "last_compaction"}`.

    The last prompt's tokens are the server's count (`usage.prompt_tokens`), else what
    the worker estimated; the window is the configured one, else the one the newest
    compaction learned from the server; `used` is their quotient, when both are known.
    """
    tokens: int | None = None
    if last_answer is not None:
        usage = last_answer.payload.get("usage")
        counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        estimated = last_answer.payload.get("prompt_estimate")
        tokens = next((v for v in (counted, estimated) if _count(v)), None)
    window = configured_window or None
    last: dict[str, Any] | None = None
    if newest_compaction is not None:
        p = newest_compaction.payload
        window = window or (p.get("window") if _count(p.get("window")) else None)
        last = {
            "seq": newest_compaction.seq,
            "at": newest_compaction.created_at,
            "method": p.get("method"),
            "to_seq": p.get("to_seq"),
            "tokens_before": p.get("tokens_before"),
            "tokens_after": p.get("tokens_after"),
        }
    return {
        "last_prompt_tokens": tokens,
        "window": window,
        "used": round(tokens / window, 4) if tokens and window else None,
        "compactions": compactions,
        "last_compaction": last,
    }


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
