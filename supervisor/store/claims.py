"""A daemon's claim on a row: who holds it (`claimed_by`, "<host>/<boot8>") and until when
(`claim_expires_at`, by the database clock).

A claim not renewed by then is free again; so is one of an earlier boot of the claimer's
host, when the claimer names its host ("<host>/"): one daemon holds a host id at a time,
so that boot is dead. The subagent registry and the delivery outbox claim rows this way;
the task registry writes a claim with no expiry (its runner's heartbeat says if it lives).

Every method that writes runs inside the caller's open write transaction, with `now`
read from the database clock in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import peewee

from supervisor.store.db import chunks


class Claims:
    """The claim columns of one table (`model`, keyed by `id`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.by = model.claimed_by
        self.until = model.claim_expires_at

    # --- conditions -----------------------------------------------------------------

    def held_by(self, owner: str) -> Any:
        """Rows whose claim is `owner`'s, run out or not."""
        return self.by == owner

    def not_held_by(self, owner: str) -> Any:
        """Rows unclaimed or claimed by another owner."""
        return self.by.is_null() | (self.by != owner)

    def free(self, now: float, owner: str = "", mine: str | None = None) -> Any:
        """Rows another claim may take at `now`: unclaimed, or their claim ran out, or
        with `mine` ("<host>/") one of this host's boots other than `owner`'s."""
        condition = self.by.is_null() | (self.until < now)
        if mine:
            condition |= (peewee.fn.SUBSTR(self.by, 1, len(mine)) == mine) & (self.by != owner)
        return condition

    @staticmethod
    def holds(row: Any, now: float) -> bool:
        """Whether the claim on a row read at `now` still holds."""
        return row.claimed_by is not None and (row.claim_expires_at or 0.0) >= now

    # --- values ---------------------------------------------------------------------

    def claimed(self, owner: str, until: float | None) -> dict[Any, Any]:
        """The columns of `owner`'s claim until `until` (None: no expiry)."""
        return {self.by: owner, self.until: until}

    def cleared(self) -> dict[Any, Any]:
        """The columns of no claim."""
        return {self.by: None, self.until: None}

    # --- writes ---------------------------------------------------------------------

    def take(
        self, ids: Sequence[str], owner: str, until: float, now: float, mine: str | None = None
    ) -> int:
        """Claim the rows of `ids` for `owner` until `until`, each only if it is `free` at
        `now` (compare and set: of two owners, one takes a row); how many it took."""
        taken = 0
        for part in chunks(ids):
            taken += (
                self.model.update(self.claimed(owner, until))
                .where(self.model.id.in_(part) & self.free(now, owner, mine))
                .execute()
            )
        return taken

    def renew(self, ids: Sequence[str], owner: str, until: float) -> int:
        """Move `owner`'s claims on the rows of `ids` to `until`; how many it still held."""
        renewed = 0
        for part in chunks(ids):
            renewed += (
                self.model.update({self.until: until})
                .where(self.model.id.in_(part) & self.held_by(owner))
                .execute()
            )
        return renewed

    def release(self, owner: str, where: Any = None) -> int:
        """Give up `owner`'s claims (on the rows matching `where`, if given); how many."""
        condition = self.held_by(owner)
        if where is not None:
            condition &= where
        return int(self.model.update(self.cleared()).where(condition).execute())
