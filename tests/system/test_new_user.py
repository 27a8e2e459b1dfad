"""What a new user hits (issue 14): the predict client's file formats, progress in logs,
the input preprocessing a model records and the service checks, <unk> in language-model
answers, the command-line edges (defaults, missing flags, a busy port, an open repository
API) and the service's smaller edges (empty repository, metadata metrics, token ids)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from orthornn.export.artifacts.package import PackageError, read_manifest
from orthornn.service.commands.predict import _request_body
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings

from orthornn.cli import main

from ..service_helpers import make_repo

ROOT = Path(__file__).resolve().parents[2]


def orthornn(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "orthornn", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# -- 1. the predict client reads .npy and .npz ----------------------------------------------

def test_predict_client_reads_npy(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2) / 10
    np.save(tmp_path / "x.npy", x)
    body = _request_body(tmp_path / "x.npy", "m", None, 3)
    assert body == {"inputs": x.tolist(), "model": "m", "top_k": 3}
    np.save(tmp_path / "tokens.npy", np.array([[1, 2, 3]], dtype=np.int32))
    assert _request_body(tmp_path / "tokens.npy", "w", 2, None)["inputs"] == [[1, 2, 3]]


def test_predict_client_reads_npz_with_lengths(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    np.savez(tmp_path / "x.npz", x=x, lengths=np.array([3, 1]))
    body = _request_body(tmp_path / "x.npz", "m", None, None)
    assert body["inputs"] == [x[0].tolist(), x[1, :1].tolist()]
    np.savez(tmp_path / "bad.npz", y=x)
    with pytest.raises(ValueError, match="has no array 'x'"):
        _request_body(tmp_path / "bad.npz", "m", None, None)
    np.savez(tmp_path / "badlen.npz", x=x, lengths=np.array([4, 1]))
    with pytest.raises(ValueError, match=r"lengths must be 2 integers in \[1, 3\]"):
        _request_body(tmp_path / "badlen.npz", "m", None, None)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    assert main(["predict", "--url", "http://127.0.0.1:9", "--model", "m",
                 str(tmp_path / "junk.npy")]) == 2


def test_predict_client_defaults_to_the_local_service_and_one_line_per_sequence(
        tmp_path, monkeypatch, capsys):
    """Without --url the client asks the quickstart's address; it prints a line per
    sequence (--verbose: the whole answer), whatever the model's task."""
    from orthornn.service.commands import predict as predict_client

    asked = []
    answer = {"model": "m", "version": 3, "outputs": [
        {"label": "4", "index": 1, "probabilities": [0.01, 0.98, 0.01]},
        {"label": "cat", "index": 0, "probabilities": [0.5, 0.25, 0.25],
         "top_k": [{"label": "cat", "index": 0, "probability": 0.5},
                   {"label": "dog", "index": 1, "probability": 0.25}]},
        {"value": 0.123456},
        {"value": [1.5, -2.0]},
        {"labels": ["B", "I", "O"], "indices": [0, 1, 2]},
        {"next_tokens": [{"token": "the", "id": 2, "probability": 0.31},
                         {"token": ",", "id": 7, "probability": 0.2}],
         "log_likelihood": -1.0, "perplexity": 2.718281, "tokens": 1},
        {"next_tokens": [{"token": "cat", "id": 5, "probability": 1.0}],
         "log_likelihood": 0.0, "perplexity": None, "tokens": 0},
    ]}

    def post(url, body, timeout):
        asked.append(url)
        return answer
    monkeypatch.setattr(predict_client, "_post_predict", post)
    (tmp_path / "x.json").write_text("[[0.1]]")
    assert main(["predict", "--model", "m", str(tmp_path / "x.json")]) == 0
    assert asked == ["http://127.0.0.1:8000"]
    assert capsys.readouterr().out.splitlines() == [
        "0: 4 (p=0.98)",
        "1: cat (p=0.5); top 2: cat 0.5, dog 0.25",
        "2: 0.1235",
        "3: [1.5, -2]",
        "4: B I O",
        '5: next: "the" 0.31, "," 0.2; perplexity 2.718',
        '6: next: "cat" 1',
    ]
    assert main(["predict", "--model", "m", "--verbose", str(tmp_path / "x.json")]) == 0
    assert json.loads(capsys.readouterr().out) == answer
    help_text = " ".join(orthornn("predict", "--help", timeout=60).stdout.split())
    assert "(default http://127.0.0.1:8000," in help_text
    assert "--verbose, -v print the whole JSON answer" in help_text
    assert "'0: 4 (p=0.98)'" in help_text

# -- 2. progress lines when stderr is not a terminal -----------------------------------------

PROGRESS = re.compile(r"^train svdrnn adding: step (\d+)/40 \(\d+%\), ([\d.]+|rate \?)")


def test_train_and_export_write_progress_lines_to_a_log(tmp_path):
    env = {"ORTHORNN_PROGRESS_INTERVAL_S": "0"}
    run = tmp_path / "run"
    result = orthornn("train", "--task", "adding", "--seq-len", "5", "--hidden", "8",
                      "--steps", "40", "--batch-size", "8", "--log-every", "20", "--out", run,
                      env=env)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if PROGRESS.match(line)]
    assert len(lines) >= 10, result.stderr  # one per step with a 0 s interval
    assert "\r" not in result.stderr  # lines, not a redrawn bar
    assert all("step/s" in line for line in lines[1:])
    assert any("ETA" in line for line in lines[1:-1]) and lines[-1].startswith(
        "train svdrnn adding: step 40/40 (100%)")
    exported = orthornn("export", run, "--repo", tmp_path / "repo", "--name", "adder",
                        env=env)
    assert exported.returncode == 0, exported.stderr
    stages = [line for line in exported.stderr.splitlines() if line.startswith("export adder")]
    assert stages[-1].startswith("export adder: stage 3/3 (100%)"), exported.stderr
    assert any("ETA" in line for line in stages)
    quiet = orthornn("train", "--task", "adding", "--seq-len", "5", "--hidden", "8",
                     "--steps", "4", "--batch-size", "8", "--out", tmp_path / "q",
                     "--no-progress", env=env)
    assert quiet.returncode == 0 and "step" not in quiet.stderr


# -- 3. input preprocessing is part of the model ----------------------------------------------

def test_training_records_preprocessing_and_the_manifest_carries_it(service_packages):
    manifest = read_manifest(service_packages / "digits" / "1")
    pre = manifest.preprocessing
    assert pre["transform"]["kind"] == "affine" and pre["transform"]["scale"] == [16.0]
    assert "divided by 16" in pre["transform"]["description"]
    stats = pre["training_range"]
    assert stats["min"] == [0.0] and stats["max"] == [1.0]
    assert 0 < stats["mean"][0] < 1 and stats["source"].startswith("training set")
    adding = read_manifest(service_packages / "adding" / "1").preprocessing
    assert adding["transform"] is None and len(adding["training_range"]["max"]) == 2
    assert read_manifest(service_packages / "words" / "1").preprocessing is None
    from orthornn.export.artifacts.package import check_preprocessing

    with pytest.raises(PackageError, match=r"training_range\.max"):
        check_preprocessing({"training_range": {"mean": [0], "std": [1], "min": [0],
                                                "max": [1, 2]}}, 1)


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("new-user-repo"),
                     {"adding": [1], "digits": [1], "words": [1]})


@pytest.fixture(scope="module")
def client(repo):
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    with TestClient(app, raise_server_exceptions=False) as c:
        app.state.registry.scanned.wait(60)
        assert app.state.registry.ready()
        yield c


def _counter(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_model_metadata_shows_the_preprocessing(client, service_packages):
    params = client.get("/v2/models/digits").json()["parameters"]
    assert params["preprocessing"] == read_manifest(
        service_packages / "digits" / "1").preprocessing


def test_inputs_far_outside_the_training_range_get_a_warning_and_a_metric(client):
    pixels = [float(v) for v in ([0, 3, 16, 12] * 16)]  # raw 0-16 values, not / 16
    before = _counter(client.get("/metrics").text, "orthornn_inputs_out_of_range_total",
                      model="digits")
    r = client.post("/predict", json={"model": "digits", "inputs": [pixels]})
    assert r.status_code == 200
    warning = r.headers["orthornn-input-warning"]
    assert "inputs[0] feature 0: 16 is far outside the training range [0, 1]" in warning
    assert "GET /v2/models/digits" in warning
    scaled = client.post("/predict", json={"model": "digits", "inputs": [
        [p / 16 for p in pixels]]})
    assert scaled.status_code == 200 and "orthornn-input-warning" not in scaled.headers
    oip = client.post("/v2/models/digits/infer", json={"inputs": [
        {"name": "x", "shape": [1, 64, 1], "datatype": "FP32", "data": pixels}]})
    assert oip.status_code == 200 and "inputs[x][0] feature 0" in oip.headers[
        "orthornn-input-warning"]
    after = _counter(client.get("/metrics").text, "orthornn_inputs_out_of_range_total",
                     model="digits")
    assert after == before + 2


# -- 4. language models do not propose <unk> unless asked ------------------------------------

def test_next_tokens_and_generate_leave_out_unk_unless_allowed(client):
    body = {"model": "words", "text": ["the cat sat on the"], "top_k": 20}
    default = client.post("/predict", json=body).json()["outputs"][0]["next_tokens"]
    allowed = client.post("/predict", json={**body, "allow_unk": True}).json()
    everything = allowed["outputs"][0]["next_tokens"]  # the whole (small) vocabulary
    assert "<unk>" in [c["token"] for c in everything]
    assert "<unk>" not in [c["token"] for c in default] and len(default) == len(everything) - 1
    for seed in range(5):  # sampling from a near-uniform tiny model would hit <unk> often
        gen = client.post("/generate", json={"model": "words", "prompt": "the", "seed": seed,
                                             "max_new_tokens": 30, "temperature": 2.0,
                                             "stop_at_eos": False}).json()
        assert "<unk>" not in gen["tokens"], gen
    greedy_unk = [client.post("/generate", json={
        "model": "words", "prompt": "the", "seed": s, "max_new_tokens": 30, "temperature": 2.0,
        "stop_at_eos": False, "allow_unk": True}).json()["tokens"] for s in range(5)]
    assert any("<unk>" in tokens for tokens in greedy_unk)
    r = client.post("/predict", json={"model": "digits", "inputs": [[0.5]], "allow_unk": True})
    assert r.status_code == 400 and r.json()["error"].startswith("allow_unk:")


# -- 6. smaller edges ---------------------------------------------------------------------------

def test_out_of_range_token_ids_are_echoed_as_integers(client):
    r = client.post("/predict", json={"model": "words", "inputs": [[1, 999999]]})
    assert r.status_code == 400
    assert r.json()["error"].endswith("got 999999"), r.json()


def test_model_metadata_requests_are_counted_under_the_model(client):
    for path in ("/v2/models/digits", "/v2/models/digits/versions/1", "/v2/models/digits/ready",
                 "/v2/models/digits/config"):
        assert client.get(path).status_code == 200
    text = client.get("/metrics").text
    for endpoint in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}",
                     "/v2/models/{name}/ready", "/v2/models/{name}/config"):
        assert _counter(text, "orthornn_requests_total", model="digits",
                        endpoint=endpoint) >= 1, endpoint
    assert client.get("/v2/models/nope").status_code == 404  # unknown: bounded cardinality
    assert _counter(client.get("/metrics").text, "orthornn_requests_total", model="_unknown",
                    endpoint="/v2/models/{name}") == 1


def test_empty_repository_logs_a_warning_and_is_ready(tmp_path, caplog):
    app = create_app(Settings(repo=tmp_path, poll_interval_s=0))
    with caplog.at_level(logging.WARNING, logger="orthornn.service"), \
            TestClient(app) as c:
        app.state.registry.scanned.wait(30)
        assert c.get("/v2/health/ready").status_code == 200
    assert any("holds no model versions" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_train_help_shows_every_default():
    from orthornn.training import tasks, trainer
    from orthornn.training.cli import UNSET
    from orthornn.training.config import TrainConfig

    from orthornn.cli import build_parser

    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    for action in train._actions:
        if action.dest in ("help",):
            continue
        assert action.help and "default" in action.help, action.option_strings
    for f in dataclasses.fields(TrainConfig):
        if f.default is None:
            assert f.name in UNSET, f.name
    assert UNSET["steps"].startswith(f"{trainer.DEFAULT_STEPS} ")
    lm = inspect.signature(tasks.lm_task).parameters
    assert UNSET["vocab_size"] == str(lm["vocab_size"].default)
    assert UNSET["bptt"] == str(lm["bptt"].default)
    adding, copy = (inspect.signature(build).parameters["seq_len"].default
                    for build in (tasks.adding_task, tasks.copy_task))
    assert UNSET["seq_len"] == f"{adding} for adding, {copy} for copy"


def test_missing_required_flags_are_named(tmp_path, capsys):
    assert main(["train", "--task", "ucr", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--dataset" in err and "GunPoint" in err and "None" not in err
    assert len(err.splitlines()) == 1
    assert main(["train", "--task", "adding"]) == 2
    assert "--out RUN_DIR is required" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_serve_refuses_a_busy_port_before_loading_models(repo):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        result = orthornn("serve", "--repo", repo, "--port", port, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port} on 127.0.0.1 is already in use" in lines[0]
    assert "loaded" not in result.stderr and time.monotonic() - start < 30


# -- 7. the repository API is closed beyond loopback without a token ----------------------------

def test_repository_api_exposure_rules(tmp_path):
    def refusal(**kw):
        return Settings(repo=tmp_path, **kw).repository_api_exposure()

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert refusal(host=host) is None
    message = refusal(host="0.0.0.0")
    assert "ORTHORNN_ADMIN_TOKEN" in message and "--allow-open-repository-api" in message
    assert refusal(host="example.internal") is not None
    assert refusal(host="0.0.0.0", admin_token="secret") is None
    assert refusal(host="0.0.0.0", allow_open_repository_api=True) is None


def test_serve_beyond_loopback_without_token_refuses_to_start(repo):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTHORNN_")}
    result = subprocess.run([sys.executable, "-m", "orthornn", "serve", "--repo", str(repo),
                             "--host", "0.0.0.0", "--port", "0"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "ORTHORNN_ADMIN_TOKEN" in line and "--allow-open-repository-api" in line
    env["ORTHORNN_ALLOW_OPEN_REPOSITORY_API"] = "true"
    with socket.socket() as busy:  # allowed: it gets as far as the (busy) port
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        allowed = subprocess.run([sys.executable, "-m", "orthornn", "serve", "--repo",
                                  str(repo), "--host", "0.0.0.0", "--port", str(port)],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert allowed.returncode == 2 and "already in use" in allowed.stderr
    flag = subprocess.run([sys.executable, "-m", "orthornn", "serve", "--repo", str(repo),
                           "--host", "0.0.0.0", "--port", str(port),
                           "--allow-open-repository-api", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert "--allow-open-repository-api" in flag.stdout


def test_manifest_round_trips_preprocessing_json(service_packages):
    data = json.loads((service_packages / "digits" / "1" / "manifest.json").read_text())
    assert "preprocessing" in data and data["preprocessing"]["training_range"]["count"] > 0


def test_quickstart_checks_port_and_exposure_before_training(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = orthornn("quickstart", "--dir", tmp_path / "qs", "--port", port, timeout=60)
    assert result.returncode == 2 and "already in use" in result.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTHORNN_")}
    result = subprocess.run([sys.executable, "-m", "orthornn", "quickstart", "--dir",
                             str(tmp_path / "qs"), "--host", "0.0.0.0"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "ORTHORNN_ADMIN_TOKEN" in result.stderr
    assert not (tmp_path / "qs").exists()  # nothing trained
