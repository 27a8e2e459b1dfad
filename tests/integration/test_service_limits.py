"""Sizes and slowness a client controls, bounded before they cost the service (issue 41):
request heads (``max_header_bytes``: 431, the event loop never held by one client's
head), request bodies received before admission (a slot is taken once the body is in:
slow bodies hold none; ``max_receiving_bytes`` bounds them together), a language model's
per-step outputs (``max_lm_output_bytes``: 413 before the model runs), and the draining
server's ``Connection: close``. Against real servers on loopback."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import select
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from orthornn.service.dataplane.checks import JSON_VALUE_BYTES

from ..service_helpers import LiveServer, RawConnection, make_repo, wait_until

ROOT = Path(__file__).resolve().parents[2]
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
BODY = json.dumps({"model": "digits", "inputs": [[0.1, 0.2, 0.3]]}).encode()


def post(body: bytes, path: str = "/predict", length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
            ).encode() + body


def rss() -> int:
    """This process's resident set, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("limits"),
                     {"digits": [1], "words": [1]})


# -- request heads (the 64 MiB head beside liveness probes, which bounds a latency, is in
# test_slow_clients.py: it runs alone) -------------------------------------------------------

@pytest.mark.parametrize("listener", ["eager", "uvicorn"])
def test_heads_within_the_limit_are_served_and_one_past_it_is_refused(tmp_path, listener):
    limit = 4096
    with LiveServer(repo=tmp_path, listener=listener, max_header_bytes=limit) as live:
        port = live.settings.port
        c = RawConnection(port)
        # a head just within the limit, then one past it trickled in small pieces
        fill = limit - len(LIVE) - len("X-Fill: \r\n") - 16
        c.send(LIVE[:-2] + b"X-Fill: " + b"a" * fill + b"\r\n\r\n")
        assert c.answer()[0] == 200
        # a small head with a body far beyond the limit, in one write: split, not refused
        body = json.dumps({"model": "nothing", "pad": "x" * (8 * limit)}).encode()
        c.send(post(body))
        status, _, answer = c.answer()
        assert status in (400, 404) and "error" in json.loads(answer), answer  # the app's
        c.trickle(LIVE[:-2] + b"X-Fill: " + b"a" * (2 * limit), pieces=8, seconds=0.2)
        status, headers, answer = c.answer()
        assert status == 431 and headers["connection"] == "close"
        assert f"limit of {limit} bytes" in json.loads(answer)["error"]
        assert c.closed(5)
        c.close()
        # pipelined requests after a refusal are not read; others are served
        assert httpx.get(live.url + "/v2/health/live").status_code == 200


def chunked(path: str, body: bytes, trailers: bytes) -> bytes:
    """A POST of BODY in one chunk, then the last chunk and TRAILERS (CRLF-ended lines)."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n").encode() + body + \
        b"\r\n0\r\n" + trailers + b"\r\n"


@pytest.mark.parametrize("listener", ["eager", "uvicorn"])
def test_trailers_are_bounded_like_heads_and_never_read_as_headers(tmp_path, listener):
    """Issue 59, finding 4, replayed: 16 MiB of trailer lines after the last chunk were
    parsed into the request's headers (memory +225 MiB, answered 200), and a trailer was
    read as a header, so that an Authorization sent after the body passed the token check.
    Now trailers are dropped, and past max_header_bytes the request gets 431."""
    limit = 4096
    with LiveServer(repo=tmp_path, listener=listener, max_header_bytes=limit,
                    admin_token="the-admin-token-of-this-test") as live:
        c = RawConnection(live.settings.port)
        c.send(chunked("/v2/repository/index", b"{}",
                       b"Authorization: Bearer the-admin-token-of-this-test\r\n"))
        status, _, answer = c.answer()
        assert status == 401, answer  # the trailer is no header: the token was not sent
        c.send(chunked("/v2/repository/index", b"{}", b""))  # the connection goes on
        assert c.answer()[0] == 401
        c.trickle(chunked("/predict", BODY, b"X-Fill: a\r\n" * (limit // 8)), pieces=8,
                  seconds=0.2)
        status, headers, answer = c.answer()
        assert status == 431 and headers["connection"] == "close", answer
        assert f"limit of {limit} bytes" in json.loads(answer)["error"]
        assert c.closed(5)
        c.close()
        assert httpx.get(live.url + "/v2/health/live").status_code == 200


def test_the_h11_protocol_bounds_heads_itself(tmp_path):
    with LiveServer({"http": "h11"}, repo=tmp_path, max_header_bytes=4096) as live:
        c = RawConnection(live.settings.port)
        # (h11 bounds what it holds of an incomplete head: a head that arrives whole in
        # one read is parsed whatever its size, within one read's bytes)
        with contextlib.suppress(OSError):  # refused and closed before the last pieces
            c.trickle(LIVE[:-2] + b"X-Fill: " + b"a" * 8192, pieces=8, seconds=0.2)
        try:
            _, data = c.cut(5)
        except OSError:
            data = b""
        assert data == b"" or data.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 431 ")), data
        c.close()


# -- slow bodies -----------------------------------------------------------------------------

def _admission(app):
    """The app's Admission middleware (its state: the bodies being received), once the
    server has built the middleware stack."""
    from orthornn.service.http.admission import Admission

    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, Admission):
        layer = getattr(layer, "app", None)
    assert layer is not None, "no Admission in the middleware stack"
    return layer


def test_bodies_holding_the_shared_budget_are_evicted_before_others_are_refused(
        repo, monkeypatch):
    """Issue 59, finding 1, replayed at a small scale: connections that send most of a
    large body and then trickle held all of max_receiving_bytes, and every other request
    got 503 while they lasted (40 of 40 over 20 s). Now a body that comes whole is never
    refused for them (a body's worth of the budget is kept free), and a body that arrives
    in pieces, once the holders are past the grace period, evicts the largest (503 with
    Retry-After, its connection closed) instead of being refused; within the grace period
    (a fast upload) nothing is evicted."""
    from orthornn.service.http.admission import Admission

    monkeypatch.setattr(Admission, "GRACE_S", 1.0)
    budget, limit, held = 256 * 1024, 128 * 1024, 60 * 1024
    with LiveServer(repo=repo, max_body_bytes=limit, max_receiving_bytes=budget,
                    min_body_rate=0) as live:
        port = live.settings.port
        admission = _admission(live.app)
        holders = [RawConnection(port) for _ in range(2)]  # 120 of the 128 KiB arriving
        for c in holders:
            c.send(post(b"{" + b" " * held, length=2 * held))
        wait_until(lambda: len(admission._bodies) == 2 and admission.receiving >= 2 * held,
                   what="both holders' bodies being received")
        with httpx.Client(base_url=live.url, timeout=30) as client:  # whole bodies: served
            assert [client.post("/predict", content=BODY).status_code
                    for _ in range(6)] == [200] * 6
        big = json.dumps({"model": "digits", "inputs": [[[0.5]] * 64] * 50}).encode()
        assert 16 * 1024 < len(big) < limit

        def in_pieces() -> tuple[RawConnection, int, bytes]:
            c = RawConnection(port)
            sent = time.monotonic()
            c.send(post(big)[:16 * 1024])
            # its first piece received (being received, or answered at once), then the rest
            wait_until(lambda: any(b.since >= sent for b in admission._bodies)
                       or select.select([c.sock], [], [], 0)[0],  # answered already
                       what="the body's first piece received")
            with contextlib.suppress(OSError):  # (refused and closed meanwhile)
                c.send(post(big)[16 * 1024:])
            status, _, answer = c.answer(10)
            return c, status, answer

        young, status, answer = in_pieces()  # the holders are within the grace period
        assert status == 503 and b"being received" in answer, answer
        young.close()
        # past it (measured on the server's own clock): the largest holder may be evicted
        wait_until(lambda: all(time.monotonic() - b.since > Admission.GRACE_S
                               for b in admission._bodies), what="the grace period's end")
        served, status, answer = in_pieces()
        assert status == 200, answer
        served.close()
        evicted = 0
        for c in holders:
            try:
                status, headers, body = c.answer(5)
            except TimeoutError:
                continue  # not needed: still receiving
            assert status == 503 and headers["retry-after"] == "1", body
            assert headers["connection"] == "close" and b"held the most" in body
            assert c.closed(5)
            evicted += 1
        assert evicted == 1
        for c in holders:
            c.close()
        metrics = httpx.get(live.url + "/metrics").text
        assert "orthornn_evicted_bodies_total 1.0" in metrics


def test_a_body_slower_than_the_minimum_rate_is_cut_after_the_grace_period(
        repo, monkeypatch):
    """Kestrel's MinRequestBodyDataRate: past the grace period a body must have come at
    min_body_rate bytes a second on average; a trickle gets 408 and the connection is
    closed, a body at the rate is served."""
    from orthornn.service.http.admission import Admission

    monkeypatch.setattr(Admission, "GRACE_S", 0.5)
    with LiveServer(repo=repo, min_body_rate=1000) as live:
        slow = RawConnection(live.settings.port)
        slow.send(post(b"{", length=1000))  # a head and a byte, then one more past the grace
        time.sleep(0.8)
        slow.send(b" ")
        status, _, body = slow.answer(5)
        assert status == 408 and "min_body_rate" in json.loads(body)["error"], body
        assert slow.closed(5)
        slow.close()
        fast = RawConnection(live.settings.port)
        fast.trickle(post(BODY), pieces=4, seconds=0.3)  # slow, but within the grace period
        assert fast.answer(5)[0] == 200
        fast.close()


def test_slow_bodies_hold_no_slot_and_others_are_served_promptly(repo):
    """N >= max_inflight_requests connections each send a head and part of the body, then
    nothing: a normal request is still answered 200 promptly, readiness stays 200 (and
    means it), and a slow body that completes is served."""
    inflight = 4
    with LiveServer(repo=repo, max_inflight_requests=inflight) as live:
        port = live.settings.port
        slow = []
        for _ in range(2 * inflight):
            c = RawConnection(port)
            c.send(post(BODY[:10], length=len(BODY)))
            slow.append(c)
        time.sleep(0.3)  # their heads and first bytes are read
        with httpx.Client(base_url=live.url, timeout=10) as http:
            for _ in range(10):
                start = time.monotonic()
                answer = http.post("/predict", content=BODY)
                assert answer.status_code == 200, answer.text
                assert time.monotonic() - start < 1.0
                assert http.get("/v2/health/ready").status_code == 200
        slow[0].send(BODY[10:])
        assert slow[0].answer(10)[0] == 200
        for c in slow:
            c.close()


def test_bodies_being_received_are_bounded_together(repo):
    with LiveServer(repo=repo, max_body_bytes=4096, max_receiving_bytes=4096) as live:
        first, second = RawConnection(live.settings.port), RawConnection(live.settings.port)
        first.send(post(b" " * 3000, length=4000))
        time.sleep(0.2)
        second.send(post(b" " * 3000, length=4000))
        status, headers, answer = second.answer(10)
        assert status == 503 and headers["retry-after"] == "1"
        assert "being received" in json.loads(answer)["error"]
        first.close()
        second.close()
        # given back: a whole body is served again
        assert httpx.post(live.url + "/predict", content=BODY).status_code == 200


def test_the_slow_bodies_benchmark_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("slow_bodies",
                                                  ROOT / "bench" / "load" / "slow_bodies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "slow_bodies.json"
    assert module.main(["--slow", "16", "--clients", "2", "--seconds", "0.3", "--rounds", "1",
                        "--max-inflight-requests", "8",
                        "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (pair,) = result["pairs"]
    assert pair["alone"]["ok"] > 0 and pair["beside"]["ok"] > 0 and result["ratio"] > 0
    assert pair["beside"]["not_200"] == 0  # none refused beside the slow bodies
    assert pair["beside"]["slow_open"] == 16 and set(pair["beside"]["ready"]) == {"200"}


# -- draining --------------------------------------------------------------------------------

def test_answers_while_draining_carry_connection_close(repo):
    with LiveServer(repo=repo) as live:
        c = RawConnection(live.settings.port)
        c.send(post(BODY))
        status, headers, _ = c.answer()
        assert status == 200 and headers.get("connection") != "close"
        live.app.state.draining = True
        c.send(post(BODY))
        status, headers, _ = c.answer()
        assert status == 200 and headers["connection"] == "close"
        assert c.closed(5)  # closed by the server once answered
        c.close()
        ready = httpx.get(live.url + "/v2/health/ready")
        assert ready.status_code == 503 and ready.headers["connection"] == "close"


# -- language-model outputs ------------------------------------------------------------------

def _binary_infer(tokens: np.ndarray) -> tuple[bytes, dict]:
    header = json.dumps({"inputs": [{"name": "tokens", "shape": list(tokens.shape),
                                     "datatype": "INT64",
                                     "parameters": {"binary_data_size": tokens.nbytes}}]}
                        ).encode()
    return header + tokens.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                       "Content-Type": "application/octet-stream"}


def test_an_lm_request_over_the_output_budget_gets_413_before_it_runs(repo):
    budget = 1 << 20
    with LiveServer(repo=repo, max_lm_output_bytes=budget) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        spec = live.app.state.registry.get("words").spec
        vocab, steps = spec.output_size, spec.max_length
        tokens = np.ones((256, steps), dtype=np.int64)
        body, headers = _binary_infer(tokens)
        # 14 MiB of logits (vocabulary 14): built, stacked and encoded, it cost +70 MiB
        # RSS; the answer is JSON, counted as written
        size = 256 * steps * vocab * JSON_VALUE_BYTES
        assert size > 8 * budget
        for _ in range(2):  # warm: the first request's allocations are the codecs' too
            assert http.post("/v2/models/words/infer", content=body,
                             headers=headers).status_code == 413
        before = rss()
        for _ in range(5):
            answer = http.post("/v2/models/words/infer", content=body, headers=headers)
            assert answer.status_code == 413
        grown = rss() - before
        error = answer.json()["error"]
        assert f"limit of {budget} bytes" in error and str(size) in error
        assert grown < 16 << 20, grown
        # /predict too; within the budget both are answered
        over = http.post("/predict", json={"model": "words",
                                           "inputs": tokens[:64].tolist()})
        assert over.status_code == 413 and "max_lm_output_bytes" in over.json()["error"]
        small, headers = _binary_infer(tokens[:2, :16])
        assert http.post("/v2/models/words/infer", content=small,
                         headers=headers).status_code == 200
        assert http.post("/predict", json={"model": "words", "inputs": [[1, 2, 3]]}
                         ).status_code == 200


def test_generate_reads_a_long_prompt_in_pieces_within_the_budget(repo):
    with LiveServer(repo=repo) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        spec = live.app.state.registry.get("words").spec
        assert spec.streaming  # its graphs take an initial state: a prompt goes in pieces
        request = {"model": "words", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
                   "max_new_tokens": 8, "temperature": 0}
        whole = http.post("/generate", json=request)
        live.settings.max_lm_output_bytes = 3 * 4 * spec.output_size  # 3 steps a piece
        pieces = http.post("/generate", json=request)
        assert whole.status_code == pieces.status_code == 200
        assert pieces.json()["ids"] == whole.json()["ids"]
        from orthornn.service.dataplane.generate import read_prompt

        mv = live.app.state.registry.get("words")
        one = read_prompt(mv.runtime, spec, request["prompt"], 0)
        three = read_prompt(mv.runtime, spec, request["prompt"], 3 * 4 * spec.output_size)
        np.testing.assert_allclose(three[0], one[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(three[1], one[1], rtol=1e-4, atol=1e-5)

