"""The lean path (service.server.lean) against the ASGI stack it bypasses: the same
requests get the same answers, byte for byte but the Date header, from a server whose hot
routes take the lean path and from one whose user middleware keeps every route on the
ASGI stack; the lean path is the one taken (no Starlette frame under the handler); and the
connection handling the ASGI server gives (keep-alive, Connection: close, pipelining,
draining) is the lean path's too."""

import asyncio
import json
import re
import sys

import httpx
import numpy as np
import pytest

from ..service_helpers import LiveServer, RawConnection, make_repo


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("lean-repo"),
                     {"digits": [1], "adding": [4]})


class PassThrough:
    """A user's middleware: the service must show it every request (the lean path off)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)


def _request(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
             "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _binary(values: np.ndarray) -> tuple[bytes, dict[str, str]]:
    head = json.dumps({"inputs": [{"name": "x", "shape": list(values.shape),
                                   "datatype": "FP32",
                                   "parameters": {"binary_data_size": values.nbytes}}],
                       "outputs": [{"name": "logits",
                                    "parameters": {"binary_data": True}}]}).encode()
    return head + values.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


X = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6, 1)
BINARY_BODY, BINARY_HEADERS = _binary(X)
#: (path, body, headers): answers of every kind the hot routes give
REQUESTS = [
    ("/predict", json.dumps({"model": "digits", "inputs": X[:, :, 0].tolist(),
                             "top_k": 2}).encode(), {}),
    ("/predict", b'{"model": "digits", "inputs": [[0.1, 0.2]]}', {"X-Request-Id": "abc-1"}),
    ("/predict", b'{"model": "digits", "inputs": [[0.1, ', {}),  # 400: not JSON
    ("/predict", b'{"model": "nope", "inputs": [[0.1]]}', {}),  # 404
    ("/predict", b'{"model": "digits", "inputs": [[0.1]], "top_k": 0}', {}),  # 400: a field
    ("/predict", b'{"model": "digits", "inputs": [[0.1], [0.2, 0.3]], "states": [1]}', {}),
    ("/predict", b'{"model": "digits", "inputs": [[0.1]]}', {"X-Request-Id": "a b"}),  # 400
    ("/v2/models/digits/infer", json.dumps({"inputs": [{
        "name": "x", "shape": [2, 6, 1], "datatype": "FP32",
        "data": X.ravel().tolist()}]}).encode(), {}),
    ("/v2/models/digits/versions/1/infer", BINARY_BODY, BINARY_HEADERS),
    ("/v2/models/digits/versions/9/infer", BINARY_BODY, BINARY_HEADERS),  # 404: no version
    ("/v2/models/digits/infer", b'{"inputs": []}', {}),  # 400
]


def _answers(live: LiveServer) -> list[tuple[int, dict, bytes]]:
    c = RawConnection(live.settings.port)
    try:
        out = []
        for i, (path, body, headers) in enumerate(REQUESTS):  # the same ids in both
            c.send(_request(path, body, {"X-Request-Id": f"req-{i}", **headers}))
            status, head, answer = c.answer()
            head.pop("date", None)
            out.append((status, head, answer))
        # last: a Content-Length past the body limit, refused before its body is read
        c.send(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
        status, head, answer = c.answer()
        head.pop("date", None)
        return [*out, (status, head, answer)]
    finally:
        c.close()


def test_the_lean_path_answers_as_the_asgi_stack_does(repo, tmp_path):
    with LiveServer(repo=repo, capture=tmp_path / "lean") as lean:
        lean_answers = _answers(lean)
        metrics = httpx.get(lean.url + "/metrics").text
    asgi = LiveServer(repo=repo, capture=tmp_path / "asgi")
    asgi.app.add_middleware(PassThrough)
    with asgi:
        asgi_answers = _answers(asgi)
    statuses = [a[0] for a in lean_answers]
    assert statuses == [200, 200, 400, 404, 400, 400, 400, 200, 200, 404, 400, 413], lean_answers
    for i, (mine, theirs) in enumerate(zip(lean_answers, asgi_answers, strict=True)):
        assert mine == theirs, i
    assert lean_answers[1][1]["x-request-id"] == "abc-1"
    assert lean_answers[8][1]["content-type"] == "application/octet-stream"
    # counted as the ASGI path counts them, the in-flight gauge back to 0
    assert re.search(r'orthornn_requests_total\{endpoint="/predict",model="digits",'
                     r'status="200",version="1"\} 2\.0', metrics), metrics
    assert re.search(r'orthornn_requests_total\{endpoint="/v2/models/\{name\}/versions/'
                     r'\{version\}/infer",model="digits",status="200",version="1"\} 1\.0',
                     metrics)
    assert "orthornn_inflight_requests 1.0" in metrics  # (the scrape itself)
    # captured alike: the same records (one per batch) but their times
    def records(folder):
        return sorted((json.loads(line) for f in folder.rglob("*.jsonl")
                       for line in f.read_text().splitlines()), key=lambda r: r["ids"])
    mine, theirs = records(tmp_path / "lean"), records(tmp_path / "asgi")
    assert [r["ids"] for r in mine] == [["abc-1"], ["req-0"], ["req-7"], ["req-8"]]
    for record in (*mine, *theirs):
        del record["time"], record["compute_ms"]
    assert mine == theirs


def test_the_hot_routes_take_the_lean_path_and_the_rest_the_asgi_stack(repo):
    """Under the handler of a hot route no frame of Starlette or FastAPI (the ASGI stack
    bypassed); under a metadata route's, Starlette's router; with a user's middleware,
    Starlette under the hot route's too."""
    def starlette_below() -> bool:
        frame = sys._getframe(1)
        while frame is not None:
            if "/starlette/" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def observe(live: LiveServer) -> list[bool]:
        seen: list[bool] = []
        dataplane = live.app.state.dataplane
        predict, model_metadata = dataplane.predict, dataplane.metadata.model_metadata

        async def spied_predict(*args, **kwargs):
            seen.append(starlette_below())
            return await predict(*args, **kwargs)

        def spied_metadata(*args, **kwargs):
            seen.append(starlette_below())
            return model_metadata(*args, **kwargs)
        dataplane.predict, dataplane.metadata.model_metadata = spied_predict, spied_metadata
        assert httpx.post(live.url + "/predict", content=REQUESTS[1][1]).status_code == 200
        assert httpx.get(live.url + "/v2/models/digits").status_code == 200
        return seen

    with LiveServer(repo=repo) as lean:
        assert observe(lean) == [False, True]
    asgi = LiveServer(repo=repo)
    asgi.app.add_middleware(PassThrough)
    with asgi:
        assert observe(asgi) == [True, True]


@pytest.mark.parametrize("listener", ["eager", "uvicorn"])
def test_keep_alive_close_pipelining_and_draining_on_the_lean_path(repo, listener):
    body = REQUESTS[1][1]
    with LiveServer(repo=repo, listener=listener) as live:
        c = RawConnection(live.settings.port)
        # three requests in one write: three answers, in order, on the kept connection
        c.send(_request("/predict", body) + _request("/predict", b"{") +
               _request("/predict", body))
        assert [c.answer()[0] for _ in range(3)] == [200, 400, 200]
        assert not c.closed(0.2)
        # the client's Connection: close: answered, then closed
        c.send(_request("/predict", body, {"Connection": "close"}))
        status, headers, _ = c.answer()
        assert status == 200 and headers["connection"] == "close"
        assert c.closed(5)
        c.close()
        # draining: every answer says Connection: close and the connection closes
        live.app.state.draining = True
        c = RawConnection(live.settings.port)
        c.send(_request("/predict", body))
        status, headers, _ = c.answer()
        assert status == 200 and headers["connection"] == "close"
        assert c.closed(5)
        c.close()


def test_an_error_outside_the_handler_is_a_logged_500_and_the_connection_closed(
        repo, caplog):
    with LiveServer(repo=repo) as live:
        admission = live.app.state.admission

        async def broken(*args, **kwargs):
            await asyncio.sleep(0)
            raise RuntimeError("a bug in admission")
        admission.admit = broken
        c = RawConnection(live.settings.port)
        c.send(_request("/predict", REQUESTS[1][1]))
        status, _, answer = c.answer()
        assert status == 500 and json.loads(answer) == {
            "error": "internal server error (logged)"}
        assert c.closed(5)
        c.close()
    assert any("a bug in admission" in str(r.exc_info) for r in caplog.records)
