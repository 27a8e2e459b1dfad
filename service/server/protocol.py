"""uvicorn's HTTP protocol class, extended: the read deadlines of a connection's phases
(head, body) and the bound on request heads' bytes, and the checks that what they use of
uvicorn is there (the reasoning: docs/design.md, "The listener")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

log = logging.getLogger("orthornn.service")
#: how long a connection refused for its head stays open for the answer to leave
LINGER_S = 2.0
#: what the deadlines use of a protocol (beyond what the listener checks)
DEADLINE_METHODS = ("connection_made", "data_received", "on_response_complete",
                    "connection_lost")
DEADLINE_ATTRIBUTES = ("cycle", "transport", "loop")


def instance_problems(server: uvicorn.Server, protocol: type,
                      attributes: tuple[str, ...]) -> list[str]:
    """The ATTRIBUTES an instance of PROTOCOL, built as for a connection, lacks."""
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
    return problems or instance_problems(server, protocol, DEADLINE_ATTRIBUTES)


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
            _close_late(self, closed)

    Deadlined.deadlines = deadlines
    Deadlined.__name__ = Deadlined.__qualname__ = f"Deadlined{protocol_class.__name__}"
    return Deadlined


def _close_late(protocol: Any, closed: Callable[[str], None]) -> None:
    """PROTOCOL's deadline passed: counted (CLOSED), answered 408 when the client can
    still read one (a byte of the head came; nothing of an answer sent, none before it
    still being sent), and the connection closed (aborted when it reads nothing either)."""
    transport = protocol.transport
    if transport.is_closing() or getattr(protocol, "head_refused", False):
        return  # (a 431 lingering: closed when its linger ends)
    phase = protocol._phase
    closed(phase)
    if phase is HEAD:
        answer = protocol._heard
    else:
        answer = not protocol.cycle.response_started and not getattr(protocol, "pipeline", ())
    if answer:
        transport.write(TIMEOUT_ANSWERS[phase])
    if transport.get_write_buffer_size():
        transport.abort()
    else:
        transport.close()


def _head_too_large(limit: int) -> bytes:
    body = (f'{{"error": "request head: larger than the limit of {limit} bytes '
            f'(max_header_bytes)"}}').encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body)) + body


def _answer_refused(protocol: Any, answer: bytes) -> None:
    """ANSWER (431) on PROTOCOL's connection, unless an answer is being sent: a head past
    the limit, or a request's trailers, whose request is then ended for the app as if the
    client had gone."""
    cycle = protocol.cycle
    if cycle is None or cycle.response_complete:  # no answer being sent
        protocol.transport.write(answer)
    elif protocol._in_body and not cycle.response_started:  # its trailers
        cycle.disconnected = True
        cycle.message_event.set()
        protocol.transport.write(answer)


def head_bounded(protocol_class: type, limit: int) -> type:
    """PROTOCOL_CLASS (uvicorn's httptools protocol) fed at most LIMIT bytes of each
    request's head: past them the parser is fed nothing more, the client gets 431 and the
    connection is closed after a short linger (its bytes read and dropped, so that the
    client reads the answer instead of a reset). Without it httptools and uvicorn grow the
    head by concatenation, so that a 64 MiB header held the event loop for seconds. A head
    and body that arrive in one read are split at the limit, so a small head with a large
    body costs one slice. A chunked body's trailers get a limit of their own, the same, and
    are dropped. h11's protocol has its own bound (``h11_max_incomplete_event_size``,
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

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._in_body:
                return super().on_header(name, value)
            # a chunked body's trailer field: bounded like a head (LIMIT bytes for a
            # message's trailers), and dropped (RFC 9110 6.5.1): httptools hands it over as
            # a header, which uvicorn appended to the request's headers, so that the app,
            # which reads a body before routing it, saw a trailer as a header (16 MiB of
            # them: 225 MiB of memory, answered 200)
            self._head_left -= len(name) + len(value) + 4  # ": " and CRLF
            if self._head_left < 0 and not self.head_refused:
                self._refuse_head()

        def on_message_complete(self) -> None:
            self._in_body, self._head_left = False, limit
            super().on_message_complete()

        def _refuse_head(self) -> None:
            self.head_refused = True
            log.debug("a request head or trailer over max_header_bytes (%d): 431", limit)
            _answer_refused(self, answer)
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
