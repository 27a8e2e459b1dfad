"""Slow clients, bounded (service/server/listener.py, ``deadlined``): a connection gets
``header_timeout_s`` to send a request's head (from the accept, or on a kept-alive
connection from the next request's first byte) and ``body_timeout_s`` for its body; past
either it is closed (408 when a byte came and nothing was answered) and counted in
orthornn_slow_client_closes_total{phase}. Answering (a long request, a streamed answer) and
the idle wait between requests are not covered.

The models do not matter to the deadlines (they live in the protocol, below the app), so
these servers serve an empty repository, and a few test routes (``/test/...``, an ASGI
wrapper around the service) stand in for a request that takes long to answer or streams."""

from __future__ import annotations

import asyncio
import json
import re
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from orthornn.service.settings import Settings

from ..service_helpers import LiveServer, RawConnection, free_port, wait_ready, wait_until

ROOT = Path(__file__).resolve().parents[2]
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
ANSWER_S = 2.0  # how long /test/slow thinks and /test/stream streams: past both deadlines


def closes(url: str) -> dict[str, float]:
    """orthornn_slow_client_closes_total by phase, from the service's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {phase: float(value) for phase, value in re.findall(
        r'orthornn_slow_client_closes_total\{phase="(\w+)"\} ([0-9.e+]+)', text)}


def post(path: str, body: bytes) -> tuple[bytes, bytes]:
    """A POST's head, and its body."""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode(), body


def with_test_routes(app):
    """The service, with /test/slow (the body read, an answer after ANSWER_S: a long
    inference), /test/stream (an answer streamed over ANSWER_S) and /test/echo."""

    async def wrapper(scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/test/"):
            return await app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        path = scope["path"]
        if path == "/test/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(5):
                await asyncio.sleep(ANSWER_S / 5)
                await send({"type": "http.response.body", "body": b"chunk %d;" % i,
                            "more_body": True})
            return await send({"type": "http.response.body", "body": b""})
        if path == "/test/slow":
            await asyncio.sleep(ANSWER_S)
        answer = b"%d bytes" % len(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})

    return wrapper


def test_the_body_deadline_scales_with_the_body_limit(tmp_path):
    assert Settings(repo=tmp_path).header_timeout_s == 10
    assert Settings(repo=tmp_path).body_timeout() == 256  # 16 MiB at 64 KiB/s
    assert Settings(repo=tmp_path, max_body_bytes=1 << 20).body_timeout() == 30
    assert Settings(repo=tmp_path, body_timeout_s=5).body_timeout() == 5
    assert Settings(repo=tmp_path, body_timeout_s=0).body_timeout() == 0  # no limit


def test_the_pinned_uvicorn_has_what_the_deadlines_use():
    import uvicorn
    from orthornn.service.server.protocol import Deadlines, deadline_problems, deadlined
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    server = uvicorn.Server(uvicorn.Config(lambda scope, receive, send: None))
    server.config.load()
    for protocol in (HttpToolsProtocol, H11Protocol):
        assert deadline_problems(server, protocol) == []

    class Changed(H11Protocol):  # a uvicorn whose protocol no longer keeps its cycle
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            del self.cycle

    assert deadline_problems(server, Changed) == ["Changed().cycle"]
    with pytest.raises(RuntimeError, match=r"slow-client deadlines use: Changed\(\)\.cycle; "
                                           r"start with --header-timeout-s 0 --body-timeout-s 0"):
        deadlined(Changed, Deadlines(1, 1, lambda phase: None), server)


@pytest.mark.parametrize(("listener", "http"), [("eager", "httptools"), ("eager", "h11"),
                                                ("uvicorn", "httptools")])
def test_deadlines_cover_receiving_a_request_only(tmp_path, listener, http):
    head_s, body_s = 1.0, 1.5
    live = LiveServer({"http": http}, repo=tmp_path, listener=listener,
                      header_timeout_s=head_s, body_timeout_s=body_s)
    live.server.config.app = with_test_routes(live.app)
    port, results, errors = live.settings.port, {}, []

    def silent():  # connects and sends nothing: closed at the head deadline, unanswered
        c = RawConnection(port, timeout=10)
        start = time.monotonic()
        end, data = c.cut(10)
        results["silent"] = (end - start, data)

    def slow_head():  # a head sent slowly, within the deadline, is served
        c = RawConnection(port, timeout=10)
        c.trickle(LIVE, pieces=4, seconds=0.6 * head_s)
        results["slow head"] = c.answer(10)[0]
        time.sleep(head_s + 0.3)  # idle between requests: not the head deadline
        c.send(LIVE)
        results["after idle"] = c.answer(10)[0]
        time.sleep(0.5)  # (were the deadline counted from the answer, the cut came early)
        c.send(LIVE[:10])  # the next request's head, begun and not finished: cut
        start = time.monotonic()
        end, data = c.cut(10)
        results["keep-alive head"] = (end - start, data)

    def slow_body():
        head, body = post("/test/echo", b"x" * 30)
        c = RawConnection(port, timeout=10)  # within the deadline: served
        c.send(head)
        c.trickle(body, pieces=3, seconds=0.6 * body_s)
        status, _, answer = c.answer(10)
        results["slow body"] = (status, answer)
        c.send(head + body[:5])  # past it: cut, with 408
        start = time.monotonic()
        for i in range(5, 15):  # a byte each 0.4 s until the server answers or closes
            if select.select([c.sock], [], [], 0.4)[0]:
                break
            c.send(body[i:i + 1])
        end, data = c.cut(10)
        results["body"] = (end - start, data)

    def long_answer(path):  # a long inference, a streamed answer: not cut
        c = RawConnection(port, timeout=10)
        start = time.monotonic()
        c.send(b"".join(post(path, b"0123456789")))
        status, _, answer = c.answer(ANSWER_S + 10)
        results[path] = ((status, answer), time.monotonic() - start)
        c.send(LIVE)  # and the connection goes on
        results[path + " then"] = c.answer(10)[0]
        c.close()

    def run(scenario, *args):
        try:
            scenario(*args)
        except Exception as error:  # reported by the test, not lost in a thread
            errors.append(error)

    with live:
        threads = [threading.Thread(target=run, args=s) for s in (
            (silent,), (slow_head,), (slow_body,), (long_answer, "/test/slow"),
            (long_answer, "/test/stream"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        counted = closes(live.url)

    waited, data = results["silent"]
    assert head_s - 0.05 <= waited <= head_s + 1.0 and data == b""  # nothing came: no 408
    assert results["slow head"] == 200 and results["after idle"] == 200
    waited, data = results["keep-alive head"]
    assert head_s - 0.05 <= waited <= head_s + 1.0 and data.startswith(b"HTTP/1.1 408 ")
    assert b"header_timeout_s" in data
    assert results["slow body"] == (200, b"30 bytes")
    waited, data = results["body"]
    assert body_s - 0.05 <= waited <= body_s + 1.0
    assert data.startswith(b"HTTP/1.1 408 ") and b"body_timeout_s" in data
    (status, answer), took = results["/test/slow"]
    # (uvloop's timers count whole milliseconds: a sleep may end up to one early)
    assert (status, answer) == (200, b"10 bytes") and took >= ANSWER_S - 0.002
    (status, answer), took = results["/test/stream"]
    assert status == 200 and answer == b"".join(b"chunk %d;" % i for i in range(5))
    assert took >= ANSWER_S - 0.002
    assert results["/test/slow then"] == results["/test/stream then"] == 200
    assert counted == {"head": 2, "body": 1}


#: The trickling clients, a process of their own (the standard library only), so that
#: their work does not share an interpreter lock with the normal clients. argv: port,
#: connections, seconds between bytes, the head they trickle (never all of it). Each line
#: read, SECONDS, is a wave: the connections are opened, each replaced when the server
#: closes it, for SECONDS; then the tricklers close those left themselves. A line "wave"
#: says it has begun (before the first connection), then one JSON line answers:
#: {"cuts": [[seconds from connect to the server's close, what the server sent first],
#: ...], "left": [seconds each connection closed by the trickler had been open]}.
TRICKLER = r"""
import json, selectors, socket, sys, time

port, count, interval = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
head = sys.argv[4].encode()


def wave(seconds):
    selector, alive, cuts = selectors.DefaultSelector(), {}, []

    def connect():
        connected = time.monotonic()  # before: the server's timer starts after it
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        sock.send(head[:1])
        alive[sock] = [connected, 1, time.monotonic() + interval]
        selector.register(sock, selectors.EVENT_READ)

    for _ in range(count):
        connect()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for key, _ in selector.select(0.01):
            sock = key.fileobj
            connected = alive.pop(sock)[0]
            selector.unregister(sock)
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            cuts.append([time.monotonic() - connected, data[:13].decode("latin-1")])
            sock.close()
            connect()
        now = time.monotonic()
        for sock, state in alive.items():
            if state[2] <= now and state[1] < len(head) - 1:
                try:
                    sock.send(head[state[1]:state[1] + 1])
                except OSError:
                    continue  # closed: its readable event says when
                state[1] += 1
                state[2] += interval
    now = time.monotonic()
    for sock in alive:
        sock.close()
    return {"cuts": cuts, "left": [now - state[0] for state in alive.values()]}


for line in sys.stdin:
    print("wave", flush=True)
    print(json.dumps(wave(float(line))), flush=True)
"""


#: The normal clients, a process of their own: COUNT keep-alive connections (argv: port,
#: count), each sending /v2/health/live again as soon as its answer has come. Each line
#: read is answered with the number of answers so far.
NORMAL = r"""
import re, selectors, socket, sys

port, count = int(sys.argv[1]), int(sys.argv[2])
request = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
selector, answered, size = selectors.DefaultSelector(), 0, None
for _ in range(count):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    sock.send(request)
    selector.register(sock, selectors.EVENT_READ, bytearray())
selector.register(sys.stdin, selectors.EVENT_READ, None)
while True:
    for key, _ in selector.select():
        if key.data is None:  # a line from the test: the answers so far
            if not sys.stdin.readline():
                sys.exit(0)
            print(answered, flush=True)
            continue
        buffer = key.data
        chunk = key.fileobj.recv(65536)
        if not chunk:
            sys.exit("closed by the server")
        buffer += chunk
        if size is None and b"\r\n\r\n" in buffer:
            head = bytes(buffer).split(b"\r\n\r\n", 1)[0]
            assert head.startswith(b"HTTP/1.1 200 "), head
            size = len(head) + 4 + int(re.search(rb"(?i)content-length: *([0-9]+)", head)[1])
        while size is not None and len(buffer) >= size:
            del buffer[:size]
            answered += 1
            key.fileobj.send(request)
"""


def test_trickling_clients_are_cut_at_the_deadline_others_keep_their_throughput(tmp_path):
    """Waves of 300 connections trickling a request's head (a byte a second; each
    replaced when cut) are all cut at the head deadline and counted, while 8 keep-alive
    connections keep being answered: at least half the throughput they have alone.

    The server (`orthornn serve`: the flag sets the deadline), the normal clients and
    the tricklers each run in a process of their own, so that none shares another's
    interpreter. The machine may be busy with other work that comes and goes (a 2-core
    CI runner, other test runs), which moves throughput by far more than 10% from one
    second to the next, and now and then halves it: so alone and beside are measured in
    turns, PAIRS times (alone 0.6 s, then beside the tricklers 2.1 s: their connecting,
    their bytes and their cut at the 2 s deadline), and the median of the pairs' ratios is
    what must reach 0.5: a change of load between pairs cancels, and a few disturbed pairs
    do not count. Tricklers cost the server mostly per connection (accepted, then closed
    at the deadline): 300 of them are 30 connections a second at the default 10 s, 150 at
    this test's 2 s; at 1 s (300 a second) they took about 5% of the throughput. The
    bound is half, not 0.9, because on 2 cores the trickler process itself takes CPU from
    the server: one clean-clone CI run measured a median of 0.85 (pairs 0.73-1.20) where
    others passed 0.9; a server that waited on a trickler (a blocking read, a slot held)
    would fall to near nothing."""
    head_s, tricklers, pairs = 2.0, 300, 6
    port = free_port()
    (tmp_path / "repo").mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "orthornn", "serve", "--repo", str(tmp_path / "repo"),
         "--port", str(port), "--header-timeout-s", str(head_s), "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    processes = [server]
    url = f"http://127.0.0.1:{port}"
    ratios, cuts, left = [], [], []
    try:
        wait_ready(server, url, timeout=60)
        attack = subprocess.Popen(
            [sys.executable, "-c", TRICKLER, str(port), str(tricklers), "1", LIVE.decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        normal = subprocess.Popen([sys.executable, "-c", NORMAL, str(port), "8"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        processes += [attack, normal]

        def answered() -> tuple[int, float]:
            normal.stdin.write("\n")
            normal.stdin.flush()
            return int(normal.stdout.readline()), time.monotonic()

        def rate(seconds: float) -> float:
            count, start = answered()
            time.sleep(seconds)
            count_end, end = answered()
            return (count_end - count) / (end - start)

        # warmed up: every normal connection open and answered again and again
        wait_until(lambda: answered()[0] >= 400, timeout=60, what="400 normal answers")
        for _ in range(pairs):
            alone = rate(0.6)
            attack.stdin.write("2.2\n")  # a wave: 300 connections, replaced for 2.2 s
            attack.stdin.flush()
            assert attack.stdout.readline() == "wave\n"  # begun: connecting
            ratios.append(rate(2.1) / alone)
            wave = json.loads(attack.stdout.readline())
            cuts += wave["cuts"]
            left += wave["left"]
        # every cut counted once the server has seen each connection closed (no more after)
        wait_until(lambda: closes(url).get("head", 0) >= len(cuts), timeout=10,
                   what=lambda: f"{len(cuts)} head cuts counted, not {closes(url)}")
        counted = closes(url)
    finally:
        for proc in reversed(processes):
            proc.kill()
            proc.wait(10)
    assert len(cuts) >= pairs * tricklers
    held = [seconds for seconds, _ in cuts]
    assert min(held) >= head_s - 0.01 and max(held) <= head_s + 1.0, (min(held), max(held))
    assert max(left) < head_s + 1.0  # none outlived the deadline
    assert {sent for _, sent in cuts} <= {"", "HTTP/1.1 408 "}
    assert counted == {"head": len(cuts), "body": 0}
    print(f"throughput beside/alone {[round(r, 2) for r in ratios]}; {len(cuts)} "
          f"tricklers cut after {min(held):.2f}-{max(held):.2f} s")
    assert statistics.median(ratios) >= 0.5, ratios


# -- a 64 MiB head beside liveness probes (from test_service_limits.py: it bounds a latency)

def test_a_64_mib_head_gets_431_while_liveness_answers_within_100_ms(tmp_path):
    """`orthornn serve` (a process of its own); a 64 MiB header sent on one connection is
    refused with 431 (JSON, naming the limit) once 64 KiB of it have come, and read no
    further; a probe of /v2/health/live on another connection meanwhile is answered within
    100 ms each time."""
    port = free_port()
    (tmp_path / "repo").mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "orthornn", "serve", "--repo", str(tmp_path / "repo"),
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    result: dict = {}
    try:
        wait_ready(server, url, timeout=60)
        probe = RawConnection(port, timeout=10)
        probe.send(LIVE)
        assert probe.answer()[0] == 200

        # built before the probes start: making 64 MiB in this process would hold the GIL
        # and delay the probe (CI measured 0.19 s for the first one so)
        head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 20) \
            + b"\r\n\r\n"

        def big_head():
            c = RawConnection(port, timeout=20)
            start = time.monotonic()
            try:
                c.send(head)
            except OSError as error:  # (closed after its linger: a reset)
                result["send"] = repr(error)
            result["answer"] = c.answer(20)
            result["took"] = time.monotonic() - start
            c.close()

        sender = threading.Thread(target=big_head)
        sender.start()
        latencies = []
        while sender.is_alive() or len(latencies) < 20:
            start = time.perf_counter()
            probe.send(LIVE)
            assert probe.answer(5)[0] == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
        sender.join()
    finally:
        server.kill()
        server.wait(10)
    status, headers, body = result["answer"]
    assert status == 431 and headers["connection"] == "close"
    assert "max_header_bytes" in json.loads(body)["error"]
    print(f"431 after {result['took']:.3f} s; liveness meanwhile: {len(latencies)} probes, "
          f"median {1000 * statistics.median(latencies):.1f} ms, "
          f"max {1000 * max(latencies):.1f} ms")
    assert max(latencies) < 0.1, latencies
