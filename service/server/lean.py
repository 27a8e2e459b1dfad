"""The lean path: the hot routes (``Route.lean``: ``POST /predict`` and the OIP infer
routes, session chunks included) answered straight from uvicorn's parsed request, without
the ASGI stack: admission's ``admit`` and the dispatcher's ``handle`` (the same objects the
ASGI middleware uses, so slots, limits and counts are shared), then the answer written to
the transport in one write. Every other route, and every route when a middleware other
than ours is installed, stays on FastAPI (the reasoning: docs/design.md, "The lean
path")."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from ..http.admission import Admission
from ..http.routing import Route, Routes

log = logging.getLogger("orthornn.service")

#: what the lean path uses of uvicorn's httptools protocol and of its request cycle
PROTOCOL_METHODS = ("_start_asgi_task",)
CYCLE_ATTRIBUTES = ("scope", "transport", "flow", "keep_alive", "disconnected",
                    "response_started", "response_complete", "message_event",
                    "on_response", "default_headers", "waiting_for_100_continue")
_INTERNAL = b'{"error": "internal server error (logged)"}'
INTERNAL_ERROR = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json"
                  b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                  % (len(_INTERNAL), _INTERNAL))


def why_not(app: Any, protocol_class: type) -> str | None:
    """Why the lean path cannot serve APP on PROTOCOL_CLASS (None: it can): an app that is
    not the service's, a middleware of someone else's (it must see every request), or a
    protocol without what the lean path uses (h11's, or a uvicorn that changed)."""
    state = getattr(getattr(app, "state", None), "_state", {})
    if not isinstance(app, FastAPI) or "admission" not in state:
        return "the app is not the service's"
    ours = {id(state["admission"]), id(state["dispatch"])}
    others = [m for m in app.user_middleware
              if id(getattr(m.cls, "middleware", None)) not in ours]
    if others:
        return f"a middleware of its own ({getattr(others[0].cls, '__name__', others[0].cls)})" \
               " must see every request"
    missing = [name for name in PROTOCOL_METHODS if not callable(getattr(protocol_class,
                                                                         name, None))]
    if missing:
        return f"{protocol_class.__name__} has no {', '.join(missing)}"
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    init = RequestResponseCycle.__init__.__code__.co_names  # the attributes it sets
    missing = [name for name in CYCLE_ATTRIBUTES if name not in init]
    missing += [] if callable(getattr(RequestResponseCycle, "receive", None)) else ["receive"]
    if missing:
        return f"uvicorn's RequestResponseCycle has no {', '.join(missing)}"
    return None


def lean_protocol(protocol_class: type, app: FastAPI) -> type:
    """PROTOCOL_CLASS (uvicorn's httptools protocol, however wrapped) answering APP's hot
    routes on the lean path; the class as it is (and a log line saying why) where the lean
    path cannot serve (``why_not``)."""
    reason = why_not(app, protocol_class)
    if reason is not None:
        log.info("every route on the ASGI stack: %s", reason)
        return protocol_class
    lean = LeanPath(app)

    class Lean(protocol_class):
        def _start_asgi_task(self, cycle: Any, asgi: Any) -> None:
            found = lean.match(cycle.scope)
            if found is None:
                return super()._start_asgi_task(cycle, asgi)
            answer = lean.serve(cycle, *found)
            if self.config.reset_contextvars:  # as uvicorn's own (its option)
                task = self.loop.create_task(answer, context=contextvars.Context())
            else:
                task = self.loop.create_task(answer)
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

    Lean.__name__ = Lean.__qualname__ = f"Lean{protocol_class.__name__}"
    return Lean


class LeanPath:
    """The hot routes of one app, and how one request of them is answered."""

    def __init__(self, app: FastAPI):
        self.table = app.state.routes
        self.admission: Admission = app.state.admission
        self.dispatch: Routes = app.state.dispatch
        self.draining = lambda: app.state.draining
        self.hot = [(r.method, r.pattern, r) for r in self.table.routes if r.lean]

    def match(self, scope: dict) -> tuple[Route, dict[str, str]] | None:
        """A hot route and its path parameters, or None (the ASGI stack answers)."""
        method, path = scope["method"], scope["path"]
        root = scope["root_path"]
        if root and path.startswith(root):
            path = path[len(root):]
        for route_method, pattern, route in self.hot:
            if route_method == method:
                found = pattern.fullmatch(path)
                if found is not None:
                    return route, found.groupdict()
        return None

    async def serve(self, cycle: Any, route: Route, params: dict[str, str]) -> None:
        """Answer one request of ROUTE on uvicorn's CYCLE: admission, then the route."""
        start = time.perf_counter()
        scope = cycle.scope
        if self.draining():  # answered with Connection: close, then closed
            cycle.keep_alive = False
        try:
            body, answer = await self.admission.admit(scope, cycle.receive, start)
            if answer is not None:
                return await write(cycle, answer)
            if body is None:  # the client gone
                return None
            try:
                async def read() -> bytes:
                    return body

                await self.dispatch.handle(route, params, scope, read,
                                           lambda response: write(cycle, response), start)
            finally:
                self.admission.release()
        except BaseException as exc:  # as uvicorn's run_asgi: logged, 500 or closed
            log.error("internal error on %s %s", scope["method"], scope["path"],
                      exc_info=exc)
            if not cycle.response_started and not cycle.disconnected:
                cycle.response_started = True
                cycle.transport.write(INTERNAL_ERROR)
            cycle.transport.close()
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
        finally:
            cycle.on_response = _nothing


def _nothing() -> None:
    return None


async def write(cycle: Any, response: Response) -> None:
    """RESPONSE on CYCLE's connection in one write, as uvicorn's send writes it: its
    default headers (server, date), ``connection: close`` when the connection is not
    kept (then closed), the cycle completed (uvicorn's keep-alive or pipelining goes on)."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    cycle.response_started, cycle.waiting_for_100_continue = True, False
    head = [STATUS_LINES[response.status_code]]
    closes = False  # the response says Connection: close (an error that ends it)
    for name, value in (*cycle.default_headers, *response.raw_headers):
        if name == b"connection" and b"close" in value.lower().replace(b" ", b"").split(b","):
            cycle.keep_alive, closes = False, True
        head += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive and not closes:
        head.append(b"connection: close\r\n")
    head += (b"\r\n", response.body)
    cycle.transport.write(b"".join(head))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()


def _status_lines() -> dict[int, bytes]:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE
    return STATUS_LINE


STATUS_LINES = _status_lines()
