"""/docs and /redoc work offline: the pages name no external URL, their assets come from
the service, and real headless Chromium, with every host name but 127.0.0.1 made
unresolvable (as in a cluster without internet), renders every operation.

Chromium comes from the system packages (`make test` installs them when missing:
scripts/ci-debian.sh); without it the test is skipped with that reason."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile

import httpx
import pytest

from ..service_helpers import LiveServer, make_repo

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
OFFLINE = "MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"


def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium: install the Debian packages chromium and "
                "chromium-driver (make test runs scripts/ci-debian.sh, which needs root and "
                "apt-get)")


def render(url: str) -> str:
    """The DOM of URL after its scripts ran (virtual time: no fixed sleeps)."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", f"--host-resolver-rules={OFFLINE}",
             "--virtual-time-budget=20000", "--dump-dom", url],
            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def server(service_packages, tmp_path_factory):
    repo = make_repo(service_packages, tmp_path_factory.mktemp("docs-repo"), {"digits": [1]})
    with LiveServer(repo=repo) as live:
        yield live


def test_docs_pages_name_no_external_url(server):
    for page in ("/docs", "/redoc"):
        html = httpx.get(server.url + page).text
        assert not re.search(r"(https?:)?//", html.replace("http-equiv", "")), html
        assets = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert assets, page  # the page's scripts and styles, served here
        for asset in assets:
            r = httpx.get(server.url + asset)
            assert r.status_code == 200 and len(r.content) > 1000, asset


def test_swagger_ui_renders_every_operation_offline(server):
    dom = render(server.url + "/docs")
    paths = set(re.findall(r'class="opblock-summary-path" data-path="([^"]+)"', dom))
    schema = httpx.get(server.url + "/openapi.json").json()
    assert paths == set(schema["paths"]), dom[-2000:]
    assert {"/predict", "/generate", "/v2/models/{name}/infer",
            "/v2/repository/index"} <= paths
    assert "Failed to load API definition" not in dom


def test_redoc_renders_offline(server):
    dom = render(server.url + "/redoc")
    assert "predict from sequences or text" in dom and "inference on one version" in dom
