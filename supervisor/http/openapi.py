"""The OpenAPI 3 document of the HTTP API, served at /openapi.json.

Kept next to the handlers in `supervisor/api.py`; a property test drives the real server
from this document and fails on any answer that does not match it.
"""

from __future__ import annotations

from typing import Any

from supervisor import __version__


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {
        400: "Malformed JSON.",
        401: "No valid bearer token.",
        403: "The caller may see the session but not do this.",
        404: "No such session (or the caller may not read it).",
        409: "The session is quarantined, or the Idempotency-Key was used for another request.",
        413: "The body is over http.max_body.",
        422: "A field is invalid; `error.field` names it.",
        429: "The principal holds http.max_streams_per_principal attach streams already.",
        503: "The daemon is stopping, or the database takes no writes; retry after Retry-After.",
    }
    return {str(s): _json(_ref("Error"), text[s]) for s in statuses}


_SESSION_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
}
_AUTH: list[dict[str, list[str]]] = [{"bearer": []}]


def document() -> dict[str, Any]:
    """The whole document."""
    session_ops = {
        "get": {
            "operationId": "getSession",
            "summary": "One session.",
            "security": _AUTH,
            "parameters": [_SESSION_ID],
            "responses": {"200": _json(_ref("Session"), "The session."), **_errors(401, 403, 404)},
        }
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "turnkeeper", "version": __version__},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {
                                "code": {"type": "string"},
                                "message": {"type": "string"},
                                "field": {"type": "string"},
                            },
                        }
                    },
                },
                "Session": {
                    "type": "object",
                    "required": ["id", "kind", "title", "status", "created_at", "last_seq"],
                    "properties": {
                        "id": {"type": "string"},
                        "kind": {
                            "type": "string",
                            "enum": ["attached", "channel", "autonomous", "subagent"],
                        },
                        "parent": {"type": "string", "nullable": True},
                        "title": {"type": "string"},
                        "agent": {"type": "string"},
                        "status": {"type": "string", "enum": ["open", "quarantined", "closed"]},
                        "created_at": {"type": "number"},
                        "updated_at": {"type": "number"},
                        "last_seq": {"type": "integer"},
                        "pending": {"type": "boolean"},
                        "active_turn_id": {"type": "string", "nullable": True},
                        "resend_requested_at": {
                            "type": "number",
                            "nullable": True,
                            "description": "recovery ended a turn it could not continue and "
                            "asked the user to resend; cleared by the next message",
                        },
                    },
                },
                "Event": {
                    "type": "object",
                    "required": ["seq", "type", "turn_id", "payload", "created_at"],
                    "properties": {
                        "seq": {"type": "integer", "minimum": 1},
                        "type": {"type": "string"},
                        "turn_id": {"type": "string", "nullable": True},
                        "payload": {"type": "object"},
                        "created_at": {"type": "number"},
                    },
                },
                "CreateSession": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "kind": {
                            "type": "string",
                            "enum": ["attached", "channel", "autonomous", "subagent"],
                        },
                        "title": {"type": "string", "maxLength": 200},
                        "agent": {
                            "type": "string",
                            "maxLength": 200,
                            "description": "package.module:Class, or empty for the default",
                        },
                        "run": {
                            "type": "object",
                            "description": "required for kind autonomous, and only there",
                            "additionalProperties": False,
                            "required": ["goal", "max_turns"],
                            "properties": {
                                "goal": {"type": "string", "minLength": 1},
                                "prompt": {
                                    "type": "string",
                                    "minLength": 1,
                                    "description": "sent as the user message of each next turn",
                                },
                                "max_turns": {"type": "integer", "minimum": 1, "maximum": 100000},
                                "max_tokens": {
                                    "type": "integer",
                                    "minimum": 1,
                                    "nullable": True,
                                },
                                "deadline_seconds": {
                                    "type": "number",
                                    "minimum": 0,
                                    "exclusiveMinimum": True,
                                    "nullable": True,
                                },
                            },
                        },
                    },
                },
                "Inject": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["text"],
                    "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 100000}},
                },
                "AclChange": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["principal", "permission"],
                    "properties": {
                        "principal": {"type": "string", "pattern": "^[A-Za-z0-9_.@-]{1,100}$"},
                        "permission": {
                            "type": "string",
                            "enum": ["read", "write", "admin"],
                            "nullable": True,
                            "description": "null revokes the principal's access",
                        },
                    },
                },
            },
        },
        "paths": {
            "/v1/sessions": {
                "post": {
                    "operationId": "createSession",
                    "summary": "Create a session; the caller gets admin on it.",
                    "security": _AUTH,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("CreateSession")}},
                    },
                    "responses": {
                        "201": _json(_ref("Session"), "Created."),
                        **_errors(400, 401, 413, 422, 503),
                    },
                },
                "get": {
                    "operationId": "listSessions",
                    "summary": "Sessions the caller may read.",
                    "security": _AUTH,
                    "parameters": [
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        }
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["sessions"],
                                "properties": {
                                    "sessions": {"type": "array", "items": _ref("Session")}
                                },
                            },
                            "Newest first.",
                        ),
                        **_errors(401, 422),
                    },
                },
            },
            "/v1/sessions/{id}": session_ops,
            "/v1/sessions/{id}/inject": {
                "post": {
                    "operationId": "inject",
                    "summary": "A user message; 202 only once committed.",
                    "security": _AUTH,
                    "parameters": [
                        _SESSION_ID,
                        {
                            "name": "Idempotency-Key",
                            "in": "header",
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                            "description": (
                                "The caller's key for this message: sent again with the same "
                                "body it appends nothing and answers as the first time, with "
                                "Idempotent-Replayed: true; with another body it is a 409."
                            ),
                        },
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("Inject")}},
                    },
                    "responses": {
                        "202": _json(
                            {
                                "type": "object",
                                "required": ["seq"],
                                "properties": {"seq": {"type": "integer", "minimum": 1}},
                            },
                            "Committed as this seq.",
                        ),
                        **_errors(400, 401, 403, 404, 409, 413, 422, 503),
                    },
                }
            },
            "/v1/sessions/{id}/wake": {
                "post": {
                    "operationId": "wake",
                    "summary": "Run a turn with no new message.",
                    "security": _AUTH,
                    "parameters": [_SESSION_ID],
                    "responses": {
                        "202": _json(
                            {"type": "object", "properties": {"pending": {"type": "boolean"}}},
                            "A turn will run.",
                        ),
                        **_errors(401, 403, 404, 503),
                    },
                }
            },
            "/v1/sessions/{id}/interrupt": {
                "post": {
                    "operationId": "interrupt",
                    "summary": "End the turn in flight; it is never continued.",
                    "security": _AUTH,
                    "parameters": [_SESSION_ID],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["interrupted", "seq"],
                                "properties": {
                                    "interrupted": {"type": "boolean"},
                                    "seq": {"type": "integer", "nullable": True},
                                },
                            },
                            "Whether a turn was running, and the seq of its end.",
                        ),
                        **_errors(401, 403, 404),
                    },
                }
            },
            "/v1/sessions/{id}/events": {
                "get": {
                    "operationId": "events",
                    "summary": "History, oldest first.",
                    "security": _AUTH,
                    "parameters": [
                        _SESSION_ID,
                        {
                            "name": "after",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 0},
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["events"],
                                "properties": {"events": {"type": "array", "items": _ref("Event")}},
                            },
                            "Events with seq > after.",
                        ),
                        **_errors(401, 403, 404, 422),
                    },
                }
            },
            "/v1/sessions/{id}/attach": {
                "get": {
                    "operationId": "attach",
                    "summary": "Server-Sent Events: replay after "
                    "Last-Event-ID (or ?after=), then live. `id:` is the seq, `event:` the type.",
                    "security": _AUTH,
                    "parameters": [
                        _SESSION_ID,
                        {
                            "name": "after",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 0},
                        },
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "schema": {"type": "string", "pattern": "^[0-9]+$"},
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "The stream.",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        **_errors(401, 403, 404, 422, 429, 503),
                    },
                }
            },
            "/v1/sessions/{id}/acl": {
                "put": {
                    "operationId": "setAcl",
                    "summary": "Grant or revoke a principal's access.",
                    "security": _AUTH,
                    "parameters": [_SESSION_ID],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("AclChange")}},
                    },
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["acl"],
                                "properties": {
                                    "acl": {
                                        "type": "object",
                                        "additionalProperties": {
                                            "type": "string",
                                            "enum": ["read", "write", "admin"],
                                        },
                                    }
                                },
                            },
                            "Every principal's access now.",
                        ),
                        **_errors(400, 401, 403, 404, 413, 422),
                    },
                }
            },
            "/v1/status": {
                "get": {
                    "operationId": "status",
                    "summary": "Boot, worker slots, sessions by state (admin only).",
                    "security": _AUTH,
                    "responses": {
                        "200": _json(
                            {"type": "object", "required": ["boot", "slots", "sessions"]},
                            "The daemon's state.",
                        ),
                        **_errors(401, 403),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "healthz",
                    "summary": "Liveness; needs no token.",
                    "security": [],
                    "responses": {"200": _json({"type": "object"}, "Alive.")},
                }
            },
            "/readyz": {
                "get": {
                    "operationId": "readyz",
                    "summary": "Readiness; 503 while starting, stopping or storage fails.",
                    "security": [],
                    "responses": {
                        "200": _json({"type": "object"}, "Ready."),
                        "503": _json(
                            {"type": "object"},
                            "Starting, stopping, or the database takes no writes.",
                        ),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus text format.",
                    "security": [{}, {"bearer": []}],
                    "responses": {
                        "200": {
                            "description": "Metrics.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document.",
                    "security": [],
                    "responses": {"200": _json({"type": "object"}, "The document.")},
                }
            },
        },
    }
