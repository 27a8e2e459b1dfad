"""Property-based fuzzing: whatever a client sends, the answer is never a 5xx, and every
4xx carries {"error": "..."}. Two budgets, both bounded: schemathesis generates valid
and invalid requests for every operation of the service's OpenAPI document; hypothesis
sends arbitrary JSON to the inference endpoints of real models."""

import contextlib
import math

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from ..service_helpers import make_repo

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_client(service_packages, tmp_path_factory):
    repo = make_repo(service_packages, tmp_path_factory.mktemp("fuzz-repo"),
                     {"adding": [5], "digits": [1], "words": [1]})
    app = create_app(Settings(repo=repo, poll_interval_s=0, max_request_sequences=16,
                              max_new_tokens=32, max_body_bytes=1 << 20))
    with TestClient(app, raise_server_exceptions=False) as client:
        app.state.registry.scanned.wait(60)
        yield client


def _check(response):
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert isinstance(response.json().get("error"), str), response.text[:500]


def test_openapi_operations_never_answer_5xx(fuzz_client):
    schema = schemathesis.openapi.from_dict(fuzz_client.get("/openapi.json").json())
    strategies = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in ("/v2/repository/models/{name}/unload",):
            continue  # would unload the models the other cases probe
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(op.as_strategy(generation_mode=mode))

    @settings(FUZZ, max_examples=400)
    @given(case=st.one_of(strategies))
    def run(case):
        kwargs = {"params": case.query or None,
                  "headers": {k: str(v) for k, v in (case.headers or {}).items()} or None}
        if isinstance(case.body, bytes | str):  # raw bodies of the wrong media type
            kwargs["content"] = case.body
        elif case.body is not NOT_SET:
            kwargs["json"] = case.body
        _check(fuzz_client.request(case.method, case.formatted_path, **kwargs))

    run()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=40)
numbers = st.integers(-3, 30) | st.floats(-1e40, 1e40) | st.sampled_from([math.pi, -0.0])
steps = st.lists(numbers, min_size=0, max_size=3) | numbers
sequences = st.lists(st.lists(steps, min_size=0, max_size=8), min_size=0, max_size=4)
small = st.floats(-10, 10)
# mostly well-formed inputs of each model, so the fuzz also reaches the batcher and answers
plausible = (st.lists(st.lists(st.lists(small, min_size=2, max_size=2), min_size=1, max_size=7),
                      min_size=1, max_size=4)
             | st.lists(st.lists(small | st.lists(small, min_size=1, max_size=1), min_size=1,
                                 max_size=65), min_size=1, max_size=3)
             | st.lists(st.lists(st.integers(-1, 12), min_size=1, max_size=6), min_size=1,
                        max_size=3))


@FUZZ
@given(model=st.sampled_from(["adding", "digits", "words", "nope"]),
       inputs=plausible | sequences | json_values,
       extra=st.dictionaries(st.sampled_from(["version", "top_k", "text", "foo"]),
                             json_values | st.integers(-2, 6), max_size=2))
def test_predict_never_answers_5xx(fuzz_client, model, inputs, extra):
    _check(fuzz_client.post("/predict", json={"model": model, "inputs": inputs, **extra}))


@FUZZ
@given(model=st.sampled_from(["adding", "digits", "words"]),
       name=st.sampled_from(["x", "tokens", "lengths", "y"]),
       shape=st.lists(st.integers(-1, 9), max_size=4),
       datatype=st.sampled_from(["FP32", "INT64", "FP64", "BYTES", ""]),
       data=sequences | json_values,
       lengths=st.none() | st.lists(st.integers(-2, 9), max_size=4))
def test_oip_infer_never_answers_5xx(fuzz_client, model, name, shape, datatype, data, lengths):
    inputs = [{"name": name, "shape": shape, "datatype": datatype, "data": data}]
    if lengths is not None:
        inputs.append({"name": "lengths", "shape": [len(lengths)], "datatype": "INT64",
                       "data": lengths})
    _check(fuzz_client.post(f"/v2/models/{model}/infer", json={"inputs": inputs}))


@FUZZ
@given(prompt=st.text(max_size=20) | st.lists(st.integers(-3, 40), max_size=6) | json_values,
       max_new_tokens=st.integers(-1, 40) | json_values,
       temperature=st.floats(-1, 200) | json_values,
       top_k=st.none() | st.integers(-1, 40), seed=st.none() | st.integers(-5, 2**64))
def test_generate_never_answers_5xx(fuzz_client, prompt, max_new_tokens, temperature, top_k,
                                    seed):
    body = {"model": "words", "prompt": prompt, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "top_k": top_k, "seed": seed}
    _check(fuzz_client.post("/generate", json=body))


def test_binary_extension_garbage_never_answers_5xx(fuzz_client):
    head = b'{"inputs": [{"name": "x", "shape": [1, 2, 2], "datatype": "FP32", ' \
           b'"parameters": {"binary_data_size": 16}}]}'
    for header, tail in ((str(len(head)), b"\0" * 16), (str(len(head)), b"\0" * 15),
                         (str(len(head)), b"\xff" * 16), ("abc", b""), ("999999", b""),
                         (str(len(head) - 3), b"\0" * 16), (str(len(head)), b"\0" * 17)):
        r = fuzz_client.post("/v2/models/adding/infer", content=head + tail,
                             headers={"Inference-Header-Content-Length": header})
        _check(r)
    # NaN bits in binary data are refused like NaN in JSON
    r = fuzz_client.post("/v2/models/adding/infer", content=head + b"\xff" * 16,
                         headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400 and "finite" in r.json()["error"]
    ok = fuzz_client.post("/v2/models/adding/infer", content=head + b"\0" * 16,
                          headers={"Inference-Header-Content-Length": str(len(head))})
    assert ok.status_code == 200, ok.text


def test_every_route_answers_as_the_openapi_document_says(fuzz_client):
    """One router, one document: every operation the document lists is answered (none is
    unreachable), and real answers of every route, error answers included, conform to it
    (schemathesis's status-code, content-type and response-schema checks)."""
    from schemathesis.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    document = fuzz_client.get("/openapi.json").json()
    app = fuzz_client.app
    table = {(r.method, r.path) for r in app.state.routes.routes}
    listed = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    assert listed == table  # the document describes exactly what the dispatcher answers
    schema = schemathesis.openapi.from_dict(document)
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    answered: dict[tuple[str, str], set[int]] = {}

    def validate(op, response, case):
        case.validate_response(response, checks=checks)
        answered.setdefault((op.method.upper(), op.path), set()).add(response.status_code)

    operations = [result.ok() for result in schema.get_all_operations()]

    def probe(op, mode):
        @settings(FUZZ, max_examples=12)
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            kwargs = {"params": case.query or None}
            if isinstance(case.body, bytes | str):
                kwargs["content"] = case.body
            elif case.body is not NOT_SET:
                kwargs["json"] = case.body
            validate(op, fuzz_client.request(case.method, case.formatted_path, **kwargs),
                     case)
        run()

    for op in operations:
        if op.path.endswith(("/unload", "/rollback")):
            continue  # change the models the other operations probe; answered below
        probe(op, GenerationMode.POSITIVE)
        with contextlib.suppress(Unsatisfiable):  # nothing to get wrong (GET /v2, ...)
            probe(op, GenerationMode.NEGATIVE)
    # hand-made answers the generators may miss: successes and each kind of error
    by_key = {(op.method.upper(), op.path): op for op in operations}
    cases = [("GET", "/v2/models/{name}", {"name": "digits"}, None),
             ("GET", "/v2/models/{name}", {"name": "nope"}, None),
             ("POST", "/predict", {}, {"model": "digits", "inputs": [[0.1, 0.2]]}),
             ("POST", "/predict", {}, {"model": "digits", "inputs": "x"}),
             ("POST", "/predict", {}, {"model": "nope", "inputs": [[0.1]]}),
             ("POST", "/v2/repository/models/{name}/rollback", {"name": "digits"}, {}),
             ("POST", "/v2/repository/models/{name}/unload", {"name": "nope"}, None)]
    for method, path, params, body in cases:
        op = by_key[(method, path)]
        case = op.Case(path_parameters=params, body=body if body is not None else NOT_SET)
        validate(op, fuzz_client.request(method, case.formatted_path,
                                         json=body if body is not None else None), case)
    assert set(answered) == listed  # every operation answered, and as documented
    assert {200, 400, 404} <= set().union(*answered.values())
