"""The route table: every route the service answers, its dispatcher (``Routes``, the
innermost ASGI middleware) and the OpenAPI paths generated from the same rows, so that no
endpoint is registered twice and none is unreachable. The dispatcher also counts every
request that reaches it, under its route template and the model version the request held
(its ``service.request`` scope, opened here and written where a version is leased)."""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, TypeAdapter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import request
from ..dataplane.schemas import ErrorResponse
from ..metrics import UNKNOWN
from ..tracing import Tracer
from .counting import RequestCounts
from .responses import error, error_response, read_body


@dataclass(frozen=True, slots=True)
class Call:
    """What a handler gets: the body, the ASGI scope (its headers) and the path parameters
    of its route."""

    body: bytes
    scope: Scope
    params: dict[str, str]


Handler = Callable[[Call], Awaitable[Response]]
#: a request's body, read (None: the client went away first), and its answer, written
Read = Callable[[], Awaitable[bytes | None]]
Write = Callable[[Response], Awaitable[None]]
#: the metric labels (model, version) of a request, from what it held or named
Labeller = Callable[[request.Scope], tuple[str, str]]


# -- the route table ---------------------------------------------------------------------

ErrorTable = dict[int, dict[str, Any]]
ERRORS: ErrorTable = {
    400: {"model": ErrorResponse, "description": "bad input (the message names the field)"},
    404: {"model": ErrorResponse, "description": "unknown model, version or session (a "
                                                 "session chunk without its secret too)"},
    413: {"model": ErrorResponse, "description": "body too large"},
    503: {"model": ErrorResponse, "description": "overloaded (Retry-After) or not ready"}}
INFER_ERRORS: ErrorTable = {
    **ERRORS,
    409: {"model": ErrorResponse,
          "description": "a state or session of another model version, a session chunk at a "
                         "position the session is not at (the message and the "
                         "Orthornn-Session-Position header name it), a start on a "
                         "session id that is open, or a session whose version is gone"},
    503: {"model": ErrorResponse, "description": "overloaded, not ready, or the session store "
                                                 "unavailable (Retry-After)"},
    429: {"model": ErrorResponse, "description": "queue full or too many sessions "
                                                 "(Retry-After)"}}
ADMIN_ERRORS: ErrorTable = {
    **ERRORS, 401: {"model": ErrorResponse, "description": "missing or wrong bearer token"},
    403: {"model": ErrorResponse,
          "description": "another origin than the server's own (Origin), or, without a "
                         "token, a Host that is not loopback (service.http.auth)"},
    415: {"model": ErrorResponse,
          "description": "a mutating route's Content-Type is not application/json"}}
ROLLBACK_ERRORS: ErrorTable = {
    **ADMIN_ERRORS,
    409: {"model": ErrorResponse,
          "description": "no such version, it does not verify, it is already promoted (the "
                         "message names the usable versions), or the repository is "
                         "read-only here"}}

LABEL_ERRORS: ErrorTable = {
    **ADMIN_ERRORS,
    404: {"model": ErrorResponse, "description": "a model that is not in the repository"},
    409: {"model": ErrorResponse,
          "description": "capture is off, or an id is already labelled (the message names "
                         "it)"},
    422: {"model": ErrorResponse,
          "description": "an id that was not captured for the model, or a label outside "
                         "the classes (or vocabulary) of the version that answered it: the "
                         "message names the item, [i].id or [i].label, and what is allowed"}}


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # a template: {name} matches one path segment
    handler: Handler
    summary: str
    response_model: Any = None  # the 200 answer's schema: a pydantic model or list[...]
    body: type[BaseModel] | None = None  # the request body's schema (OpenAPI)
    body_required: bool = True
    errors: ErrorTable = field(default_factory=lambda: ERRORS)
    admin: bool = False  # the repository API: bearer token
    media_type: str = "application/json"  # of the 200 answer (the document says it)
    tracer: Tracer | None = None  # tracing on: its requests' server spans (service.tracing)
    lean: bool = False  # a hot route: the server's lean path answers it (service.server.lean)

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(re.sub(r"\\{(\w+)\\}", r"(?P<\1>[^/]+)", re.escape(self.path)))


class RouteTable:
    """The routes, matched by method and path (a root_path stripped first)."""

    def __init__(self, routes: list[Route]):
        self.routes = routes
        self._table = [(r.method, r.pattern, r) for r in routes]

    @staticmethod
    def _path(scope: Scope) -> str:
        path: str = scope["path"]
        root: str = scope.get("root_path", "")
        return path[len(root):] if root and path.startswith(root) else path

    def match(self, scope: Scope) -> tuple[Route, dict[str, str]] | None:
        path = self._path(scope)
        for method, pattern, route in self._table:
            if method == scope["method"]:
                found = pattern.fullmatch(path)
                if found is not None:
                    return route, found.groupdict()
        return None

    def methods(self, scope: Scope) -> list[str]:
        """The methods the table answers at this path (for a 405's Allow header)."""
        path = self._path(scope)
        return sorted({m for m, pattern, _ in self._table if pattern.fullmatch(path)})


class Routes:
    """ASGI middleware (the innermost): answers the table's routes itself, and counts
    them; anything else (/docs, /openapi.json, 404, 405) goes on to FastAPI, counted
    under FastAPI's route (else "other") and no model."""

    def __init__(self, app: ASGIApp, table: RouteTable, counts: RequestCounts,
                 labels: Labeller, observe: Callable[[request.Scope, int], None]):
        self.app, self.table, self.counts, self.labels = app, table, counts, labels
        self.observe = observe  # the dataplane's per-version tallies (rollouts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        found = self.table.match(scope)
        if found is not None:
            route, params = found

            async def write(response: Response) -> None:
                await response(scope, receive, send)
            return await self.handle(route, params, scope, lambda: read_body(receive), write,
                                     start)
        allowed = self.table.methods(scope)
        if allowed:  # a route of the table, another method
            response = error(405, f"Method Not Allowed: {scope['method']}; this path "
                                  f"takes {', '.join(allowed)}",
                             headers={"Allow": ", ".join(allowed)})
            await response(scope, receive, send)
            self.counts.record("other", (UNKNOWN, ""), 405, start)
            return None
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_status)  # /docs, /redoc, /openapi.json, 404
        finally:
            endpoint = getattr(scope.get("route"), "path", None) or "other"
            self.counts.record(endpoint, (UNKNOWN, ""), status, start)

    async def handle(self, route: Route, params: dict[str, str], scope: Scope, read: Read,
                     write: Write, start: float) -> None:
        """Answer a request of ROUTE (the ASGI path's and the lean path's one way):
        READ its body, run the handler in the request's own scope (tracing on: inside
        its server span), WRITE the response, and count it under the version it held."""
        with request.opened() as held:
            tracer = route.tracer
            if tracer is None:  # tracing off: this check is all it costs
                status = await self.answer(route, params, scope, read, write)
            else:
                with tracer.request(scope, route.method, route.path) as span:
                    async def write_traced(response: Response) -> None:
                        # the span gets the status and the version held as the answer
                        # starts (the server's own span ends with its body)
                        tracer.answered(span, response.status_code, held.model,
                                        held.version)
                        await write(response)
                    status = await self.answer(route, params, scope, read, write_traced)
        if status is not None:
            self.counts.record(route.path, self.labels(held), status, start)
            self.observe(held, status)

    @staticmethod
    async def answer(route: Route, params: dict[str, str], scope: Scope, read: Read,
                     write: Write) -> int | None:
        """Run ROUTE's handler and write its response; its status (None: the client went
        away before its body arrived)."""
        try:
            body = await read()
            if body is None:
                return None
            response = await route.handler(Call(body, scope, params))
        except Exception as exc:
            response = error_response(exc, f"{scope['method']} {scope['path']}")
        request.answered(request.current())  # built: its output budget goes back
        await write(response)
        return response.status_code


def _schema_ref(model: Any, components: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a pydantic model (a $ref, the schema added to components) or of
    another annotated type (``list[RepositoryModel]``: inline), definitions included."""
    schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    if isinstance(model, type) and issubclass(model, BaseModel):
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}
    return schema


def openapi_paths(routes: list[Route], components: dict[str, Any], secured: bool
                  ) -> dict[str, Any]:
    """The OpenAPI paths of the route table: what the dispatcher answers, and only that
    (no endpoint is registered twice): each operation's parameters, request body, answer
    and error answers."""
    paths: dict = {}
    for route in routes:
        op: dict = {"summary": route.summary,
                    "operationId": f"{route.handler.__name__}_{route.method.lower()}_"
                                   + re.sub(r"\W+", "_", route.path).strip("_")}
        params = re.findall(r"{(\w+)}", route.path)
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True,
                                 "schema": {"type": "string"}} for p in params]
        if route.body is not None:
            op["requestBody"] = {"required": route.body_required, "content": {
                "application/json": {"schema": _schema_ref(route.body, components)}}}
        media = route.media_type
        answer_schema = _schema_ref(route.response_model, components) \
            if route.response_model is not None else {}
        responses = {"200": {"description": "OK",
                             "content": {media: {"schema": answer_schema}}}}
        for status, spec in sorted(route.errors.items()):
            description = spec.get("description") or HTTPStatus(status).phrase
            responses[str(status)] = {"description": description, "content": {
                "application/json": {"schema": _schema_ref(spec["model"], components)}}}
        op["responses"] = responses
        if route.admin and secured:
            op["security"] = [{"bearer": []}]
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return paths
