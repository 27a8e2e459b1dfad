"""Capture through the service: what a record holds against the answer the client got, the
request id (X-Request-Id, OIP's id, or the server's), the sample alike for every replica,
and a SIGKILL during load: every request answered 200 is on disk exactly once after the
restart."""

import binascii
import os
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from orthornn.export.artifacts.loop.captures import read_records
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings

from ..service_helpers import free_port, make_repo, wait_ready


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("capture-repo"),
                     {"adding": [4], "digits": [1]})


def serving(repo, captured, **settings) -> TestClient:
    app = create_app(Settings(repo=repo, poll_interval_s=0, capture=captured,
                              capture_replica="r", **settings))
    return TestClient(app)


def test_a_record_holds_what_the_model_saw_and_what_the_client_got(repo, tmp_path):
    x = [[0.1], [0.5], [0.9]]
    with serving(repo, tmp_path / "cap") as c:
        c.app.state.registry.scanned.wait(60)
        r = c.post("/predict", json={"model": "digits", "inputs": [x], "top_k": 2},
                   headers={"X-Request-Id": "client-7"})
        assert r.status_code == 200 and r.headers["X-Request-Id"] == "client-7"
        oip = c.post("/v2/models/digits/infer", json={
            "id": "oip-1", "inputs": [{"name": "x", "shape": [1, 3, 1], "datatype": "FP32",
                                       "data": [0.1, 0.5, 0.9]}]})
        assert oip.status_code == 200 and oip.headers["X-Request-Id"] == "oip-1"
        made = c.post("/predict", json={"model": "digits", "inputs": [x]})
        assert len(made.headers["X-Request-Id"]) == 32  # one the server made
        start = c.post("/predict", json={"model": "adding", "inputs": [[[0.5, 1.0]]],
                                         "session": "s", "start": True},
                       headers={"X-Request-Id": "chunk-0"})
        assert start.status_code == 200
        bad = c.post("/predict", json={"model": "digits", "inputs": [x]},
                     headers={"X-Request-Id": "two words"})
        assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]
        refused = c.post("/predict", json={"model": "nope", "inputs": [x]},
                         headers={"X-Request-Id": "refused"})
        assert refused.status_code == 404
        metrics = c.get("/metrics").text
    records, torn = read_records(tmp_path / "cap", "digits")
    by_id = {rec["id"]: rec for rec in records}
    assert torn == 0 and set(by_id) == {"client-7", "oip-1", made.headers["X-Request-Id"]}
    rec = by_id["client-7"]
    assert (rec["model"], rec["version"], rec["route"]) == ("digits", 1, "/predict")
    # the inputs as the model saw them (float32), the outputs the client's answer was made
    # from: the probabilities (its top-k is their order) and the most likely class
    (seen,) = rec["inputs"]  # exact: the float32 bytes, in base64
    assert seen.dtype == np.float32 and np.array_equal(seen, np.float32(x))
    (answer,), (kept,) = r.json()["outputs"], rec["outputs"]
    assert kept == {"index": answer["index"], "probabilities": answer["probabilities"]}
    order = np.argsort(-np.array(kept["probabilities"]), kind="stable")[:2]
    assert [t["index"] for t in answer["top_k"]] == order.tolist()
    assert rec["compute_ms"] > 0 and rec["session"] is None
    # OIP: the logits the client got, as probabilities (numpy's softmax of them)
    logits = np.float64({o["name"]: o["data"] for o in oip.json()["outputs"]}["logits"])
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    (oip_kept,) = by_id["oip-1"]["outputs"]
    assert by_id["oip-1"]["route"] == "infer"
    np.testing.assert_allclose(oip_kept["probabilities"], expected, rtol=1e-6)  # JSON floats
    (chunk,) = read_records(tmp_path / "cap", "adding")[0]
    assert (chunk["id"], chunk["session"], chunk["position"]) == ("chunk-0", "s", 1)
    assert 'orthornn_capture_records_total{model="digits"} 3.0' in metrics
    assert (tmp_path / "cap" / "digits" / "1").is_dir()  # closed at the end: no .open left
    assert not list((tmp_path / "cap").glob("*/*/*/*.open"))


def test_an_answer_whose_record_is_dropped_carries_no_id(repo, tmp_path):
    """A disk that refuses the records: the request whose batch's write failed was answered
    under its id (the write came after its tag), then for the second of drops every answer
    carries no X-Request-Id (no record is kept under it), and each drop is counted."""
    captured = tmp_path / "cap"
    with serving(repo, captured) as c:
        c.app.state.registry.scanned.wait(60)
        c.app.state.dataplane.capture.clock = lambda: 1_790_000_000.0  # the second never ends
        (captured / "digits").write_text("")  # a file where the model's folder would go
        x = {"model": "digits", "inputs": [[[0.1], [0.5]]]}
        first = c.post("/predict", json=x, headers={"X-Request-Id": "first"})
        later = [c.post("/predict", json=x, headers={"X-Request-Id": f"later-{i}"})
                 for i in range(3)]
        metrics = c.get("/metrics").text
    assert first.status_code == 200 and first.headers["X-Request-Id"] == "first"
    assert [(r.status_code, r.headers.get("X-Request-Id")) for r in later] == [(200, None)] * 3
    assert 'orthornn_capture_dropped_total{reason="error"} 4.0' in metrics
    assert "orthornn_capture_records_total{" not in metrics  # nothing written


def test_the_sample_is_the_ids_hash_alike_on_two_replicas(repo, tmp_path):
    """A given id is kept when its hash is in the sample, on every replica alike, and only
    the answers of requests kept carry their id; a request without one is kept with the
    sample's chance, under the id its answer carries."""
    ids = [f"id-{i}" for i in range(60)]
    echoed: dict[str, list] = {}
    made: dict[str, list] = {}
    for replica in ("a", "b"):
        app = create_app(Settings(repo=repo, poll_interval_s=0, capture=tmp_path / replica,
                                  capture_sample=0.5))
        with TestClient(app) as c:
            app.state.registry.scanned.wait(60)
            answers = [c.post("/predict", json={"model": "digits", "inputs": [[0.1, 0.2]]},
                              headers={"X-Request-Id": i}) for i in ids]
            assert {r.status_code for r in answers} == {200}
            echoed[replica] = [r.headers.get("X-Request-Id") for r in answers]
            unnamed = [c.post("/predict", json={"model": "digits", "inputs": [[0.3, 0.4]]})
                       for _ in range(60)]
            assert {r.status_code for r in unnamed} == {200}
            made[replica] = [r.headers["X-Request-Id"] for r in unnamed
                             if "X-Request-Id" in r.headers]
    expected = {i for i in ids if binascii.crc32(i.encode()) % 10_000 < 5_000}
    assert 15 < len(expected) < 45
    for replica in ("a", "b"):
        assert echoed[replica] == [i if i in expected else None for i in ids]
        assert 10 < len(made[replica]) < 50  # binomial(60, 0.5): 5.5 sd either side
        assert {r["id"] for r in read_records(tmp_path / replica, "digits")[0]} == \
            expected | set(made[replica])


def _serve(repo, captured, port):
    return subprocess.Popen(
        [sys.executable, "-m", "orthornn", "serve", "--repo", str(repo), "--port", str(port),
         "--capture", str(captured), "--capture-replica", "pod-0", "--poll-interval-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_killed_replica_loses_no_record_of_an_answered_request(repo, tmp_path):
    """2,000 requests from 8 clients, SIGKILL after about half were answered, a restart:
    every request answered 200 is on disk exactly once (a torn last line at most, cut and
    counted at the restart)."""
    captured, port = tmp_path / "cap", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(repo, captured, port)
    wait_ready(proc, url)
    answered: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            for i in range(250):
                rid = f"c{k}-{i}"
                try:
                    r = http.post("/predict", json={"model": "digits",
                                                    "inputs": [[0.1 * (i % 9), 0.2]]},
                                  headers={"X-Request-Id": rid})
                except httpx.HTTPError:
                    return  # the server is gone
                if r.status_code == 200:
                    with lock:
                        answered.append(rid)
                        if len(answered) == 1000:
                            os.kill(proc.pid, signal.SIGKILL)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL and len(answered) >= 1000
    restarted = _serve(repo, captured, port)  # recovers pod-0's open segments
    try:
        wait_ready(restarted, url)
    finally:
        restarted.terminate()
        restarted.wait(30)
    assert not list(captured.glob("*/*/*/*.open"))
    records, torn = read_records(captured, "digits")
    ids = [r["id"] for r in records]
    assert torn == 0  # cut at the restart
    assert len(ids) == len(set(ids))  # each once
    assert set(answered) <= set(ids), len(set(answered) - set(ids))


def test_a_squatted_id_pairs_no_clients_input_with_anothers_label(repo, tmp_path):
    """Issue 59, finding 6, replayed on a real server: a client that sends X-Request-Id
    order-40 with its own input before the real client does had its input captured under
    that id, and the label for order-40 then trained on the attacker's input (a squat with
    2 sequences made the real label fail with 422). Now an id captured for requests with
    different inputs is ambiguous: its label is refused (409, saying why), the data set
    leaves it out, and a retry (the same inputs again) is still labelled once."""
    from orthornn.export.artifacts.loop.captures import read_labels

    from ..helpers import orthornn_here
    from ..service_helpers import LiveServer

    captured = tmp_path / "cap"
    token = {"Authorization": "Bearer the-labels-token-of-this-test"}
    mine, theirs = [[0.1], [0.5], [0.9]], [[0.9], [0.9], [0.9]]
    with LiveServer(repo=repo, capture=captured, capture_replica="r0",
                    labels_token="the-labels-token-of-this-test") as live, \
            httpx.Client(base_url=live.url, timeout=30) as client:
        def predict(rid: str, inputs: list) -> None:
            r = client.post("/predict", json={"model": "digits", "inputs": inputs},
                            headers={"X-Request-Id": rid})
            assert r.status_code == 200 and r.headers["x-request-id"] == rid, r.text

        predict("order-40", [theirs, theirs])  # the squat: first, two sequences
        predict("order-40", [mine])  # the real request
        predict("order-41", [mine])
        predict("order-41", [mine])  # a retry of it: the same input
        r = client.post("/v2/models/digits/labels", headers=token,
                        json=[{"id": "order-40", "label": 3}])
        assert r.status_code == 409, r.text
        assert "captured for two requests with different inputs" in r.json()["error"]
        for i in range(12):  # enough labelled records for a data set
            predict(f"other-{i}", [[[0.05 * i], [0.5], [0.9]]])
        r = client.post("/v2/models/digits/labels", headers=token,
                        json=[{"id": "order-41", "label": 4},
                              *({"id": f"other-{i}", "label": i % 10} for i in range(12))])
        assert r.status_code == 200 and r.json()["accepted"] == 13, r.text
    assert "order-40" not in {v["id"] for v in read_labels(captured, "digits")}
    # a label written for it anyway (imported before the squat, say): still left out
    folder = captured / "digits" / "labels" / "2030-01-01"
    folder.mkdir(parents=True)
    (folder / "import-1.jsonl").write_text('{"id": "order-40", "label": 3, "time": 0}\n')
    r = orthornn_here("capture", "dataset", "--capture", captured, "--name", "digits",
                      "--out", tmp_path / "set.npz", "--holdout-share", "0", "--no-progress",
                      code=0)
    assert "labelled 13" in r.stdout and "ambiguous ids 1 (left out)" in r.stdout, r.stdout
    with np.load(tmp_path / "set.npz") as data:
        assert "order-40" not in set(data["ids"].tolist()) and len(data["ids"]) == 13
