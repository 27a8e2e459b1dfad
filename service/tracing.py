"""OpenTelemetry tracing of requests: optional (the ``otel`` extra), off by default (the
reasoning: docs/design.md, "Tracing")."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:  # the otel extra: imported when tracing is switched on
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, TracerProvider

log = logging.getLogger("orthornn.service")

P = ParamSpec("P")
R = TypeVar("R")

NAME = "orthornn.service"
EXPORTERS = ("otlp", "console", "none")
_batches = itertools.count(1)  # orthornn.batch.id (next() is atomic under the GIL)


class Tracer:
    """The service's spans on PROVIDER (an OpenTelemetry tracer provider)."""

    def __init__(self, provider: TracerProvider):
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._tracer = provider.get_tracer(NAME)
        self._current_context = context.get_current
        self._current_span = trace.get_current_span
        self._extract = propagate.extract
        self._server = SpanKind.SERVER
        self._error = StatusCode.ERROR
        self._status = Status

    # -- the event loop: the request, its decoding and encoding ---------------------------

    @contextmanager
    def request(self, scope: Mapping[str, Any], method: str, route: str) -> Iterator[Span]:
        """The server span of one request to ROUTE (a route template), current inside:
        the HTTP server's own when it opened one, else a new one whose parent is the
        request's ``traceparent``."""
        name = f"{method} {route}"
        current = self._current_span()
        if current.get_span_context().is_valid:  # the server's span: named after the route
            current.update_name(name)
            current.set_attribute("http.route", route)
            yield current
            return
        headers = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        with self._tracer.start_as_current_span(
                name, context=self._extract(headers), kind=self._server,
                attributes={"http.request.method": method, "http.route": route,
                            "url.path": scope.get("path", "")}) as span:
            yield span

    def answered(self, span: Span, status: int, model: str | None, version: int | None
                 ) -> None:
        """The request's answer on its span, as it starts: its status and the model
        version that answered."""
        span.set_attribute("http.response.status_code", status)
        if status >= 500:  # a server span's error: 5xx only (a 4xx is the client's)
            span.set_attribute("error.type", str(status))
            span.set_status(self._status(self._error))
        if model is not None:
            span.set_attribute("orthornn.model", model)
            if version is not None:
                span.set_attribute("orthornn.model.version", version)

    def wrap(self, name: str, fn: Callable[P, R]) -> Callable[P, R]:
        """FN, each call in a span NAME, a child of the current span (not made current
        itself: FN opens no spans, and attaching a context costs a request more)."""
        start, current = self._tracer.start_span, self._current_span

        @functools.wraps(fn)
        def traced(*args: P.args, **kwargs: P.kwargs) -> R:
            if not current().is_recording():  # a request not sampled: no spans under it
                return fn(*args, **kwargs)
            span = start(name)
            try:
                return fn(*args, **kwargs)
            except Exception as error:  # a body that does not decode: 4xx, and this span
                span.set_attribute("error.type", type(error).__qualname__)
                span.set_status(self._status(self._error, str(error)[:200]))
                raise
            finally:
                span.end()
        return traced

    def context(self) -> Context | None:
        """The current context (on the event loop, in the request's task: its span), for
        the spans the inference thread makes for it; None when the request's span is not
        recorded (not sampled: its children would not be either)."""
        if not self._current_span().is_recording():
            return None
        return self._current_context()

    # -- the inference thread: after a batch ------------------------------------------------

    def batch(self, model: str, requests: Sequence[tuple[Context | None, float,
                                                         BaseException | None]],
              size: int, started: float, ended: float) -> None:
        """The spans of one batch of MODEL: per request (its context, when it was queued,
        its error or None), a ``queue`` span (queued -> STARTED) and an ``inference`` span
        (STARTED -> ENDED), children of its request span. SIZE: the batch's sequences;
        times are time.perf_counter() values."""
        offset = time.time_ns() - time.perf_counter_ns()  # the same clock, in epoch ns

        def ns(t: float) -> int:
            return int(t * 1e9) + offset
        attributes: dict[str, str | int] = {
            "orthornn.model": model, "orthornn.batch.size": size,
            "orthornn.batch.requests": len(requests), "orthornn.batch.id": next(_batches)}
        start = self._tracer.start_span
        begun, done = ns(started), ns(ended)
        for context, queued, error in requests:
            if context is None:
                continue
            start("queue", context=context, start_time=ns(queued),
                  attributes={"orthornn.model": model}).end(end_time=begun)
            span = start("inference", context=context, start_time=begun,
                         attributes=attributes)
            if error is not None:
                span.set_attribute("error.type", type(error).__qualname__)
                span.set_status(self._status(self._error, str(error)[:200]))
            span.end(end_time=done)


# -- switching it on ----------------------------------------------------------------------

_shared: Tracer | None = None
_lock = threading.Lock()


def open_tracing(enabled: bool) -> Tracer | None:
    """None when ENABLED is false (nothing of OpenTelemetry is imported); else the
    process's Tracer, the SDK configured on first use. ValueError, one line, when the
    otel extra is missing or an OTEL_* variable asks for what it cannot do."""
    global _shared
    if not enabled:
        return None
    with _lock:
        if _shared is None:
            _shared = Tracer(_provider())
        return _shared


def _provider() -> TracerProvider:
    """The global tracer provider: the one configured already, else the SDK's, configured
    from the OTEL_* variables, and made global."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as missing:
        raise ValueError(f"tracing needs the otel extra: pip install '.[otel]' in a checkout "
                         f"of orthornn (missing module {missing.name!r})") from None
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider):  # configured already
        return current
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (Resource.create); orthornn instead of
    # the SDK's "unknown_service" when neither names the service
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "orthornn"}))
    # OTEL_TRACES_SAMPLER(_ARG), OTEL_SDK_DISABLED, OTEL_SPAN_*_LIMIT: TracerProvider
    provider = TracerProvider(resource=resource)
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_*
    trace.set_tracer_provider(provider)
    return trace.get_tracer_provider()


def _exporters() -> list[SpanExporter]:
    """OTEL_TRACES_EXPORTER's exporters (default otlp; console and none too): OTLP over
    HTTP/protobuf, configured by the exporter itself from OTEL_EXPORTER_OTLP_* (endpoint,
    headers, timeout, compression, certificates)."""
    names = [n.strip().lower() for n in
             os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER: {unknown[0]!r} is not one of "
                         f"{', '.join(EXPORTERS)}")
    out: list[SpanExporter] = []
    if "otlp" in names:
        protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
        if protocol != "http/protobuf":
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r}; the service "
                             f"exports OTLP over http/protobuf only")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError as missing:
            raise ValueError(f"tracing needs the otel extra: pip install '.[otel]' in a "
                             f"checkout of orthornn (missing module {missing.name!r})") \
                from None
        out.append(OTLPSpanExporter())
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        out.append(ConsoleSpanExporter())
    return out
