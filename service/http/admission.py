"""Admission and request metrics: the outermost of the service's ASGI middleware.

Over ``max_inflight_requests`` in flight, a request gets 503 with Retry-After at once (so
answered requests keep a bounded latency). Where the server offers a ``Connection`` (the
eager listener does, under ``scope["state"][CONNECTION]``):

- the refused connection is held: not read again until Retry-After has passed (and a
  random fraction of ``RETRY_JITTER_S`` more, so that connections refused together do
  not all come back together, in the same order), so a client that retries at once
  waits in TCP instead of costing another refusal;
- its next request, the retry, is not refused again when it finds every slot taken: it
  waits (at most ``max_inflight_requests`` such retries) for the next slot to come free,
  ahead of any new request. Without this, the connections being served would keep the
  slots for ever (each sends its next request the moment its answer arrives, before a
  retry can take the slot) and the others would be refused at every retry.

Nothing is refused while a slot is free; health and metrics take no slot. A body over the
limit gets 413; every request is counted under its route template and the model/version
the dataplane chose.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import Counter, Histogram

from ..errors import BodyTooLarge
from ..metrics import UNKNOWN, Metrics
from .responses import JSON, error, header
from .routing import RouteTable

#: scope["state"] key of the request's Connection, where the server offers one
CONNECTION = "orthornn.connection"
_NO_STATE: dict = {}


class Connection:
    """What admission keeps of one client connection, offered by the server (one object
    per connection, under scope["state"][CONNECTION]): ``hold(seconds)``, the server's
    way to read nothing more from the connection for SECONDS once the response being sent
    is complete; ``refused``, set by admission: its next request is a retry."""

    __slots__ = ("hold", "refused")

    def __init__(self, hold: Callable[[float], None]):
        self.hold = hold
        self.refused = False


class Observe:
    """ASGI middleware (the outermost of ours; a user's, added after create_app, wraps it):
    admission, the body limit, the in-flight gauge and
    the request metrics of every route (labels: the route template and the model/version
    the dataplane set). Label children are cached."""

    EXEMPT = ("/v2/health/", "/metrics")  # answered even when overloaded
    RETRY_AFTER_S = 1  # whole seconds, as the header takes them
    RETRY_JITTER_S = 0.25

    def __init__(self, app, table: RouteTable, metrics: Metrics, max_body: int,
                 max_inflight: int):
        self.app, self.table, self.metrics = app, table, metrics
        self.max_body, self.max_inflight = max_body, max_inflight
        self.inflight = 0
        self._retries: deque[asyncio.Future] = deque()  # retries waiting for a slot
        self._counters: dict[tuple, Counter] = {}
        self._durations: dict[str, Histogram] = {}
        # rendered once: the same error() every other refusal uses
        self._overloaded = error(503, f"overloaded: {max_inflight} requests in flight; "
                                      "retry later",
                                 headers={"Retry-After": str(self.RETRY_AFTER_S)})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
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

        # health and metrics neither wait for a slot nor take one: they cost next to
        # nothing, and a probe must not turn a request away while a slot is free
        limited = not scope["path"].startswith(self.EXEMPT)
        if limited:
            connection = (scope.get("state") or _NO_STATE).get(CONNECTION)
            if self.inflight < self.max_inflight:
                self.inflight += 1
                if connection is not None:
                    connection.refused = False
            elif connection is not None and connection.refused \
                    and len(self._retries) < self.max_inflight:
                connection.refused = False
                await self._wait_for_slot()  # handed over by a finishing request
            else:
                # Overloaded: the cheapest answer there is (prebuilt bytes, no routing).
                # Fresh messages: a middleware outside this one (CORS, GZip) may edit them.
                if connection is not None:  # not read again until Retry-After
                    connection.refused = True
                    connection.hold(self.RETRY_AFTER_S + self.RETRY_JITTER_S * random.random())
                await send({"type": "http.response.start", "status": 503,
                            "headers": list(self._overloaded.raw_headers)})
                await send({"type": "http.response.body", "body": self._overloaded.body})
                return self.record(scope, found, 503, start)
        # a slot is held from here: the finally below passes it on
        self.metrics.inflight.inc()
        try:
            refused = self.refuse(scope)
            if refused is not None:
                await refused(scope, receive, send_wrapper)
            else:
                await self.app(scope, limited_receive, send_wrapper)
        finally:
            if limited:
                self._free_slot()
            self.metrics.inflight.dec()
            self.record(scope, found, status, start)

    async def _wait_for_slot(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._retries.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot, then cancelled
                self._free_slot()
            raise

    def _free_slot(self) -> None:
        """A finishing request's slot: to the longest-waiting retry, else free."""
        while self._retries:
            waiter = self._retries.popleft()
            if not waiter.done():  # (a cancelled one is skipped)
                waiter.set_result(None)
                return
        self.inflight -= 1

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
