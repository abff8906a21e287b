"""The `[delivery]` section: where replies are pushed, and how hard to try.

A target is the operator's: a name, a URL and the environment variable holding its HMAC
secret (checked at start: `supervisor.checks`). A request only names a target (a
session's `deliver_to`); no URL ever comes from a request.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic import model_validator as _model_validator
from pydantic_core import PydanticCustomError

from supervisor.contract.named import unique_names
from supervisor.core.vocabulary import DeliveryKind
from supervisor.deliveries.rules import DEFAULT_KINDS

TARGET_NAME = r"^[a-z0-9][a-z0-9_.-]{0,39}$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
MAX_TARGETS = 64


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class DeliveryTarget(_Section):
    """One endpoint deliveries are POSTed to (`[[delivery.targets]]`)."""

    name: Annotated[str, StringConstraints(pattern=TARGET_NAME)]
    url: Annotated[str, StringConstraints(max_length=2000)]
    secret_env: Annotated[str, StringConstraints(pattern=ENV_NAME)]
    timeout: Annotated[float, Field(gt=0, le=300)] = 10.0
    events: Annotated[list[DeliveryKind], Field(min_length=1)] = Field(
        default_factory=lambda: list(DEFAULT_KINDS)
    )
    # Who may bind a session to it (besides the admin token); empty: any principal.
    principals: list[Annotated[str, StringConstraints(min_length=1, max_length=200)]] = Field(
        default_factory=list, max_length=1000
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PydanticCustomError(
                "target_url",
                "must be an http:// or https:// URL with a host, not {url!r}",
                {"url": url},
            )
        if parts.username or parts.password or parts.fragment:
            raise PydanticCustomError(
                "target_url",
                "must hold no user, password or #fragment (the secret goes in secret_env)",
            )
        import httpx  # here: a worker's start (its configuration) need not import it

        try:
            parts.port  # noqa: B018 (a port out of range raises)
            httpx.URL(url)  # what the courier will send to: a host it cannot encode fails here
        except (ValueError, httpx.InvalidURL) as exc:
            raise PydanticCustomError(
                "target_url", "cannot be sent to: {error}", {"error": str(exc)}
            ) from None
        return url

    @field_validator("events")
    @classmethod
    def _unique_events(cls, events: list[DeliveryKind]) -> list[DeliveryKind]:
        return list(dict.fromkeys(events))


class DeliveryConfig(_Section):
    # Seconds after its event's commit a delivery not delivered yet is dead (4xx: at once).
    max_age: Annotated[float, Field(gt=0)] = 86400.0
    max_attempts: Annotated[int, Field(ge=0, le=100)] = 0  # dead sooner, after this many; 0: no
    backoff: Annotated[float, Field(gt=0)] = 5.0  # after the first failed attempt; doubling
    backoff_cap: Annotated[float, Field(gt=0)] = 600.0
    poll_interval: Annotated[float, Field(gt=0, le=60)] = 1.0
    concurrency: Annotated[int, Field(ge=1, le=256)] = 16  # attempts in flight per target
    keep: Annotated[float, Field(gt=0)] = 7 * 86400.0  # delivered rows kept this long
    targets: list[DeliveryTarget] = Field(default_factory=list, max_length=MAX_TARGETS)

    @field_validator("targets")
    @classmethod
    def _unique_names(cls, targets: list[DeliveryTarget]) -> list[DeliveryTarget]:
        unique_names(targets, "delivery target", "delivery.targets")
        return targets

    @_model_validator(mode="after")
    def _cap_not_below_base(self) -> DeliveryConfig:
        if self.backoff_cap < self.backoff:
            raise PydanticCustomError(
                "backoff_cap",
                "backoff_cap ({cap}) must not be below backoff ({base})",
                {"cap": self.backoff_cap, "base": self.backoff, "at": ("backoff_cap",)},
            )
        return self

    def target(self, name: Any) -> DeliveryTarget | None:
        """The target called `name`; None when there is none."""
        return next((t for t in self.targets if t.name == name), None)
