"""The HTTP layer: one route table, thin handlers over ``service.dataplane``.

Every route is a row of ``ROUTES`` (built in ``create_app``): method, path template,
handler ``(body, scope, **path parameters) -> Response`` and its OpenAPI description.
The table is served by ``Routes``, a small ASGI dispatcher that answers a matching request
without FastAPI's routing, dependency and validation layers (the fast path), and 405 for
another method on a path of the table. The OpenAPI document is generated from the same
rows (``openapi_paths``): nothing is registered twice, so no endpoint is unreachable.
FastAPI itself serves only /openapi.json, /docs and /redoc, and 404 for what matches
nothing. Around both, written once and applied to every route:

    Observe (outermost of ours): admission (over ``max_inflight_requests`` in flight ->
        503 with Retry-After at once, so answered requests keep a bounded latency), the
        body-size limit, the in-flight gauge, request counts and durations;
    any middleware added with ``app.add_middleware`` (it sees every route);
    Routes (innermost of the middleware): the table, with the error mapping ``answer``.

Every client mistake is a 4xx with {"error": "..."}; anything else is a logged 500.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import auth
from .dataplane import DataPlane, server_version
from .docs import add_docs
from .errors import BodyTooLarge, ClientError, ServiceError
from .metrics import UNKNOWN, Metrics
from .protocol import (
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InferenceRequest,
    InferenceResponse,
    ModelMetadata,
    PredictRequest,
    PredictResponse,
    RepositoryIndexRequest,
    RepositoryModel,
    RollbackRequest,
    RollbackResponse,
    ServerMetadata,
)
from .registry import Registry
from .runtime import select_providers
from .settings import Settings

log = logging.getLogger("orthornn.service")
WARNING_HEADER = "Orthornn-Input-Warning"
Handler = Callable[..., Awaitable[Response]]


class JSON(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def error(status: int, message: str, headers: dict | None = None) -> JSON:
    return JSON({"error": message}, status_code=status, headers=headers)


def answer(exc: Exception, where: str = "") -> JSON:
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


def header(scope, name: bytes) -> str | None:
    """A request header (name in lower case) from the ASGI scope, or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def labels(scope: dict) -> dict:
    """The request's scope["state"] (what request.state shows); the dataplane puts the
    model/version metric labels there."""
    return scope.setdefault("state", {})


# -- the route table ---------------------------------------------------------------------

ERRORS = {400: {"model": ErrorResponse, "description": "bad input (the message names the "
                                                      "field)"},
          404: {"model": ErrorResponse, "description": "unknown model, version or session"},
          413: {"model": ErrorResponse, "description": "body too large"},
          503: {"model": ErrorResponse, "description": "overloaded (Retry-After) or not "
                                                      "ready"}}
INFER_ERRORS = {**ERRORS,
                409: {"model": ErrorResponse, "description": "a state or session of another "
                                                            "model version"},
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


async def read_body(receive) -> bytes | None:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Observe:
    """ASGI middleware (the outermost of ours; a user's, added after create_app, wraps it):
    admission, the body limit, the in-flight gauge and
    the request metrics of every route (labels: the route template and the model/version
    the dataplane set). Label children are cached."""

    EXEMPT = ("/v2/health/", "/metrics")  # answered even when overloaded

    def __init__(self, app, table: RouteTable, metrics: Metrics, max_body: int,
                 max_inflight: int):
        self.app, self.table, self.metrics = app, table, metrics
        self.max_body, self.max_inflight = max_body, max_inflight
        self.inflight = 0
        self._counters: dict[tuple, Counter] = {}
        self._durations: dict[str, Histogram] = {}
        # rendered once: the same error() every other refusal uses
        self._overloaded = error(503, f"overloaded: {max_inflight} requests in flight; "
                                      "retry later", headers={"Retry-After": "1"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        if self.inflight >= self.max_inflight and not scope["path"].startswith(self.EXEMPT):
            # Overloaded: the cheapest answer there is (prebuilt bytes, no routing),
            # because under overload the event loop spends most of its time here, and
            # every microsecond saved shortens the wait of the requests it does admit.
            # Fresh messages: a middleware outside this one (CORS, GZip) may edit them.
            await send({"type": "http.response.start", "status": 503,
                        "headers": list(self._overloaded.raw_headers)})
            await send({"type": "http.response.body", "body": self._overloaded.body})
            return self.record(scope, self.table.match(scope), 503, start)
        status = 500
        found = scope["orthornn.route"] = self.table.match(scope)

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        self.inflight += 1
        self.metrics.inflight.inc()
        try:
            refused = self.refuse(scope)
            if refused is not None:
                await refused(scope, receive, send_wrapper)
            else:
                await self.app(scope, limited_receive, send_wrapper)
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()
            self.record(scope, found, status, start)

    def refuse(self, scope) -> JSON | None:
        """413 at once when Content-Length says the body is too large."""
        length = header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return error(413, f"body: larger than the limit of {self.max_body} bytes")
        return None

    def record(self, scope, found, status: int, start: float) -> None:
        """Count the request under its route template (the table's match ``found``, else
        FastAPI's route, else "other") and the model/version the dataplane set."""
        endpoint = found[0].path if found is not None else \
            getattr(scope.get("route"), "path", None) or "other"
        model, ver = (scope.get("state") or {}).get("labels", (UNKNOWN, ""))
        key = (model, ver, endpoint, status)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.metrics.requests.labels(
                model, ver, endpoint, str(status))
        counter.inc()
        histogram = self._durations.get(endpoint)
        if histogram is None:
            histogram = self._durations[endpoint] = self.metrics.request_duration.labels(
                endpoint)
        histogram.observe(time.perf_counter() - start)


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


def create_app(settings: Settings) -> FastAPI:
    metrics = Metrics()
    providers = select_providers(settings.providers)
    executor = ThreadPoolExecutor(settings.inference_workers, thread_name_prefix="orthornn-run")
    registry = Registry(settings, metrics, executor, providers)
    dataplane = DataPlane(settings, registry, metrics)
    admin = auth.bearer(settings.admin_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("serving %s with %s", settings.repo, providers)
        registry.start(asyncio.get_running_loop())
        dataplane.sessions.start_sweeper()
        yield
        await dataplane.sessions.close()
        await registry.close()
        executor.shutdown(wait=True)

    app = FastAPI(title="orthornn inference service", version=server_version(),
                  lifespan=lifespan, default_response_class=JSON,
                  docs_url=None, redoc_url=None,  # service.docs: offline assets
                  description="Predictions from orthogonal RNNs exported as ONNX packages: "
                              "a simple /predict API (with state carried across requests), "
                              "/generate for language models and the Open Inference "
                              "Protocol (v2, REST, with sequences).")
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.registry = registry
    app.state.dataplane = dataplane
    app.state.draining = False

    # -- handlers: (body, scope, **path parameters) -> Response ---------------------------

    def warned(scope: dict) -> dict | None:
        """The input-range warning header the dataplane left for this request, if any."""
        warning = labels(scope).get("warning")
        return None if warning is None else {WARNING_HEADER: warning}

    async def predict(body: bytes, scope: dict) -> Response:
        return JSON(await dataplane.predict(body, labels(scope)), headers=warned(scope))

    async def generate_text(body: bytes, scope: dict) -> Response:
        return JSON(await dataplane.generate(body, labels(scope)))

    async def infer(body: bytes, scope: dict, name: str, version: str | None = None):
        dataplane.label(labels(scope), name)  # counted under the model from the start
        length = header(scope, b"inference-header-content-length")
        tail = b""
        if length is not None:
            if not length.isdigit() or int(length) > len(body):
                raise ClientError("Inference-Header-Content-Length: must be an integer no "
                                  "larger than the body")
            body, tail = body[:int(length)], body[int(length):]
        head, blobs = await dataplane.infer(body, tail, name, version, labels(scope))
        headers = warned(scope) or {}
        if not blobs:
            return Response(head, media_type="application/json", headers=headers)
        return Response(head + b"".join(blobs), media_type="application/octet-stream",
                        headers={**headers, "Inference-Header-Content-Length": str(len(head))})

    async def server_metadata(body: bytes, scope: dict) -> Response:
        return JSON(dataplane.server_metadata())

    async def live(body: bytes, scope: dict) -> Response:
        return JSON({"live": True})

    async def ready(body: bytes, scope: dict) -> Response:
        if app.state.draining:
            return error(503, "shutting down")
        if not dataplane.ready():
            return error(503, "models are still loading (or failed: see /v2/repository/index)")
        return JSON({"ready": True})

    async def model_metadata(body: bytes, scope: dict, name: str,
                             version: str | None = None) -> Response:
        return JSON(dataplane.model_metadata(name, version, labels(scope)))

    async def model_ready(body: bytes, scope: dict, name: str,
                          version: str | None = None) -> Response:
        if dataplane.model_ready(name, version, labels(scope)):
            return JSON({"name": name, "ready": True})
        return error(503, f"model {name!r}" + (f" version {version}" if version else "")
                     + " is not ready")

    async def model_config(body: bytes, scope: dict, name: str) -> Response:
        return JSON(dataplane.model_config(name, labels(scope)))

    def admin_body(body: bytes) -> None:
        if body.strip():
            try:
                value = orjson.loads(body)
            except orjson.JSONDecodeError:
                raise ClientError("body is not valid JSON") from None
            if not isinstance(value, dict):
                raise ClientError("body: must be a JSON object")

    async def repository_index(body: bytes, scope: dict) -> Response:
        admin(scope)
        return JSON(await dataplane.repository_index(body))

    async def load_model(body: bytes, scope: dict, name: str) -> Response:
        admin(scope)
        admin_body(body)
        return JSON(await dataplane.load(name))

    async def rollback_model(body: bytes, scope: dict, name: str) -> Response:
        admin(scope)
        return JSON(await dataplane.rollback(name, body))

    async def unload_model(body: bytes, scope: dict, name: str) -> Response:
        admin(scope)
        admin_body(body)
        return JSON(await dataplane.unload(name))

    async def prometheus(body: bytes, scope: dict) -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    ready_errors = {**ERRORS, 503: {"model": ErrorResponse}}
    routes = [
        Route("POST", "/predict", predict, "predict from sequences or text (optionally "
              "continuing from states or a session)", PredictResponse, PredictRequest,
              errors=INFER_ERRORS),
        Route("POST", "/generate", generate_text, "language models: sample text, carrying "
              "the hidden state", GenerateResponse, GenerateRequest, errors=INFER_ERRORS),
        Route("GET", "/v2", server_metadata, "server metadata", ServerMetadata),
        Route("GET", "/v2/health/live", live, "liveness"),
        Route("GET", "/v2/health/ready", ready, "readiness: every configured model loaded "
              "and warm, not shutting down", errors=ready_errors),
        Route("GET", "/v2/models/{name}", model_metadata, "model metadata (the version a "
              "request without one gets: the promoted one, else the newest loaded)",
              ModelMetadata),
        Route("GET", "/v2/models/{name}/versions/{version}", model_metadata,
              "model version metadata", ModelMetadata),
        Route("GET", "/v2/models/{name}/ready", model_ready, "model readiness",
              errors=ready_errors),
        Route("GET", "/v2/models/{name}/versions/{version}/ready", model_ready,
              "version readiness", errors=ready_errors),
        Route("GET", "/v2/models/{name}/config", model_config, "Triton-style model "
              "configuration (for tritonclient)"),
        Route("POST", "/v2/models/{name}/infer", infer, "inference (the promoted version, "
              "else the newest loaded; "
              "sequence_id / sequence_start / sequence_end parameters for sequences)",
              InferenceResponse, InferenceRequest, errors=INFER_ERRORS),
        Route("POST", "/v2/models/{name}/versions/{version}/infer", infer,
              "inference on one version", InferenceResponse, InferenceRequest,
              errors=INFER_ERRORS),
        Route("POST", "/v2/repository/index", repository_index, "every model version in the "
              "repository with its state", list[RepositoryModel], RepositoryIndexRequest,
              body_required=False, errors=ADMIN_ERRORS, admin=True),
        Route("POST", "/v2/repository/models/{name}/load", load_model, "load (or reload) a "
              "model now, verifying it", errors=ADMIN_ERRORS, admin=True),
        Route("POST", "/v2/repository/models/{name}/unload", unload_model, "stop serving a "
              "model (in-flight requests finish)", errors=ADMIN_ERRORS, admin=True),
        Route("POST", "/v2/repository/models/{name}/rollback", rollback_model, "promote the "
              "version promoted before the current one (or the body's version) once it "
              "verifies, and serve it now (in-flight requests and sessions finish on theirs)",
              RollbackResponse, RollbackRequest, body_required=False, errors=ROLLBACK_ERRORS,
              admin=True),
        Route("GET", "/metrics", prometheus, "Prometheus metrics", media_type="text/plain"),
    ]
    table = app.state.routes = RouteTable(routes)
    add_docs(app)
    # added first: innermost, so middleware added later (by us or a user) wraps it
    app.add_middleware(Routes, table=table, max_body=settings.max_body_bytes)
    app.add_middleware(Observe, table=table, metrics=metrics, max_body=settings.max_body_bytes,
                       max_inflight=settings.max_inflight_requests)

    async def _error(request, exc: Exception):
        return answer(exc, f"{request.method} {request.url.path}")

    for kind in (ServiceError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _error)

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        # FastAPI's own routes are only /docs and /redoc (outside the schema): every
        # operation is a row of the table, described from it
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        schema["paths"] = openapi_paths(table.routes, components,
                                        settings.admin_token is not None)
        if settings.admin_token is not None:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                  "scheme": "bearer"}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
    return app
