"""Admission and request metrics: the outermost of the service's ASGI middleware.

Over ``max_inflight_requests`` in flight, a request gets 503 with Retry-After at once (so
answered requests keep a bounded latency); a body over the limit gets 413; every request is
counted under its route template and the model/version the dataplane chose.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from .errors import BodyTooLarge
from .http import JSON, error, header
from .metrics import UNKNOWN, Metrics
from .routing import RouteTable


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
