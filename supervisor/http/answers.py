"""Answers and errors of the HTTP API, and reading a request's body and numbers.

Every answer is built from its model in `schemas.py`; an error is `{"error": {"code",
"message"}}`, raised as `ApiError` and answered by the API's error middleware.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import peewee
from aiohttp import web
from pydantic import BaseModel, ValidationError

from supervisor.contract.logs import log
from supervisor.core.vocabulary import Rejection
from supervisor.http.schemas import ErrorBody, ErrorDetail
from supervisor.http.storage import StorageHealth
from supervisor.metrics import Metrics
from supervisor.store import IdempotencyConflict, SessionClosed, StorageUnavailable

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RETRY_AFTER = "5"

# What the auth middleware (auth.py) puts on a request it lets through.
PRINCIPAL = web.RequestKey("principal", str)  # whose token it carries
TOKEN_HASH = web.RequestKey("token_hash", str)  # that token's digest: a stream checks it again
# Whether that token still names that principal (a reload may revoke it mid-request).
TOKEN_VALID: web.RequestKey[Callable[[], bool]] = web.RequestKey("token_valid")

MAX_SEQ = 2**62  # beyond any seq, and within every backend's BIGINT
_WHOLE = re.compile(r"[0-9]{1,19}")


def whole(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    """A whole number from a query value or header: ASCII digits only, within [low, high]."""
    if raw is None:
        return default
    if not _WHOLE.fullmatch(raw) or not low <= int(raw) <= high:
        raise ApiError(
            422, "invalid", f"{name} must be a whole number from {low} to {high}", field=name
        )
    return int(raw)


class ApiError(Exception):
    """An error answer: status, a stable code, a message naming what to fix."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.headers, self.extra = status, code, headers, extra


def answer(
    body: BaseModel, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON answer from its model (`schemas.py`, which the OpenAPI document is built from)."""
    return web.json_response(body.model_dump(mode="json"), status=status, headers=headers)


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> web.Response:
    """An error answer; `extra` is `field` (a 422) or `seq` (a 409), sent only when given."""
    body = ErrorBody(error=ErrorDetail(code=code, message=message, **extra))
    data = body.model_dump(mode="json", exclude_unset=True)
    return web.json_response(data, status=status, headers=headers)


async def read_body(request: web.Request, model: type[M], timeout: float) -> M:
    """The request's JSON body as `model`; an ApiError (400, 408, 422) saying what is wrong,
    or 401 if the request's token was revoked while the body was read (a reload)."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except web.HTTPException:
        raise  # 413, answered by the error middleware
    except TimeoutError as exc:
        raise ApiError(408, "timeout", f"the body did not arrive within {timeout} s") from exc
    except Exception as exc:  # a broken transfer or content encoding
        raise ApiError(400, "bad_body", f"the body cannot be read: {exc}") from exc
    still_valid = request.get(TOKEN_VALID)
    if still_valid is not None and not still_valid():
        # A reload revoked or replaced the token while the body came in: nothing is written.
        raise ApiError(
            401,
            "unauthorized",
            "the token was revoked while the request was sent; nothing was stored",
            headers={"WWW-Authenticate": "Bearer"},
        )
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, "malformed_json", f"the body is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, "malformed_json", "the body is nested too deeply") from exc
    except ValueError as exc:  # a number Python will not convert (over 4300 digits)
        raise ApiError(400, "malformed_json", f"the body cannot be read as JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(422, "invalid", f"{field}: {first['msg']}", field=field) from exc


def errors(storage: StorageHealth, metrics: Metrics, max_body: int) -> Any:
    """The middleware that turns every failure of a handler into an error answer."""
    logger = log("intake")

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        declared = request.content_length
        if declared is not None and declared > max_body:
            # At once, from the header: a client need not send (nor the daemon read) a body
            # it will refuse. The connection is closed: the body is never read.
            metrics.intake_rejections.labels(Rejection.TOO_LARGE).inc()
            response = error_response(
                413, "too_large", f"the body is over http.max_body ({max_body} bytes)"
            )
            response.force_close()
            return response
        try:
            return await handler(request)
        except ApiError as exc:
            response = error_response(exc.status, exc.code, str(exc), exc.headers, **exc.extra)
            if exc.status in (400, 408):
                response.force_close()  # the rest of a broken or late body is not read
            return response
        except IdempotencyConflict as exc:
            return error_response(409, "idempotency_conflict", str(exc), seq=exc.seq)
        except SessionClosed as exc:  # closed after the handler read the session
            return error_response(409, "closed", str(exc))
        except (StorageUnavailable, peewee.DatabaseError) as exc:
            storage.failed(exc)
            return error_response(
                503,
                "storage_unavailable",
                "the database cannot be written now; nothing of this request was stored, "
                "retry shortly",
                headers={"Retry-After": RETRY_AFTER},
            )
        except web.HTTPException as exc:
            if exc.status == 413:
                metrics.intake_rejections.labels(Rejection.TOO_LARGE).inc()
                return error_response(
                    413, "too_large", f"the body is over http.max_body ({max_body} bytes)"
                )
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
            return error_response(exc.status, code, exc.reason, headers=headers)
        except Exception:
            logger.exception("{} {} failed", request.method, request.path)
            return error_response(500, "internal", "internal error; see the daemon's log")

    return middleware
