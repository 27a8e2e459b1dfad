"""Streaming: a sequence sent in chunks, continuing from a client-held state or a
server-side session, answers what one /predict of the whole sequence answers (the
independent reference: that request, and onnxruntime run directly on the package);
every way a state or a session can be wrong is a clear 4xx."""

from __future__ import annotations

import itertools
import random
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings

from ...service_helpers import OWNER, golden, make_repo, publish_copy, reference, softmax


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("stream-repo"),
                     {"adding": [4, 5], "digits": [1], "words": [1]})


@pytest.fixture(scope="module")
def client(repo):
    app = create_app(Settings(repo=repo, keep_versions=2, poll_interval_s=0, max_sessions=4))
    with TestClient(app, raise_server_exceptions=False, headers=OWNER) as c:
        app.state.registry.scanned.wait(60)
        assert app.state.registry.ready()
        yield c


def _chunks(seq, rng: random.Random) -> list:
    """A random split into chunks of 1 .. 5 steps."""
    bounds, t = [0], 0
    while t < len(seq):
        t = min(len(seq), t + rng.randint(1, 5))
        bounds.append(t)
    return [seq[a:b] for a, b in itertools.pairwise(bounds)]


def _seq(repo, name: str, version: int = 1) -> list:
    g = golden(repo / name / str(version))
    key = "model/tokens" if name == "words" else "model/x"
    return g[key][0][: g["model/lengths"][0]].tolist()


def _post(client, body: dict) -> dict:
    r = client.post("/predict", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _same(final: dict, whole: dict) -> None:
    for key in ("probabilities", "value"):
        if key in whole:
            np.testing.assert_allclose(final[key], whole[key], atol=1e-5)
    if "next_tokens" in whole:
        assert [t["id"] for t in final["next_tokens"]] == [t["id"] for t in whole["next_tokens"]]
        np.testing.assert_allclose([t["probability"] for t in final["next_tokens"]],
                                   [t["probability"] for t in whole["next_tokens"]], atol=1e-5)


@pytest.mark.parametrize("name,version", [("digits", 1), ("adding", 5), ("words", 1)])
@pytest.mark.parametrize("how", ["one step at a time", "random chunks", "one chunk"])
def test_client_state_chunks_equal_the_whole_sequence(client, repo, name, version, how):
    seq = _seq(repo, name, version)
    whole = _post(client, {"model": name, "inputs": [seq]})["outputs"][0]
    rng = random.Random(hash(how) % 1000)
    chunks = ([seq[t:t + 1] for t in range(len(seq))] if how == "one step at a time" else
              _chunks(seq, rng) if how == "random chunks" else [seq])
    state, ll, scored = None, 0.0, 0
    for chunk in chunks:
        body = {"model": name, "inputs": [chunk], "return_state": True}
        if state is not None:
            body["states"] = [state]
        answer = _post(client, body)
        assert answer["version"] == version  # the state continues the version that made it
        out = answer["outputs"][0]
        state = out["state"]
        assert set(state) == {"model", "version", "data"} and state["version"] == version
        if name == "words":
            ll, scored = ll + out["log_likelihood"], scored + out["tokens"]
    _same(out, whole)
    if name == "words":  # every token after the first is scored once, whatever the chunks
        assert scored == whole["tokens"]
        assert ll == pytest.approx(whole["log_likelihood"], abs=1e-4)
    # and the state is onnxruntime's own, run on the whole sequence
    ref = reference(repo / name / str(version), [np.array(seq)])[0]["state"]
    data = np.frombuffer(__import__("base64").b64decode(state["data"]), "<f4")
    np.testing.assert_allclose(data, ref, atol=1e-5)


@pytest.mark.parametrize("name", ["digits", "words"])
def test_session_chunks_equal_the_whole_sequence(client, repo, name):
    seq = _seq(repo, name)
    whole = _post(client, {"model": name, "inputs": [seq]})["outputs"][0]
    chunks = _chunks(seq, random.Random(3))
    for k, chunk in enumerate(chunks):
        body = {"model": name, "inputs": [chunk], "session": f"s-{name}", "start": k == 0,
                "end": k == len(chunks) - 1}
        answer = _post(client, body)
        assert answer["session"] == f"s-{name}" and "state" not in answer["outputs"][0]
    _same(answer["outputs"][0], whole)
    r = client.post("/predict", json={"model": name, "inputs": [chunks[0]],
                                      "session": f"s-{name}"})
    assert r.status_code == 404 and f"session 's-{name}' is not open" in r.json()["error"]


def test_per_step_labels_each_prefix(client, repo):
    seq = _seq(repo, "digits")
    ref = reference(repo / "digits" / "1", [np.array(seq[:t]) for t in range(1, len(seq) + 1)])
    steps, state = [], None
    for chunk in _chunks(seq, random.Random(5)):
        body = {"model": "digits", "inputs": [chunk], "per_step": True, "return_state": True}
        if state:
            body["states"] = [state]
        out = _post(client, body)["outputs"][0]
        assert out["probabilities"] == out["steps"][-1]["probabilities"]
        steps += out["steps"]
        state = out["state"]
    assert len(steps) == len(seq)
    for step, r in zip(steps, ref, strict=True):
        np.testing.assert_allclose(step["probabilities"], softmax(r["logits"].astype(float)),
                                   atol=1e-5)
    r = client.post("/predict", json={"model": "words", "inputs": [[1, 2]], "per_step": True})
    assert r.status_code == 400 and "per_step" in r.json()["error"]


def _state(client, name="adding", version=4, seq=None):
    seq = seq or [[0.5, 1.0], [0.2, 0.0]]
    body = {"model": name, "version": version, "inputs": [seq], "return_state": True}
    return _post(client, body)["outputs"][0]["state"]


@pytest.mark.parametrize("mutate,status,message", [
    (lambda s: {**s, "version": 5}, 409, "a state only continues the version that made it"),
    (lambda s: {**s, "model": "digits"}, 409, "cannot continue on model 'adding'"),
    (lambda s: {**s, "data": s["data"][:-8]}, 400, "the state of this model has 8 numbers"),
    (lambda s: {**s, "data": __import__("base64").b64encode(
        np.full(8, np.nan, "<f4").tobytes()).decode()}, 400, "non-finite"),
    (lambda s: {**s, "data": "***"}, 400, "not valid base64"),
    (lambda s: {"version": 4}, 400, "exactly as a response returned it"),
    (lambda s: "opaque", 400, "exactly as a response returned it"),
])
def test_bad_states_are_refused(client, mutate, status, message):
    bad = mutate(_state(client))
    r = client.post("/predict", json={"model": "adding", "version": 4, "inputs": [[[0.1, 0]]],
                                      "states": [bad]})
    assert r.status_code == status and message in r.json()["error"], r.text


def test_state_routes_to_its_version_and_refuses_another(client):
    state = _state(client, version=4)
    answer = _post(client, {"model": "adding", "inputs": [[[0.1, 0.0]]], "states": [state]})
    assert answer["version"] == 4  # not the newest (5): the state's own version
    r = client.post("/predict", json={"model": "adding", "version": 5, "inputs": [[[0.1, 0]]],
                                      "states": [state]})
    assert r.status_code == 409 and "made by version 4" in r.json()["error"]
    r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0]], [[0.2, 0]]],
                                      "states": [state]})
    assert r.status_code == 400 and "one per sequence" in r.json()["error"]


def test_a_state_of_another_model_is_409_whatever_versions_are_loaded(client):
    """adding runs versions 4 and 5, digits only version 1: a state of adding is refused
    by digits with 409 naming both models, before any version is looked up (not 404 for
    digits' missing version 4 or 5)."""
    seq = [[0.1], [0.2]]
    for state in (_state(client, version=4), _state(client, version=5)):
        for extra in ({}, {"version": 1}):
            r = client.post("/predict", json={"model": "digits", "inputs": [seq],
                                              "states": [state], **extra})
            error = r.json()["error"]
            assert r.status_code == 409, r.text
            assert error.startswith("states[0]: a state of model 'adding'") and \
                "cannot continue on model 'digits'" in error, error
    # the second of two states belongs to another model: named by its index
    words = _state(client, name="words", version=1, seq=[1, 2])
    r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0]], [[0.2, 0]]],
                                      "states": [_state(client), words]})
    assert r.status_code == 409 and r.json()["error"].startswith(
        "states[1]: a state of model 'words'"), r.text
    # a state of this model whose version is not loaded: 404 (the documented answer after
    # a hot swap), saying the version is the state's
    r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0]]],
                                      "states": [{**_state(client), "version": 9}]})
    assert r.status_code == 404, r.text
    assert "states: made by model 'adding' version 9, which is not loaded (loaded: [4, 5])" \
        in r.json()["error"]


@pytest.mark.parametrize("data,kind", [(0.75, "a number"), (3, "a number"),
                                       ([0.0] * 8, "a list"), ({"a": 1}, "an object"),
                                       (None, "null"), (True, "a boolean")])
def test_a_state_whose_data_is_not_a_string_is_named(client, data, kind):
    state = {**_state(client), "data": data}
    for version in ({}, {"version": 4}, {"version": 5}):  # the same answer on every path
        r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0]]],
                                          "states": [state], **version})
        assert r.status_code == 400 and r.json()["error"] == (
            f"states[0].data must be a string (the base64 state an earlier answer "
            f"returned); got {kind}"), r.text
    r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0]]],
                                      "states": [{**_state(client), "version": "4"}]})
    assert r.status_code == 400 and r.json()["error"] == (
        "states[0].version must be an integer (the version that made the state); got a "
        "string"), r.text

def test_session_errors(client):
    def post(**body):
        return client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0.0]]],
                                             **body})
    assert post(session="e1", start=True, version=4).status_code == 200
    r = post(session="e1", start=True)
    assert r.status_code == 409 and "already open" in r.json()["error"]
    r = post(session="e1", version=5)
    assert r.status_code == 409 and "runs on version 4, not 5" in r.json()["error"]
    r = post(session="e1", states=[_state(client)])
    assert r.status_code == 400 and "states: not with 'session'" in r.json()["error"]
    r = client.post("/predict", json={"model": "digits", "inputs": [[0.1]], "session": "e1"})
    assert r.status_code == 400 and "belongs to model 'adding'" in r.json()["error"]
    r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1, 0]], [[0.1, 0]]],
                                      "session": "e1"})
    assert r.status_code == 400 and "one sequence per request" in r.json()["error"]
    r = post(session="nope")
    assert r.status_code == 404 and "session 'nope' is not open" in r.json()["error"]
    assert post(end=True).status_code == 400  # end without a session
    r = post(session="bad id!", start=True)
    assert r.status_code == 400 and "session" in r.json()["error"]
    # a failed first chunk opens nothing
    r = client.post("/predict", json={"model": "adding", "inputs": [[[0.1]]], "session": "e2",
                                      "start": True})
    assert r.status_code == 400
    assert post(session="e2").status_code == 404
    assert post(session="e1", end=True).status_code == 200
    # the maximum (4 in this app): the fifth open session gets 429
    for i in range(4):
        assert post(session=f"m{i}", start=True).status_code == 200
    r = post(session="m4", start=True)
    assert r.status_code == 429 and "maximum of 4" in r.json()["error"]
    assert r.headers["retry-after"] == "1"
    for i in range(4):
        assert post(session=f"m{i}", end=True).status_code == 200
    metrics = client.get("/metrics").text
    assert "orthornn_sessions_active 0.0" in metrics
    assert re.search(r'orthornn_session_starts_total\{model="adding"\} ([0-9.]+)', metrics)
    assert 'orthornn_session_ends_total{model="adding"}' in metrics


def test_concurrent_chunks_of_one_session_never_interleave(client, repo):
    """The same chunk sent 12 times at once: applied one after another (in any order the
    result is the 12-fold sequence), no update lost."""
    chunk = [[0.3, 0.0], [0.1, 1.0], [0.7, 0.0]]
    assert _post(client, {"model": "adding", "version": 4, "inputs": [chunk],
                          "session": "c", "start": True})
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: client.post("/predict", json={
            "model": "adding", "inputs": [chunk], "session": "c"}), range(11)))
    assert all(a.status_code == 200 for a in answers)
    final = _post(client, {"model": "adding", "inputs": [[[0.0, 0.0]]], "session": "c",
                           "end": True})
    # longer than the model's max_length: onnxruntime on the package is the reference
    whole = reference(repo / "adding" / "4", [np.array(chunk * 12 + [[0.0, 0.0]], np.float32)])
    np.testing.assert_allclose(final["outputs"][0]["value"], whole[0]["value"][0], atol=1e-5)


def test_session_keeps_its_version_across_a_hot_swap(service_packages, tmp_path):
    repo = make_repo(service_packages, tmp_path, {"adding": [1]})
    app = create_app(Settings(repo=repo, poll_interval_s=0.05))
    seq = [[0.5, 1.0], [0.25, 0.0], [0.1, 1.0]]
    with TestClient(app, raise_server_exceptions=False, headers=OWNER) as c:
        registry = app.state.registry
        registry.scanned.wait(60)
        assert _post(c, {"model": "adding", "inputs": [seq[:1]], "session": "pin",
                         "start": True})["version"] == 1
        publish_copy(service_packages / "adding" / "2", repo / "adding", 2)
        deadline = __import__("time").time() + 30
        while registry.serving().get("adding") != [2]:
            assert __import__("time").time() < deadline
            __import__("time").sleep(0.05)
        assert _post(c, {"model": "adding", "inputs": [seq]})["version"] == 2  # new requests
        answer = _post(c, {"model": "adding", "inputs": [seq[1:]], "session": "pin",
                           "end": True})
        assert answer["version"] == 1  # the session stays on its version
        ref = reference(service_packages / "adding" / "1", [np.array(seq, np.float32)])[0]
        np.testing.assert_allclose(answer["outputs"][0]["value"], ref["value"][0], atol=1e-5)
        metrics = c.get("/metrics").text  # version 1 released once the session ended
        assert not re.search(r'orthornn_model_loaded\{[^}]*version="1"\} 1', metrics)
        assert re.search(r'orthornn_model_loaded\{[^}]*version="2"\} 1', metrics)


@pytest.fixture(scope="module")
def every_arch(tmp_path_factory):
    """A tiny classifier package of every recurrent architecture in both export modes."""
    from orthornn.export.builder.exporter import export_run
    from orthornn.models import ARCHITECTURES
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    root = tmp_path_factory.mktemp("every-arch")
    rng = np.random.default_rng(0)
    np.savez(root / "data.npz", x=rng.normal(size=(12, 9, 2)).astype(np.float32),
             y=rng.integers(0, 3, size=12))
    names = []
    for arch, spec in ARCHITECTURES.items():
        if not spec.recurrent:
            continue
        train(TrainConfig(arch=arch, task="classify", data=str(root / "data.npz"),
                          hidden_size=4, steps=1, batch_size=4, log_every=1,
                          out=str(root / arch)), progress=False)
        for mode in ("dense", "factored"):
            names.append(f"{arch}-{mode}")
            export_run(root / arch, root / "repo", names[-1], mode=mode)
    return root / "repo", names


def test_every_architecture_and_mode_streams_through_http(every_arch):
    repo, names = every_arch
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    seq = np.random.default_rng(2).normal(size=(9, 2)).round(3).tolist()
    with TestClient(app, raise_server_exceptions=False, headers=OWNER) as c:
        app.state.registry.scanned.wait(120)
        for name in names:
            whole = _post(c, {"model": name, "inputs": [seq]})["outputs"][0]
            state = None
            for chunk in (seq[:1], seq[1:5], seq[5:]):
                body = {"model": name, "inputs": [chunk], "return_state": True}
                if state:
                    body["states"] = [state]
                out = _post(c, body)["outputs"][0]
                state = out["state"]
            np.testing.assert_allclose(out["probabilities"], whole["probabilities"],
                                       atol=1e-5, err_msg=name)
            for k, chunk in enumerate((seq[:4], seq[4:8], seq[8:])):
                out = _post(c, {"model": name, "inputs": [chunk], "session": name,
                                "start": k == 0, "end": k == 2})["outputs"][0]
            np.testing.assert_allclose(out["probabilities"], whole["probabilities"],
                                       atol=1e-5, err_msg=name)


def test_oip_sequence_refuses_a_raw_initial_state(client):
    x = {"name": "x", "shape": [1, 1, 2], "datatype": "FP32", "data": [0.1, 0.0]}
    h = {"name": "initial_state", "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8}
    r = client.post("/v2/models/adding/versions/4/infer", json={
        "inputs": [x, h], "parameters": {"sequence_id": 5, "sequence_start": True}})
    assert r.status_code == 400 and "not with a sequence_id" in r.json()["error"]
    r = client.post("/v2/models/adding/versions/4/infer", json={
        "inputs": [x], "parameters": {"sequence_id": 5}})
    assert r.status_code == 404  # the failed start opened nothing
    ok = client.post("/v2/models/adding/versions/4/infer", json={"inputs": [x, h]})
    assert ok.status_code == 200  # a raw state without a sequence is fine
