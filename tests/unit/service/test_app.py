"""The service's HTTP API in process (Starlette's TestClient): every endpoint and error
case, answers checked against the torch outputs in golden.npz and against onnxruntime
run directly on the package."""

import math
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient
from orthornn.service.http.app import create_app
from orthornn.service.registry.spec import tokenize
from orthornn.service.settings import Settings
from orthornn.training.corpus import tokenize as training_tokenize

from ...service_helpers import golden, make_repo, reference, softmax


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("api-repo"),
                     {"adding": [4, 5], "digits": [1], "words": [1]})


@pytest.fixture(scope="module")
def client(repo):
    app = create_app(Settings(repo=repo, keep_versions=2, poll_interval_s=0,
                              max_request_sequences=8, max_body_bytes=200_000))
    # the Host a client on loopback sends (no token: the repository API answers no other)
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as c:
        app.state.registry.scanned.wait(60)
        assert app.state.registry.ready()
        yield c


def _cut(g, key="model/x"):
    return [x[:n] for x, n in zip(g[key], g["model/lengths"], strict=True)]


# -- /predict ------------------------------------------------------------------------

def test_predict_classify_matches_torch_golden_outputs(client, repo):
    g = golden(repo / "digits" / "1")
    seqs = _cut(g)  # four sequences of different lengths in one request
    r = client.post("/predict", json={"model": "digits", "inputs": [s.tolist() for s in seqs],
                                      "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["model"], body["version"]) == ("digits", 1)
    expected = softmax(g["model/logits"].astype(np.float64))
    for out, p in zip(body["outputs"], expected, strict=True):
        np.testing.assert_allclose(out["probabilities"], p, atol=1e-5)
        assert out["index"] == int(np.argmax(p)) and out["label"] == str(out["index"])
        assert [c["index"] for c in out["top_k"]] == list(np.argsort(-p, kind="stable")[:3])
    # feature size 1: a bare number per step is the same as a one-element list
    flat = client.post("/predict", json={"model": "digits",
                                         "inputs": [seqs[1][:, 0].tolist()]}).json()
    assert flat["outputs"][0]["probabilities"] == body["outputs"][1]["probabilities"]


def test_predict_regress_matches_golden_and_onnxruntime(client, repo):
    package = repo / "adding" / "5"
    g = golden(package)
    seqs = _cut(g)
    r = client.post("/predict", json={"model": "adding", "inputs": [s.tolist() for s in seqs]})
    assert r.status_code == 200 and r.json()["version"] == 5  # newest by default
    values = [o["value"] for o in r.json()["outputs"]]
    np.testing.assert_allclose(values, g["model/value"][:, 0], atol=1e-4)
    np.testing.assert_allclose(values, [o["value"][0] for o in reference(package, seqs)],
                               atol=1e-6)


def test_explicit_version_reaches_the_older_loaded_version(client, repo):
    seqs = [[[0.5, 0.0], [0.25, 1.0], [0.1, 1.0]]]
    answers = {}
    for v in (4, 5, "4"):
        r = client.post("/predict", json={"model": "adding", "version": v, "inputs": seqs})
        assert r.status_code == 200 and r.json()["version"] == int(v)
        answers[v] = r.json()["outputs"][0]["value"]
    for v in (4, 5):
        want = reference(repo / "adding" / str(v), [np.array(seqs[0])])[0]["value"][0]
        assert answers[v] == pytest.approx(want, abs=1e-6)
    assert answers[4] != answers[5] and answers["4"] == answers[4]


def test_predict_language_model_scores_and_next_tokens(client, repo):
    package = repo / "words" / "1"
    vocab = (package / "vocab.txt").read_text().split("\n")[:-1]
    ids = {w: i for i, w in enumerate(vocab)}
    text = "The cat sat on the mat 42 and the zebra"
    r = client.post("/predict", json={"model": "words", "text": [text], "top_k": 3})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    # tokenisation: training's tokenize without its closing <eos>; unknown words -> <unk>
    words = tokenize(text)
    assert [*words, "<eos>"] == training_tokenize(text)
    seq = np.array([ids.get(w, 0) for w in words])
    logits = reference(package, [seq])[0]["logits"].astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ll = logp[np.arange(len(seq) - 1), seq[1:]].sum()
    assert out["log_likelihood"] == pytest.approx(ll, abs=1e-4)
    assert out["perplexity"] == pytest.approx(math.exp(-ll / (len(seq) - 1)), rel=1e-4)
    assert out["tokens"] == len(seq) - 1
    p = np.exp(logp[-1])
    assert [t["id"] for t in out["next_tokens"]] == list(np.argsort(-p, kind="stable")[:3])
    assert [t["token"] for t in out["next_tokens"]] == [vocab[t["id"]]
                                                        for t in out["next_tokens"]]
    # the same as token ids
    by_ids = client.post("/predict", json={"model": "words", "inputs": [seq.tolist()],
                                           "top_k": 3}).json()["outputs"][0]
    assert by_ids == out


def test_tokenizer_matches_training_on_awkward_text():
    for text in ["Don't STOP: 3.14, 1,000 and 7!", "  ", "café naïve rock'n'roll", "a'b'c 12a"]:
        expected = training_tokenize(text)
        assert tokenize(text) == (expected[:-1] if expected else [])


# -- /generate -----------------------------------------------------------------------

def test_generate_greedy_equals_rerunning_the_prefix(client, repo):
    package = repo / "words" / "1"
    r = client.post("/generate", json={"model": "words", "prompt": "the cat",
                                       "max_new_tokens": 6, "temperature": 0,
                                       "stop_at_eos": False})
    assert r.status_code == 200, r.text
    body = r.json()
    # independent reference: no carried state, the full graph on the growing prefix
    context = list(body["prompt_ids"])
    for token in body["ids"]:
        logits = reference(package, [np.array(context)])[0]["logits"][-1]
        assert token == int(np.argmax(logits))
        context.append(token)
    assert len(body["ids"]) == 6 and body["finish_reason"] == "length"
    assert body["tokens"] == [(package / "vocab.txt").read_text().split("\n")[i]
                              for i in body["ids"]]


def test_generate_sampling_is_reproducible_with_a_seed(client):
    req = {"model": "words", "prompt": [2, 3], "max_new_tokens": 10, "temperature": 1.5,
           "seed": 7, "stop_at_eos": False}
    a, b = (client.post("/generate", json=req).json() for _ in range(2))
    assert a["ids"] == b["ids"] and len(a["ids"]) == 10
    greedy = client.post("/generate", json={**req, "temperature": 0}).json()
    top1 = client.post("/generate", json={**req, "top_k": 1}).json()
    assert top1["ids"] == greedy["ids"]


# -- Open Inference Protocol -------------------------------------------------------------

def test_oip_server_and_health(client):
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data", "model_repository",
                                                     "sequences"]
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").json() == {"ready": True}


def test_oip_metadata_and_readiness(client):
    meta = client.get("/v2/models/adding").json()
    assert meta["versions"] == ["4", "5"] and meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 2]},
                              {"name": "lengths", "datatype": "INT64", "shape": [-1]},
                              {"name": "initial_state", "datatype": "FP32", "shape": [-1, 8],
                               "optional": True}]
    assert [o["name"] for o in meta["outputs"]] == ["value", "state"]
    assert meta["parameters"]["version"] == "5"
    assert client.get("/v2/models/adding/versions/4").json()["parameters"]["version"] == "4"
    assert client.get("/v2/models/words").json()["inputs"][0] == {
        "name": "tokens", "datatype": "INT64", "shape": [-1, -1]}
    assert client.get("/v2/models/adding/ready").json() == {"name": "adding", "ready": True}
    assert client.get("/v2/models/adding/versions/4/ready").status_code == 200
    assert client.get("/v2/models/adding/versions/1/ready").status_code == 503
    assert client.get("/v2/models/nope/ready").status_code == 404
    config = client.get("/v2/models/digits/config").json()
    assert config["input"][0] == {"name": "x", "data_type": "TYPE_FP32", "dims": [-1, 1]}


def test_oip_infer_matches_onnxruntime(client, repo):
    package = repo / "digits" / "1"
    g = golden(package)
    x, lengths = g["model/x"], g["model/lengths"]
    req = {"id": "r1", "inputs": [
        {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()},
        {"name": "lengths", "shape": [4], "datatype": "INT64", "data": lengths.tolist()}]}
    r = client.post("/v2/models/digits/versions/1/infer", json=req)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["model_name"], body["model_version"], body["id"]) == ("digits", "1", "r1")
    outs = {o["name"]: o for o in body["outputs"]}
    assert outs["logits"]["shape"] == [4, 10] and outs["logits"]["datatype"] == "FP32"
    ref = reference(package, _cut(g))
    np.testing.assert_allclose(np.reshape(outs["logits"]["data"], (4, 10)),
                               [r["logits"] for r in ref], atol=1e-6)
    np.testing.assert_allclose(np.reshape(outs["logits"]["data"], (4, 10)), g["model/logits"],
                               atol=1e-4)
    # nested data, no lengths (every sequence full length), one requested output
    req = {"inputs": [{"name": "x", "shape": [1, 3, 1], "datatype": "FP32",
                       "data": [[[0.5], [0.1], [0.2]]]}], "outputs": [{"name": "state"}]}
    body = client.post("/v2/models/digits/infer", json=req).json()
    assert [o["name"] for o in body["outputs"]] == ["state"]
    np.testing.assert_allclose(body["outputs"][0]["data"],
                               reference(package, [np.array([[.5], [.1], [.2]])])[0]["state"],
                               atol=1e-6)


def test_oip_infer_language_model_pads_time_outputs_with_zeros(client, repo):
    tokens = [[2, 3, 4, 5], [6, 7, 0, 0]]
    req = {"inputs": [{"name": "tokens", "shape": [2, 4], "datatype": "INT64", "data": tokens},
                      {"name": "lengths", "shape": [2], "datatype": "INT64", "data": [4, 2]}]}
    body = client.post("/v2/models/words/infer", json=req).json()
    logits = np.reshape(body["outputs"][0]["data"], body["outputs"][0]["shape"])
    ref = reference(repo / "words" / "1", [np.array([2, 3, 4, 5]), np.array([6, 7])])
    np.testing.assert_allclose(logits[0], ref[0]["logits"], atol=1e-6)
    np.testing.assert_allclose(logits[1, :2], ref[1]["logits"], atol=1e-6)
    assert not logits[1, 2:].any()


# -- errors ----------------------------------------------------------------------------

X6 = [[[0.1, 0.0]] * 3]
ERROR_CASES = [
    ("post", "/predict", b"{not json", 400, "not valid JSON"),
    ("post", "/predict", [1, 2], 400, "body"),
    ("post", "/predict", {"inputs": X6}, 400, "model: Field required"),
    ("post", "/predict", {"model": "nope", "inputs": X6}, 404, "'nope' is not loaded"),
    ("post", "/predict", {"model": "adding", "version": 3, "inputs": X6}, 404, "version 3"),
    ("post", "/predict", {"model": "adding", "version": "v2", "inputs": X6}, 400, "version"),
    ("post", "/predict", {"model": "adding", "version": 0, "inputs": X6}, 400, "version"),
    ("post", "/predict", {"model": "adding"}, 400, "inputs: required"),
    ("post", "/predict", {"model": "adding", "inputs": []}, 400, "between 1 and 8"),
    ("post", "/predict", {"model": "adding", "inputs": X6 * 9}, 400, "between 1 and 8"),
    ("post", "/predict", {"model": "adding", "inputs": [[]]}, 400, "inputs[0]: sequence length"),
    ("post", "/predict", {"model": "adding", "inputs": [[[0.1, 0]] * 7]}, 400,
     "inputs[0]: sequence length must be in [1, 6]"),
    ("post", "/predict", {"model": "adding", "inputs": [[[0.1, 0, 3]]]}, 400,
     "inputs[0][0]: each time step must be a list of 2 numbers (feature_size 2); got 3"),
    ("post", "/predict", {"model": "adding", "inputs": [[0.5, 0.5]]}, 400, "inputs[0][0]"),
    ("post", "/predict", {"model": "adding", "inputs": [[[0.1, "a"]]]}, 400,
     "inputs[0][0][1]: Input should be a valid number"),
    ("post", "/predict", {"model": "adding", "inputs": [[[True, 1]]]}, 400, "inputs[0][0]"),
    ("post", "/predict", b'{"model": "adding", "inputs": [[[NaN, 1]]]}', 400, "finite"),
    ("post", "/predict", {"model": "adding", "inputs": [[[1e39, 1]]]}, 400, "float32 range"),
    ("post", "/predict", {"model": "adding", "inputs": X6, "extra": 1}, 400, "extra: Extra"),
    ("post", "/predict", {"model": "adding", "inputs": X6, "top_k": 2}, 400, "top_k"),
    ("post", "/predict", {"model": "adding", "text": ["hi"]}, 400, "text: only language"),
    ("post", "/predict", {"model": "digits", "inputs": [[0.1]], "top_k": 0}, 400, "top_k"),
    ("post", "/predict", {"model": "words", "inputs": [[1, 99]]}, 400,
     "inputs[0][1]: token ids must be integers in [0, "),
    ("post", "/predict", {"model": "words", "inputs": [[1, 2.5]]}, 400, "token ids"),
    ("post", "/predict", {"model": "words", "inputs": [[-1]]}, 400, "token ids"),
    ("post", "/predict", {"model": "words", "text": ["a"], "inputs": [[1]]}, 400, "exactly one"),
    ("post", "/predict", {"model": "words", "text": ["!!"]}, 400, "text[0] (tokens)"),
    ("post", "/generate", {"model": "digits"}, 400, "needs a language model"),
    ("post", "/generate", {"model": "words", "max_new_tokens": 10**5}, 400, "max_new_tokens"),
    ("post", "/generate", {"model": "words", "prompt": [50]}, 400, "prompt: token ids"),
    ("post", "/generate", {"model": "words", "temperature": -1}, 400, "temperature"),
    ("post", "/generate", {"model": "words", "top_k": 500}, 400, "top_k: at most"),
    ("get", "/v2/models/nope", None, 404, "not loaded"),
    ("get", "/v2/models/adding/versions/9", None, 404, "no loaded version 9"),
    ("get", "/v2/models/adding/versions/x", None, 404, "positive integer"),
    ("post", "/v2/models/nope/infer", {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                                   "data": [1]}]}, 404, "not loaded"),
    ("post", "/v2/models/adding/infer", {"inputs": []}, 400, "inputs: List should have"),
    ("post", "/v2/models/adding/infer", {"inputs": [{"name": "y", "shape": [1, 1, 2],
                                                     "datatype": "FP32", "data": [1, 2]}]},
     400, "inputs[y]: unknown input"),
    ("post", "/v2/models/adding/infer", {"inputs": [{"name": "x", "shape": [1, 1, 2],
                                                     "datatype": "FP64", "data": [1, 2]}]},
     400, "inputs[x].datatype: the model expects FP32"),
    ("post", "/v2/models/adding/infer", {"inputs": [{"name": "x", "shape": [1, 2, 2],
                                                     "datatype": "FP32", "data": [1, 2]}]},
     400, "2 elements do not match shape"),
    ("post", "/v2/models/adding/infer", {"inputs": [{"name": "x", "shape": [1, 1, 3],
                                                     "datatype": "FP32", "data": [1, 2, 3]}]},
     400, "shape[2]: feature_size is 2"),
    ("post", "/v2/models/adding/infer", {"inputs": [{"name": "x", "shape": [1, 9, 2],
                                                     "datatype": "FP32", "data": [0] * 18}]},
     400, "sequence length must be in [1, 6]"),
    ("post", "/v2/models/adding/infer", {"inputs": [{"name": "x", "shape": [1, 1, 2],
                                                     "datatype": "FP32", "data": [1, "a"]}]},
     400, "numbers only"),
    ("post", "/v2/models/adding/infer", {"inputs": [
        {"name": "x", "shape": [1, 2, 2], "datatype": "FP32", "data": [0] * 4},
        {"name": "lengths", "shape": [1], "datatype": "INT64", "data": [3]}]},
     400, "lengths must be in [1, 2]"),
    ("post", "/v2/models/adding/infer", {"inputs": [
        {"name": "x", "shape": [1, 2, 2], "datatype": "FP32", "data": [0] * 4}],
        "outputs": [{"name": "logits"}]}, 400, "unknown output 'logits'"),
    ("post", "/v2/models/words/infer", {"inputs": [
        {"name": "tokens", "shape": [1, 2], "datatype": "INT64", "data": [1, 1.5]}]},
     400, "INT64 values must be 64-bit integers"),
    ("post", "/v2/models/words/infer", {"inputs": [
        {"name": "tokens", "shape": [1, 2], "datatype": "INT64", "data": [1, 400]}]},
     400, "token ids must be in"),
    ("post", "/v2/repository/models/nope/load", {}, 404, "not in the repository"),
    ("post", "/v2/repository/models/nope/rollback", {}, 404, "not in the repository"),
    ("post", "/v2/repository/models/nope/load", None, 415, "application/json"),
    ("post", "/v2/repository/models/nope/load", b"{}", 415, "application/json"),
    ("post", "/v2/repository/models/adding/rollback", {"version": 0}, 400, "version"),
    ("get", "/no/such/path", None, 404, "Not Found"),
    ("delete", "/predict", None, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize("method,path,body,status,message", ERROR_CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_bad_requests_get_4xx_with_a_json_error_naming_the_field(client, method, path, body,
                                                                 status, message):
    kwargs = {"content": body} if isinstance(body, bytes) else {} if body is None else \
        {"json": body}
    r = client.request(method.upper(), path, **kwargs)
    assert r.status_code == status, r.text
    assert message in r.json()["error"], r.json()


def test_body_size_limit(client):
    big = {"model": "digits", "inputs": [[0.123456789] * 64] * 8 * 60}
    r = client.post("/predict", json=big)
    assert r.status_code == 413 and "limit of 200000 bytes" in r.json()["error"]

    def chunks():  # no Content-Length: the limit is counted as the body streams
        yield b'{"model": "digits", "inputs": ['
        for _ in range(3000):
            yield b"[0.1234567, 0.1234567, 0.1234567, 0.1234567, 0.1234567, 0.1234567],"
        yield b"[0.1]]}"
    r = client.post("/predict", content=chunks())
    assert r.status_code == 413


def test_full_queue_answers_429(repo):
    app = create_app(Settings(repo=repo, poll_interval_s=0, max_queue_size=2))
    with TestClient(app) as c:
        app.state.registry.scanned.wait(60)
        r = c.post("/predict", json={"model": "digits", "inputs": [[0.1]] * 3})
        assert r.status_code == 429 and "queue" in r.json()["error"]
        assert r.headers["retry-after"] == "1"
        assert c.post("/predict", json={"model": "digits", "inputs": [[0.1]] * 2}).status_code \
            == 200


# -- repository API, auth, metrics, docs ---------------------------------------------------

def test_repository_api_requires_the_bearer_token(repo):
    app = create_app(Settings(repo=repo, poll_interval_s=0, admin_token="s3cret"))
    with TestClient(app) as c:
        app.state.registry.scanned.wait(60)
        for path in ("/v2/repository/index", "/v2/repository/models/digits/unload",
                     "/v2/repository/models/digits/load"):
            assert c.post(path).status_code == 401
            assert c.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.post(path, headers={"Authorization": "Basic s3cret"}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        index = c.post("/v2/repository/index", headers=ok).json()
        assert {(m["name"], m["version"], m["state"]) for m in index} >= {
            ("digits", "1", "READY"), ("adding", "5", "READY"), ("adding", "4", "UNAVAILABLE")}
        assert c.post("/v2/repository/models/digits/unload", headers=ok).status_code == 200
        assert c.post("/predict", json={"model": "digits", "inputs": [[0.1]]}).status_code == 404
        assert c.get("/v2/health/ready").status_code == 200  # unloaded on purpose
        ready = c.post("/v2/repository/index", headers=ok, json={"ready": True}).json()
        assert "digits" not in {m["name"] for m in ready}
        r = c.post("/v2/repository/models/digits/load", headers=ok, json={})
        assert r.status_code == 200 and r.json()["versions"] == [1]
        assert c.post("/predict", json={"model": "digits", "inputs": [[0.1]]}).status_code == 200
        schema = c.get("/openapi.json").json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_metrics_exposition(client):
    client.post("/predict", json={"model": "digits", "inputs": [[0.1, 0.2]]})
    client.post("/predict", json={"model": "nope", "inputs": [[0.1]]})
    text = client.get("/metrics").text
    assert re.search(r'orthornn_requests_total\{endpoint="/predict",model="digits",status="200",'
                     r'version="1"\} \d', text)
    assert 'orthornn_requests_total{endpoint="/predict",model="_unknown",status="404",' \
           'version=""}' in text
    for name in ("orthornn_request_duration_seconds_bucket", "orthornn_queue_duration_seconds",
                 "orthornn_inference_duration_seconds", "orthornn_batch_size_bucket",
                 "orthornn_inflight_requests", "orthornn_model_swaps_total",
                 "orthornn_model_load_failures_total", "orthornn_queue_depth"):
        assert name in text, name
    assert re.search(r'orthornn_model_loaded\{arch="scornn",mode="dense",model="digits",'
                     r'version="1"\} 1.0', text)
    sigma = re.search(r'orthornn_transition_sigma_max\{model="digits",version="1"\} (\S+)', text)
    assert sigma and abs(float(sigma.group(1)) - 1) < 1e-5  # scoRNN's W is orthogonal
    assert 'orthornn_transition_sigma_min{model="adding",version="4"}' in text
    for line in text.splitlines():  # every metric of ours carries the prefix
        if line and not line.startswith("#"):
            assert line.split("{")[0].split(" ")[0].startswith("orthornn_"), line


def test_unknown_versions_of_a_loaded_model_are_counted_under_the_model(service_packages,
                                                                       tmp_path):
    """A request for a version that is not loaded (404) names a loaded model: it is counted
    under that model, with no version label (clients choose the number); only a model that
    is not loaded at all is "_unknown"."""
    repo = make_repo(service_packages, tmp_path, {"digits": [1]})
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    x = {"name": "x", "shape": [1, 2, 1], "datatype": "FP32", "data": [0.1, 0.2]}
    with TestClient(app, raise_server_exceptions=False) as c:
        app.state.registry.scanned.wait(60)
        for path in ("/v2/models/digits/versions/99/infer", "/v2/models/digits/versions/x/infer",
                     "/v2/models/nope/infer"):
            assert c.post(path, json={"inputs": [x]}).status_code == 404, path
        assert c.post("/predict", json={"model": "digits", "version": 99,
                                        "inputs": [[0.1]]}).status_code == 404
        assert c.get("/v2/models/digits/versions/99").status_code == 404
        assert c.get("/v2/models/digits/versions/99/ready").status_code == 503
        assert c.get("/v2/models/nope/versions/7/ready").status_code == 404
        text = c.get("/metrics").text

    def count(endpoint: str, model: str, status: int, version: str = "") -> float:
        line = (f'orthornn_requests_total{{endpoint="{endpoint}",model="{model}",'
                f'status="{status}",version="{version}"}} ')
        found = [row for row in text.splitlines() if row.startswith(line)]
        return float(found[0][len(line):]) if found else 0.0

    assert count("/v2/models/{name}/versions/{version}/infer", "digits", 404) == 2
    assert count("/v2/models/{name}/infer", "_unknown", 404) == 1
    assert count("/predict", "digits", 404) == 1
    assert count("/v2/models/{name}/versions/{version}", "digits", 404) == 1
    assert count("/v2/models/{name}/versions/{version}/ready", "digits", 503) == 1
    assert count("/v2/models/{name}/versions/{version}/ready", "_unknown", 404) == 1
    # no label value a client chose: neither "nope" nor the versions 99, x and 7
    assert not re.search(r'orthornn_requests_total\{[^}]*(model="nope"|version="(99|x|7)")',
                         text), text

def test_docs_and_openapi(client):
    assert client.get("/docs").status_code == 200
    schema = client.get("/openapi.json").json()
    for path in ("/predict", "/generate", "/v2", "/v2/health/live", "/v2/health/ready",
                 "/v2/models/{name}", "/v2/models/{name}/versions/{version}",
                 "/v2/models/{name}/ready", "/v2/models/{name}/infer",
                 "/v2/models/{name}/versions/{version}/infer", "/v2/repository/index",
                 "/v2/repository/models/{name}/load", "/v2/repository/models/{name}/unload",
                 "/v2/repository/models/{name}/rollback", "/metrics"):
        assert path in schema["paths"], path
    body = schema["paths"]["/predict"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/PredictRequest"
    assert "inputs" in schema["components"]["schemas"]["PredictRequest"]["properties"]


def test_errors_carry_their_status_and_one_handler_answers_them(caplog):
    """Every service error is answered with its own status (and headers) by app.answer;
    nothing maps types to statuses a second time."""
    import orjson
    from orthornn.service import errors
    from orthornn.service.errors import (
        QueueFull,
        RollbackRefused,
        SessionLimit,
        StateConflict,
        UnknownSession,
    )
    from orthornn.service.http.responses import error_response

    cases = [(errors.ClientError("x"), 400), (errors.NotFound("x"), 404),
             (UnknownSession("x"), 404), (StateConflict("x"), 409),
             (RollbackRefused("x"), 409), (errors.BodyTooLarge(1024), 413),
             (QueueFull("x"), 429), (SessionLimit("x"), 429),
             (errors.ClientError("x", status=422), 422)]
    for exc, status in cases:
        response = error_response(exc)
        assert response.status_code == status, exc
        assert orjson.loads(response.body) == {"error": str(exc)}
        assert (response.headers.get("retry-after") == "1") == (status == 429), exc
    assert "larger than the limit of 1024 bytes" in str(errors.BodyTooLarge(1024))
    with caplog.at_level("ERROR", logger="orthornn.service"):
        assert error_response(RuntimeError("bug"), "GET /x").status_code == 500
    assert "internal error on GET /x" in caplog.text


def test_only_an_evaluation_with_a_metric_and_a_finite_value_is_exported():
    """The evaluation gauges' source: a metric name and a finite number, never a bool, a
    NaN or a missing value read as some number."""
    from types import SimpleNamespace

    from orthornn.service.metrics import Metrics

    for evaluation in ({"metric": "accuracy"}, {"metric": "accuracy", "value": True},
                       {"metric": "accuracy", "value": float("nan")}, {"value": 0.9},
                       {"metric": "", "value": 0.9}, None):
        assert Metrics._evaluation(SimpleNamespace(evaluation=evaluation)) is None, evaluation
    assert Metrics._evaluation(SimpleNamespace(evaluation={"metric": "mse", "value": 2})) == \
        ("mse", 2.0)

