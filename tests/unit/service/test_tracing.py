"""OpenTelemetry tracing (``--tracing``, the otel extra): the span tree of one request with
its parent propagated by ``traceparent`` (the SDK's in-memory exporter), on /predict and the
Open Inference Protocol's infer route; a batch's spans in each of its requests' traces; the
OTLP exporter configured by the OTEL_* variables; nothing of OpenTelemetry imported by the
service when tracing is off; and the one-line exit 2 when the extra is missing."""

from __future__ import annotations

import asyncio
import http.server
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra")

from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings
from orthornn.service.tracing import open_tracing

from ...service_helpers import make_repo

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def exporter():
    """The in-memory exporter on the process's tracer provider (set here: the first
    provider set in a process stays; the service uses the one it finds)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not isinstance(provider, TracerProvider):
        pytest.skip(f"another tracer provider is set in this process: {provider!r}")
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()  # keeps nothing more (later tests' apps are traced by FastAPI)


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("tracing-repo"),
                     {"digits": [1]})


@pytest.fixture(scope="module")
def client(repo, exporter):
    app = create_app(Settings(repo=repo, poll_interval_s=0, tracing=True))
    with TestClient(app, raise_server_exceptions=False) as c:
        app.state.registry.scanned.wait(60)
        assert app.state.registry.ready()
        yield c


def _trace(exporter: InMemorySpanExporter, trace_id: str, names: set[str],
           timeout: float = 10.0) -> list[ReadableSpan]:
    """The finished spans of TRACE_ID once NAMES are among them (the queue and inference
    spans are made in the inference thread, after the answer is on its way)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans()
                 if s.context.trace_id == int(trace_id, 16)]
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.01)


def _traceparent(trace_id: str, span_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{span_id}-01"}


def _check_tree(spans: list[ReadableSpan], route: str, parent_id: str) -> ReadableSpan:
    """One server span named after ROUTE, its parent the traceparent's span; decode, queue,
    inference and encode its children, in that order; the request span returned."""
    server = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(server) == 1, [(s.name, s.kind) for s in spans]
    (request,) = server
    assert request.name == f"POST {route}"
    assert request.parent is not None and request.parent.is_remote
    assert request.parent.span_id == int(parent_id, 16)
    attrs = request.attributes or {}
    assert attrs["http.request.method"] == "POST" and attrs["http.route"] == route
    assert attrs["http.response.status_code"] == 200
    assert (attrs["orthornn.model"], attrs["orthornn.model.version"]) == ("digits", 1)
    children = sorted((s for s in spans if s.parent is not None
                       and s.parent.span_id == request.context.span_id),
                      key=lambda s: s.start_time or 0)
    assert [s.name for s in children] == ["decode", "queue", "inference", "encode"]
    decode, queue, inference, encode = children
    assert queue.end_time == inference.start_time  # taken from the queue, then run
    for span in children:
        assert span.context.trace_id == request.context.trace_id
        assert (span.end_time or 0) >= (span.start_time or 0)
    assert (request.start_time or 0) <= (decode.start_time or 0)
    assert (encode.end_time or 0) <= (request.end_time or 0)
    assert (inference.attributes or {})["orthornn.batch.size"] == 1
    assert (inference.attributes or {})["orthornn.batch.requests"] == 1
    assert (inference.attributes or {})["orthornn.model"] == "digits"
    return request


def test_predict_span_tree_in_the_propagated_trace(client, exporter):
    parent = "00f067aa0ba902b7"
    r = client.post("/predict", json={"model": "digits", "inputs": [[0.1, 0.5, -0.2]]},
                    headers=_traceparent(TRACE_ID, parent))
    assert r.status_code == 200, r.text
    spans = _trace(exporter, TRACE_ID, {"decode", "queue", "inference", "encode"})
    _check_tree(spans, "/predict", parent)


def test_oip_infer_span_tree_in_the_propagated_trace(client, exporter):
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    req = {"inputs": [{"name": "x", "shape": [1, 3, 1], "datatype": "FP32",
                       "data": [0.1, 0.5, -0.2]}]}
    r = client.post("/v2/models/digits/infer", json=req,
                    headers=_traceparent(trace_id, parent))
    assert r.status_code == 200, r.text
    spans = _trace(exporter, trace_id, {"decode", "queue", "inference", "encode"})
    _check_tree(spans, "/v2/models/{name}/infer", parent)


def test_a_client_error_is_not_a_server_error(client, exporter):
    trace_id = "1af7651916cd43dd8448eb211c80319c"
    r = client.post("/predict", json={"model": "digits", "inputs": "nope"},
                    headers=_traceparent(trace_id, "c7ad6b7169203331"))
    assert r.status_code == 400
    spans = _trace(exporter, trace_id, {"decode"})
    (request,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert (request.attributes or {})["http.response.status_code"] == 400
    assert request.status.is_unset  # a 4xx is the client's (the server span stays unset)
    assert {s.name for s in spans} == {"POST /predict", "decode"}


def test_a_batch_is_in_the_trace_of_each_of_its_requests(exporter):
    """Three requests queued in one turn of the event loop run as one batch: each trace
    has its own queue and inference spans, the inference spans naming the same batch."""
    from orthornn.service.registry.batcher import Batcher

    tracer = open_tracing(True)
    assert tracer is not None
    otel = trace.get_tracer("test")

    async def main() -> list[int]:
        with ThreadPoolExecutor(1) as pool:
            b = Batcher(lambda seqs: [{"y": s} for s in seqs], pool, max_batch_size=8,
                        max_queue_delay_ms=0, max_queue_size=64, workers=1,
                        model="m", tracer=tracer)

            async def request(k: int) -> int:
                with otel.start_as_current_span(f"request {k}") as span:
                    await b.submit([np.zeros((2, 1), np.float32)] * (k + 1))
                    return span.get_span_context().trace_id
            ids = await asyncio.gather(*(request(k) for k in range(3)))
            await b.close()
        return list(ids)
    trace_ids = asyncio.run(main())
    assert len(set(trace_ids)) == 3
    batch_ids = set()
    for k, trace_id in enumerate(trace_ids):
        spans = _trace(exporter, f"{trace_id:032x}", {"queue", "inference"})
        (root,) = [s for s in spans if s.name == f"request {k}"]
        (inference,) = [s for s in spans if s.name == "inference"]
        (queue,) = [s for s in spans if s.name == "queue"]
        for span in (queue, inference):
            assert span.parent is not None and span.parent.span_id == root.context.span_id
        attrs = inference.attributes or {}
        assert (attrs["orthornn.batch.size"], attrs["orthornn.batch.requests"]) == (6, 3)
        batch_ids.add(attrs["orthornn.batch.id"])
    assert len(batch_ids) == 1


def test_without_a_server_span_the_dispatcher_opens_one(exporter):
    """The route dispatcher alone (no FastAPI, whose telemetry opens the server span):
    it opens the server span itself, its parent read from traceparent."""
    from fastapi.responses import Response
    from orthornn.service.http.counting import RequestCounts
    from orthornn.service.http.routing import Call, Route, Routes, RouteTable
    from orthornn.service.metrics import Metrics

    async def handler(call: Call) -> Response:
        return Response(b"boom", status_code=503)

    async def nothing(scope, receive, send) -> None:
        raise AssertionError("not reached")
    tracer = open_tracing(True)
    table = RouteTable([Route("GET", "/things/{name}", handler, "a thing", tracer=tracer)])
    app = Routes(nothing, table, RequestCounts(Metrics()), lambda held: ("", ""),
                 lambda held, status: None)
    trace_id, parent = "2af7651916cd43dd8448eb211c80319c", "d7ad6b7169203331"
    r = TestClient(app).get("/things/x", headers=_traceparent(trace_id, parent))
    assert r.status_code == 503
    (request,) = _trace(exporter, trace_id, {"GET /things/{name}"})
    assert request.kind == SpanKind.SERVER and request.name == "GET /things/{name}"
    assert request.parent is not None and request.parent.span_id == int(parent, 16)
    attrs = request.attributes or {}
    assert attrs["http.route"] == "/things/{name}" and attrs["url.path"] == "/things/x"
    assert attrs["http.response.status_code"] == 503 and not request.status.is_ok
    assert not request.status.is_unset  # 5xx: an error


def _python(code: str, env: dict[str, str] | None = None, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, cwd=cwd, env={**os.environ, **(env or {})})


def test_tracing_off_imports_nothing_of_opentelemetry(repo):
    """Off (the default), serving a request imports no OpenTelemetry module: none of the
    SDK or the exporter, and of the API only what FastAPI imports itself (its native
    telemetry: opentelemetry-api is a dependency of FastAPI, so the API is loaded by
    `import fastapi` whatever the service does)."""
    code = f"""
import sys
import fastapi
before = sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry')
from fastapi.testclient import TestClient
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings
app = create_app(Settings(repo={str(repo)!r}, poll_interval_s=0))
assert all(row.tracer is None for row in app.state.routes.routes)
with TestClient(app) as c:
    app.state.registry.scanned.wait(60)
    r = c.post('/predict', json={{'model': 'digits', 'inputs': [[0.1, 0.5]]}})
    assert r.status_code == 200, r.text
    assert app.state.registry.get('digits').batcher.tracer is None
after = sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry')
assert after == before, sorted(set(after) - set(before))
assert 'orthornn.service.tracing' in sys.modules  # the leaf itself, without OpenTelemetry
print('ok', len(before))
"""
    result = _python(code, env={"ORTHORNN_TRACING": "false"})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_serve_with_tracing_without_the_extra_exits_2_naming_it(tmp_path):
    """The otel extra missing (its SDK and exporter unimportable; the API stays, FastAPI
    needs it): `orthornn serve --tracing` ends with one line naming the extra, exit 2."""
    code = f"""
import sys
for name in ('opentelemetry.sdk', 'opentelemetry.exporter'):
    sys.modules[name] = None  # unimportable, as without the otel extra
from orthornn.cli import main
sys.exit(main(['serve', '--repo', {str(tmp_path)!r}, '--port', '0', '--tracing']))
"""
    result = _python(code)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("orthornn serve: error: tracing needs the otel extra: "
                               "pip install '.[otel]'"), lines[0]


class _Collector(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_otlp_exporter_is_configured_by_the_otel_variables():
    """A fresh process: open_tracing configures the SDK from OTEL_* (endpoint, service
    name); its spans reach an OTLP/HTTP collector at OTEL_EXPORTER_OTLP_ENDPOINT."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = """
from opentelemetry import trace
from orthornn.service.tracing import open_tracing
tracer = open_tracing(True)
with trace.get_tracer('test').start_as_current_span('request'):
    tracer.wrap('decode', lambda: None)()
trace.get_tracer_provider().shutdown()  # flushes the batch processor
print('ok')
"""
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
               "OTEL_SERVICE_NAME": "orthornn-test", "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        result = _python(code, env)
        assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    finally:
        server.shutdown()
    paths = [path for path, _ in _Collector.received]
    assert paths == ["/v1/traces"], paths
    request = ExportTraceServiceRequest.FromString(_Collector.received[0][1])
    (resource_spans,) = request.resource_spans
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert service["service.name"] == "orthornn-test"
    names = [s.name for scope in resource_spans.scope_spans for s in scope.spans]
    assert sorted(names) == ["decode", "request"]


@pytest.mark.parametrize("env,message", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: 'zipkin' is not one of"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "exports OTLP over http/protobuf only"),
])
def test_otel_variables_the_service_cannot_follow_are_one_line(env, message):
    code = ("from orthornn.service.tracing import open_tracing\n"
            "try:\n    open_tracing(True)\n"
            "except ValueError as e:\n    print(e)\n")
    result = _python(code, env)
    assert result.returncode == 0 and message in result.stdout, result.stdout + result.stderr


def test_off_by_default_on_by_flag_or_variable(monkeypatch):
    from orthornn.service.commands.serve import settings_from_args

    from orthornn.cli import build_parser

    assert Settings(repo=".").tracing is False
    args = build_parser().parse_args(["serve", "--repo", ".", "--tracing"])
    assert settings_from_args(args).tracing is True
    monkeypatch.setenv("ORTHORNN_TRACING", "true")
    assert Settings(repo=".").tracing is True
