"""What the configuration's lists of named tables share (`[[mcp.servers]]`,
`[[tasks.kinds]]`, `[[delivery.targets]]`): a name is used once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from pydantic_core import PydanticCustomError


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


def unique_names(items: Sequence[T], what: str, key: str) -> Sequence[T]:
    """`items` if no two share a name; else the error naming the second one's key (`what`
    says what a name is, `key` where the list is: "duplicate {what} 'x', already used by
    {key}[0]")."""
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        if item.name in first:
            raise PydanticCustomError(
                "duplicate_name",
                f"duplicate {what} '{{name}}', already used by {key}[{{first}}]",
                {"name": item.name, "first": first[item.name], "at": (index, "name")},
            )
        first[item.name] = index
    return items
