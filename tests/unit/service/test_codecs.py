"""The /predict fast path (simdjson + numpy instead of pydantic) against the pydantic path:
whatever the body, when the fast path gives sequences they are those of pydantic's
request, bit for bit, and pydantic accepts the body too."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from orthornn.service.dataplane.checks import predict_sequences
from orthornn.service.dataplane.messages import Prediction
from orthornn.service.dataplane.schemas import PredictRequest
from orthornn.service.errors import ClientError
from orthornn.service.http.codecs.predict_json import fast_predict_request
from orthornn.service.registry.spec import ModelSpec
from pydantic import ValidationError


def _spec(d: int) -> ModelSpec:
    return ModelSpec(name="m", version=1, task="classify", arch="lstm", kind="float",
                     feature_size=d, max_length=64, output_name="logits", output_size=3,
                     state_size=4, labels=None)


def _sequences(spec, req):
    """The request's sequences for SPEC, or the message that refuses them."""
    try:
        return predict_sequences(spec, req, 16)
    except ClientError as e:
        return str(e)


def _agrees(body: bytes) -> bool:
    """True when the fast path took the body (and agreed with pydantic)."""
    fast = fast_predict_request(body)
    if fast is None:
        return False
    slow = Prediction.of(PredictRequest.model_validate_json(body))  # must not raise
    assert (fast.model, fast.version, fast.top_k, fast.text) == \
        (slow.model, slow.version, slow.top_k, slow.text)
    for d in (1, 2, 3):
        spec = _spec(d)
        got, want = _sequences(spec, fast), _sequences(spec, slow)
        if isinstance(got, str) or isinstance(want, str):
            assert got == want  # the same message on either path
            continue
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
            assert a.tobytes() == b.tobytes()
    return True


numbers = (st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**63, 2**64 - 1)
           | st.sampled_from([0, 1, 0.0, 1.0, -0.0, 3.4028235e38, 3.4028236e38, 1e39, 2**53 + 1]))
finite = st.floats(-1e30, 1e30) | st.integers(-2**63, 2**64 - 1) | st.sampled_from([0, 1, -0.0])
leaf = numbers | st.booleans() | st.none() | st.sampled_from(["1.5", "nan", "", "0"])
step = leaf | st.lists(leaf, max_size=3) | st.lists(st.lists(numbers, max_size=2), max_size=2)
sequence = st.lists(step, max_size=6) | st.lists(st.lists(numbers, min_size=2, max_size=2),
                                                 min_size=1, max_size=6)
# mostly well-formed, so the fast path takes many: [B][T][d] numbers, sometimes one odd leaf
clean = st.integers(1, 3).flatmap(lambda d: st.lists(st.lists(
    st.lists(finite, min_size=d, max_size=d) | (finite if d == 1 else st.nothing()),
    min_size=1, max_size=5), min_size=1, max_size=3))


def _spoil(batch: list, value) -> list:
    """The batch with its first number replaced by value (a boolean, null, string...)."""
    first = batch[0][0]
    step = [value, *first[1:]] if isinstance(first, list) else value
    return [[step, *batch[0][1:]], *batch[1:]]


odd = st.builds(_spoil, clean, leaf)
extras = st.dictionaries(
    st.sampled_from(["version", "top_k", "text", "foo"]),
    st.none() | st.booleans() | st.integers(-2, 2**63) | st.sampled_from(["2", "x", 1.0])
    | st.lists(st.text(max_size=3), max_size=2), max_size=2)


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(model=st.sampled_from(["m", 'a"b', "true", "", "x" * 129]) | st.text(max_size=5),
       inputs=clean | odd | st.lists(sequence, max_size=3) | leaf,
       extra=st.just({}) | extras)
def test_fast_path_takes_only_what_pydantic_takes_and_agrees(model, inputs, extra):
    body = json.dumps({"model": model, "inputs": inputs, **extra}).encode()
    try:
        _agrees(body)
    except ValidationError as e:
        pytest.fail(f"the fast path took a body pydantic refuses: {body!r}: {e}")


@pytest.mark.parametrize("body", [
    b'{"model": "m", "inputs": [[[0.5, 1], [0.25, 0]]]}',
    b'{"model": "m", "version": 2, "top_k": 3, "inputs": [[0.5, 1, 2], [[1], [2]]]}',
    b' {"inputs": [[[1e-7, -2.5e3]]], "text": null, "model": "m\\u00e9"} ',
])
def test_fast_path_takes_well_formed_bodies(body):
    assert _agrees(body)


@pytest.mark.parametrize("body", [
    b'{"model": "m", "inputs": [[[0.5, true]]]}',  # a boolean is no number
    b'{"model": "m", "inputs": [[[0.5, "1"]]]}',  # nor is a string
    b'{"model": "m", "inputs": [[[0.5, null]]]}',
    b'{"model": "m", "inputs": [[[0.5, 1], [0.5]]]}',  # ragged steps
    b'{"model": "m", "inputs": [[[0.5, 1e39]]]}',  # beyond float32: pydantic names it
    b'{"model": "m", "model": "n", "inputs": [[[0.5]]]}',
    b'{"model": "m", "version": "2", "inputs": [[[0.5]]]}',
    b'{"model": "m", "text": ["a b"]}',
    b'{"model": "m", "inputs": [[[0.5]]], "foo": 1}',
    b'{"model": "m", "inputs": [[[NaN]]]}',
    b'{"model": "m", "inputs": [[[[], [1, 2]], [3, 4]]]}',  # as_buffer would flatten these
    b'{"model": "m", "inputs": [[[[7], 1], [2, 3]]]}',
    b'{"model": "m", "inputs": [[1, [2], 3]]}',
    b'{"model": "m", "inputs": [[[1, 2], [3, 4, 5], 6], [[[7], 1], [2, 3]]]}',
    # one sequence's extra number and another's missing one: the total count is right
    b'{"model": "m", "inputs": [[1, [2, 3]], [[[], 5]]]}',
    b'{"model": "m[", "inputs": [[[0.5]]]}',
    b'{"model": "m", "inputs": [[[0.5]]], "inputs": [[[1.5]]]}',
    b'{"model": "m", "inputs": [[[18446744073709551616]]]}',  # beyond 64-bit integers
    b'[1, 2]',
    b'{not json',
    b'\xef\xbb\xbf{"model": "m", "inputs": [[[0.5]]]}',  # a BOM: pydantic refuses it
])
def test_fast_path_leaves_the_rest_to_pydantic(body):
    assert fast_predict_request(body) is None


def test_direct_routes_answer_errors_like_the_app(service_packages, tmp_path, monkeypatch):
    """The route table is answered without FastAPI's layers (app.Routes): a
    bug is still a logged 500 with a JSON error, counted in the metrics under the route."""
    from fastapi.testclient import TestClient
    from orthornn.service.dataplane import dataplane
    from orthornn.service.http.app import create_app
    from orthornn.service.settings import Settings

    from ...service_helpers import make_repo

    repo = make_repo(service_packages, tmp_path, {"digits": [1]})
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    with TestClient(app, raise_server_exceptions=False) as c:
        app.state.registry.scanned.wait(60)
        ok = c.post("/predict", json={"model": "digits", "inputs": [[0.1, 0.2]]})
        assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"

        def broken(*args):
            raise RuntimeError("boom")
        monkeypatch.setattr(dataplane, "shape_outputs", broken)
        r = c.post("/predict", json={"model": "digits", "inputs": [[0.1, 0.2]]})
        assert r.status_code == 500 and r.json() == {"error": "internal server error (logged)"}
        # the OIP infer routes are direct too, counted under their path templates
        x = {"name": "x", "shape": [1, 2, 1], "datatype": "FP32", "data": [0.1, 0.2]}
        assert c.post("/v2/models/digits/versions/1/infer",
                      json={"inputs": [x]}).status_code == 200
        bad = c.post("/v2/models/digits/infer", content=b'{"inputs": []}',
                     headers={"Inference-Header-Content-Length": "x"})
        assert bad.status_code == 400 and "Inference-Header-Content-Length" in bad.json()["error"]
        assert c.post("/v2/models/digits/extra/infer", json={"inputs": [x]}).status_code == 404
        text = c.get("/metrics").text
        assert 'orthornn_requests_total{endpoint="/predict",model="digits",status="500",' \
               'version="1"} 1.0' in text
        assert 'orthornn_requests_total{endpoint="/predict",model="digits",status="200",' \
               'version="1"} 1.0' in text
        assert 'orthornn_requests_total{endpoint="/v2/models/{name}/versions/{version}/infer",' \
               'model="digits",status="200",version="1"} 1.0' in text
        # a bad request that names a loaded model is counted under it (no version yet)
        assert 'orthornn_requests_total{endpoint="/v2/models/{name}/infer",model="digits",' \
               'status="400",version=""} 1.0' in text


# -- the OIP JSON fast path --------------------------------------------------------------

def _decoded(req, arrays=()) -> list:
    """Each input decoded as the model would (FP32 / INT64 declared as given), or the
    ClientError message: the fast (ARRAYS: the numbers it read beside the request) and the
    pydantic request must give the same."""
    from orthornn.service.http.codecs.oip_json import decode_input

    out = []
    for i, inp in enumerate(req.inputs):
        try:
            arr = decode_input(inp, None, arrays[i] if arrays else None).data
            out.append(None if arr is None else (arr.dtype.str, arr.shape, arr.tobytes()))
        except ClientError as e:
            out.append(str(e))
    return out


def _infer_agrees(body: bytes) -> bool:
    from orthornn.service.dataplane.schemas import InferenceRequest
    from orthornn.service.http.codecs.oip_json import fast_infer_request

    found = fast_infer_request(body)
    if found is None:
        return False
    fast, arrays = found
    slow = InferenceRequest.model_validate_json(body)  # must not raise
    assert (fast.id, fast.parameters, fast.outputs) == (slow.id, slow.parameters, slow.outputs)
    assert [(i.name, i.shape, i.datatype) for i in fast.inputs] == \
        [(i.name, i.shape, i.datatype) for i in slow.inputs]
    assert _decoded(fast, arrays) == _decoded(slow)
    return True


tensor_data = st.lists(numbers, max_size=6) | st.lists(st.lists(numbers, max_size=3),
                                                        max_size=3)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(datatype=st.sampled_from(["FP32", "INT64", "BYTES"]),
       data=tensor_data | st.lists(leaf, max_size=4),
       shape=st.lists(st.integers(0, 4), max_size=3),
       extra=st.dictionaries(st.sampled_from(["id", "parameters", "outputs", "foo"]),
                             st.none() | st.sampled_from(["7", {"sequence_id": 3},
                                                          [{"name": "logits"}], 5]),
                             max_size=2))
def test_infer_fast_path_takes_only_what_pydantic_takes_and_agrees(datatype, data, shape,
                                                                   extra):
    body = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": datatype,
                                   "data": data}], **extra}).encode()
    try:
        _infer_agrees(body)
    except ValidationError as e:
        pytest.fail(f"the fast path took a body pydantic refuses: {body!r}: {e}")


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(inputs=st.lists(st.fixed_dictionaries(
           {"name": st.sampled_from(["x", "", "lengths"]),
            "shape": st.lists(st.integers(-1, 4), max_size=3) | st.just("3"),
            "datatype": st.sampled_from(["FP32", "INT64", "BYTES", 5])},
           optional={"parameters": st.dictionaries(
               st.sampled_from(["binary_data_size", "k"]),
               st.integers(-2, 10**21) | st.floats(allow_nan=False) | st.text(max_size=3)
               | st.none() | st.lists(st.integers(), max_size=2), max_size=2)}),
           max_size=3),
       extra=st.dictionaries(st.sampled_from(["id", "parameters", "outputs", "model_name"]),
                             st.none() | st.sampled_from(["7", {"sequence_id": 3}, 12,
                                                          {"n": 10**30}, [{"name": "y"}]]),
                             max_size=2))
def test_a_small_header_is_read_as_pydantic_reads_it(inputs, extra):
    """The binary extension's header (no JSON data) through orjson: taken only where
    pydantic's own parser takes the body too, and read the same (integers beyond 64 bits
    included, which orjson would make floats)."""
    from orthornn.service.dataplane.schemas import InferenceRequest
    from orthornn.service.http.codecs.oip_json import small_request

    body = json.dumps({"inputs": inputs, **extra}).encode()
    found = small_request(body)
    try:
        slow = InferenceRequest.model_validate_json(body)
    except ValidationError:
        assert found is None, body
        return
    if found is not None:
        assert found[0] == slow and found[1] == []


def test_a_binary_header_takes_the_small_path():
    from orthornn.service.http.codecs import oip_json

    head = json.dumps({"id": "a", "inputs": [{"name": "x", "shape": [1, 2, 1],
                                              "datatype": "FP32",
                                              "parameters": {"binary_data_size": 8}}]}).encode()
    req, arrays = oip_json.small_request(head)
    assert arrays == [] and req.inputs[0].parameters == {"binary_data_size": 8}
    assert oip_json.small_request(head + b" " * oip_json.SMALL_BODY) is None  # too large
    assert oip_json.small_request(head.replace(b'"a"', b'"data"')) is None  # JSON data
    assert oip_json.small_request(head.replace(b"8}", b"8000000000000000000}")) is None


def test_infer_fast_path_takes_well_formed_bodies():
    body = json.dumps({"id": "1", "parameters": {"sequence_id": 9, "sequence_start": True},
                       "inputs": [{"name": "x", "shape": [1, 2, 1], "datatype": "FP32",
                                   "data": [[[0.5], [1e-3]]]},
                                  {"name": "lengths", "shape": [1], "datatype": "INT64",
                                   "data": [2]}],
                       "outputs": [{"name": "logits"}]}).encode()
    assert _infer_agrees(body)


@pytest.mark.parametrize("extra, message", [
    # issue 59, finding 5: 1,000,000 keys held the event loop for 1.5 s, answered 200
    ({"parameters": {str(i): i for i in range(100_000)}},
     "parameters: at most 64 keys; got 100000"),
    ({"outputs": [{"name": "y", "parameters": {str(i): 1 for i in range(65)}}]},
     "outputs[0].parameters: at most 64 keys; got 65"),
    ({"parameters": {"a": list(range(1000))}},
     "parameters.a: a string (at most 4096 characters), a number or a boolean"),
    ({"parameters": {"a": {"deep": {"er": 1}}}},
     "parameters.a: a string (at most 4096 characters), a number or a boolean"),
    ({"parameters": {"a": "x" * 4097}},
     "parameters.a: a string (at most 4096 characters), a number or a boolean"),
])
@pytest.mark.parametrize("data", [[0.5], ["not a number"]])  # the fast path, pydantic's
def test_oip_parameters_are_bounded_and_hold_only_oips_values(extra, message, data):
    """OIP's parameter values are strings, numbers or booleans (the protocol's $parameter);
    at most 64 keys in each parameters object, counted before any becomes a dict."""
    from orthornn.service.errors import ClientError
    from orthornn.service.http.codecs import oip_json

    inp = {"name": "x", "shape": [1, 1, 1], "datatype": "FP32", "data": data}
    if "inputs" in extra:
        inp = {**inp, **extra.pop("inputs")}
    body = json.dumps({"inputs": [inp], **extra}).encode()
    with pytest.raises(ClientError) as raised:
        oip_json.decode(body, "m", None)
    assert str(raised.value) == message or (data == ["not a number"] and "inputs" in
                                            str(raised.value)), str(raised.value)
    assert raised.value.status == 400
    ok = json.dumps({"inputs": [{**inp, "data": [0.5]}], "parameters": {
        "sequence_id": 9, "binary_data_output": False, "content_type": "x" * 4096,
        **{f"k{i}": 1.5 for i in range(61)}}}).encode()
    assert len(oip_json.decode(ok, "m", None).parameters) == 64


def test_a_large_body_simdjson_cannot_read_is_refused_not_handed_to_pydantic():
    """A number beyond 64 bits made simdjson give up and pydantic parse the body, every
    key of a 1,000,000-key object a Python object first (1.2 s on the event loop). Above
    SLOW_PATH_BYTES such a body is a 400 at once; a small one still goes to pydantic."""
    from orthornn.service.errors import ClientError
    from orthornn.service.http.codecs import oip_json
    from orthornn.service.http.codecs.simd import SLOW_PATH_BYTES

    inp = {"name": "x", "shape": [1, 1, 1], "datatype": "FP32", "data": [0.5]}
    big = b'{"parameters": {"n": 1%s, %s}, "inputs": [%s]}' % (
        b"0" * 30, b", ".join(b'"%d": 1' % i for i in range(200_000)), json.dumps(inp).encode())
    assert len(big) > SLOW_PATH_BYTES
    with pytest.raises(ClientError, match="body is not valid JSON, or holds a number beyond "
                                          "64 bits"):
        oip_json.decode(big, "m", None)
    small = b'{"parameters": {"n": 1%s}, "inputs": [%s]}' % (b"0" * 30, json.dumps(inp).encode())
    assert oip_json.decode(small, "m", None).parameters == {"n": 10**30}
