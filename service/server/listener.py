"""The eager listener, and every use of uvicorn beyond its public surface, in one place.

uvicorn's public surface is ``Config``, ``Server(config).run(sockets=...)`` and
``Server.handle_exit``. To put ``EagerListener`` where uvicorn's own server would be,
this module also uses what uvicorn builds inside ``Server.startup``: the protocol class
(``Config.http_protocol_class``, constructed with ``config``, ``server_state``,
``app_state`` and ``_loop``), ``Server.server_state``, ``Server.lifespan.state`` and the
``Server.servers`` list that its shutdown closes; and, for holding refused connections,
the protocol's ``on_response_complete`` (called when a response is sent; it resumes
reading and starts the next pipelined request), ``connection_lost``, and its ``flow``
(uvicorn's FlowControl), ``transport`` and ``loop``. uvicorn has changed this surface about
once a year, so ``surface_problems`` names whatever of it is missing: the service
refuses to start with that list (``--listener uvicorn`` runs uvicorn's own listener
instead), and tests/integration/test_service_live.py checks it against the pinned uvicorn.

Holding: admission (``service.http.admission``) refuses a request over the in-flight limit with
503 and Retry-After. A client that retries at once (wrk, most load generators, many
clients' retry loops) would be refused again and again, each refusal costing nearly what
an answer costs, and the event loop would spend its time refusing. So each connection
offers admission an ``http.admission.Connection`` under ``scope["state"][CONNECTION]``, whose
``hold(seconds)`` is its protocol's: once that response is sent, the connection is not
read until Retry-After has passed (the next request, even one already pipelined, waits in
the kernel's buffers: TCP holds the client back at no cost); then it is read as usual.

Deadlines (``deadlined``; both listeners): uvicorn has no timeout for receiving a request
(its keep-alive timer is cancelled by the first byte and none is armed at accept), so a
client that trickles a request, or connects and sends nothing, holds its connection for
ever. Each connection's protocol keeps one timer (``loop.call_later``), in one of four
phases: ``head`` from the accept, or on a kept-alive connection from the next request's
first byte, until its head is parsed (``header_timeout_s``); ``body`` from the head until
the body's last byte (``body_timeout_s``); none while the request is answered (inference,
a streamed answer, a held connection) and none while idle between requests (uvicorn's
keep-alive timer). A request whose head and body arrive in one read arms no timer. When
the timer fires the connection is closed (408 first when a byte of the request came and
nothing of an answer has been sent) and ``Deadlines.closed`` counts it. They use, beyond
holding's: the protocol's ``connection_made``, ``data_received`` and
``handle_websocket_upgrade``, its ``cycle`` (uvicorn's RequestResponseCycle: ``more_body``,
``response_started``, ``response_complete``) and httptools' ``pipeline``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import logging
import socket
import ssl as ssl_module
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from ..http.admission import CONNECTION, Connection

log = logging.getLogger("orthornn.service")

#: the protocol class's constructor parameters this module passes
PROTOCOL_PARAMETERS = ("config", "server_state", "app_state", "_loop")
#: what holding uses of a protocol: methods it overrides, attributes its instances have
PROTOCOL_METHODS = ("on_response_complete", "connection_lost")
PROTOCOL_ATTRIBUTES = ("flow", "transport", "loop")
#: what the deadlines use of a protocol, beyond that (its cycle's attributes: above)
DEADLINE_METHODS = ("connection_made", "data_received", "on_response_complete",
                    "connection_lost")
DEADLINE_ATTRIBUTES = ("cycle", "transport", "loop")


def surface_problems(server: uvicorn.Server) -> list[str]:
    """What this module needs of uvicorn's internals and does not find, each named (call
    after uvicorn's own startup has run with no sockets); [] when all is there."""
    problems = []
    if "sockets" not in inspect.signature(uvicorn.Server.startup).parameters:
        problems.append("uvicorn.Server.startup(sockets=...)")
    protocol = getattr(server.config, "http_protocol_class", None)
    if protocol is None:
        problems.append("uvicorn.Config.http_protocol_class")
    else:
        given = inspect.signature(protocol.__init__).parameters
        problems += [f"{protocol.__name__}.__init__({name}=...)"
                     for name in PROTOCOL_PARAMETERS if name not in given]
        problems += [f"{protocol.__name__}.{name}()" for name in PROTOCOL_METHODS
                     if not callable(getattr(protocol, name, None))]
    if not hasattr(server, "server_state"):
        problems.append("uvicorn.Server.server_state")
    if not hasattr(getattr(server, "lifespan", None), "state"):
        problems.append("uvicorn.Server.lifespan.state")
    if not isinstance(getattr(server, "servers", None), list):
        problems.append("uvicorn.Server.servers (a list its shutdown closes)")
    if not problems and protocol is not None:  # instance attributes: on one protocol,
        problems += _instance_problems(server, protocol)  # built as for a connection
    return problems


def _instance_problems(server: uvicorn.Server, protocol: type,
                       attributes: tuple[str, ...] = PROTOCOL_ATTRIBUTES) -> list[str]:
    try:
        loop, own = asyncio.get_running_loop(), None
    except RuntimeError:  # called outside the server's loop (a test): a loop of its own
        loop = own = asyncio.new_event_loop()
    try:
        instance = protocol(config=server.config, server_state=server.server_state,
                            app_state={}, _loop=loop)
    except Exception as error:  # named, not raised
        return [f"{protocol.__name__}(...): {error!r}"]
    finally:
        if own is not None:
            own.close()
    return [f"{protocol.__name__}().{name}" for name in attributes
            if not hasattr(instance, name)]


def listen_eagerly(server: uvicorn.Server, sockets: list[socket.socket],
                   hold: bool = True, deadlines: Deadlines | None = None,
                   max_head: int = 0) -> list:
    """EagerListeners on ``sockets`` serving uvicorn's protocol, as uvicorn's own
    startup would build its servers (TLS included: ``config.ssl``), with ``hold`` each
    connection's protocol able to hold a refused connection (``holding``), with
    ``deadlines`` its request's receipt bounded (``deadlined``), with ``max_head`` its
    request heads' bytes (``head_bounded``); RuntimeError naming what of uvicorn is
    missing."""
    problems = surface_problems(server)
    if problems:
        raise RuntimeError(f"uvicorn {uvicorn.__version__} lacks what the eager listener "
                           f"uses: {', '.join(problems)}; start with --listener uvicorn "
                           f"(ORTHORNN_LISTENER=uvicorn)")
    config = server.config
    protocol_class: type = config.http_protocol_class
    if max_head:
        protocol_class = head_bounded(protocol_class, max_head)
    if deadlines is not None:
        protocol_class = deadlined(protocol_class, deadlines, server)
    if hold:  # outside: a held connection's end of response (and phase) waits for the hold
        protocol_class = holding(protocol_class)

    def create_protocol(_loop: asyncio.AbstractEventLoop | None = None
                        ) -> asyncio.Protocol:  # as uvicorn's own startup builds it
        if not hold:
            return protocol_class(config=config, server_state=server.server_state,
                                  app_state=server.lifespan.state, _loop=_loop)
        # the connection's own copy of the lifespan state (complete before any connection),
        # which uvicorn copies into each request's scope["state"]: admission finds the
        # request's connection there, at no cost per request
        state = dict(server.lifespan.state)
        protocol = protocol_class(config=config, server_state=server.server_state,
                                  app_state=state, _loop=_loop)
        state[CONNECTION] = Connection(protocol.hold)
        return protocol

    return [EagerListener(sock, create_protocol, config.backlog, ssl=config.ssl)
            for sock in sockets]


def holding(protocol_class: type) -> type:
    """PROTOCOL_CLASS (uvicorn's httptools or h11 protocol) with ``hold(seconds)``: when the
    response being sent completes, the connection is not read for SECONDS; uvicorn's own
    end of the response (resume reading, start a pipelined request, arm keep-alive) runs
    after them. A connection closed meanwhile (by the server's shutdown) drops the wait."""

    class Holding(protocol_class):
        _hold_s = 0.0
        _held: asyncio.TimerHandle | None = None

        def hold(self, seconds: float) -> None:
            """Hold the connection for SECONDS once the current response is sent."""
            self._hold_s = seconds

        def on_response_complete(self) -> None:
            seconds, self._hold_s = self._hold_s, 0.0
            if seconds <= 0 or self.transport.is_closing():
                return super().on_response_complete()
            self.flow.pause_reading()  # uvicorn's own resume_reading ends it
            self._held = self.loop.call_later(seconds, self._release)

        def _release(self) -> None:
            self._held = None
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._held is not None:
                self._held.cancel()
                self._held = None
            super().connection_lost(exc)

    Holding.__name__ = Holding.__qualname__ = f"Holding{protocol_class.__name__}"
    return Holding


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How long a connection may take to send a request's head (``head_s``) and then its
    body (``body_s``); 0: no limit. ``closed(phase)`` counts each connection closed past
    one, phase "head" or "body"."""

    head_s: float
    body_s: float
    closed: Callable[[str], None]


HEAD, BODY, BUSY, IDLE = "head", "body", "busy", "idle"  # a connection's phases


def _timeout_answer(what: str) -> bytes:
    setting = "header_timeout_s" if what == HEAD else "body_timeout_s"
    body = f'{{"error": "request not received in time: its {what} took longer than '\
           f'{setting}"}}'.encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body


TIMEOUT_ANSWERS = {HEAD: _timeout_answer("head"), BODY: _timeout_answer("body")}


def deadline_problems(server: uvicorn.Server, protocol: type) -> list[str]:
    """What the deadlines need of PROTOCOL (a uvicorn HTTP protocol class) and do not find,
    each named; [] when all is there."""
    problems = [f"{protocol.__name__}.{name}()" for name in DEADLINE_METHODS
                if not callable(getattr(protocol, name, None))]
    return problems or _instance_problems(server, protocol, DEADLINE_ATTRIBUTES)


def with_deadlines(server: uvicorn.Server, deadlines: Deadlines) -> None:
    """Deadlines in uvicorn's own listener (``--listener uvicorn``): its startup builds each
    connection's protocol from ``config.http_protocol_class`` (a class is what
    ``Config(http=...)`` takes too). Call after the config is loaded, before startup."""
    config = server.config
    if not getattr(config.http_protocol_class, "deadlines", None):
        config.http_protocol_class = deadlined(config.http_protocol_class, deadlines, server)


def deadlined(protocol_class: type, deadlines: Deadlines, server: uvicorn.Server) -> type:
    """PROTOCOL_CLASS (uvicorn's httptools or h11 protocol) with a deadline for receiving
    each request's head and one for its body (the module's docstring); RuntimeError naming
    what of uvicorn it lacks."""
    problems = deadline_problems(server, protocol_class)
    if problems:
        raise RuntimeError(f"uvicorn {uvicorn.__version__} lacks what the slow-client "
                           f"deadlines use: {', '.join(problems)}; start with "
                           f"--header-timeout-s 0 --body-timeout-s 0 to serve without them")
    head_s, body_s, closed = deadlines.head_s, deadlines.body_s, deadlines.closed

    class Deadlined(protocol_class):
        _phase = HEAD
        _timer: asyncio.TimerHandle | None = None
        _cycle: Any = None  # the request (uvicorn's cycle) whose head came last
        _heard = False  # a byte of the head being waited for has come

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._time(HEAD, head_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is not self._cycle:  # a request's head was parsed
                previous, self._cycle = self._cycle, cycle
                if previous is not None and not previous.response_complete:
                    self._time(BUSY)  # pipelined: timed when the answer before it is sent
                elif cycle.more_body:
                    self._time(BODY, body_s)
                else:
                    self._time(BUSY)
            elif self._phase is BODY:
                if not cycle.more_body:  # its last byte
                    self._time(BUSY)
            elif self._phase is IDLE:  # a kept-alive connection's next request begins
                self._time(HEAD, head_s)
                self._heard = True
            elif self._phase is HEAD:
                self._heard = True

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request (parsed or not)
            cycle = self._cycle = self.cycle
            if cycle is None or cycle.response_complete or self.transport.is_closing():
                self._time(IDLE)  # uvicorn's keep-alive timer waits for the next one
            elif cycle.more_body:
                self._time(BODY, body_s)
            else:
                self._time(BUSY)

        def handle_websocket_upgrade(self, *args: object) -> None:
            self._time(BUSY)  # the connection is the websocket protocol's from now on
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            self._time(BUSY)
            super().connection_lost(exc)

        def _time(self, phase: str, seconds: float = 0.0) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase, self._heard = phase, False
            if seconds > 0 and not self.transport.is_closing():
                self._timer = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._timer = None
            transport = self.transport
            if transport.is_closing() or getattr(self, "head_refused", False):
                return  # (a 431 lingering: closed when its linger ends)
            phase = self._phase
            closed(phase)
            if phase is HEAD:
                answer = self._heard
            else:  # nothing of an answer sent, none before it still being sent
                answer = not self.cycle.response_started and not getattr(self, "pipeline", ())
            if answer:
                transport.write(TIMEOUT_ANSWERS[phase])
            if transport.get_write_buffer_size():  # a client that reads nothing either
                transport.abort()
            else:
                transport.close()

    Deadlined.deadlines = deadlines
    Deadlined.__name__ = Deadlined.__qualname__ = f"Deadlined{protocol_class.__name__}"
    return Deadlined


def _head_too_large(limit: int) -> bytes:
    body = (f'{{"error": "request head: larger than the limit of {limit} bytes '
            f'(max_header_bytes)"}}').encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body)) + body


def head_bounded(protocol_class: type, limit: int) -> type:
    """PROTOCOL_CLASS (uvicorn's httptools protocol) fed at most LIMIT bytes of each
    request's head: past them the parser is fed nothing more, the client gets 431 and the
    connection is closed after a short linger (its bytes read and dropped, so that the
    client reads the answer instead of a reset). Without it httptools and uvicorn grow the
    head by concatenation, so that a 64 MiB header held the event loop for seconds. A head
    and body that arrive in one read are split at the limit, so a small head with a large
    body costs one slice. h11's protocol has its own bound (``h11_max_incomplete_event_size``,
    400): it is returned as it is, as is a class already bounded."""
    if not callable(getattr(protocol_class, "on_headers_complete", None)) \
            or getattr(protocol_class, "max_head", None):
        return protocol_class
    answer = _head_too_large(limit)

    class HeadBounded(protocol_class):
        max_head = limit
        head_refused = False
        _in_body = False  # between a head's end and its message's end
        _head_left = limit  # bytes the head being received may still take
        _heads = 0  # heads parsed on this connection
        _linger: asyncio.TimerHandle | None = None

        def data_received(self, data: bytes) -> None:
            if self.head_refused:  # lingering: read and dropped
                return
            while not self._in_body and len(data) > self._head_left:
                heads, cut = self._heads, self._head_left
                if cut:
                    self._head_left = 0
                    super().data_received(data[:cut])
                    data = data[cut:]
                    if self.parser is None or self.transport.is_closing():
                        return  # a 400 (a malformed head), or the connection lost
                if self._heads == heads:  # the head goes on past the limit
                    return self._refuse_head()
            if not self._in_body:
                self._head_left -= len(data)
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._heads += 1
            self._in_body, self._head_left = True, limit
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body, self._head_left = False, limit
            super().on_message_complete()

        def _refuse_head(self) -> None:
            self.head_refused = True
            log.debug("a request head over max_header_bytes (%d): 431", limit)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # no answer being sent
                self.transport.write(answer)
            self.flow.resume_reading()
            self._linger = self.loop.call_later(LINGER_S, self.transport.close)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            super().connection_lost(exc)

    HeadBounded.__name__ = HeadBounded.__qualname__ = f"HeadBounded{protocol_class.__name__}"
    return HeadBounded


#: how long a connection refused for its head's size is read (and dropped) before it is
#: closed, so that a client still sending gets the 431 rather than a reset
LINGER_S = 2.0


class EagerListener:
    """Accepts every connection waiting in the listen queue each time it is readable.

    uvloop's libuv accepts one connection per event-loop iteration. Under overload an
    iteration serves a thousand open connections (tens of ms), so new connections wait
    in the kernel's queue for seconds before their first byte is read: with 1,024
    clients reconnecting, p99 reached 7 s though every answer took milliseconds (the
    asyncio loop accepts up to ``backlog`` per readiness, but serves 6x fewer requests).
    Quacks like asyncio.Server for uvicorn's shutdown (close, wait_closed)."""

    RETRY_S = 1.0  # out of descriptors or memory: wait as asyncio does, rather than spin
    OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                 backlog: int,
                 ssl: ssl_module.SSLContext | None = None):
        self.sock, self.protocol_factory, self.backlog = sock, protocol_factory, backlog
        self.ssl = ssl
        self.loop = asyncio.get_running_loop()
        sock.setblocking(False)
        sock.listen(backlog)
        self.loop.add_reader(sock.fileno(), self._accept)
        self.closed = False

    def _accept(self) -> None:
        for _ in range(self.backlog):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno not in self.OUT_OF_RESOURCES:  # one connection's trouble
                    log.debug("accept: %s", error)
                    continue
                log.error("accept failed (%s); pausing new connections for %.0f s",
                          error.strerror or error, self.RETRY_S)
                self.loop.remove_reader(self.sock.fileno())
                self.loop.call_later(self.RETRY_S, self._resume)
                return
            task = self.loop.create_task(
                self.loop.connect_accepted_socket(self.protocol_factory, conn, ssl=self.ssl))
            task.add_done_callback(functools.partial(self._connected, conn))

    def _connected(self, conn: socket.socket, task: asyncio.Task) -> None:
        if task.cancelled():
            conn.close()
        elif task.exception() is not None:
            log.debug("connection setup failed: %s", task.exception())
            conn.close()
        elif self.closed:  # accepted just before shutdown, after uvicorn listed connections
            shutdown = getattr(task.result()[1], "shutdown", None)
            if shutdown is not None:
                shutdown()

    def _resume(self) -> None:
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    async def wait_closed(self) -> None:
        return None


