"""The HTTP layer (FastAPI): thin handlers over the registry, the batcher and the schemas.

Request bodies are read as bytes and validated with the pydantic schemas of
``service.protocol`` (one pass of pydantic's JSON parser); the OpenAPI document still
describes them. The hot path, POST /predict, is answered by ``Service`` before FastAPI's
layers and reads well-formed float sequences with simdjson and numpy
(``inputs.fast_predict_request``), falling back to pydantic for anything else. Every
client mistake is a 4xx with {"error": "..."}; anything else is a logged 500.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, suppress
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import auth, generate, inputs
from .batcher import QueueFull
from .docs import add_docs
from .inputs import ClientError
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
    ServerMetadata,
)
from .registry import NotFound, Registry
from .runtime import select_providers
from .settings import Settings

log = logging.getLogger("orthornn.service")
DATATYPE_BYTES = {"FP32": np.dtype("<f4"), "INT64": np.dtype("<i8")}
WARNING_HEADER = "Orthornn-Input-Warning"


def _version() -> str:
    try:
        return dist_version("orthornn")
    except PackageNotFoundError:
        return "0+unknown"


class JSON(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def error(status: int, message: str, headers: dict | None = None) -> JSON:
    return JSON({"error": message}, status_code=status, headers=headers)


class BodyTooLarge(Exception):
    pass


def known_error(exc: Exception, max_body: int) -> JSON | None:
    """The answer to a client mistake raised by a handler (None: not one of ours)."""
    if isinstance(exc, ClientError):
        return error(exc.status, str(exc))
    if isinstance(exc, NotFound):
        return error(404, str(exc))
    if isinstance(exc, QueueFull):
        return error(429, str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, BodyTooLarge):
        return error(413, f"body: larger than the limit of {max_body} bytes")
    return None


class Observer:
    """The body-size limit, in-flight gauge, request counter and duration histogram
    (labels: the route template and the model/version a handler set), for the Observe
    middleware and the direct routes of Service. Label children are cached."""

    def __init__(self, metrics: Metrics, max_body: int):
        self.metrics, self.max_body = metrics, max_body
        self._counters: dict[tuple, object] = {}
        self._durations: dict[str, object] = {}

    def too_large(self, scope) -> JSON | None:
        """413 at once when Content-Length says so."""
        for key, value in scope["headers"]:
            if key == b"content-length":
                if not value.isdigit() or int(value) > self.max_body:
                    return error(413, f"body: larger than the limit of {self.max_body} bytes")
                break
        return None

    def record(self, scope, endpoint: str, status: int, start: float) -> None:
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

    async def direct(self, handler, endpoint: str, params: dict, scope, receive,
                     send) -> None:
        """Answer a request with handler(body, scope, **params) -> Response, without the
        framework's routing, dependency and middleware layers; errors answer like the
        app's handlers; metrics count it under the route template ``endpoint``."""
        start = time.perf_counter()
        status = 500
        self.metrics.inflight.inc()
        try:
            response = self.too_large(scope)
            if response is None:
                try:
                    body = await self._read(receive)
                    if body is None:
                        return  # the client went away
                    response = await handler(body, scope, **params)
                except Exception as exc:
                    response = known_error(exc, self.max_body)
                    if response is None:
                        log.error("internal error on %s %s", scope["method"], scope["path"],
                                  exc_info=exc)
                        response = error(500, "internal server error (logged)")
            status = response.status_code
            await response(scope, receive, send)
        finally:
            self.metrics.inflight.dec()
            self.record(scope, endpoint, status, start)

    async def _read(self, receive) -> bytes | None:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise BodyTooLarge
            chunks.append(chunk)
            more = message.get("more_body", False)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Observe:
    """ASGI middleware: the Observer's accounting for every request the app routes."""

    def __init__(self, app, observer: Observer):
        self.app, self.observer = app, observer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500
        observer = self.observer

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
                if received > observer.max_body:
                    raise BodyTooLarge
            return message

        observer.metrics.inflight.inc()
        try:
            too_large = observer.too_large(scope)
            if too_large is not None:
                await too_large(scope, receive, send_wrapper)
            else:
                await self.app(scope, limited_receive, send_wrapper)
        finally:
            observer.metrics.inflight.dec()
            route = scope.get("route")
            observer.record(scope, getattr(route, "path", None) or "other", status, start)


class Service(FastAPI):
    """The FastAPI app, with ``direct`` routes answered before the framework's layers: the
    inference paths (POST /predict and the OIP infer routes). Each is (path template,
    handler(body, scope, **path parameters)); their FastAPI routes stay for the OpenAPI
    document (and for apps mounted under a root_path)."""

    def __init__(self, *, observer: Observer, **kwargs):
        super().__init__(**kwargs)
        self.observer = observer
        self._direct: list[tuple[re.Pattern, str, Any]] = []

    def add_direct(self, template: str, handler) -> None:
        """template: a POST path with {name} parameters (one path segment each)."""
        pattern = re.sub(r"\\{(\w+)\\}", r"(?P<\1>[^/]+)", re.escape(template))
        self._direct.append((re.compile(pattern), template, handler))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not self.root_path \
                and not scope.get("root_path"):
            for pattern, template, handler in self._direct:
                match = pattern.fullmatch(scope["path"])
                if match is not None:
                    return await self.observer.direct(handler, template, match.groupdict(),
                                                      scope, receive, send)
        await super().__call__(scope, receive, send)


def parse(model: type[BaseModel], body: bytes, allow_empty: bool = False):
    if allow_empty and not body.strip():
        return model()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ClientError(_describe(e)) from None


def _describe(e: ValidationError) -> str:
    errors = e.errors(include_url=False)
    first = max(errors, key=lambda err: len(err["loc"]))  # the most specific union branch
    if any(err["type"] == "json_invalid" for err in errors):
        return f"body is not valid JSON: {first['msg']}"
    where = ""
    for part in first["loc"]:
        if isinstance(part, int):
            where += f"[{part}]"
        elif "[" in part or part in ("float", "int", "str", "bool", "list", "constrained-str"):
            continue  # a union member's tag, not a field
        else:
            where += f".{part}" if where else part
    return f"{where or 'body'}: {first['msg']}"


def _header(scope, name: bytes) -> str | None:
    """A request header (name in lower case) from the ASGI scope, or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _state(scope: dict) -> dict:
    """The request's scope["state"] (what request.state shows)."""
    return scope.setdefault("state", {})


def _version_param(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if not (isinstance(value, str) and value.isascii() and value.isdigit()) or \
            not 1 <= int(value) < 2**62:
        raise NotFound(f"version must be a positive integer; got {value!r}")
    return int(value)


def _body(model: type[BaseModel], required: bool = True) -> dict:
    return {"requestBody": {"required": required, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


ERRORS = {400: {"model": ErrorResponse, "description": "bad input (the message names the "
                                                      "field)"},
          404: {"model": ErrorResponse, "description": "unknown model or version"},
          413: {"model": ErrorResponse, "description": "body too large"}}
INFER_ERRORS = {**ERRORS, 429: {"model": ErrorResponse, "description": "queue full"}}
ADMIN_ERRORS = {**ERRORS, 401: {"model": ErrorResponse, "description": "missing or wrong "
                                                                      "bearer token"}}


def create_app(settings: Settings) -> FastAPI:
    metrics = Metrics()
    providers = select_providers(settings.providers)
    executor = ThreadPoolExecutor(settings.inference_workers, thread_name_prefix="orthornn-run")
    registry = Registry(settings, metrics, executor, providers)
    admin = auth.bearer(settings.admin_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("serving %s with %s", settings.repo, providers)
        registry.start(asyncio.get_running_loop())
        yield
        await registry.close()
        executor.shutdown(wait=True)

    observer = Observer(metrics, settings.max_body_bytes)
    app = Service(observer=observer, title="orthornn inference service", version=_version(),
                  lifespan=lifespan, default_response_class=JSON,
                  docs_url=None, redoc_url=None,  # service.docs: offline assets
                  description="Predictions from orthogonal RNNs exported as ONNX packages: "
                              "a simple /predict API, /generate for language models and the "
                              "Open Inference Protocol (v2, REST).")
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.registry = registry
    app.state.draining = False
    app.add_middleware(Observe, observer=observer)
    add_docs(app)

    @contextmanager
    def hold(state: dict, name: str, version: int | None):
        """Acquire a model version; state (the request's scope["state"]) gets the metric
        labels."""
        mv = registry.acquire(name, version)
        state["labels"] = (name, str(mv.version))
        try:
            yield mv
        finally:
            registry.release(mv)

    def out_of_range(mv, seqs: list, field: str) -> str | None:
        """The warning for inputs far outside mv's training range (counted), or None."""
        warning = inputs.range_warning(mv.spec, seqs, field)
        if warning is not None:
            metrics.inputs_out_of_range.labels(mv.name, str(mv.version)).inc()
        return warning

    # -- errors -------------------------------------------------------------------

    async def _known(request, exc: Exception):
        return known_error(exc, settings.max_body_bytes)

    for kind in (ClientError, NotFound, QueueFull, BodyTooLarge):
        app.add_exception_handler(kind, _known)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "request"
        return error(400, f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error(500, "internal server error (logged)")

    # -- the simple API ---------------------------------------------------------------

    async def predict_body(body: bytes, scope: dict) -> JSON:
        # the common body (float sequences) without pydantic; anything it does not take,
        # and every mistake, goes through pydantic and the checks that name the field
        fast = inputs.fast_predict_request(body)
        req = fast or parse(PredictRequest, body)
        with hold(_state(scope), req.model, _version_param(req.version)) as mv:
            spec = mv.spec
            seqs = None
            if fast is not None and spec.kind == "float":
                with suppress(ClientError):
                    seqs = inputs.predict_sequences(spec, fast, settings.max_request_sequences)
            if seqs is None:
                if fast is not None:
                    req = parse(PredictRequest, body)
                seqs = inputs.predict_sequences(spec, req, settings.max_request_sequences)
            warning = out_of_range(mv, seqs, "inputs")
            outputs = await mv.batcher.submit(
                seqs, lambda rows: inputs.shape_outputs(spec, rows, seqs, req.top_k,
                                                        req.allow_unk))
        return JSON({"model": mv.name, "version": mv.version, "outputs": outputs},
                    headers=None if warning is None else {WARNING_HEADER: warning})

    app.add_direct("/predict", predict_body)

    @app.post("/predict", response_model=PredictResponse, responses=INFER_ERRORS,
              openapi_extra=_body(PredictRequest), summary="predict from sequences or text")
    async def predict(request: Request):
        return await predict_body(await request.body(), request.scope)

    @app.post("/generate", response_model=GenerateResponse, responses=INFER_ERRORS,
              openapi_extra=_body(GenerateRequest),
              summary="language models: sample text, carrying the hidden state")
    async def generate_text(request: Request):
        req = parse(GenerateRequest, await request.body())
        with hold(_state(request.scope), req.model, _version_param(req.version)) as mv:
            prompt = generate.prompt_ids(mv.spec, req, settings.max_new_tokens)
            # a thread of its own (asyncio's default pool): a long generation must not hold
            # the inference threads, and the batcher must not wait for it
            mv.generating += 1
            try:
                result = await asyncio.to_thread(generate.generate, mv.runtime, mv.spec,
                                                 prompt, req)
            finally:
                mv.generating -= 1
        return JSON({"model": mv.name, "version": mv.version, **result})

    # -- Open Inference Protocol -------------------------------------------------------

    @app.get("/v2", response_model=ServerMetadata, summary="server metadata")
    async def server_metadata():
        return JSON({"name": "orthornn", "version": _version(),
                     "extensions": ["binary_tensor_data", "model_repository"]})

    @app.get("/v2/health/live", summary="liveness")
    async def live():
        return JSON({"live": True})

    @app.get("/v2/health/ready", responses={503: {"model": ErrorResponse}},
             summary="readiness: every configured model loaded and warm, not shutting down")
    async def ready():
        if app.state.draining:
            return error(503, "shutting down")
        if not registry.ready():
            return error(503, "models are still loading (or failed: see /v2/repository/index)")
        return JSON({"ready": True})

    def metadata(name: str, version: str | None, scope: dict) -> dict:
        mv = registry.get(name, _version_param(version))
        _state(scope)["labels"] = (name, str(mv.version))  # metrics: under the model's name
        io = mv.spec.io["model"]
        return {"name": name, "versions": [str(v) for v in registry.serving().get(name, [])],
                "platform": "onnxruntime_onnx",
                "inputs": io["inputs"], "outputs": io["outputs"],
                "parameters": {"version": str(mv.version), "task": mv.spec.task,
                               "arch": mv.spec.arch, "max_length": mv.spec.max_length,
                               "labels": mv.spec.labels,
                               "preprocessing": mv.manifest.preprocessing,
                               "spectral": mv.manifest.spectral or {}}}

    @app.get("/v2/models/{name}", response_model=ModelMetadata, responses=ERRORS,
             summary="model metadata (newest loaded version)")
    async def model_metadata(name: str, request: Request):
        return JSON(metadata(name, None, request.scope))

    @app.get("/v2/models/{name}/versions/{version}", response_model=ModelMetadata,
             responses=ERRORS, summary="model version metadata")
    async def version_metadata(name: str, version: str, request: Request):
        return JSON(metadata(name, version, request.scope))

    def model_ready(name: str, version: str | None, scope: dict):
        v = _version_param(version)
        if registry.model_ready(name, v):
            _state(scope)["labels"] = (name, str(v) if v else "")
            return JSON({"name": name, "ready": True})
        on_disk = name in {r["name"] for r in registry.index()}
        if not on_disk:
            raise NotFound(f"model {name!r} is not in the repository")
        return error(503, f"model {name!r}" + (f" version {v}" if v else "") + " is not ready")

    @app.get("/v2/models/{name}/ready", responses={**ERRORS, 503: {"model": ErrorResponse}},
             summary="model readiness")
    async def ready_model(name: str, request: Request):
        return model_ready(name, None, request.scope)

    @app.get("/v2/models/{name}/versions/{version}/ready",
             responses={**ERRORS, 503: {"model": ErrorResponse}}, summary="version readiness")
    async def ready_version(name: str, version: str, request: Request):
        return model_ready(name, version, request.scope)

    @app.get("/v2/models/{name}/config", responses=ERRORS,
             summary="Triton-style model configuration (for tritonclient)")
    async def model_config(name: str, request: Request):
        mv = registry.get(name)
        _state(request.scope)["labels"] = (name, str(mv.version))
        io = mv.spec.io["model"]

        def tensors(items):
            return [{"name": t["name"], "data_type": "TYPE_" + t["datatype"],
                     "dims": t["shape"][1:]} for t in items]
        return JSON({"name": name, "platform": "onnxruntime_onnx",
                     "max_batch_size": settings.max_request_sequences,
                     "input": tensors(io["inputs"]), "output": tensors(io["outputs"]),
                     "dynamic_batching": {"max_queue_delay_microseconds":
                                          int(settings.max_queue_delay_ms * 1000)}
                     if settings.batching else None,
                     "version_policy": {settings.version_policy: {
                         "num_versions": settings.keep_versions}}})

    async def infer(body: bytes, scope: dict, name: str, version: str | None = None):
        header = _header(scope, b"inference-header-content-length")
        tail = b""
        if header is not None:
            if not header.isdigit() or int(header) > len(body):
                raise ClientError("Inference-Header-Content-Length: must be an integer no "
                                  "larger than the body")
            body, tail = body[:int(header)], body[int(header):]
        req = parse(InferenceRequest, body)
        binaries = inputs.binary_chunks(req, tail)
        with hold(_state(scope), name, _version_param(version)) as mv:
            spec, runtime = mv.spec, mv.runtime
            names = runtime.output_names["model"]
            wanted = [o.name for o in req.outputs] if req.outputs else names
            unknown = [n for n in wanted if n not in names]
            if unknown:
                raise ClientError(f"outputs: unknown output {unknown[0]!r}; the model has "
                                  f"{names}")
            seqs, steps = inputs.infer_sequences(spec, req, binaries, spec.io["model"],
                                                 settings.max_request_sequences)
            warning = out_of_range(mv, seqs, "inputs[x]")
            tensors = await mv.batcher.submit(
                seqs, lambda rows: inputs.outputs_to_tensors(rows, names, steps,
                                                             runtime.per_step))
        binary_all = bool((req.parameters or {}).get("binary_data_output"))
        binary = {o.name: bool((o.parameters or {}).get("binary_data", binary_all))
                  for o in req.outputs} if req.outputs else dict.fromkeys(wanted, binary_all)
        datatypes = {o["name"]: o["datatype"] for o in spec.io["model"]["outputs"]}
        outputs, blobs = [], []
        for n in wanted:
            arr = tensors[n]
            item = {"name": n, "shape": list(arr.shape), "datatype": datatypes[n]}
            if binary[n]:
                blob = arr.astype(DATATYPE_BYTES[datatypes[n]]).tobytes()
                item["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                item["data"] = arr.reshape(-1)
            outputs.append(item)
        answer = {"model_name": name, "model_version": str(mv.version), "outputs": outputs}
        if req.id is not None:
            answer["id"] = req.id
        head = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
        headers = {} if warning is None else {WARNING_HEADER: warning}
        if not blobs:
            return Response(head, media_type="application/json", headers=headers)
        return Response(head + b"".join(blobs), media_type="application/octet-stream",
                        headers={**headers, "Inference-Header-Content-Length": str(len(head))})

    @app.post("/v2/models/{name}/infer", response_model=InferenceResponse,
              responses=INFER_ERRORS, openapi_extra=_body(InferenceRequest),
              summary="inference (newest loaded version)")
    async def infer_model(name: str, request: Request):
        return await infer(await request.body(), request.scope, name)

    @app.post("/v2/models/{name}/versions/{version}/infer", response_model=InferenceResponse,
              responses=INFER_ERRORS, openapi_extra=_body(InferenceRequest),
              summary="inference on one version")
    async def infer_version(name: str, version: str, request: Request):
        return await infer(await request.body(), request.scope, name, version)

    app.add_direct("/v2/models/{name}/infer", infer)
    app.add_direct("/v2/models/{name}/versions/{version}/infer", infer)

    # -- model repository API ----------------------------------------------------------

    @app.post("/v2/repository/index", response_model=list[RepositoryModel],
              responses=ADMIN_ERRORS, openapi_extra=_body(RepositoryIndexRequest, False),
              summary="every model version in the repository with its state")
    async def repository_index(request: Request):
        admin(request)
        req = parse(RepositoryIndexRequest, await request.body(), allow_empty=True)
        rows = await asyncio.to_thread(registry.index)
        if req.ready is not None:
            rows = [r for r in rows if (r["state"] == "READY") == req.ready]
        return JSON(rows)

    async def _admin_body(request: Request) -> None:
        body = await request.body()
        if body.strip():
            try:
                value = orjson.loads(body)
            except orjson.JSONDecodeError:
                raise ClientError("body is not valid JSON") from None
            if not isinstance(value, dict):
                raise ClientError("body: must be a JSON object")

    @app.post("/v2/repository/models/{name}/load", responses=ADMIN_ERRORS,
              summary="load (or reload) a model now, verifying it")
    async def load_model(name: str, request: Request):
        admin(request)
        await _admin_body(request)
        errors = await asyncio.to_thread(registry.load, name)
        if not registry.model_ready(name):
            raise ClientError(f"model {name!r} failed to load: " + "; ".join(errors))
        return JSON({"name": name, "versions": registry.serving()[name], "refused": errors})

    @app.post("/v2/repository/models/{name}/unload", responses=ADMIN_ERRORS,
              summary="stop serving a model (in-flight requests finish)")
    async def unload_model(name: str, request: Request):
        admin(request)
        await _admin_body(request)
        await asyncio.to_thread(registry.unload, name)
        return JSON({"name": name, "unloaded": True})

    # -- operations -----------------------------------------------------------------

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (PredictRequest, GenerateRequest, InferenceRequest,
                      RepositoryIndexRequest):
            s = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(s.pop("$defs", {}))
            components[model.__name__] = s
        if settings.admin_token is not None:
            components_root = schema["components"]
            components_root["securitySchemes"] = {"bearer": {"type": "http",
                                                             "scheme": "bearer"}}
            for path, ops in schema["paths"].items():
                if path.startswith("/v2/repository"):
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
    return app
