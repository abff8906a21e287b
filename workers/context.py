"""A session's context window: what a prompt costs in tokens, and compaction.

Before a model call whose prompt would not fit `context_window - max_tokens - margin`,
the older part of the conversation is replaced by a summary: one model call with the
summarizing instruction (`model.compaction_prompt`), committed as a `compaction` event
(the summary, the seqs it covers, the token counts before and after). The history a
worker builds is then the newest compaction's summary and the events after it
(`workers.cache.SessionLog`). The cut is only ever right after a turn's end, where no
tool call is open (`history.compaction_cuts`): a call and its result are never split,
and the turn in flight is never summarized. If even the summarizing call cannot fit, the
oldest part is dropped with a note saying so.

Token counts: the server's where it reports them (`usage`), else an estimate of UTF-8
bytes / 3, rounded up. What the server counted for a prompt against what was estimated
for it gives a ratio that scales later estimates (a model's tokenizer may count a byte a
token); the estimate is kept in the `model_response` event, so a worker that reads the
log anew has the ratio at no cost.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loguru import logger

from supervisor.core.vocabulary import EventType
from supervisor.store import EventRecord
from workers import history
from workers.models import Message, ModelError, ModelResponse, ToolSpec

MESSAGE_OVERHEAD = 4  # tokens a chat template adds around each message, about
RATIO_BOUNDS = (0.1, 10.0)  # a server's count over our estimate, as far as it is believed
SUMMARY_NOTE = (
    "[turnkeeper] The conversation before this point was compacted to fit the model's "
    "context window. Summary of it:\n"
)
DROPPED_NOTE = (
    "[turnkeeper] {count} earlier messages were dropped to fit the model's context window; "
    "no summary of them could be made."
)
SUMMARY_TRIES = 3  # summarizing calls a compaction makes at most
KEY = "compaction:{to_seq}"  # a compaction of the same range is committed once

# (type, payload, turn id, idempotency key) -> seq
CommitKeyed = Callable[[str, dict[str, Any], str | None, str | None], Awaitable[int]]
# One model call (the turn's, which a release abandons): (messages, tools) -> answer
Ask = Callable[[list[Message], list[ToolSpec]], Awaitable[ModelResponse]]


def estimate(text: str) -> int:
    """Tokens in `text`, estimated: its UTF-8 bytes / 3, rounded up."""
    return math.ceil(len(text.encode("utf-8", "replace")) / 3)


def message_tokens(message: Message) -> int:
    """What `message` costs in a prompt: its count if the log kept one, else estimated."""
    if message.tokens is not None:
        return message.tokens + MESSAGE_OVERHEAD
    cost = MESSAGE_OVERHEAD + estimate(message.content)
    for call in message.tool_calls:
        cost += estimate(call.name) + estimate(json.dumps(call.arguments))
    return cost


def tools_tokens(tools: Sequence[ToolSpec]) -> int:
    """What offering `tools` costs in a prompt, estimated."""
    return sum(
        estimate(tool.name) + estimate(tool.description) + estimate(json.dumps(tool.input_schema))
        for tool in tools
    )


def prompt_estimate(messages: Sequence[Message], tools: Sequence[ToolSpec]) -> int:
    """The estimated tokens of a prompt of `messages` offering `tools`."""
    return sum(message_tokens(m) for m in messages) + tools_tokens(tools)


def ratio_of(payload: dict[str, Any]) -> float | None:
    """The server's prompt count over our estimate, from a `model_response` payload."""
    usage, estimated = payload.get("usage"), payload.get("prompt_estimate")
    if not isinstance(usage, dict) or not isinstance(estimated, int) or estimated <= 0:
        return None
    counted = usage.get("prompt_tokens")
    if not isinstance(counted, int) or isinstance(counted, bool) or counted <= 0:
        return None
    return min(max(counted / estimated, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])


@dataclass(frozen=True)
class Summary:
    """The newest compaction of a session: it stands for every event up to `to_seq`."""

    text: str
    to_seq: int
    dropped: bool = False

    @classmethod
    def of(cls, event: EventRecord) -> Summary | None:
        """The summary a `compaction` event holds; None for a malformed one."""
        return cls.of_payload(event.payload)

    @classmethod
    def of_payload(cls, payload: dict[str, Any]) -> Summary | None:
        """The summary a `compaction` event's payload holds; None for a malformed one."""
        to_seq, text = payload.get("to_seq"), payload.get("summary")
        if not isinstance(to_seq, int) or not isinstance(text, str):
            return None
        return cls(text, to_seq, payload.get("method") == "dropped")

    def message(self) -> Message:
        """The summary as the conversation's first message: a framework note."""
        text = self.text if self.dropped else SUMMARY_NOTE + self.text
        return Message("user", text, note=True, tokens=estimate(text))


class Window:
    """A model's context window: the configured size, or one learned from the server's
    context-length error (`model.context_window = 0`). One per worker."""

    def __init__(self, configured: int, learned: int = 0) -> None:
        self.configured = configured
        self.learned = learned

    @property
    def size(self) -> int:
        """Tokens, or 0 while unknown."""
        return self.configured or self.learned

    def learn(self, size: int | None) -> None:
        """A server's error named its window."""
        if size and not self.configured:
            self.learned = size


@dataclass(frozen=True)
class Settings:
    """What compaction needs of `model.*`."""

    max_tokens: int
    margin: int
    prompt: str


class Compactor:
    """Compaction for one run of a turn, over the session log it started from.

    `messages` is the turn's own list: a compaction replaces its older part in place.
    `base` is 1 when that list starts with an earlier compaction's summary, else 0.
    """

    def __init__(
        self,
        *,
        events: Sequence[EventRecord],
        base: int,
        window: Window,
        settings: Settings,
        ask: Ask,
        commit: CommitKeyed,
        turn_id: str,
        ratio: float = 1.0,
        session_tokens: int = 0,
    ) -> None:
        self._events = events
        self._offset = -base  # original message index -> index in the list, less this
        self._after = 0  # the seq up to which this run compacted already
        self.window = window
        self.settings = settings
        self._ask = ask
        self._commit = commit
        self._turn_id = turn_id
        self.ratio = ratio
        self._session_tokens = session_tokens  # carried on, for `workers.budget`

    def limit(self) -> int | None:
        """The most tokens a prompt may have, if the window is known."""
        size = self.window.size
        if not size:
            return None
        return max(size - self.settings.max_tokens - self.settings.margin, 1)

    def cost(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> int:
        """The prompt's tokens as the server will count them, estimated."""
        return math.ceil(prompt_estimate(messages, tools) * self.ratio)

    def counted(self, estimated: int, usage: dict[str, int]) -> None:
        """A call's prompt, estimated at `estimated`, was counted by the server: learn."""
        found = ratio_of({"usage": usage, "prompt_estimate": estimated})
        if found is not None:
            self.ratio = found

    async def fit(
        self, messages: list[Message], tools: Sequence[ToolSpec], *, forced: bool = False
    ) -> bool:
        """Compact `messages` if their prompt would not fit (or, `forced`, because the
        server said it did not); whether it compacted."""
        limit = self.limit()
        before = self.cost(messages, tools)
        if not forced and (limit is None or before <= limit):
            return False
        cuts = self._cuts()
        if not cuts:
            logger.bind(subsystem="worker").warning(
                "the prompt ({} tokens) does not fit the context window ({}), and there is "
                "no earlier turn to compact",
                before,
                self.window.size or "unknown",
            )
            return False
        seq, count = self._choose(cuts, messages, tools, limit)
        logger.bind(subsystem="worker").info(
            "compacting the conversation up to seq {}: the prompt ({} tokens) {} the context "
            "window ({})",
            seq,
            before,
            "did not fit" if forced else "would not fit",
            self.window.size or "unknown",
        )
        summary, method, dropped = await self._summarize(messages[:count], cuts, limit)
        kept = messages[count:]
        head = Summary(summary, seq, method == "dropped").message()
        after = self.cost([head, *kept], tools)
        payload = {
            "summary": summary,
            "method": method,
            "from_seq": 1,
            "to_seq": seq,
            "messages": count,
            "dropped": dropped,
            "tokens_before": before,
            "tokens_after": after,
            "tokens": head.tokens,
            "window": self.window.size,
            "session_tokens": self._session_tokens,
        }
        await self._commit(EventType.COMPACTION, payload, self._turn_id, KEY.format(to_seq=seq))
        messages[:count] = [head]
        self._offset += count - 1
        self._after = seq
        logger.bind(subsystem="worker").info(
            "compacted the conversation up to seq {} ({}): {} -> {} tokens",
            seq,
            method,
            before,
            after,
        )
        return True

    def _cuts(self) -> list[tuple[int, int]]:
        """The cuts still open to this run: (seq, index in the turn's list), oldest first."""
        found = history.compaction_cuts(self._events)
        return [
            (seq, count - self._offset)
            for seq, count in found
            if seq > self._after and count - self._offset > 1
        ]

    def _choose(
        self,
        cuts: list[tuple[int, int]],
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        limit: int | None,
    ) -> tuple[int, int]:
        """The earliest cut that leaves half the limit or less; else the latest."""
        if limit is None:
            return cuts[-1]
        target = limit // 2
        for seq, count in cuts:
            if self.cost(messages[count:], tools) <= target:
                return seq, count
        return cuts[-1]

    async def _summarize(
        self, older: list[Message], cuts: list[tuple[int, int]], limit: int | None
    ) -> tuple[str, str, int]:
        """(summary, method, messages left out of it). What is summarized is `older`
        less its oldest turns as far as the summarizing call needs to fit (an earlier
        summary, first, is kept); a server that still finds it too long gets the newer
        half of it, up to `SUMMARY_TRIES` times; with nothing left, the older part is
        dropped."""
        request = Message("user", self.settings.prompt)
        start = 1 if older and older[0].note and older[0].content.startswith(SUMMARY_NOTE) else 0
        bounds = [count for _, count in cuts if start < count < len(older)]
        first = start
        while (
            limit is not None and self.cost([*older[:start], *older[first:], request], []) > limit
        ):
            later = [b for b in bounds if b > first]
            first = later[0] if later else len(older)
            if not later:
                break
        for _ in range(SUMMARY_TRIES):
            if first >= len(older) and not start:
                break
            try:
                answer = await self._ask([*older[:start], *older[first:], request], [])
            except ModelError as exc:
                if not exc.context_exceeded:
                    raise
                later = [b for b in bounds if b > first]
                first = later[len(later) // 2] if later else len(older)
                continue
            text = answer.text.strip() or "(the model gave an empty summary)"
            return text, "summary", first - start
        return DROPPED_NOTE.format(count=len(older)), "dropped", len(older)
