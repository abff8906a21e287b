"""The vocabulary: members are their wire strings, and the rules attached to them."""

from __future__ import annotations

import json

import pytest

from supervisor.core import vocabulary as v


@pytest.mark.parametrize(
    ("held", "needed", "allowed"),
    [
        ("read", "read", True),
        ("read", "write", False),
        ("write", "read", True),
        ("write", "admin", False),
        ("admin", "write", True),
    ],
)
def test_a_permission_includes_the_weaker_ones(held: str, needed: str, allowed: bool) -> None:
    assert v.Permission(held).includes(needed) is allowed


def test_members_are_their_wire_strings() -> None:
    assert v.EventType.USER_MESSAGE == "user_message"
    assert {v.SessionStatus.OPEN: 1}["open"] == 1  # same hash as the string
    assert json.dumps({"type": v.EventType.ACL}) == '{"type": "acl"}'
    assert f"{v.SlotState.FATAL}" == "fatal"


def test_every_assign_reason_has_a_cause_and_every_cause_a_text() -> None:
    assert {reason.cause for reason in v.AssignReason} <= set(v.Cause)
    assert all(cause.text for cause in v.Cause)


def test_mcp_states_reported_leave_out_new() -> None:
    assert v.McpState.NEW.reported is v.McpState.STARTING
    assert v.McpState.NEW not in v.MCP_REPORTED
    assert v.MCP_REPORTED == ("starting", "ready", "backoff", "down", "stopped")


def test_session_counts_cover_every_status() -> None:
    assert set(v.SessionStatus) <= set(v.SessionCount)
