"""Admission, the outermost ASGI middleware: the in-flight limit, the body limit, held
connections; its ``admit`` serves the lean path too (the reasoning: docs/design.md,
"Admission")."""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import BodyTooLarge
from ..metrics import UNKNOWN, Metrics
from .counting import RequestCounts
from .responses import JSON, error, header
from .routing import RouteTable

#: scope["state"] key of the request's Connection, where the server offers one
CONNECTION = "orthornn.connection"


class Connection:
    """What admission keeps of one client connection, offered by the server (one object
    per connection, under scope["state"][CONNECTION]): ``hold(seconds)``, the server's
    way to read nothing more from the connection for SECONDS once the response being sent
    is complete; ``refused``, set by admission: its next request is a retry."""

    __slots__ = ("hold", "refused")

    def __init__(self, hold: Callable[[float], None]):
        self.hold = hold
        self.refused = False


_NO_STATE: dict[str, Connection] = {}


class _Receiving:
    """A body that came in more than one message and is still being received: the bytes
    it holds of the shared budget, when it began, its task (cancelled when it is evicted)
    and whether it was."""

    __slots__ = ("evicted", "since", "taken", "task")

    def __init__(self, taken: int, since: float, task: asyncio.Task | None):
        self.taken, self.since, self.task, self.evicted = taken, since, task, False


class Admission:
    """ASGI middleware (the outermost of ours; a user's, added after create_app, wraps it):
    admission, the body limit and the in-flight gauge of every route."""

    EXEMPT = ("/v2/health/", "/metrics")  # answered even when overloaded
    RETRY_AFTER_S = 1  # whole seconds, as the header takes them
    RETRY_JITTER_S = 0.25
    #: a body still being received this long may be evicted when the shared budget is
    #: full, and is held to ``min_body_rate`` from then on (Kestrel's grace period)
    GRACE_S = 5.0

    def __init__(self, app: ASGIApp, table: RouteTable, metrics: Metrics,
                 counts: RequestCounts, max_body: Callable[[], int], max_inflight: int,
                 max_receiving: int = 0, draining: Callable[[], bool] | None = None,
                 min_body_rate: float = 0.0):
        self.app, self.table, self.metrics, self.counts = app, table, metrics, counts
        # the body limit, asked per request: by default it follows the loaded models
        # (Settings.body_limit)
        self.body_limit, self.max_inflight = max_body, max_inflight
        self._max_receiving = max_receiving
        self.receiving = 0
        self.min_body_rate = min_body_rate  # bytes a second, on average, after GRACE_S
        self._bodies: set[_Receiving] = set()  # the bodies of more than one message
        self.draining = draining
        self.inflight = 0  # the slots taken (max_inflight)
        # the requests being answered, slot or not: the gauge reads it when scraped (an
        # inc and a dec per request cost more than the rest of this bookkeeping)
        self.active = 0
        metrics.inflight.set_function(lambda: self.active)
        self._retries: deque[asyncio.Future[None]] = deque()  # retries waiting for a slot
        # rendered once: the same error() every other refusal uses
        self._overloaded = error(503, f"overloaded: {max_inflight} requests in flight; "
                                      "retry later",
                                 headers={"Retry-After": str(self.RETRY_AFTER_S)})

    @property
    def max_body(self) -> int:
        return self.body_limit()

    @property
    def max_receiving(self) -> int:
        """Body bytes being received before admission, over all requests (a bound of at
        least one full body; 0: max_inflight bodies, as many as the slots hold)."""
        max_body = self.max_body
        return max(self._max_receiving or self.max_inflight * max_body, max_body)

    @property
    def max_arriving(self) -> int:
        """What the bodies still arriving (of more than one message) may hold together: a
        body's worth is kept free, so that a request whose body came whole is never
        refused for the slow ones (it holds nothing across an await)."""
        total, max_body = self.max_receiving, self.max_body
        return total - max_body if total >= 2 * max_body else total

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        if self.draining is not None and self.draining():
            send = _closing(send)
        # health and metrics neither wait for a slot nor take one: they cost next to
        # nothing, and a probe must not turn a request away while a slot is free
        if scope["path"].startswith(self.EXEMPT):
            return await self._exempt(scope, receive, send, start)
        body, answer = await self.admit(scope, receive, start)
        if answer is not None:
            # fresh messages: a middleware outside this one (CORS, GZip) may edit them
            await send({"type": "http.response.start", "status": answer.status_code,
                        "headers": list(answer.raw_headers)})
            await send({"type": "http.response.body", "body": answer.body})
            return None
        if body is None:  # the client gone
            return None
        try:  # a slot is held from here: release() passes it on
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.release()

    async def _exempt(self, scope: Scope, receive: Receive, send: Send, start: float
                      ) -> None:
        """A health or metrics request: no slot; its body bounded as it is read."""
        received = 0
        max_body = self.max_body

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    raise BodyTooLarge(max_body)
            return message

        refused = self.refuse(scope, max_body)
        if refused is not None:
            await refused(scope, receive, send)
            return self._record(scope, refused.status_code, start)
        self.active += 1
        try:
            await self.app(scope, limited_receive, send)
        finally:
            self.active -= 1

    async def admit(self, scope: Scope, receive: Receive, start: float
                    ) -> tuple[bytes | None, JSON | None]:
        """Admission of a request of a limited route (every route but health and metrics),
        for the ASGI middleware and the lean path (``service.server.lean``) alike: (its
        whole body, None) once it holds a slot, to be given back by ``release()``; (None,
        the answer to send) when it is refused here (413, 408, 503: counted); (None, None)
        when the client went away first. RECEIVE: the ASGI receive of its body."""
        max_body = self.max_body
        refused = self.refuse(scope, max_body)
        if refused is not None:  # (no slot: nothing of it is read)
            self._record(scope, refused.status_code, start)
            return None, refused
        # the body first: a slot is taken for the work, not for a slow upload
        body = await self._body(scope, receive, start, max_body)
        if not isinstance(body, bytes):  # answered (413, 408, 503) or the client gone
            return None, body
        connection: Connection | None = (scope.get("state") or _NO_STATE).get(CONNECTION)
        if self.inflight < self.max_inflight:
            self.inflight += 1
            if connection is not None:
                connection.refused = False
        elif connection is not None and connection.refused \
                and len(self._retries) < self.max_inflight:
            connection.refused = False
            await self._wait_for_slot()  # handed over by a finishing request
        else:  # overloaded: the cheapest answer there is (prebuilt, no routing)
            if connection is not None:  # not read again until Retry-After
                connection.refused = True
                connection.hold(self.RETRY_AFTER_S + self.RETRY_JITTER_S * random.random())
                self.metrics.held.inc()
            self._record(scope, 503, start)
            return None, self._overloaded
        self.active += 1
        return body, None

    def release(self) -> None:
        """An admitted request is answered: its slot to the longest-waiting retry, else
        free."""
        self.active -= 1
        self._free_slot()

    async def _body(self, scope: Scope, receive: Receive, start: float,
                    max_body: int) -> bytes | JSON | None:
        """The request's whole body, read before it takes a slot (bounded by the body
        limit and, over all requests, by ``max_receiving``); the answer (413, 408, 503,
        counted) when it is refused here, None when the client has gone.

        The shared budget cannot be owned: a body that came whole (one message) is never
        refused for it (a body's worth is kept free: ``max_arriving``); when a chunk of one
        still arriving does not fit, the bodies that have been arriving for longer than
        GRACE_S and hold more than it are evicted, largest first (503 with Retry-After, the
        connection closed), before it is refused; and such a body must keep arriving at
        ``min_body_rate`` on average (else 408). Seventeen trickling connections holding
        256 MiB turned every other request away with 503 (issue 59, finding 1)."""
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            return None
        chunk = message.get("body", b"")
        if not message.get("more_body", False):  # the common case: one message
            if len(chunk) > max_body:
                return self._answer(scope, start, self._too_large(max_body))
            return chunk  # (in memory already, held across no await: the reserve's)
        body = _Receiving(0, time.monotonic(), asyncio.current_task())
        self._bodies.add(body)
        chunks: list[bytes] = []
        try:
            while True:
                if chunk:
                    body.taken += len(chunk)
                    self.receiving += len(chunk)
                    answer = None
                    if body.taken > max_body:
                        answer = self._too_large(max_body)
                    elif self.receiving > self.max_arriving \
                            and not self._make_room(body.taken):
                        answer = self._full()
                    elif self._too_slow(body):
                        answer = error(408, "request not received in time: its body came "
                                            f"slower than {self.min_body_rate:g} bytes a "
                                            f"second (min_body_rate)",
                                       headers={"Connection": "close"})
                    if answer is not None:
                        return self._answer(scope, start, answer)
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    if not body.evicted:
                        raise
                    if body.task is not None:  # evicted: answered, not cancelled
                        body.task.uncancel()
                    answer = error(503, "overloaded: this body held the most of the "
                                        f"{self.max_receiving} bytes being received, for "
                                        f"over {self.GRACE_S:g} s; retry later",
                                   headers={"Retry-After": str(self.RETRY_AFTER_S),
                                            "Connection": "close"})
                    return self._answer(scope, start, answer)
                if message["type"] != "http.request":  # http.disconnect
                    return None
                chunk = message.get("body", b"")
        finally:
            self._bodies.discard(body)
            if not body.evicted:  # (an evicted body's bytes were given back then)
                self.receiving -= body.taken

    def _make_room(self, holding: int) -> bool:
        """Evict the bodies received for over GRACE_S that hold more than HOLDING bytes
        (the body asking, its latest chunk counted), largest first, until the budget has
        room again; whether it has."""
        now = time.monotonic()
        older = sorted((b for b in self._bodies if b.taken > holding and not b.evicted
                        and now - b.since > self.GRACE_S), key=lambda b: -b.taken)
        for victim in older:
            if self.receiving <= self.max_arriving:
                break
            victim.evicted = True
            self.receiving -= victim.taken
            self.metrics.evicted.inc()
            if victim.task is not None:
                victim.task.cancel()
        return self.receiving <= self.max_arriving

    def _too_slow(self, body: _Receiving) -> bool:
        if not self.min_body_rate:
            return False
        elapsed = time.monotonic() - body.since
        return elapsed > self.GRACE_S and body.taken < self.min_body_rate * elapsed

    @staticmethod
    def _too_large(max_body: int) -> JSON:
        return error(413, f"body: larger than the limit of {max_body} bytes (max_body_bytes)")

    def _full(self) -> JSON:
        return error(503, f"overloaded: request bodies of {self.max_receiving} bytes being "
                          "received; retry later",
                     headers={"Retry-After": str(self.RETRY_AFTER_S)})

    def _answer(self, scope: Scope, start: float, answer: JSON) -> JSON:
        """ANSWER, a refusal of admission's own, counted."""
        self._record(scope, answer.status_code, start)
        return answer

    async def _wait_for_slot(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
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

    def refuse(self, scope: Scope, max_body: int) -> JSON | None:
        """413 at once when Content-Length says the body is larger than MAX_BODY."""
        length = header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            return self._too_large(max_body)
        return None

    def _record(self, scope: Scope, status: int, start: float) -> None:
        """Count a request admission answered itself, under its route template (else
        "other") and no model (it never reached one)."""
        found = self.table.match(scope)
        self.counts.record(found[0].path if found is not None else "other", (UNKNOWN, ""),
                           status, start)


def _replay(body: bytes, receive: Receive) -> Receive:
    """RECEIVE, its body already read: BODY in one message, then RECEIVE's own (a
    disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _closing(send: Send) -> Send:
    """SEND, each answer's head with ``Connection: close`` (the server then closes the
    connection once the answer is sent)."""

    async def closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing
