"""The few HTTP pieces the HTTP layer shares: the JSON response (orjson), the error body
{"error": ...} and the one mapping of exceptions to it (``error_response``), a request
header from the ASGI scope, the request body."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope

from ..errors import ServiceError

log = logging.getLogger("orthornn.service")


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSON:
    return JSON({"error": message}, status_code=status, headers=headers)


def error_response(exc: Exception, where: str = "") -> JSON:
    """The one error handler: a ServiceError's own status (service.errors), FastAPI's
    and Starlette's 4xx, or a logged 500."""
    if isinstance(exc, ServiceError):
        return error(exc.status, str(exc), headers=exc.headers)
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "request"
        return error(400, f"{where}: {first.get('msg', 'invalid')}")
    if isinstance(exc, StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
    log.error("internal error on %s", where or "a request", exc_info=exc)
    return error(500, "internal server error (logged)")


def header(scope: Scope, name: bytes) -> str | None:
    """A request header (name in lower case) from the ASGI scope, or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client went away first."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
