"""Promotion in the service: REPO/<name>/promotion.json (written here with
``export.repository.promote``, as the export and rollback commands write it) decides which
version answers requests that name none; a change of it swaps like a new version does;
the repository API's rollback moves it; metadata and /metrics show it. Answers are
checked against onnxruntime run directly on each package."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from orthornn.export.artifacts.repository import promote, read_promotion
from orthornn.service.http.app import create_app
from orthornn.service.registry.policy import promotion_changes
from orthornn.service.settings import Settings
from prometheus_client.parser import text_string_to_metric_families

from .. import objectstore
from ..service_helpers import OWNER, LiveServer, make_repo, publish_copy, reference

TOKEN = {"Authorization": "Bearer tok"}
SEQS = [np.array([[0.5, 1.0], [0.25, 0.0], [0.1, 1.0]]), np.array([[0.9, 0.0], [0.3, 1.0]])]
EVALUATION = {"metric": "mse", "value": 0.0123, "higher_is_better": False, "split": "test",
              "examples": 512, "data_fingerprint": "ab" * 32}
LINEAGE = {"config_sha256": "cd" * 32, "train_data_fingerprint": "ef" * 32,
           "orthornn_version": "0.1.0", "source_revision": "f8237b6", "parent": 3,
           "created": "2025-01-01T00:00:00+00:00"}

seaweedfs, s3_env = objectstore.seaweedfs, objectstore.s3_env


def set_manifest(package: Path, **fields) -> None:
    """Set (None: remove, as in a package from before the field) manifest fields; the
    manifest is not among the hashed files."""
    manifest = json.loads((package / "manifest.json").read_text())
    for key, value in fields.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    (package / "manifest.json").write_text(json.dumps(manifest))


def metrics(text: str) -> dict[tuple, float]:
    """{(sample name, (label, value), ...): value} of a Prometheus exposition."""
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def expected(repo: Path, version: int) -> list[float]:
    return [r["value"][0] for r in reference(repo / "adding" / str(version), SEQS)]


def predict(client, **body) -> dict:
    r = client.post("/predict", json={"model": "adding", "inputs": [s.tolist() for s in SEQS],
                                      **body})
    assert r.status_code == 200, r.text
    return r.json()


def values(answer: dict) -> list[float]:
    return [o["value"] for o in answer["outputs"]]


def break_model(package: Path) -> None:
    """Edit one byte of model.onnx (its sha256 in the manifest no longer matches)."""
    data = bytearray((package / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (package / "model.onnx").write_bytes(bytes(data))


# -- in process: the promoted version, metadata, metrics, the rollback route ------------

@pytest.fixture
def repo(service_packages, tmp_path):
    """adding 3 (an older package: no evaluation, no lineage), 4 (promoted, evaluated) and
    5 (newer, evaluation absent); a refused candidate kept under rejected/; digits 1
    without a promotion."""
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [3, 4, 5], "digits": [1]})
    model_dir = repo / "adding"
    set_manifest(model_dir / "3", evaluation=None, lineage=None)
    set_manifest(model_dir / "4", evaluation=EVALUATION, lineage=LINEAGE)
    set_manifest(model_dir / "5", evaluation={"absent": "the run's data cannot be rebuilt"},
                 lineage={**LINEAGE, "parent": 4})
    publish_copy(service_packages / "adding" / "2", model_dir / "rejected",
                 "20250101T000000Z-0a1b2c")
    promote(model_dir, 3, "publish", "exported")
    promote(model_dir, 4, "promote", "passed the gate")
    assert all(not np.allclose(expected(repo, a), expected(repo, b), atol=1e-4)
               for a, b in ((3, 4), (4, 5), (3, 5)))
    return repo


def start(repo: Path, **settings) -> tuple:
    app = create_app(Settings(repo=repo, poll_interval_s=0, admin_token="tok", **settings))
    return app, TestClient(app, raise_server_exceptions=False)


def test_the_promoted_version_serves_while_a_newer_one_exists(repo):
    app, client = start(repo)
    with client:
        registry = app.state.registry
        assert registry.scanned.wait(60) and registry.ready()
        # keep_versions 1: only the promoted version is loaded; the rejected candidate never
        assert registry.serving() == {"adding": [4], "digits": [1]}
        answer = predict(client)
        assert answer["version"] == 4
        np.testing.assert_allclose(values(answer), expected(repo, 4), atol=1e-6)
        assert client.post("/predict", json={"model": "adding", "version": 5,
                                             "inputs": [[[0.1, 0.0]]]}).status_code == 404
        index = client.post("/v2/repository/index", headers=TOKEN).json()
        rows = {m["version"]: m for m in index if m["name"] == "adding"}
        assert set(rows) == {"3", "4", "5"}  # rejected/... is no version
        assert rows["4"]["state"] == "READY" and rows["5"]["state"] == "UNAVAILABLE"
        assert "version 4 is promoted" in rows["5"]["reason"]
        # sessions and the OIP route start on the promoted version too
        r = client.post("/predict", json={"model": "adding", "inputs": [SEQS[0].tolist()],
                                          "session": "s1", "start": True, "end": True})
        assert r.status_code == 200 and r.json()["version"] == 4
        r = client.post("/v2/models/adding/infer", json={"inputs": [{
            "name": "x", "shape": [1, *SEQS[0].shape], "datatype": "FP32",
            "data": SEQS[0].ravel().tolist()}]})
        assert r.json()["model_version"] == "4"


def test_metadata_shows_promotion_evaluation_and_lineage(repo):
    app, client = start(repo, keep_versions=2)
    with client:
        assert app.state.registry.scanned.wait(60)
        meta = client.get("/v2/models/adding").json()
        # the promoted version and the newest other one are loaded; requests without a
        # version (and this metadata) get the promoted one
        assert meta["versions"] == ["4", "5"]
        p = meta["parameters"]
        assert (p["version"], p["promoted"]) == ("4", "4")
        assert p["evaluation"] == EVALUATION and p["lineage"] == LINEAGE
        p5 = client.get("/v2/models/adding/versions/5").json()["parameters"]
        assert (p5["version"], p5["promoted"]) == ("5", "4")
        assert p5["evaluation"] == {"absent": "the run's data cannot be rebuilt"}
        assert p5["lineage"]["parent"] == 4
        assert client.get("/v2/models/digits").json()["parameters"]["promoted"] is None
        assert predict(client)["version"] == 4
        # promoting the other loaded version swaps at the next scan, nothing to load
        promote(repo / "adding", 5, "promote", "passed the gate")
        app.state.registry.scan()
        assert predict(client)["version"] == 5
        assert client.get("/v2/models/adding").json()["parameters"]["promoted"] == "5"
        assert app.state.registry.serving()["adding"] == [4, 5]
        m = metrics(client.get("/metrics").text)
        assert m[("orthornn_model_swaps_total", ("model", "adding"))] == 1
        assert m[("orthornn_model_promotions_total", ("action", "promote"),
                  ("model", "adding"))] == 1


def test_rollback_route(repo):
    app, client = start(repo)
    model_dir = repo / "adding"
    with client:
        registry = app.state.registry
        assert registry.scanned.wait(60)
        text = client.get("/metrics").text
        m = metrics(text)
        assert m[("orthornn_model_evaluation", ("metric", "mse"), ("model", "adding"),
                  ("version", "4"))] == pytest.approx(0.0123)
        assert "orthornn_model_promotions_total{" not in text  # history before start-up
        url = "/v2/repository/models/adding/rollback"
        # the bearer token is required
        for headers in (None, {"Authorization": "Bearer wrong"}):
            r = client.post(url, headers=headers)
            assert r.status_code == 401 and "bearer token" in r.json()["error"]
        assert read_promotion(model_dir)["version"] == 4
        # refusals: 409 naming the versions it could use, 404, 400
        r = client.post(url, headers=TOKEN, json={"version": 9})
        assert r.status_code == 409, r.text
        assert "version 9" in r.json()["error"] and "3, 5" in r.json()["error"]
        r = client.post(url, headers=TOKEN, json={"version": 4})
        assert r.status_code == 409 and "already promoted" in r.json()["error"]
        assert client.post("/v2/repository/models/nope/rollback", headers=TOKEN
                           ).status_code == 404
        for body, field in (({"version": "x"}, "version"), ({"to": 3}, "to"),
                            ([3], "body"), (b"{no", "JSON")):
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = client.post(url, headers=TOKEN, **kwargs)
            assert r.status_code == 400 and field in r.json()["error"], r.text
        assert read_promotion(model_dir)["version"] == 4 and predict(client)["version"] == 4
        # one step back: the version promoted before 4; served at once (no poll here)
        r = client.post(url, headers=TOKEN)
        assert r.status_code == 200, r.text
        assert r.json() == {"model": "adding", "promoted": 3, "previous": 4}
        last = read_promotion(model_dir)["history"][-1]
        assert (last["action"], last["version"], last["previous"]) == ("rollback", 3, 4)
        assert registry.serving()["adding"] == [3]
        answer = predict(client)
        assert answer["version"] == 3
        np.testing.assert_allclose(values(answer), expected(repo, 3), atol=1e-6)
        p = client.get("/v2/models/adding").json()["parameters"]
        assert (p["promoted"], p["evaluation"], p["lineage"]) == ("3", None, None)
        m = metrics(client.get("/metrics").text)
        assert m[("orthornn_model_promotions_total", ("action", "rollback"),
                  ("model", "adding"))] == 1
        assert m[("orthornn_model_swaps_total", ("model", "adding"))] == 1
        # version 4 was released: its per-version series are gone
        assert not [k for k in m if ("version", "4") in k and k[0] in (
            "orthornn_model_loaded", "orthornn_model_evaluation",
            "orthornn_transition_sigma_min")]
        # to a named version (newer: rolling back a rollback), then a promotion by file
        r = client.post(url, headers=TOKEN, json={"version": "5"})
        assert r.json() == {"model": "adding", "promoted": 5, "previous": 3}
        assert predict(client)["version"] == 5
        promote(model_dir, 4, "promote", "passed the gate")
        registry.scan()
        assert predict(client)["version"] == 4
        m = metrics(client.get("/metrics").text)
        assert m[("orthornn_model_promotions_total", ("action", "rollback"),
                  ("model", "adding"))] == 2
        assert m[("orthornn_model_promotions_total", ("action", "promote"),
                  ("model", "adding"))] == 1
        assert m[("orthornn_model_evaluation", ("metric", "mse"), ("model", "adding"),
                  ("version", "4"))] == pytest.approx(0.0123)
        assert m[("orthornn_model_swaps_total", ("model", "adding"))] == 3
        # the route is in the OpenAPI document with the other repository routes
        schema = client.get("/openapi.json").json()
        op = schema["paths"]["/v2/repository/models/{name}/rollback"]["post"]
        assert op["security"] == [{"bearer": []}] and "409" in op["responses"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"] == \
            "#/components/schemas/RollbackRequest"


def test_rollback_on_a_read_only_repository_is_a_409_naming_the_fix(repo, monkeypatch):
    """The chart mounts the repository read-only in the serving pods by default."""
    import errno

    from orthornn.export.artifacts import rollback

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(rollback, "promote", read_only)  # what the rollback writes with
    app, client = start(repo)
    with client:
        assert app.state.registry.scanned.wait(60)
        r = client.post("/v2/repository/models/adding/rollback", headers=TOKEN)
        assert r.status_code == 409, r.text
        assert "Read-only file system" in r.json()["error"]
        assert "persistence.readOnlyInServer=false" in r.json()["error"]
        assert read_promotion(repo / "adding")["version"] == 4
        assert predict(client)["version"] == 4


def test_an_unreadable_promotion_never_serves_the_newest_and_is_reported(repo, caplog):
    """promotion.json there but unreadable (garbled, empty: a node crash with a writer
    that did not fsync) or gone after it was read: what serves keeps serving, unchanged,
    reported in the log (once), a metric, the model's metadata and the index; never the
    newest version (5 here, which may be one that was rolled back)."""
    model_dir = repo / "adding"
    (model_dir / "promotion.json").write_text("{broken")
    app, client = start(repo)
    with caplog.at_level(logging.ERROR, logger="orthornn.service"), client:
        registry = app.state.registry
        assert registry.scanned.wait(60)
        # a fresh replica: nothing of the model serves (not the newest), and it says why
        assert "adding" not in registry.serving() and not registry.ready()
        r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0.0]]]})
        assert r.status_code == 404, r.text
        rows = [m for m in client.post("/v2/repository/index", headers=TOKEN).json()
                if m["name"] == "adding"]
        assert {m["state"] for m in rows} == {"UNAVAILABLE"}
        assert all("promotion.json" in m["reason"] and "cannot be read" in m["reason"]
                   for m in rows), rows
        m = metrics(client.get("/metrics").text)
        assert m[("orthornn_model_promotion_unreadable", ("model", "adding"))] == 1
        registry.scan()  # logged once, not at every scan
        logged = [r.getMessage() for r in caplog.records if "promotion.json" in r.getMessage()]
        assert len(logged) == 1 and "serving nothing of it" in logged[0], logged
        promote(model_dir, 4, "rollback", "repaired")  # replaces the broken file
        registry.scan()
        assert predict(client)["version"] == 4 and registry.ready()
        assert client.get("/v2/models/adding").json()["parameters"]["promotion_error"] is None
        m = metrics(client.get("/metrics").text)
        assert m[("orthornn_model_promotion_unreadable", ("model", "adding"))] == 0
        # unreadable again while serving (empty, garbage, gone): version 4 keeps serving
        for damage in ("", "\x00" * 64, '{"version": "five"}', None):
            if damage is None:
                (model_dir / "promotion.json").unlink()
            else:
                (model_dir / "promotion.json").write_text(damage)
            registry.scan()
            answer = predict(client)
            assert answer["version"] == 4
            np.testing.assert_allclose(values(answer), expected(repo, 4), atol=1e-6)
            meta = client.get("/v2/models/adding").json()["parameters"]
            assert meta["promoted"] == "4" and meta["promotion_error"], meta
            m = metrics(client.get("/metrics").text)
            assert m[("orthornn_model_promotion_unreadable", ("model", "adding"))] == 1
            assert "keeping version 4 serving" in caplog.records[-1].getMessage()
        assert "is gone" in client.get("/v2/models/adding").json()["parameters"][
            "promotion_error"]


def test_promotion_changes_counts_new_history_entries():
    def record(version, *entries):
        return {"version": version, "history": [
            {"version": v, "action": a, "previous": p} for v, a, p in entries]}
    one = record(2, (1, "publish", None), (2, "promote", 1))
    assert promotion_changes(one, one) == []
    # two changes between two scans: both counted
    three = record(2, *[(1, "publish", None), (2, "promote", 1)], (3, "promote", 2),
                   (2, "rollback", 3))
    assert promotion_changes(one, three) == ["promote", "rollback"]
    # a history rewritten (an unreadable file replaced): one change, its last entry's action
    assert promotion_changes(three, record(4, (4, "rollback", None))) == ["rollback"]
    assert promotion_changes(one, {"version": 3, "history": []}) == ["unknown"]


# -- a live server: swaps under load, a corrupted promoted version ----------------------

class Clients:
    """Threads sending /predict and OIP requests without a version until stopped; every
    answer is checked against onnxruntime on the version that says it answered."""

    def __init__(self, url: str, repo: Path, versions: list[int], threads: int = 3):
        self.url, self.expected = url, {v: expected(repo, v) for v in versions}
        self.served = dict.fromkeys(versions, 0)
        self.failures: list = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(k,)) for k in range(threads)]

    def run(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            i = k
            while not self.stop.is_set():
                i += 1
                try:
                    if i % 3:
                        r = http.post("/predict", json={"model": "adding",
                                                        "inputs": [s.tolist() for s in SEQS]})
                        v, got = r.json()["version"], values(r.json())
                        want = self.expected[v]
                    else:
                        x = SEQS[0]
                        r = http.post("/v2/models/adding/infer", json={"inputs": [{
                            "name": "x", "shape": [1, *x.shape], "datatype": "FP32",
                            "data": x.ravel().tolist()}], "outputs": [{"name": "value"}]})
                        v = int(r.json()["model_version"])
                        got, want = r.json()["outputs"][0]["data"], self.expected[v][:1]
                    ok = r.status_code == 200 and np.allclose(got, want, rtol=0, atol=1e-5)
                except Exception as error:  # every failure is recorded
                    ok, v, got = False, None, repr(error)
                with self.lock:
                    if ok:
                        self.served[v] += 1
                    else:
                        self.failures.append((v, got))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def wait_for(self, srv: LiveServer, version: int, more: int = 10) -> None:
        """Until VERSION has answered MORE further requests."""
        before = self.served[version]
        srv.wait(lambda: self.served[version] >= before + more or self.failures)
        assert not self.failures, self.failures[:3]


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_promotion_changes_swap_under_load_and_sessions_keep_their_version(
        where, service_packages, tmp_path, request):
    """In a folder, and with the repository in a bucket (a SeaweedFS; the service serves
    a mirror of it): the same swaps, sessions, answers and counts."""
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1, 2, 3]})
    model_dir = repo / "adding"  # the packages' files: the answers' reference
    promote(model_dir, 1, "publish")
    promote(model_dir, 2, "promote")
    served, records, options = repo, model_dir, {}
    if where == "bucket":
        served = f"{request.getfixturevalue('s3_env').location()}/repo"
        records = objectstore.upload_model(model_dir, f"{served}/adding")
        options = {"repository_cache": str(tmp_path / "cache")}
    whole = np.array([[0.5, 1.0], [0.25, 0.0], [0.1, 1.0], [0.7, 0.0], [0.3, 1.0]])
    with LiveServer(repo=served, poll_interval_s=0.2, admin_token="tok", **options) as srv, \
            Clients(srv.url, repo, [1, 2, 3]) as load, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        registry = srv.app.state.registry
        load.wait_for(srv, 2)
        assert load.served[1] == load.served[3] == 0
        # a session opened on version 2 before the swap
        r = http.post("/predict", json={"model": "adding", "inputs": [whole[:3].tolist()],
                                        "session": "pinned", "start": True}, headers=OWNER)
        assert r.status_code == 200 and r.json()["version"] == 2
        promote(records, 3, "promote", "passed the gate")  # found by the next scan
        load.wait_for(srv, 3)
        assert registry.serving() == {"adding": [3]}
        r = http.post("/predict", json={"model": "adding", "inputs": [whole[3:].tolist()],
                                        "session": "pinned", "end": True}, headers=OWNER)
        assert r.status_code == 200 and r.json()["version"] == 2
        assert r.json()["outputs"][0]["value"] == pytest.approx(
            reference(model_dir / "2", [whole])[0]["value"][0], abs=1e-5)
        # the session ended: version 2 is released
        srv.wait(lambda: ("orthornn_model_loaded", ("arch", "svdrnn"), ("mode", "dense"),
                          ("model", "adding"), ("version", "2"))
                 not in metrics(http.get("/metrics").text))
        # the repository API's rollback swaps at once; a rollback by file at the next scan
        r = http.post("/v2/repository/models/adding/rollback", headers=TOKEN)
        assert r.json() == {"model": "adding", "promoted": 2, "previous": 3}
        load.wait_for(srv, 2)
        promote(records, 1, "rollback", "by hand")
        load.wait_for(srv, 1)
        text = http.get("/metrics").text
    assert not load.failures, load.failures[:5]
    m = metrics(text)
    assert m[("orthornn_model_promotions_total", ("action", "promote"), ("model", "adding"))] == 1
    assert m[("orthornn_model_promotions_total", ("action", "rollback"),
              ("model", "adding"))] == 2
    assert m[("orthornn_model_swaps_total", ("model", "adding"))] == 3
    assert [k[-1] for k in m if k[0] == "orthornn_model_loaded"] == [("version", "1")]


def test_a_corrupted_promoted_version_is_refused_and_the_previous_keeps_serving(
        service_packages, tmp_path):
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1, 2, 3, 4]})
    model_dir = repo / "adding"
    promote(model_dir, 1, "publish")
    promote(model_dir, 3, "promote")
    with LiveServer(repo=repo, poll_interval_s=0.1, admin_token="tok") as srv, \
            Clients(srv.url, repo, [1, 3], threads=2) as load, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        load.wait_for(srv, 3)
        for v in (2, 4):
            break_model(model_dir / str(v))
        promote(model_dir, 2, "rollback", "by hand, to a version damaged since")

        def failures() -> float:
            return metrics(http.get("/metrics").text).get(
                ("orthornn_model_load_failures_total", ("model", "adding")), 0.0)
        srv.wait(lambda: failures() >= 1)
        # what served keeps serving (not the newest below the promoted one, 1)
        load.wait_for(srv, 3)
        assert srv.app.state.registry.serving() == {"adding": [3]}
        p = http.get("/v2/models/adding").json()["parameters"]
        assert (p["version"], p["promoted"]) == ("3", "2")
        index = {m["version"]: m for m in http.post("/v2/repository/index", headers=TOKEN
                                                    ).json()}
        assert "sha256 mismatch for 'model.onnx'" in index["2"]["reason"]
        assert http.get("/v2/health/ready").status_code == 200
        # the rollback route will not promote a version that does not verify
        url = "/v2/repository/models/adding/rollback"
        r = http.post(url, headers=TOKEN, json={"version": 4})
        assert r.status_code == 409 and "does not verify" in r.json()["error"]
        assert r.json()["error"].endswith("could use: 1, 3"), r.json()
        r = http.post(url, headers=TOKEN, json={"version": 3})
        assert r.json() == {"model": "adding", "promoted": 3, "previous": 2}
        load.wait_for(srv, 3)
        assert failures() == 1  # the refused version is not retried while unchanged
        text = http.get("/metrics").text
    assert not load.failures, load.failures[:5]
    assert load.served[1] == 0
    m = metrics(text)
    assert m.get(("orthornn_model_swaps_total", ("model", "adding")), 0) == 0
    assert m[("orthornn_model_promotions_total", ("action", "rollback"),
              ("model", "adding"))] == 2
