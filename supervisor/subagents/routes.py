"""`GET /v1/sessions/{id}/subagents`: the children a session's turns spawned, oldest first.

Reading a session is the whole check: a child inherits its parent's ACL when it is
spawned, and every later change of the parent's ACL is made on its subagents too (in the
same transaction), so whoever may read the parent may read each child it lists.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from supervisor.core.vocabulary import Permission
from supervisor.http.answers import Handler, answer, whole
from supervisor.http.lifecycle import Lookup
from supervisor.http.schemas import SubagentList, SubagentOut
from supervisor.store import Store

MAX_LISTED = 1000  # children one answer lists (`limit`); the oldest first


def route(store: Store, session: Lookup) -> Handler:
    """The handler of the route, reading `store` for sessions that `session` lets through."""

    async def subagents(request: web.Request) -> web.Response:
        info = await session(request, Permission.READ)
        limit = whole(request.query.get("limit"), "limit", MAX_LISTED, 1, MAX_LISTED)
        children = await asyncio.to_thread(store.subagents.children, info.id, limit)
        listed = [SubagentOut.model_validate(child.to_dict()) for child in children]
        return answer(SubagentList(subagents=listed))

    return subagents
