"""The eager listener, and every use of uvicorn beyond its public surface, in one place
(the reasoning: docs/design.md, "The listener")."""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import logging
import socket
import ssl as ssl_module
from collections.abc import Callable

import uvicorn

from ..http.admission import CONNECTION, Connection
from .protocol import Deadlines, deadlined, head_bounded, instance_problems

log = logging.getLogger("orthornn.service")

#: the protocol class's constructor parameters this module passes
PROTOCOL_PARAMETERS = ("config", "server_state", "app_state", "_loop")
#: what holding uses of a protocol: methods it overrides, attributes its instances have
PROTOCOL_METHODS = ("on_response_complete", "connection_lost")
PROTOCOL_ATTRIBUTES = ("flow", "transport", "loop")
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
        # built as for a connection
        problems += instance_problems(server, protocol, PROTOCOL_ATTRIBUTES)
    return problems


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


