"""The service on a real uvicorn server on 127.0.0.1: tritonclient, dynamic batching under
concurrency, hot-swap under load, refused versions, the predict client, SIGTERM."""

import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from orthornn.export.artifacts.package import sha256
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings

from orthornn.cli import main as cli

from ..service_helpers import (
    OWNER,
    SECRET,
    LiveServer,
    free_port,
    golden,
    make_repo,
    publish_copy,
    reference,
    softmax,
    wait_ready,
    wait_until,
    wait_until_async,
)

ROOT = Path(__file__).resolve().parents[2]


def test_kserve_client_round_trip_json_and_binary(service_packages, tmp_path):
    """KServe's own Python client (InferenceRESTClient, protocol v2) sends model_name in
    the body, and with binary data the Inference-Header-Content-Length extension: both
    are answered, equal to onnxruntime's; a body naming another model is refused."""
    import asyncio

    kserve = pytest.importorskip("kserve")
    from kserve.protocol.infer_type import InferInput, InferRequest

    repo = make_repo(service_packages, tmp_path, {"digits": [1]})
    g = golden(repo / "digits" / "1")
    x, lengths = g["model/x"], g["model/lengths"].astype(np.int64)
    ref = reference(repo / "digits" / "1", [s[:n] for s, n in zip(x, lengths, strict=True)])

    def request(binary: bool, model: str = "digits") -> InferRequest:
        inputs = [InferInput("x", list(x.shape), "FP32"),
                  InferInput("lengths", [len(lengths)], "INT64")]
        inputs[0].set_data_from_numpy(x, binary_data=binary)
        inputs[1].set_data_from_numpy(lengths, binary_data=binary)
        return InferRequest(model_name=model, infer_inputs=inputs, request_id="k1")

    async def run(url: str):
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0))
        answers = [await client.infer(url, request(binary), model_name="digits")
                   for binary in (False, True)]
        with pytest.raises(Exception) as wrong:
            await client.infer(url, request(False, model="words"), model_name="digits")
        await client.close()
        return answers, wrong.value

    with LiveServer(repo=repo) as srv:
        answers, wrong = asyncio.run(run(srv.url))
    for answer in answers:
        logits = answer.outputs[0].as_numpy() if answer.outputs[0].name == "logits" else \
            answer.outputs[1].as_numpy()
        np.testing.assert_allclose(np.asarray(logits).reshape(4, 10),
                                   [r["logits"] for r in ref], atol=1e-6)
        assert answer.id == "k1" and answer.model_name == "digits"
    assert wrong.response.status_code == 400
    assert "model_name: the body names 'words', the URL 'digits'" in wrong.response.text


def test_tritonclient_round_trip(service_packages, tmp_path):
    repo = make_repo(service_packages, tmp_path, {"digits": [1], "words": [1]})
    with LiveServer(repo=repo, admin_token="tok") as srv:
        client = triton.InferenceServerClient(srv.url.removeprefix("http://"))
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("digits") and client.is_model_ready("digits", "1")
        assert client.get_server_metadata()["name"] == "orthornn"
        meta = client.get_model_metadata("digits")
        assert [i["name"] for i in meta["inputs"]] == ["x", "lengths", "initial_state"]
        assert client.get_model_config("digits")["max_batch_size"] > 0
        g = golden(repo / "digits" / "1")
        x, lengths = g["model/x"], g["model/lengths"]
        ref = reference(repo / "digits" / "1", [s[:n] for s, n in zip(x, lengths, strict=True)])
        for binary in (True, False):
            inputs = [triton.InferInput("x", list(x.shape), "FP32"),
                      triton.InferInput("lengths", [len(lengths)], "INT64")]
            inputs[0].set_data_from_numpy(x, binary_data=binary)
            inputs[1].set_data_from_numpy(lengths.astype(np.int64), binary_data=binary)
            outputs = [triton.InferRequestedOutput("logits", binary_data=binary)]
            result = client.infer("digits", inputs, outputs=outputs, request_id="7")
            logits = result.as_numpy("logits")
            assert logits.dtype == np.float32 and logits.shape == (4, 10)
            np.testing.assert_allclose(logits, [r["logits"] for r in ref], atol=1e-6)
            np.testing.assert_allclose(logits, g["model/logits"], atol=1e-4)
            assert result.get_response()["id"] == "7"
        # no outputs named: the client asks for every output in binary
        tokens = np.array([[2, 3, 4]], dtype=np.int64)
        inp = triton.InferInput("tokens", [1, 3], "INT64")
        inp.set_data_from_numpy(tokens)
        result = client.infer("words", [inp], model_version="1")
        assert result.as_numpy("logits").shape[:2] == (1, 3)
        np.testing.assert_allclose(result.as_numpy("state")[0],
                                   reference(repo / "words" / "1", [tokens[0]])[0]["state"],
                                   atol=1e-6)
        # a sequence through the OIP sequence parameters: chunks of one sequence_id end
        # where the whole sequence ends; its secret (chosen here) goes with every chunk, as
        # a header (the start) or a parameter (the others): tritonclient sends both
        seq = x[:1, :lengths[0]]
        whole = reference(repo / "digits" / "1", [seq[0]])[0]
        bounds = [0, 3, 4, seq.shape[1]]
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            chunk = triton.InferInput("x", [1, b - a, 1], "FP32")
            chunk.set_data_from_numpy(np.ascontiguousarray(seq[:, a:b]))
            owner = {"headers": dict(OWNER)} if k == 0 else \
                {"parameters": {"session_secret": SECRET}}
            result = client.infer("digits", [chunk], sequence_id=42, sequence_start=k == 0,
                                  sequence_end=b == seq.shape[1], **owner)
            if k == 0:  # the answer to the start gives the secret back
                assert result.get_response()["parameters"]["session_secret"] == SECRET
        np.testing.assert_allclose(result.as_numpy("state")[0], whole["state"], atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("logits")[0], whole["logits"], atol=1e-5)
        with pytest.raises(triton.InferenceServerException, match="session '42' is not open"):
            client.infer("digits", [chunk], sequence_id=42, headers=dict(OWNER))
        with pytest.raises(triton.InferenceServerException, match="unknown input"):
            bad = triton.InferInput("y", [1, 3], "INT64")
            bad.set_data_from_numpy(tokens)
            client.infer("words", [bad])
        # the repository API with the token, as tritonclient sends it
        auth = {"Authorization": "Bearer tok"}
        index = client.get_model_repository_index(headers=auth)
        assert {m["name"] for m in index} == {"digits", "words"}
        client.unload_model("words", headers=auth)
        assert not client.is_model_ready("words")
        client.load_model("words", headers=auth)
        assert client.is_model_ready("words")
        with pytest.raises(triton.InferenceServerException):
            client.unload_model("words")  # no token


def _predict(url_or_client, body):
    r = url_or_client.post("/predict", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_batched_answers_equal_unbatched(service_packages, tmp_path):
    repo = make_repo(service_packages, tmp_path, {"digits": [1]})
    rng = np.random.default_rng(0)
    requests = [[rng.normal(size=int(rng.integers(1, 65))).round(4).tolist()
                 for _ in range(int(rng.integers(1, 4)))] for _ in range(24)]
    answers = {}
    for batching in (True, False):
        with LiveServer(repo=repo, batching=batching, max_queue_delay_ms=40,
                        max_batch_size=16) as srv, \
                httpx.Client(base_url=srv.url, timeout=30) as http:
            with ThreadPoolExecutor(12) as pool:
                answers[batching] = list(pool.map(
                    lambda seqs, h=http: _predict(h, {"model": "digits", "inputs": seqs}),
                    requests))
            metrics = http.get("/metrics").text
        sizes = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("orthornn_batch_size_sum")]
        counts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("orthornn_batch_size_count")]
        if batching:  # requests really were run together
            assert sizes[0] / counts[0] > 1.5
    ref_pkg = repo / "digits" / "1"
    for seqs, a, b in zip(requests, answers[True], answers[False], strict=True):
        for out_a, out_b, ref in zip(a["outputs"], b["outputs"],
                                     reference(ref_pkg, [np.array(s)[:, None] for s in seqs]),
                                     strict=True):
            np.testing.assert_allclose(out_a["probabilities"], out_b["probabilities"],
                                       rtol=0, atol=1e-6)
            np.testing.assert_allclose(out_a["probabilities"],
                                       np.exp(ref["logits"]) / np.exp(ref["logits"]).sum(),
                                       atol=1e-6)


def test_hot_swap_of_five_versions_under_load(service_packages, tmp_path):
    """Eight client threads send /predict and OIP requests while versions 2..5 are
    published one by one; every answer must be 200 and equal to what onnxruntime gives
    on the version that says it served it."""
    stage = service_packages / "adding"
    repo = make_repo(service_packages, tmp_path, {"adding": [1]})
    rng = np.random.default_rng(1)
    seqs = [rng.random((int(n), 2)).round(3) for n in rng.integers(1, 7, size=16)]
    expected = {v: [r["value"][0] for r in reference(stage / str(v), seqs)]
                for v in range(1, 6)}
    for v in range(2, 6):
        assert not np.allclose(expected[v], expected[v - 1], atol=1e-4)
    failures, served = [], {v: 0 for v in range(1, 6)}
    stop = threading.Event()
    lock = threading.Lock()

    def client(k: int):
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            i = k
            while not stop.is_set():
                j = i % len(seqs)
                i += 1
                try:
                    if i % 3:
                        r = http.post("/predict", json={"model": "adding",
                                                        "inputs": [seqs[j].tolist()]})
                        v = r.json()["version"]
                        got = r.json()["outputs"][0]["value"]
                    else:
                        r = http.post("/v2/models/adding/infer", json={"inputs": [{
                            "name": "x", "shape": [1, *seqs[j].shape], "datatype": "FP32",
                            "data": seqs[j].ravel().tolist()}], "outputs": [{"name": "value"}]})
                        v = int(r.json()["model_version"])
                        got = r.json()["outputs"][0]["data"][0]
                    ok = r.status_code == 200 and abs(got - expected[v][j]) < 1e-5
                except Exception as e:  # every failure is recorded
                    ok, v, got = False, None, repr(e)
                with lock:
                    if ok:
                        served[v] += 1
                    else:
                        failures.append((v, j, got))

    with LiveServer(repo=repo, poll_interval_s=0.05, max_queue_delay_ms=1) as srv:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        registry = srv.app.state.registry
        for v in range(2, 6):
            before = served[v - 1]
            srv.wait(lambda b=before, v=v: served[v - 1] > b + 20)  # the old one served
            publish_copy(stage / str(v), repo / "adding", v)
            srv.wait(lambda v=v: registry.serving().get("adding") == [v])
        srv.wait(lambda: served[5] > 50)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        metrics = httpx.get(srv.url + "/metrics").text
    assert not failures, failures[:5]
    assert all(served[v] > 0 for v in range(1, 6)), served
    assert 'orthornn_model_swaps_total{model="adding"} 4.0' in metrics
    assert 'orthornn_model_loaded{arch="svdrnn",mode="dense",model="adding",version="5"} 1.0' \
        in metrics
    assert 'version="4"} 1.0' not in metrics  # older versions released


def _break_hash(package: Path) -> None:
    data = bytearray((package / "model.onnx").read_bytes())
    data[-5] ^= 0xFF
    (package / "model.onnx").write_bytes(bytes(data))


def _break_golden(package: Path) -> None:
    g = golden(package)
    g["model/value"] = g["model/value"] + 0.01
    np.savez(package / "golden.npz", **g)
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["files"]["golden.npz"] = sha256(package / "golden.npz")
    (package / "manifest.json").write_text(json.dumps(manifest))


def test_corrupt_or_half_written_versions_are_refused(service_packages, tmp_path):
    stage = service_packages / "adding"
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1]})
    probe = {"model": "adding", "inputs": [[[0.5, 1.0], [0.25, 1.0]]]}
    want = reference(stage / "1", [np.array(probe["inputs"][0])])[0]["value"][0]
    with LiveServer(repo=repo, poll_interval_s=0.05) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        registry = srv.app.state.registry
        scans, scan = [0], registry.policy.scan

        def counted_scan() -> None:  # the repository thread's scans, counted when done
            scan()
            scans[0] += 1
        registry.policy.scan = counted_scan

        def failed():
            text = http.get("/metrics").text
            line = [x for x in text.splitlines()
                    if x.startswith('orthornn_model_load_failures_total{model="adding"}')]
            return float(line[0].split()[-1]) if line else 0.0

        # 2: a model.onnx that does not match its sha256; 3: wrong golden outputs (with a
        # correct hash); 4: half-written, copied in place without the atomic rename
        for n, (v, damage) in enumerate(((2, _break_hash), (3, _break_golden)), start=1):
            tmp = tmp_path / f"broken-{v}"
            publish_copy(stage / str(v), tmp, v)
            damage(tmp / str(v))
            os.rename(tmp / str(v), repo / "adding" / str(v))
            srv.wait(lambda n=n: failed() >= n)
            answer = _predict(http, probe)
            assert answer["version"] == 1
            assert answer["outputs"][0]["value"] == pytest.approx(want, abs=1e-6)
            assert http.get("/v2/health/ready").status_code == 200
        half = repo / "adding" / "4"
        half.mkdir()
        (half / "model.onnx").write_bytes((stage / "4" / "model.onnx").read_bytes()[:100])
        srv.wait(lambda: failed() >= 3)
        index = {m["version"]: m for m in http.post("/v2/repository/index").json()}
        assert "sha256 mismatch for 'model.onnx'" in index["2"]["reason"]
        assert "golden check failed" in index["3"]["reason"]
        assert "no manifest.json" in index["4"]["reason"]
        assert index["1"]["state"] == "READY"
        # refused versions are not retried while unchanged: three more scans (two of them
        # begun after this point) leave them refused
        done = scans[0]
        wait_until(lambda: scans[0] >= done + 3, what="three more repository scans")
        assert failed() == 3 and registry.serving() == {"adding": [1]}
        assert _predict(http, probe)["version"] == 1
        # the explicit load API reports why; the half-written version, once complete, loads
        r = http.post("/v2/repository/models/adding/load", json={})
        assert r.status_code == 200 and "version 4" in " ".join(r.json()["refused"])
        for item in (stage / "4").iterdir():
            (half / item.name).write_bytes(item.read_bytes())
        srv.wait(lambda: registry.serving() == {"adding": [4]})
        assert _predict(http, probe)["version"] == 4


def test_predict_client_command(service_packages, tmp_path, capsys):
    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1], "words": [1]})
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 5, 1), np.float32), lengths=np.array([5, 3]))
    (tmp_path / "t.txt").write_text("the cat sat\nthe dog\n")
    (tmp_path / "x.json").write_text(json.dumps([[0.1, 0.2], [[0.3]]]))
    with LiveServer(repo=repo) as srv:
        for name, model in (("x.npz", "digits"), ("t.txt", "words"), ("x.json", "digits")):
            # --verbose: the whole JSON answer
            assert cli(["predict", "--url", srv.url, "--model", model, "--top-k", "2",
                        "--verbose", str(tmp_path / name)]) == 0
            answer = json.loads(capsys.readouterr().out)
            assert answer["model"] == model and len(answer["outputs"]) == 2
            # by default: one line per sequence, summing that answer up
            assert cli(["predict", "--url", srv.url, "--model", model, "--top-k", "2",
                        str(tmp_path / name)]) == 0
            lines = capsys.readouterr().out.splitlines()
            assert len(lines) == 2
            for i, (line, out) in enumerate(zip(lines, answer["outputs"], strict=True)):
                if model == "digits":
                    best, second = out["top_k"]
                    p = out["probabilities"][out["index"]]
                    assert line == (f"{i}: {out['label']} (p={p:.3g}); "
                                    f"top 2: {best['label']} {best['probability']:.3g}, "
                                    f"{second['label']} {second['probability']:.3g}")
                else:
                    tokens = ", ".join(f'"{t["token"]}" {t["probability"]:.3g}'
                                       for t in out["next_tokens"])
                    assert line == f"{i}: next: {tokens}; perplexity {out['perplexity']:.4g}"
        assert cli(["predict", "--url", srv.url, "--model", "nope",
                    str(tmp_path / "x.json")]) == 2
        assert "HTTP 404: model 'nope' is not loaded" in capsys.readouterr().err
        # --stream: each sequence through a session, a line per chunk, ending where one
        # request of the whole sequence ends (--verbose: a JSON line per chunk)
        x = np.random.default_rng(0).random((2, 7, 1)).astype(np.float32)
        np.savez(tmp_path / "s.npz", x=x)
        assert cli(["predict", "--url", srv.url, "--model", "digits", "--stream", "--verbose",
                    "--chunk-size", "3", str(tmp_path / "s.npz")]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(r["sequence"], r["steps"]) for r in lines] == [
            (i, s) for i in (0, 1) for s in ([0, 3], [3, 6], [6, 7])]
        ref = reference(repo / "digits" / "1", list(x))
        for i in (0, 1):
            np.testing.assert_allclose(lines[3 * i + 2]["output"]["probabilities"],
                                       softmax(ref[i]["logits"].astype(float)), atol=1e-5)
        assert cli(["predict", "--url", srv.url, "--model", "digits", "--stream",
                    "--chunk-size", "3", str(tmp_path / "s.npz")]) == 0
        compact = capsys.readouterr().out.splitlines()
        assert [line.split(":")[0] for line in compact] == [
            f"{i} steps {a}-{b}" for i in (0, 1) for a, b in ((0, 3), (3, 6), (6, 7))]
        for line, r in zip(compact, lines, strict=True):
            p = r["output"]["probabilities"][r["output"]["index"]]
            assert line.endswith(f": {r['output']['label']} (p={p:.3g})"), line
        assert cli(["predict", "--url", srv.url, "--model", "words", "--stream", "-v",
                    "--chunk-size", "2", str(tmp_path / "t.txt")]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["steps"] for r in lines] == [[0, 2], [2, 3], [0, 2]]
        assert cli(["predict", "--url", srv.url, "--model", "words", "--stream",
                    "--chunk-size", "2", str(tmp_path / "t.txt")]) == 0
        assert [line.split(": next: ")[0] for line in capsys.readouterr().out.splitlines()
                ] == ["0 words 0-2", "0 words 2-3", "1 words 0-2"]
        assert cli(["predict", "--url", srv.url, "--model", "digits", "--stream",
                    "--chunk-size", "0", str(tmp_path / "s.npz")]) == 2
        assert "--chunk-size must be an integer >= 1" in capsys.readouterr().err
    assert cli(["predict", "--url", "http://127.0.0.1:9", "--model", "m",
                str(tmp_path / "x.json")]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert cli(["predict", "--url", "u", "--model", "m", str(tmp_path / "missing.json")]) == 2


def _slow_request(port: int, body: bytes, sent_half: threading.Event, go_on: threading.Event,
                  answer: list) -> None:
    """POST /predict whose body arrives in two halves: in flight from the first byte."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
        sent_half.set()
        go_on.wait(30)
        sock.sendall(body[len(body) // 2:])
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                data.lower().split(b"content-length: ")[1].split(b"\r\n")[0]):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, payload = data.split(b"\r\n\r\n", 1)
    answer.append((int(head[9:12]), json.loads(payload)))


def test_sigterm_drains_in_flight_requests(service_packages, tmp_path):
    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orthornn", "serve", "--repo", str(repo), "--port", str(port),
         "--shutdown-delay-s", "1", "--log-level", "warning"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    seqs = [[0.1, 0.2, 0.3], [0.5] * 64]
    try:
        wait_ready(proc, url, timeout=60)
        answers, threads, halves, go_on = [], [], [], threading.Event()
        for s in seqs:
            body = json.dumps({"model": "digits", "inputs": [s]}).encode()
            halves.append(threading.Event())
            threads.append(threading.Thread(target=_slow_request,
                                            args=(port, body, halves[-1], go_on, answers)))
            threads[-1].start()
        for h in halves:
            assert h.wait(30)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # two requests are half-way through their bodies
        # readiness turns 503 at once (a TransportError here: the listener closed before
        # readiness was seen turning, i.e. no 503 for the shutdown delay)
        wait_until(lambda: httpx.get(url + "/v2/health/ready", timeout=5).status_code == 503,
                   what="readiness 503 after SIGTERM")

        def closed() -> bool:  # past the shutdown delay: the listener is closed
            try:
                httpx.get(url + "/v2/health/live", timeout=2)
            except httpx.TransportError:
                return True
            return False
        wait_until(closed, what="the listener closed after the shutdown delay")
        assert time.monotonic() - signalled >= 1.0  # not before it
        assert proc.poll() is None  # still finishing the two requests
        go_on.set()
        for t in threads:
            t.join(timeout=30)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(answers) == 2
    ref = reference(repo / "digits" / "1", [np.array(s)[:, None] for s in seqs])
    for status, body in answers:
        assert status == 200
        probs = np.array(body["outputs"][0]["probabilities"])
        match = [r for r in ref if np.allclose(probs, np.exp(r["logits"])
                                               / np.exp(r["logits"]).sum(), atol=1e-6)]
        assert len(match) == 1, probs


def test_serve_logs_once_that_it_is_ready_and_where(service_packages, tmp_path):
    """With the default log level, one INFO line on stderr says the service is ready, at
    which address (--port 0: the port it bound) and with which models; the address in it
    answers."""
    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1], "words": [1]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTHORNN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orthornn", "serve", "--repo", str(repo), "--port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if " ready on " in line:
                ready.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(60), "".join(lines)[-3000:]
        line = next(line for line in lines if " ready on " in line)
        found = re.fullmatch(r"\S+ \S+ INFO orthornn\.service: ready on "
                             r"(http://127\.0\.0\.1:([0-9]+)) \(2 models: digits v1, words v1\)",
                             line.strip())
        assert found and int(found.group(2)) > 0, line
        url = found.group(1)
        assert httpx.get(url + "/v2/health/ready", timeout=5).status_code == 200
        assert httpx.post(url + "/predict", json={"model": "digits", "inputs": [[0.1]]},
                          timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    assert sum(" ready on " in line for line in lines) == 1, "".join(lines)

def test_middleware_root_path_and_admission_apply_to_every_route(service_packages, tmp_path):
    """One route table behind one middleware stack: a middleware added with add_middleware
    sees the fast-path routes too; the table answers under a root_path; beyond
    max_inflight_requests a request gets 503 + Retry-After at once while health answers."""
    repo = make_repo(service_packages, tmp_path, {"digits": [1]})
    seen: list[str] = []

    class Tag:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                seen.append(scope["path"])
            await self.app(scope, receive, send)

    srv = LiveServer(repo=repo, max_inflight_requests=1)
    srv.app.add_middleware(Tag)  # as a user would, after create_app
    with srv:
        body = json.dumps({"model": "digits", "inputs": [[0.1, 0.2]]}).encode()
        x = {"name": "x", "shape": [1, 2, 1], "datatype": "FP32", "data": [0.1, 0.2]}
        assert httpx.post(srv.url + "/predict", content=body).status_code == 200
        assert httpx.post(srv.url + "/v2/models/digits/infer", json={"inputs": [x]}
                          ).status_code == 200
        assert httpx.get(srv.url + "/v2/models/digits").status_code == 200
        assert httpx.get(srv.url + "/openapi.json").status_code == 200
        assert seen == ["/predict", "/v2/models/digits/infer", "/v2/models/digits",
                        "/openapi.json"]
        # one request whose body is in and whose answer waits holds the only slot (a body
        # still arriving holds none: admission takes the slot once the body is in)
        go_on, half, answers = threading.Event(), threading.Event(), []
        predict = srv.app.state.dataplane.predict

        async def gated(req, *args, **kwargs):
            if req.top_k == 1:
                half.set()
                while not go_on.is_set():
                    await asyncio.sleep(0.005)
            return await predict(req, *args, **kwargs)

        def waiting() -> None:
            held = json.dumps({"model": "digits", "inputs": [[0.1, 0.2]], "top_k": 1})
            answer = httpx.post(srv.url + "/predict", content=held, timeout=30)
            answers.append((answer.status_code, answer.json()))

        srv.app.state.dataplane.predict = gated
        slow = threading.Thread(target=waiting)
        slow.start()
        assert half.wait(30)  # in predict: admission has given it the slot
        refused = httpx.post(srv.url + "/predict", content=body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "overloaded" in refused.json()["error"]
        assert httpx.get(srv.url + "/v2/health/ready").status_code == 200
        go_on.set()
        slow.join(30)
        assert answers and answers[0][0] == 200
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'endpoint="/predict",model="_unknown",status="503"' in metrics
        # metadata is counted under its model
        assert re.search(r'orthornn_requests_total\{endpoint="/v2/models/\{name\}",'
                         r'model="digits",status="200",version="1"\}', metrics)
    from fastapi.testclient import TestClient

    app = create_app(Settings(repo=repo, poll_interval_s=0))
    with TestClient(app, root_path="/api") as c:
        app.state.registry.scanned.wait(60)
        r = c.post("/api/predict", content=body)
        assert r.status_code == 200 and r.json()["model"] == "digits"


def test_listener_accepts_every_waiting_connection_at_once():
    """libuv (uvloop) accepts one connection per loop iteration; the service's listener
    takes every connection in the kernel's queue on one readiness event, so a busy loop
    does not leave new clients waiting seconds for their first byte."""
    import asyncio
    import socket

    import uvloop
    from orthornn.service.server.listener import EagerListener

    async def main():
        made, received = [], []

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport):
                made.append(transport)

            def data_received(self, data):
                received.append(data)

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        listener = EagerListener(sock, Protocol, backlog=256)
        clients = [socket.create_connection(sock.getsockname()) for _ in range(100)]
        listener._accept()  # one readiness event
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(made) == 100
        for c in clients:  # each accepted connection reads its client's bytes
            c.sendall(b"x")
        await wait_until_async(lambda: len(received) >= 100, timeout=30,
                               what=lambda: f"{len(received)} of 100 bytes received")
        assert received == [b"x"] * 100
        listener.close()
        with pytest.raises(OSError):
            socket.create_connection(sock.getsockname(), timeout=1)
        for transport in made:
            transport.close()
        for c in clients:
            c.close()

    uvloop.run(main())


def test_listener_pauses_when_out_of_file_descriptors(monkeypatch):
    import asyncio
    import errno
    import socket

    import uvloop
    from orthornn.service.server.listener import EagerListener

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setattr(EagerListener, "RETRY_S", 0.05)
        listener = EagerListener(sock, asyncio.Protocol, backlog=16)
        calls = []

        class Full:  # accept() as it behaves at the process's descriptor limit
            def __getattr__(self, name):
                return getattr(sock, name)

            def accept(self):
                calls.append(time.monotonic())
                raise OSError(errno.EMFILE, "Too many open files")

        listener.sock = Full()
        client = socket.create_connection(sock.getsockname())
        # paused at each failure: no busy loop on a readable listener, each retry (resumed)
        # RETRY_S after the failure before it
        await wait_until_async(lambda: len(calls) >= 3, timeout=30,
                               what=lambda: f"three accept tries: {calls}")
        gaps = [b - a for a, b in itertools.pairwise(calls)]
        assert min(gaps) >= 0.045, gaps
        client.close()

        made = []

        class Flaky(Full):  # one connection's error (a firewall's EPERM): skip it, no pause
            def accept(self):
                if not calls or calls[-1] != "eperm":
                    calls.append("eperm")
                    raise OSError(errno.EPERM, "Operation not permitted")
                return sock.accept()

        calls.clear()
        listener.sock = Flaky()
        listener.protocol_factory = lambda: type("P", (asyncio.Protocol,), {
            "connection_made": lambda self, t: made.append(t)})()
        client2 = socket.create_connection(sock.getsockname())
        await wait_until_async(lambda: len(made) >= 2, timeout=30,
                               what=lambda: f"two connections made: {made}, {calls}")
        # both queued connections (the one left waiting while paused, and the new one)
        assert calls == ["eperm"] and len(made) == 2
        for transport in made:
            transport.close()
        client2.close()
        listener.close()
        client.close()

    uvloop.run(main())


# -- the eager listener and uvicorn's internals (service/server/listener.py) ------------------

def test_uvicorn_provides_what_the_eager_listener_uses(service_packages, tmp_path):
    """The contract: against the pinned uvicorn nothing is missing, and the listener in
    place is ours. An upgrade that drops an attribute fails here, naming it."""
    from orthornn.service.server.listener import EagerListener, surface_problems

    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    with LiveServer(repo=repo) as live:
        assert surface_problems(live.server) == []
        assert all(isinstance(s, EagerListener) for s in live.server.servers)
        assert httpx.get(live.url + "/v2/health/ready").status_code == 200


def test_a_missing_uvicorn_attribute_is_named_with_the_fallback():
    from orthornn.service.server.listener import listen_eagerly, surface_problems

    class Changed:  # a uvicorn whose Server lost server_state and lifespan
        config = type("Config", (), {"http_protocol_class": None})()
        servers: ClassVar[list] = []

    problems = surface_problems(Changed())
    assert problems == ["uvicorn.Config.http_protocol_class", "uvicorn.Server.server_state",
                        "uvicorn.Server.lifespan.state"]
    with pytest.raises(RuntimeError, match=r"lacks what the eager listener uses: "
                                           r"uvicorn\.Config\.http_protocol_class.*"
                                           r"--listener uvicorn"):
        listen_eagerly(Changed(), [])


def test_listener_uvicorn_serves_with_uvicorns_own_server(service_packages, tmp_path):
    from orthornn.service.server.listener import EagerListener

    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    with LiveServer(repo=repo, listener="uvicorn") as live:
        assert live.server.servers and not any(isinstance(s, EagerListener)
                                               for s in live.server.servers)
        r = httpx.post(live.url + "/predict", json={"model": "digits", "inputs": [[0.5] * 8]})
        assert r.status_code == 200 and r.json()["version"] == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.parametrize("listener", ["eager", "uvicorn"])
def test_tls_works_through_either_listener(service_packages, tmp_path, listener):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    with LiveServer(uvicorn_options={"ssl_certfile": str(cert), "ssl_keyfile": str(key)},
                    repo=repo, listener=listener) as live:
        assert live.url.startswith("https://")
        r = httpx.post(live.url + "/predict", json={"model": "digits", "inputs": [[0.5] * 8]},
                       verify=ssl.create_default_context(cafile=str(cert)))
        assert r.status_code == 200 and r.json()["version"] == 1
