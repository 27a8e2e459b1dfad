"""The repository API cannot be driven by a web page open in the user's browser (issue
41, item 8): against a real server on loopback with the default settings (no token),
the browser-style probe (a CORS "simple request": text/plain, a foreign Origin; DNS
rebinding: a foreign Host) gets 4xx and the model stays loaded, while a JSON request
from a command-line client still works; with a token, tritonclient's requests (no
Content-Type) still work."""

from __future__ import annotations

import httpx
import pytest
import tritonclient.http as triton

from ..service_helpers import LiveServer, make_repo

UNLOAD = "/v2/repository/models/digits/unload"


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("browser-repo"),
                     {"digits": [1], "adding": [5]})


def _ready(http: httpx.Client, model: str = "digits") -> bool:
    return http.get(f"/v2/models/{model}/ready").status_code == 200


def test_browser_style_requests_are_refused_and_the_model_stays_loaded(repo):
    with LiveServer(repo=repo) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        port = srv.settings.port
        probe = {"Content-Type": "text/plain", "Origin": "http://evil.example",
                 "Host": "evil.example"}
        r = http.post(UNLOAD, content=b"{}", headers=probe)
        assert 400 <= r.status_code < 500 and "error" in r.json(), r.text
        # each defence alone refuses it
        cases = [
            ({"Content-Type": "text/plain"}, 415, "application/json"),
            ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "content-type"),
            ({}, 415, "content-type"),  # no Content-Type (a bodiless fetch) without a token
            ({"Content-Type": "application/json", "Origin": "http://evil.example"}, 403,
             "origin"),
            ({"Content-Type": "application/json", "Origin": "null"}, 403, "origin"),
            ({"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port + 1}"},
             403, "origin"),  # another local server's page
            ({"Content-Type": "application/json", "Host": f"evil.example:{port}"}, 403,
             "host"),  # DNS rebinding: the page's name resolved to 127.0.0.1
            ({"Content-Type": "application/json", "Host": f"evil.example:{port}",
              "Origin": f"http://evil.example:{port}"}, 403, "host"),
            ({"Content-Type": "application/json", "Host": "127.0.0.1.evil.example"}, 403,
             "host"),
        ]
        for headers, status, word in cases:
            for path in (UNLOAD, "/v2/repository/models/digits/load",
                         "/v2/repository/models/digits/rollback",
                         "/v2/repository/models/digits/rollout/abort"):
                r = http.post(path, content=b"{}", headers=headers)
                assert r.status_code == status, (headers, path, r.text)
                assert word in r.json()["error"].lower(), r.text
        # the read-only index is not mutating, but a foreign page may not read it either
        assert http.post("/v2/repository/index", headers={"Host": "evil.example"}
                         ).status_code == 403
        assert http.post("/v2/repository/index", headers={"Origin": "http://evil.example"}
                         ).status_code == 403
        assert _ready(http)  # nothing above unloaded it
        # a command-line client's JSON request works (loopback names, any port; the
        # server's own page, as /docs sends it)
        for headers in ({}, {"Host": f"localhost:{port}"}, {"Host": f"[::1]:{port}"},
                        {"Host": "LOCALHOST"}, {"Origin": srv.url},
                        {"Origin": f"http://localhost:{port}"}):
            r = http.post("/v2/repository/models/digits/load", json={}, headers=headers)
            assert r.status_code == 200, (headers, r.text)
        assert http.post("/v2/repository/index").status_code == 200  # no body needed
        r = http.post(UNLOAD, headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text
        assert not _ready(http)
        assert http.post("/v2/repository/models/digits/load", json={}).status_code == 200
        assert _ready(http)
        # the OpenAPI document lists the new answers of the repository routes
        ops = http.get("/openapi.json").json()["paths"]
        assert {"403", "415"} <= set(ops["/v2/repository/models/{name}/unload"]["post"]
                                     ["responses"])


def test_with_a_token_the_host_is_free_and_tritonclient_still_works(repo):
    with LiveServer(repo=repo, admin_token="tok") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        auth = {"Authorization": "Bearer tok"}
        # behind a proxy or a Service the Host is any name: the token protects the API
        r = http.post("/v2/repository/models/digits/load", json={},
                      headers={**auth, "Host": "orthornn.example"})
        assert r.status_code == 200, r.text
        # a foreign origin is refused even with the token, and a declared non-JSON body
        r = http.post(UNLOAD, json={}, headers={**auth, "Origin": "http://evil.example"})
        assert r.status_code == 403
        r = http.post(UNLOAD, content=b"{}", headers={**auth, "Content-Type": "text/plain"})
        assert r.status_code == 415
        assert http.post(UNLOAD, content=b"{}").status_code == 401  # the token first
        assert _ready(http)
        client = triton.InferenceServerClient(srv.url.removeprefix("http://"))
        client.unload_model("digits", headers=auth)  # sends no Content-Type
        assert not client.is_model_ready("digits")
        client.load_model("digits", headers=auth)
        assert client.is_model_ready("digits")
