"""Every route the service answers: its handler and its row of the route table (method,
path template, summary, schemas and error answers, for the dispatcher and the OpenAPI
document alike). A handler decodes the body with its protocol's codec, asks the dataplane,
and encodes the typed result; it names the model the request is for in the request's
scope (``service.request``), where the registry records the version leased for it, so
the dispatcher counts the request under it. Tracing on (``service.tracing``), every row
carries the tracer and the codecs' decode and encode run in spans of their own (chosen
once here: off costs a request nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import orjson
from fastapi.responses import Response

from .. import request
from ..addresses import is_loopback
from ..dataplane.checks import version_param
from ..dataplane.dataplane import DataPlane
from ..dataplane.messages import Served
from ..dataplane.schemas import (
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InferenceRequest,
    InferenceResponse,
    LabelsRequest,
    LabelsResponse,
    ModelMetadata,
    PredictRequest,
    PredictResponse,
    RepositoryIndexRequest,
    RepositoryModel,
    RollbackRequest,
    RollbackResponse,
    RolloutStartRequest,
    ServerMetadata,
    parse,
)
from ..errors import POSITION_HEADER, SECRET_HEADER, ClientError, ServiceError
from ..loop.ids import given_id
from ..metrics import Metrics
from ..settings import Settings
from ..tracing import Tracer, open_tracing
from . import auth
from .codecs import oip_binary, predict_json
from .responses import JSON, error, header
from .routing import (
    ADMIN_ERRORS,
    ERRORS,
    INFER_ERRORS,
    LABEL_ERRORS,
    ROLLBACK_ERRORS,
    Call,
    ErrorTable,
    Route,
)

WARNING_HEADER = "Orthornn-Input-Warning"
REQUEST_ID_HEADER = "X-Request-Id"


def _version_or_none(version: str | None) -> int | None:
    """A URL's version as an integer, None when absent or not one (then the labels leave
    it out)."""
    try:
        return version_param(version)
    except ServiceError:
        return None


def _names(model: str, version: int | None = None) -> request.Scope:
    """The model (and version) the request names: it is counted under them until a version
    is leased for it (then under that one), a failed request too. Returns its scope."""
    scope = request.current()
    scope.named, scope.named_version = model, version
    return scope


def _headers(served: Served, position: int | None = None,
             secret: str | None = None) -> dict[str, str]:
    """The headers of an answer: the input warning, the session's position and (answering
    its start) its secret, where there are some."""
    headers = {} if served.warning is None else {WARNING_HEADER: served.warning}
    rid = request.current().id  # in capture's sample: the id its record is kept under
    if rid is not None:
        headers[REQUEST_ID_HEADER] = rid
    if position is not None:
        headers[POSITION_HEADER] = str(position)
    if secret is not None:
        headers[SECRET_HEADER] = secret
    return headers


def session_secret(call: Call) -> str | None:
    """The session secret the request's header presents, if any."""
    return header(call.scope, b"orthornn-session-secret")


def routing_key(call: Call) -> bytes:
    """What a rollout's canary places a request by: the client's X-Routing-Key, else
    the body (the same body, retried, lands on the same version)."""
    given = header(call.scope, b"x-routing-key")
    return call.body if given is None else given.encode()


def _admin_body(body: bytes) -> None:
    if body.strip():
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise ClientError("body is not valid JSON") from None
        if not isinstance(value, dict):
            raise ClientError("body: must be a JSON object")


def service_routes(dataplane: DataPlane, settings: Settings, metrics: Metrics,
                   draining: Callable[[], bool]) -> list[Route]:
    """The route table's rows, their handlers bound to DATAPLANE; DRAINING says whether
    the server is shutting down (readiness answers 503 then). In the order the OpenAPI
    document lists them: inference, metadata and health, the repository API."""
    tracer = open_tracing(settings.tracing)  # None: off (ValueError: the extra is missing)
    rows = [*_inference_routes(dataplane, settings, tracer),
            *_metadata_routes(dataplane, metrics, draining),
            *_repository_routes(dataplane, settings)]
    if tracer is not None:
        rows = [dataclasses.replace(row, tracer=tracer) for row in rows]
    return rows


def _inference_routes(dataplane: DataPlane, settings: Settings, tracer: Tracer | None
                      ) -> list[Route]:
    """/predict, /generate, the OIP infer routes and the labels route."""
    # labels: the admin token or the labels token, and the repository API's other checks
    label_check = auth.admin(settings.admin_token, is_loopback(settings.host),
                             settings.labels_token, "the labels route")
    decode_predict, encode_predict = predict_json.decode, predict_json.encode
    decode_infer, encode_infer = oip_binary.decode, oip_binary.encode
    if tracer is not None:
        decode_predict = tracer.wrap("decode", decode_predict)
        encode_predict = tracer.wrap("encode", encode_predict)
        decode_infer = tracer.wrap("decode", decode_infer)
        encode_infer = tracer.wrap("encode", encode_infer)

    async def predict(call: Call) -> Response:
        req = decode_predict(call.body)
        scope = _names(req.model)
        if dataplane.capture is not None:  # the sample is decided with its batch
            scope.given, scope.deciding = given_id(call.scope["headers"]), True
        result = await dataplane.predict(req, routing_key(call),
                                         session_secret(call))
        return Response(encode_predict(result), media_type="application/json",
                        headers=_headers(result.served, result.position,
                                         result.session_secret))

    async def generate_text(call: Call) -> Response:
        req = parse(GenerateRequest, call.body)
        _names(req.model)
        result = await dataplane.generate(req)
        return JSON(result.body)

    async def infer(call: Call) -> Response:
        name, version = call.params["name"], call.params.get("version")
        scope = _names(name)  # counted under the model from the start
        req = decode_infer(call.body, header(call.scope, b"inference-header-content-length"),
                           name, version)
        if dataplane.capture is not None:
            scope.given, scope.deciding = given_id(call.scope["headers"], req.id), True
        result = await dataplane.infer(req, name, version, routing_key(call),
                                       session_secret(call))
        head, blobs = encode_infer(req, result)
        headers = _headers(result.served, result.position, result.session_secret)
        if not blobs:
            return Response(head, media_type="application/json", headers=headers)
        return Response(head + b"".join(blobs), media_type="application/octet-stream",
                        headers={**headers, oip_binary.HEADER_LENGTH: str(len(head))})

    async def labels(call: Call) -> Response:
        name = call.params["name"]
        _names(name)
        label_check(call.scope, True)
        return JSON(await dataplane.label(name, call.body))

    return [
        Route("POST", "/predict", predict, "predict from sequences or text (optionally "
              "continuing from states or a session)", PredictResponse, PredictRequest,
              errors=INFER_ERRORS, lean=True),
        Route("POST", "/generate", generate_text, "language models: sample text, carrying "
              "the hidden state", GenerateResponse, GenerateRequest, errors=INFER_ERRORS),
        Route("POST", "/v2/models/{name}/infer", infer, "inference (the promoted version, "
              "else the newest loaded; "
              "sequence_id / sequence_start / sequence_end parameters for sequences, "
              "sequence_position to make a chunk exactly-once)",
              InferenceResponse, InferenceRequest, errors=INFER_ERRORS, lean=True),
        Route("POST", "/v2/models/{name}/versions/{version}/infer", infer,
              "inference on one version", InferenceResponse, InferenceRequest,
              errors=INFER_ERRORS, lean=True),
        Route("POST", "/v2/models/{name}/labels", labels, "labels of captured requests "
              "(by their X-Request-Id), all or none, checked against the version that "
              "answered; capture on only (bearer: the admin or the labels token)",
              LabelsResponse, LabelsRequest, errors=LABEL_ERRORS, admin=True),
    ]


def _metadata_routes(dataplane: DataPlane, metrics: Metrics, draining: Callable[[], bool]
                     ) -> list[Route]:
    """Server and model metadata, health and readiness, the model config, /metrics."""
    async def server_metadata(call: Call) -> Response:
        return JSON(dataplane.metadata.server_metadata())

    async def live(call: Call) -> Response:
        return JSON({"live": True})

    async def ready(call: Call) -> Response:
        if draining():
            return error(503, "shutting down")
        if not dataplane.metadata.ready():
            return error(503, "models are still loading (or failed: see /v2/repository/index)")
        return JSON({"ready": True})

    async def model_metadata(call: Call) -> Response:
        name = call.params["name"]
        _names(name)
        result = dataplane.metadata.model_metadata(name, call.params.get("version"))
        return JSON(result.body)

    async def model_ready(call: Call) -> Response:
        name, version = call.params["name"], call.params.get("version")
        _names(name, _version_or_none(version))
        if dataplane.metadata.model_ready(name, version):
            return JSON({"name": name, "ready": True})
        return error(503, f"model {name!r}" + (f" version {version}" if version else "")
                     + " is not ready")

    async def model_config(call: Call) -> Response:
        name = call.params["name"]
        _names(name)
        result = dataplane.metadata.model_config(name)
        return JSON(result.body)

    async def prometheus(call: Call) -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    ready_errors: ErrorTable = {**ERRORS, 503: {"model": ErrorResponse}}
    return [
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
        Route("GET", "/metrics", prometheus, "Prometheus metrics", media_type="text/plain"),
    ]


def _repository_routes(dataplane: DataPlane, settings: Settings) -> list[Route]:
    """The repository API: index, load, unload, rollback and rollouts (bearer token)."""
    admin = auth.admin(settings.admin_token, is_loopback(settings.host))

    async def repository_index(call: Call) -> Response:
        admin(call.scope, False)  # reads only
        req = parse(RepositoryIndexRequest, call.body, allow_empty=True)
        return JSON(await dataplane.repository.repository_index(req))

    async def load_model(call: Call) -> Response:
        admin(call.scope, True)
        _admin_body(call.body)
        return JSON(await dataplane.repository.load(call.params["name"]))

    async def rollback_model(call: Call) -> Response:
        admin(call.scope, True)
        req = parse(RollbackRequest, call.body, allow_empty=True)
        return JSON(await dataplane.repository.rollback(call.params["name"], req))

    async def rollout_status(call: Call) -> Response:
        return JSON(dataplane.repository.rollout(call.params["name"]))

    async def rollout_start(call: Call) -> Response:
        admin(call.scope, True)
        req = parse(RolloutStartRequest, call.body)
        return JSON(await dataplane.repository.start_rollout(call.params["name"], req))

    async def rollout_promote(call: Call) -> Response:
        admin(call.scope, True)
        _admin_body(call.body)
        return JSON(await dataplane.repository.end_rollout(call.params["name"], "promote"))

    async def rollout_abort(call: Call) -> Response:
        admin(call.scope, True)
        _admin_body(call.body)
        return JSON(await dataplane.repository.end_rollout(call.params["name"], "abort"))

    async def unload_model(call: Call) -> Response:
        admin(call.scope, True)
        _admin_body(call.body)
        return JSON(await dataplane.repository.unload(call.params["name"]))

    return [
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
        Route("GET", "/v2/repository/models/{name}/rollout", rollout_status, "the model's "
              "rollout plan (as this replica read it) and this replica's measurements of it",
              errors=ERRORS),
        Route("POST", "/v2/repository/models/{name}/rollout/start", rollout_start, "start "
              "rolling out a candidate that passed the gate (shadow, then canary steps)",
              None, RolloutStartRequest,
              errors=ROLLBACK_ERRORS, admin=True),
        Route("POST", "/v2/repository/models/{name}/rollout/promote", rollout_promote,
              "promote the running rollout's candidate now", errors=ROLLBACK_ERRORS,
              admin=True),
        Route("POST", "/v2/repository/models/{name}/rollout/abort", rollout_abort,
              "stop the running rollout; the promoted version stays", errors=ROLLBACK_ERRORS,
              admin=True),
    ]
