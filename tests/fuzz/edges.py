"""Fuzz targets for the values a client controls at the edge (issue 59): the OIP request's
``id`` and ``parameters`` through the JSON codec and capture's id check, and a chunked
body's trailers through the server's bounded protocol. Used by fuzz.py's ``oip_fields``
and ``trailers`` targets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import atheris

BAD_HEADER_BYTES = (b"\r", b"\n", b"\0")


def _value(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> Any:
    kind = fdp.ConsumeIntInRange(0, 6 if depth < 2 else 4)
    if kind == 0:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 300))
    if kind == 1:
        return fdp.ConsumeInt(9)
    if kind == 2:
        return fdp.ConsumeRegularFloat()
    if kind == 3:
        return fdp.ConsumeBool()
    if kind == 4:
        return None
    if kind == 5:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return {fdp.ConsumeUnicodeNoSurrogates(8): _value(fdp, depth + 1)
            for _ in range(fdp.ConsumeIntInRange(0, 4))}


def oip_fields_target(data: bytes) -> None:
    """An OIP body, valid but for a fuzzed ``id`` and ``parameters`` (the request's and its
    input's and output's): refused with a 4xx, or taken with an id that an answer header
    and a capture record can hold and parameters of OIP's value kinds; the X-Request-Id
    header through capture's check likewise."""
    from orthornn.service.errors import ServiceError
    from orthornn.service.http.codecs import oip_json
    from orthornn.service.loop.ids import given_id

    fdp = atheris.FuzzedDataProvider(data)
    body: dict[str, Any] = {"inputs": [{"name": "x", "shape": [1, 2, 1], "datatype": "FP32",
                                        "data": [0.5, 1.0]}]}
    if fdp.ConsumeBool():
        body["id"] = _value(fdp) if fdp.ConsumeBool() else \
            fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 200))
    for where in (body, body["inputs"][0]):
        if fdp.ConsumeBool():
            where["parameters"] = {fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 150)):
                                   _value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 70))}
    if fdp.ConsumeBool():
        body["outputs"] = [{"name": "y", "parameters": {
            fdp.ConsumeUnicodeNoSurrogates(4): _value(fdp)
            for _ in range(fdp.ConsumeIntInRange(0, 3))}}]
    raw = json.dumps(body, ensure_ascii=fdp.ConsumeBool()).encode("utf-8", "surrogatepass")
    try:
        got = oip_json.decode(raw, "model", None)
    except ServiceError as error:
        assert error.status < 500, error
    else:
        if got.id is not None:  # what the answer's X-Request-Id and the record will hold
            header = got.id.encode("latin-1")
            assert 0 < len(header) <= 128 and not any(b in header for b in BAD_HEADER_BYTES)
        assert len(got.parameters) <= 64
        assert all(isinstance(v, bool | int | float | str) for v in got.parameters.values())
    header_value = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200))
    try:
        rid = given_id([(b"x-request-id", header_value)])
    except ServiceError as error:
        assert error.status == 400, error
    else:
        assert rid is not None and not any(b in rid for b in BAD_HEADER_BYTES)


class _Transport(asyncio.Transport):
    """What the protocol writes, kept; closing is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closing = bytearray(), False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_write_buffer_size(self) -> int:
        return 0


HEAD = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n")
LIMIT = 4096


def trailers_setup():
    """The target: a chunked request whose trailers are the fuzzer's bytes, fed in pieces
    to the server's protocol (uvicorn's httptools one, head-bounded at LIMIT) with an app
    that reads the body and answers; no exception escapes, the app never sees a header that
    the head did not have, and past the limit the answer is 431."""
    import uvicorn
    from orthornn.service.server.protocol import head_bounded

    seen: list[list] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, http="httptools", log_level="critical", lifespan="off")
    server = uvicorn.Server(config)
    config.load()
    protocol_class = head_bounded(config.http_protocol_class, LIMIT)
    loop = asyncio.new_event_loop()
    head_headers = [(b"host", b"x"), (b"content-type", b"application/json"),
                    (b"transfer-encoding", b"chunked")]

    def feed(trailers: bytes, pieces: int) -> tuple[_Transport, list[list]]:
        """The request with TRAILERS sent in PIECES writes: (what was written back, the
        headers the app saw per request)."""
        seen.clear()

        async def one() -> _Transport:
            protocol = protocol_class(config=config, server_state=server.server_state,
                                      app_state={}, _loop=loop)
            transport = _Transport()
            protocol.connection_made(transport)
            message = HEAD + trailers + b"\r\n"
            size = -(-len(message) // pieces)
            for i in range(0, len(message), size):
                if transport.closing:
                    break
                protocol.data_received(message[i:i + size])
                await asyncio.sleep(0)
            for _ in range(20):  # the app's task
                await asyncio.sleep(0)
            protocol.connection_lost(None)
            return transport

        return loop.run_until_complete(one()), list(seen)

    def target(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        pieces = fdp.ConsumeIntInRange(1, 8)
        trailers = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 3 * LIMIT))
        if fdp.ConsumeBool():  # a long one: the limit's side
            trailers = trailers * (1 + 2 * LIMIT // max(1, len(trailers)))
        transport, seen = feed(trailers, pieces)
        for headers in seen:
            assert headers == head_headers, headers  # a trailer never becomes a header
        if len(trailers) > LIMIT + 64 and transport.written:
            assert transport.written.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 400 ")), \
                bytes(transport.written[:80])

    target.feed = feed  # type: ignore[attr-defined]
    return target
