"""The HTTP layer assembled into one app: the route table, its dispatcher and admission,
FastAPI for the documents, the lifespan (the reasoning: docs/design.md, "The app")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from ..dataplane.dataplane import DataPlane
from ..dataplane.metadata import server_version
from ..errors import ServiceError
from ..loop.capture import open_capture
from ..metrics import Metrics
from ..registry.batching import Batching
from ..registry.devices import ProviderChoice, select_providers
from ..registry.registry import Registry
from ..settings import Settings
from .admission import Admission
from .counting import RequestCounts
from .docs import add_docs
from .responses import JSON, error_response
from .routes import service_routes
from .routing import Routes, RouteTable, openapi_paths

log = logging.getLogger("orthornn.service")


async def _not_installed(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("a middleware called before Starlette built the stack")


def installed(middleware: Any) -> Callable[[ASGIApp], Any]:
    """What ``add_middleware`` takes for a middleware object made beforehand: a factory
    that gives it the app it wraps when Starlette builds the stack."""
    def install(app: ASGIApp) -> Any:
        middleware.app = app
        return middleware
    install.middleware = middleware  # type: ignore[attr-defined]  # the lean path's check
    return install


def _install_middleware(app: FastAPI, table: RouteTable, settings: Settings,
                        metrics: Metrics, registry: Registry, dataplane: DataPlane) -> None:
    """The dispatcher and admission, made here and installed by add_middleware
    (``installed`` sets their app as Starlette builds its stack): the lean path
    (service.server.lean) answers the hot routes with the same two objects, their slots
    and counts shared. Added first: innermost, so middleware added later (by us or a
    user) wraps it (and turns the lean path off)."""
    counts = RequestCounts(metrics)
    dispatch = app.state.dispatch = Routes(_not_installed, table, counts, dataplane.labels,
                                           dataplane.observe)
    admission = app.state.admission = Admission(
        _not_installed, table, metrics, counts,
        max_body=lambda: settings.body_limit(registry.catalog.largest_body),
        max_inflight=settings.max_inflight_requests,
        max_receiving=settings.max_receiving_bytes,
        draining=lambda: app.state.draining, min_body_rate=settings.min_body_rate)
    app.add_middleware(installed(dispatch))
    app.add_middleware(installed(admission))


def create_app(settings: Settings, providers: ProviderChoice | None = None) -> FastAPI:
    """The service's app; PROVIDERS: the execution providers chosen for the settings
    (chosen here when not given; ValueError when the settings' device cannot be had)."""
    metrics = Metrics()
    if providers is None:
        providers = select_providers(settings.providers, settings.device)
    executor = ThreadPoolExecutor(settings.inference_workers, thread_name_prefix="orthornn-run")
    capture = open_capture(settings, metrics)  # None: off
    batching = Batching(settings, metrics, executor, capture)  # attaches the batchers
    registry = Registry(settings, metrics, providers.providers,
                        on_load=batching.attach, on_release=batching.close)
    dataplane = DataPlane(settings, registry, metrics, capture)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log.info("serving %s with %s", settings.repo, providers)  # the providers and why
        registry.start(asyncio.get_running_loop())
        dataplane.sessions.start()  # keeps the versions open sessions use loaded
        yield
        await dataplane.sessions.close()
        await dataplane.shadows.close()
        if dataplane.drift is not None:
            dataplane.drift.close()
        await registry.close()  # the batchers' last batches, their records written
        if dataplane.capture is not None:  # every segment closed
            dataplane.capture.close()
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

    routes = service_routes(dataplane, settings, metrics, lambda: app.state.draining)
    table = app.state.routes = RouteTable(routes)
    add_docs(app)
    _install_middleware(app, table, settings, metrics, registry, dataplane)

    async def _error(request: Request, exc: Exception) -> Response:
        return error_response(exc, f"{request.method} {request.url.path}")

    for kind in (ServiceError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, _error)

    def openapi() -> dict[str, Any]:
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
