"""Goodput under overload: admission refuses over max_inflight_requests with 503 +
Retry-After, and the eager listener then holds the refused connection (reads nothing more
from it) until Retry-After has passed, so a client that retries at once waits in TCP
instead of costing the server another refusal; the retry, if every slot is taken, waits
for the next one ahead of new requests. Behaviour only, never timings: "not read" shows
as no answer while a slot is free, and as no second refusal while none is."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from orthornn.service.http.admission import CONNECTION, Admission, Connection
from orthornn.service.http.counting import RequestCounts
from orthornn.service.http.routing import RouteTable
from orthornn.service.metrics import Metrics

from ..service_helpers import LiveServer, RawConnection, make_repo

ROOT = Path(__file__).resolve().parents[2]
BODY = json.dumps({"model": "digits", "inputs": [[0.1, 0.2, 0.3]]}).encode()



def _admission(app, max_inflight: int = 1) -> Admission:
    metrics = Metrics()
    return Admission(app, RouteTable([]), metrics, RequestCounts(metrics), max_body=lambda: 1024,
                     max_inflight=max_inflight)

def post(body: bytes = BODY, path: str = "/predict") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Slot:
    """A /predict that holds one in-flight slot until release(): its body is in and its
    answer waits, the service's dataplane gated for it (the request's top_k numbers its
    gate). A body sent slowly holds no slot: admission takes one once the body is in, so
    ``taken`` is set once the request has reached its gate (in the dataplane)."""

    def __init__(self, live: LiveServer):
        dataplane = live.app.state.dataplane
        gates = getattr(dataplane, "test_gates", None)
        if gates is None:
            gates = dataplane.test_gates = {}
            predict = dataplane.predict

            async def gated(req, *args, **kwargs):
                slot = gates.get(req.top_k)
                if slot is not None:
                    slot.taken.set()
                    while not slot.gate.is_set():
                        await asyncio.sleep(0.005)
                return await predict(req, *args, **kwargs)

            dataplane.predict = gated
        number = len(gates) + 1
        self.gate, self.taken = threading.Event(), threading.Event()
        gates[number] = self
        self.client = RawConnection(live.settings.port)
        self.client.send(post(json.dumps({"model": "digits", "inputs": [[0.1, 0.2, 0.3]],
                                          "top_k": number}).encode()))

    def release(self) -> int:
        self.gate.set()
        status = self.client.answer()[0]
        self.client.close()
        return status


def refusals(url: str) -> int:
    """503s counted for /predict so far (the service's own metrics)."""
    text = httpx.get(url + "/metrics").text
    found = re.search(r'orthornn_requests_total\{endpoint="/predict",model="_unknown",'
                      r'status="503"[^}]*\} ([0-9.]+)', text)
    return int(float(found.group(1))) if found else 0


def overloaded(live: LiveServer) -> Slot:
    """Take the only slot (max_inflight_requests=1) and wait until admission refuses."""
    slot = Slot(live)
    deadline = time.time() + 30
    while True:  # a fresh connection each try: a refused one is held
        probe = RawConnection(live.settings.port)
        probe.send(post())
        status = probe.answer()[0]
        probe.close()
        if status == 503:
            return slot
        assert time.time() < deadline, "the slow request never took the slot"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("overload"), {"digits": [1]})


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_refused_connection_is_not_read_until_retry_after_then_served(repo, http):
    with LiveServer({"http": http}, repo=repo, max_inflight_requests=1) as live:
        slot = overloaded(live)
        before = refusals(live.url)
        client = RawConnection(live.settings.port)
        sent = time.monotonic()  # the hold starts after the refusal: after this
        client.send(post())
        status, headers, body = client.answer()
        assert status == 503 and headers["retry-after"] == "1"
        assert "overloaded" in json.loads(body)["error"]
        # retried at once while the slot is still taken: were it read, it would be
        # refused again at once; held, it gets no answer and costs no refusal
        client.send(post())
        assert client.silent(0.4)
        assert refusals(live.url) == before + 1
        # the slot is free now, yet the held request waits for Retry-After, then is served
        assert slot.release() == 200
        assert client.silent(max(0.05, sent + 0.8 - time.monotonic()))
        status, _, body = client.answer(10)
        assert status == 200 and json.loads(body)["model"] == "digits"
        assert time.monotonic() - sent >= 0.95
        # served: the connection is read as usual again
        client.send(post())
        assert client.answer(5)[0] == 200
        client.close()


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_requests_pipelined_behind_a_refusal_wait_then_are_served(repo, http):
    with LiveServer({"http": http}, repo=repo, max_inflight_requests=1) as live:
        slot = overloaded(live)
        client = RawConnection(live.settings.port)
        sent = time.monotonic()  # the hold starts after the refusal: after this
        client.send(post() + post() + post())  # three requests in one write
        assert client.answer()[0] == 503
        assert slot.release() == 200
        assert client.silent(max(0.05, sent + 0.8 - time.monotonic()))
        assert [client.answer(10)[0] for _ in range(2)] == [200, 200]
        assert time.monotonic() - sent >= 0.95
        client.close()


def test_health_and_metrics_stay_answered_under_overload(repo):
    with LiveServer(repo=repo, max_inflight_requests=1) as live:
        slot = overloaded(live)
        held = []
        for _ in range(20):  # twenty refused (and held) connections, each retrying at once
            client = RawConnection(live.settings.port)
            client.send(post())
            assert client.answer()[0] == 503
            client.send(post())
            held.append(client)
        with httpx.Client(base_url=live.url, timeout=5) as http:
            for _ in range(5):
                assert http.get("/v2/health/ready").status_code == 200
                assert http.get("/v2/health/live").status_code == 200
                assert http.get("/metrics").status_code == 200
        # each held request is read after its Retry-After: answered (served, or refused
        # again when another took the slot at that moment), none lost
        assert slot.release() == 200
        statuses = [c.answer(10)[0] for c in held]
        assert set(statuses) <= {200, 503} and 200 in statuses
        for c in held:
            c.close()


def test_nothing_is_refused_while_a_slot_is_free(repo):
    with LiveServer(repo=repo, max_inflight_requests=3) as live:
        slots = [Slot(live), Slot(live)]  # two of three taken
        for s in slots:
            assert s.taken.wait(30), "a slot's request never reached the dataplane"
        with httpx.Client(base_url=live.url, timeout=10) as http:
            for _ in range(10):  # the third slot, again and again, health probes beside
                assert http.post("/predict", content=BODY).status_code == 200
                assert http.get("/v2/health/ready").status_code == 200

        async def burst():  # three at once, when none is taken
            async with httpx.AsyncClient(base_url=live.url, timeout=10) as http:
                answers = await asyncio.gather(*(http.post("/predict", content=BODY)
                                                 for _ in range(3)))
            return [a.status_code for a in answers]

        assert [s.release() for s in slots] == [200, 200]
        for _ in range(5):
            assert asyncio.run(burst()) == [200, 200, 200]
        assert refusals(live.url) == 0


@pytest.mark.parametrize("options", [{"listener": "uvicorn"}, {"hold_refused": False}],
                         ids=["uvicorn listener", "hold off"])
def test_without_the_hold_a_refused_connection_is_read_at_once(repo, options):
    """uvicorn's own listener (the fallback: its protocol offers no hold) and
    --no-hold-refused: refusals as before, the next request read and answered at once."""
    with LiveServer(repo=repo, max_inflight_requests=1, **options) as live:
        slot = overloaded(live)
        client = RawConnection(live.settings.port)
        client.send(post())
        status, headers, _ = client.answer()
        assert status == 503 and headers["retry-after"] == "1"
        client.send(post())
        assert client.answer(5)[0] == 503  # read at once: refused again
        assert slot.release() == 200
        client.send(post())
        assert client.answer(5)[0] == 200
        client.close()


def test_shutdown_closes_a_held_connection_at_once(repo):
    live = LiveServer(repo=repo, max_inflight_requests=1)
    with live:
        slot = overloaded(live)
        client = RawConnection(live.settings.port)
        client.send(post())
        assert client.answer()[0] == 503
        slot.release()
        live.server.should_exit = True  # uvicorn's shutdown closes idle connections
        assert client.closed(0.8)  # before Retry-After: not waited for
    client.close()


def test_admission_asks_for_the_hold_only_when_it_refuses():
    held: list[float] = []
    sent: list[dict] = []

    slots_taken: list[int] = []

    async def app(scope, receive, send):
        slots_taken.append(admission.inflight)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    admission = _admission(app)

    connection = Connection(held.append)

    def scope(path="/predict"):
        return {"type": "http", "method": "POST", "path": path, "headers": [],
                "state": {CONNECTION: connection}}

    asyncio.run(admission(scope(), receive, send))
    assert held == [] and sent[0]["status"] == 200 and slots_taken == [1]
    admission.inflight = 1  # the only slot taken
    asyncio.run(admission(scope("/v2/health/ready"), receive, send))
    # exempt: answered, not held, and takes no slot
    assert held == [] and sent[2]["status"] == 200 and slots_taken == [1, 1]
    asyncio.run(admission(scope(), receive, send))
    assert sent[4]["status"] == 503 and dict(sent[4]["headers"])[b"retry-after"] == b"1"
    # held for Retry-After, plus a random part, so that those refused together spread out
    assert len(held) == 1 and 1 <= held[0] < 1 + Admission.RETRY_JITTER_S
    del sent[:]  # a server without the hold: refused all the same
    asyncio.run(admission({**scope(), "state": {}}, receive, send))
    assert sent[0]["status"] == 503 and len(held) == 1


def test_a_protocol_without_what_holding_uses_is_named():
    from orthornn.service.server.listener import surface_problems

    class Protocol:  # a uvicorn whose protocol lost on_response_complete
        def __init__(self, config, server_state, app_state, _loop):
            pass

        def connection_lost(self, exc):
            pass

    class Server:
        config = type("Config", (), {"http_protocol_class": Protocol})()
        server_state = object()
        lifespan = type("Lifespan", (), {"state": {}})()
        servers: ClassVar[list] = []

    assert surface_problems(Server()) == ["Protocol.on_response_complete()"]
    Protocol.on_response_complete = lambda self: None  # type: ignore[attr-defined]
    assert surface_problems(Server()) == ["Protocol().flow", "Protocol().transport",
                                          "Protocol().loop"]


def _answered():
    import importlib.util

    spec = importlib.util.spec_from_file_location("answered",
                                                  ROOT / "bench" / "load" / "answered.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_health_probe_and_the_goodput_line(repo, tmp_path):
    answered = _answered()
    out = tmp_path / "health.json"
    with LiveServer(repo=repo) as live:
        assert answered.main(["--connections", "0", "--health", live.url + "/v2/health/ready",
                              "--seconds", "0.3", "--health-interval-ms", "20",
                              "--json", str(out)]) == 0
    health = json.loads(out.read_text())["health"]
    assert set(health) == {"200"} and 5 <= health["200"]["requests"] <= 20  # paced

    def level(c, requests, refused, rps):
        return {"concurrency": c, "requests": requests, "duration_s": 10.0, "rps": rps,
                "p99_ms": 50.0, "errors": {"status": refused, "connect": 0, "read": 1},
                "error_total": refused + 1}

    (tmp_path / "orthornn.json").write_text(json.dumps({"levels": [level(32, 10000, 0, 1000)]}))
    (tmp_path / "orthornn-overload.json").write_text(json.dumps(
        {"levels": [level(256, 1, 0, 0.1), level(1024, 12000, 4000, 1200)]}))
    (tmp_path / "health.json").write_text(out.read_text())
    assert answered.main(["--goodput", str(tmp_path), "--json", str(tmp_path / "g.json")]) == 0
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["c32_rps"] == 1000 and g["overload"]["served_rps"] == 800
    assert g["overload"]["served_ratio"] == 0.8 and g["overload"]["refused_rps"] == 400
    assert g["overload"]["connection_errors"] == 1 and "probed" not in g
    assert g["health"]["200"]["requests"] == health["200"]["requests"]
    # beside the probes: the server's goodput counts the probe's 200s too
    (tmp_path / "orthornn-overload-probed.json").write_text(json.dumps(
        {"levels": [level(1024, 11000, 4000, 1100)]}))
    (tmp_path / "answered.json").write_text(json.dumps({"seconds": 8.0, "by_status": {
        "200": {"requests": 800, "p50_ms": 40.0, "p90_ms": 60.0, "p99_ms": 1100.0,
                "max_ms": 1200.0},
        "503": {"requests": 400, "p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0,
                "max_ms": 4.0}}}))
    assert answered.main(["--goodput", str(tmp_path), "--json", str(tmp_path / "g.json")]) == 0
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["probed"]["wrk_served_rps"] == 700 and g["probed"]["probe_served_rps"] == 100
    assert g["probed"]["served_rps"] == 800 and g["probed"]["served_ratio"] == 0.8
    assert g["served_latency"]["p99_ms"] == 1100.0 and g["probe_errors"] == 0


def test_a_retry_waits_for_the_next_slot_ahead_of_new_requests():
    """The connection being served sends its next request the moment its answer arrives,
    before a held connection's retry can take the slot: without a turn for retries the
    same connections would keep the slots and the others be refused at every retry."""
    order: list[str] = []

    async def main():
        gates: dict[str, asyncio.Event] = {}

        async def app(scope, receive, send):
            name = scope["name"]
            gates[name] = asyncio.Event()
            await gates[name].wait()
            order.append(name)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        admission = _admission(app)
        winner, other = Connection(lambda s: None), Connection(lambda s: None)
        statuses: dict[str, int] = {}

        def request(name, connection):
            async def send(message):
                if message["type"] == "http.response.start":
                    statuses[name] = message["status"]

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            scope = {"type": "http", "method": "POST", "path": "/predict", "headers": [],
                     "name": name, "state": {CONNECTION: connection}}
            return asyncio.create_task(admission(scope, receive, send))

        async def settle():
            for _ in range(5):
                await asyncio.sleep(0)

        first = request("winner 1", winner)
        await settle()
        await request("other 1", other)  # refused: the slot is taken
        assert statuses["other 1"] == 503 and other.refused
        retry = request("other 2 (retry)", other)  # after Retry-After: waits, not refused
        await settle()
        assert "other 2 (retry)" not in statuses and not other.refused
        gates["winner 1"].set()
        await first  # its slot goes to the retry...
        await request("winner 2", winner)  # ...so the winner's next request is refused
        assert statuses["winner 2"] == 503
        await settle()
        gates["other 2 (retry)"].set()
        await retry
        assert statuses["other 2 (retry)"] == 200 and admission.inflight == 0
        # with nothing waiting, a request takes a free slot at once
        third = request("winner 3", winner)
        await settle()
        gates["winner 3"].set()
        await third
        assert statuses["winner 3"] == 200 and admission.inflight == 0

    asyncio.run(main())
    assert order == ["winner 1", "other 2 (retry)", "winner 3"]


def test_a_retry_that_finds_the_slot_taken_waits_for_it_instead_of_a_refusal(repo):
    with LiveServer(repo=repo, max_inflight_requests=1) as live:
        slot = overloaded(live)
        client = RawConnection(live.settings.port)
        client.send(post())
        assert client.answer()[0] == 503
        refused_at = time.monotonic()
        before = refusals(live.url)
        client.send(post())  # the retry: read after Retry-After, the slot still taken
        assert client.silent(max(0.05, refused_at + 1.4 - time.monotonic()))
        assert refusals(live.url) == before  # read by now, and waiting: not refused
        newcomer = RawConnection(live.settings.port)
        newcomer.send(post())
        assert newcomer.answer()[0] == 503  # a new request does not go ahead of it
        assert slot.release() == 200  # the slot passes to the retry
        assert client.answer(10)[0] == 200
        client.close()
        newcomer.close()
