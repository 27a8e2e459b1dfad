"""The HTTP layer: thin handlers over ``service.dataplane.dataplane``, assembled into one app.

Every route is a row of the route table (``service.http.routing``): method, path template,
handler ``(body, scope, **path parameters) -> Response`` and its OpenAPI description.
``routing.Routes`` answers the table without FastAPI's routing, dependency and validation
layers (the fast path), 405 for another method on a path of the table; the OpenAPI
document is generated from the same rows. FastAPI itself serves only /openapi.json, /docs
and /redoc, and 404 for what matches nothing. The middleware, outermost first:

    observe.Observe: admission (503 with Retry-After over ``max_inflight_requests``), the
        body-size limit, the in-flight gauge, request counts and durations;
    any middleware added with ``app.add_middleware`` (it sees every route);
    routing.Routes: the table, with the one error mapping (``http.answer``).

Every client mistake is a 4xx with {"error": "..."}; anything else is a logged 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..dataplane.dataplane import DataPlane, server_version, version_param
from ..dataplane.messages import Served
from ..dataplane.schemas import (
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
    parse,
)
from ..errors import POSITION_HEADER, ClientError, ServiceError
from ..metrics import Metrics
from ..registry.devices import ProviderChoice, select_providers
from ..registry.registry import Registry
from ..settings import Settings
from . import auth
from .admission import Observe
from .codecs import oip_binary, predict_json
from .docs import add_docs
from .responses import JSON, answer, error, header
from .routing import (
    ADMIN_ERRORS,
    ERRORS,
    INFER_ERRORS,
    ROLLBACK_ERRORS,
    Route,
    Routes,
    RouteTable,
    openapi_paths,
)

log = logging.getLogger("orthornn.service")
WARNING_HEADER = "Orthornn-Input-Warning"
Handler = Callable[..., Awaitable[Response]]


def count_under(scope: dict, labels: tuple[str, str | int]) -> None:
    """The model / version metric labels of this request, for observe.Observe (which
    reads them from the ASGI scope's state, as request.state shows it)."""
    scope.setdefault("state", {})["labels"] = (labels[0], str(labels[1]))


def _version_or_none(version: str | None) -> int | None:
    """A URL's version as an integer, None when absent or not one (then the labels leave
    it out)."""
    try:
        return version_param(version)
    except ServiceError:
        return None


def create_app(settings: Settings, providers: ProviderChoice | None = None) -> FastAPI:
    """The service's app; PROVIDERS: the execution providers chosen for the settings
    (chosen here when not given; ValueError when the settings' device cannot be had)."""
    metrics = Metrics()
    if providers is None:
        providers = select_providers(settings.providers, settings.device)
    executor = ThreadPoolExecutor(settings.inference_workers, thread_name_prefix="orthornn-run")
    registry = Registry(settings, metrics, executor, providers.providers)
    dataplane = DataPlane(settings, registry, metrics)
    admin = auth.bearer(settings.admin_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("serving %s with %s", settings.repo, providers)  # the providers and why
        registry.start(asyncio.get_running_loop())
        dataplane.sessions.start()  # keeps the versions open sessions use loaded
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
    # A body is decoded by its protocol's codec, the dataplane answers with a typed result,
    # and the codec encodes it; the request is counted under the model version that
    # answered (or, on an error, the one it held, else the model it named).

    @contextmanager
    def counted(scope: dict, name: str, version: str | None = None) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            served = getattr(exc, "served", None)  # the version it held (service.errors)
            count_under(scope, served or dataplane.labels(name, _version_or_none(version)))
            raise

    def done(scope: dict, served: Served | None) -> dict[str, str] | None:
        """Count the request under SERVED; its warning header, if any."""
        if served is None:
            return None
        count_under(scope, (served.model, served.version))
        return None if served.warning is None else {WARNING_HEADER: served.warning}

    async def predict(body: bytes, scope: dict) -> Response:
        req = predict_json.decode(body)
        with counted(scope, req.model):
            result = await dataplane.predict(req)
        headers = done(scope, result.served) or {}
        if result.position is not None:
            headers[POSITION_HEADER] = str(result.position)
        return Response(predict_json.encode(result), media_type="application/json",
                        headers=headers)

    async def generate_text(body: bytes, scope: dict) -> Response:
        req = parse(GenerateRequest, body)
        with counted(scope, req.model):
            result = await dataplane.generate(req)
        done(scope, result.served)
        return JSON(result.body)

    async def infer(body: bytes, scope: dict, name: str, version: str | None = None):
        with counted(scope, name):  # counted under the model from the start
            req = oip_binary.decode(body, header(scope, b"inference-header-content-length"),
                                    name, version)
            result = await dataplane.infer(req, name, version)
        head, blobs = oip_binary.encode(req, result)
        headers = done(scope, result.served) or {}
        if result.position is not None:
            headers[POSITION_HEADER] = str(result.position)
        if not blobs:
            return Response(head, media_type="application/json", headers=headers)
        return Response(head + b"".join(blobs), media_type="application/octet-stream",
                        headers={**headers, oip_binary.HEADER_LENGTH: str(len(head))})

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
        with counted(scope, name):
            result = dataplane.model_metadata(name, version)
        done(scope, result.served)
        return JSON(result.body)

    async def model_ready(body: bytes, scope: dict, name: str,
                          version: str | None = None) -> Response:
        with counted(scope, name, version):
            is_ready = dataplane.model_ready(name, version)
        count_under(scope, dataplane.labels(name, _version_or_none(version)))
        if is_ready:
            return JSON({"name": name, "ready": True})
        return error(503, f"model {name!r}" + (f" version {version}" if version else "")
                     + " is not ready")

    async def model_config(body: bytes, scope: dict, name: str) -> Response:
        with counted(scope, name):
            result = dataplane.model_config(name)
        done(scope, result.served)
        return JSON(result.body)

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
        req = parse(RepositoryIndexRequest, body, allow_empty=True)
        return JSON(await dataplane.repository_index(req))

    async def load_model(body: bytes, scope: dict, name: str) -> Response:
        admin(scope)
        admin_body(body)
        return JSON(await dataplane.load(name))

    async def rollback_model(body: bytes, scope: dict, name: str) -> Response:
        admin(scope)
        req = parse(RollbackRequest, body, allow_empty=True)
        return JSON(await dataplane.rollback(name, req))

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
              "sequence_id / sequence_start / sequence_end parameters for sequences, "
              "sequence_position to make a chunk exactly-once)",
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
