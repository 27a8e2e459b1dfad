"""The route table: every route the service answers, its dispatcher (``Routes``, the
innermost ASGI middleware) and the OpenAPI paths generated from the same rows, so that no
endpoint is registered twice and none is unreachable."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi.responses import Response
from pydantic import BaseModel, TypeAdapter

from ..dataplane.schemas import ErrorResponse
from .responses import answer, error, read_body

Handler = Callable[..., Awaitable[Response]]


# -- the route table ---------------------------------------------------------------------

ERRORS = {400: {"model": ErrorResponse, "description": "bad input (the message names the "
                                                      "field)"},
          404: {"model": ErrorResponse, "description": "unknown model, version or session"},
          413: {"model": ErrorResponse, "description": "body too large"},
          503: {"model": ErrorResponse, "description": "overloaded (Retry-After) or not "
                                                      "ready"}}
INFER_ERRORS = {**ERRORS,
                409: {"model": ErrorResponse, "description": "a state or session of another "
                                                            "model version, a session "
                                                            "chunk at a position the session "
                                                            "is not at (the message and the "
                                                            "Orthornn-Session-Position "
                                                            "header name it), or a session "
                                                            "whose version is gone"},
                503: {"model": ErrorResponse, "description": "overloaded, not ready, or the "
                                                            "session store unavailable "
                                                            "(Retry-After)"},
                429: {"model": ErrorResponse, "description": "queue full or too many "
                                                            "sessions (Retry-After)"}}
ADMIN_ERRORS = {**ERRORS, 401: {"model": ErrorResponse, "description": "missing or wrong "
                                                                      "bearer token"}}
ROLLBACK_ERRORS = {**ADMIN_ERRORS,
                   409: {"model": ErrorResponse, "description": "no such version, it does "
                                                               "not verify, it is already "
                                                               "promoted (the message names "
                                                               "the usable versions), or the "
                                                               "repository is read-only here"}}


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # a template: {name} matches one path segment
    handler: Handler  # (body, scope, **path parameters) -> Response
    summary: str
    response_model: type | None = None
    body: type[BaseModel] | None = None  # the request body's schema (OpenAPI)
    body_required: bool = True
    errors: dict = field(default_factory=lambda: ERRORS)
    admin: bool = False  # the repository API: bearer token
    media_type: str = "application/json"  # of the 200 answer (the document says it)

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(re.sub(r"\\{(\w+)\\}", r"(?P<\1>[^/]+)", re.escape(self.path)))


class RouteTable:
    """The routes, matched by method and path (a root_path stripped first)."""

    def __init__(self, routes: list[Route]):
        self.routes = routes
        self._table = [(r.method, r.pattern, r) for r in routes]

    @staticmethod
    def _path(scope) -> str:
        path, root = scope["path"], scope.get("root_path", "")
        return path[len(root):] if root and path.startswith(root) else path

    def match(self, scope) -> tuple[Route, dict] | None:
        path = self._path(scope)
        for method, pattern, route in self._table:
            if method == scope["method"]:
                found = pattern.fullmatch(path)
                if found is not None:
                    return route, found.groupdict()
        return None

    def methods(self, scope) -> list[str]:
        """The methods the table answers at this path (for a 405's Allow header)."""
        path = self._path(scope)
        return sorted({m for m, pattern, _ in self._table if pattern.fullmatch(path)})


class Routes:
    """ASGI middleware (the innermost): answers the table's routes itself; anything else
    (/docs, /openapi.json, 404, 405) goes on to FastAPI."""

    def __init__(self, app, table: RouteTable, max_body: int):
        self.app, self.table, self.max_body = app, table, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            found: tuple[Route, dict] | None = \
                scope.get("orthornn.route") or self.table.match(scope)
            if found is not None:
                route, params = found
                return await self.answer(route, params, scope, receive, send)
            allowed = self.table.methods(scope)
            if allowed:  # a route of the table, another method
                response = error(405, f"Method Not Allowed: {scope['method']}; this path "
                                      f"takes {', '.join(allowed)}",
                                 headers={"Allow": ", ".join(allowed)})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)  # /docs, /redoc, /openapi.json, else 404

    async def answer(self, route: Route, params: dict, scope, receive, send) -> None:
        try:
            body = await read_body(receive)
            if body is None:
                return  # the client went away
            response = await route.handler(body, scope, **params)
        except Exception as exc:
            response = answer(exc, f"{scope['method']} {scope['path']}")
        await response(scope, receive, send)


def _schema_ref(model, components: dict) -> dict:
    """The JSON schema of a pydantic model (a $ref, the schema added to components) or of
    another annotated type (``list[RepositoryModel]``: inline), definitions included."""
    schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    if isinstance(model, type) and issubclass(model, BaseModel):
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}
    return schema


def openapi_paths(routes: list[Route], components: dict, secured: bool) -> dict:
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
