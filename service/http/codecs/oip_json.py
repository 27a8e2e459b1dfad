"""The Open Inference Protocol's JSON codec (REST, v2): an inference request body into an
``Inference`` (each input's ``data`` through simdjson's ``as_buffer``, no Python object per
number; anything unusual through pydantic, whose messages name the field), an
``InferenceResult`` into the JSON answer. The binary tensor extension
(``codecs.oip_binary``) reuses the header parse and the answer document."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import orjson
import simdjson
from orthornn.export.artifacts.loop.captures import REQUEST_ID_RULE, is_request_id
from orthornn.export.artifacts.numbers import is_integer
from orthornn.export.artifacts.package import DATATYPES
from pydantic import ValidationError

from ...dataplane.messages import Inference, InferenceResult, InputTensor, Sequence
from ...dataplane.schemas import MAX_PARAMETERS, InferenceRequest, RequestInput, parse
from ...errors import ClientError
from ...sessions.owners import MAX_ID_LENGTH
from .simd import NUMBER_ERRORS, parse_object

#: the numbers of each input's JSON data as read by the fast path (None: no data, or not
#: read there), in the order of the request's inputs
Arrays = list[np.ndarray | None]


def decode(body: bytes, name: str, version: str | None) -> Inference:
    """A JSON inference request to model NAME (VERSION: the URL's, or None)."""
    req, arrays = parse_header(body)
    return to_inference(req, arrays, {}, name, version)


def parse_header(body: bytes) -> tuple[InferenceRequest, Arrays]:
    """The request (its inputs' data validated as present) and the numbers the fast path
    read beside it."""
    return (small_request(body) or fast_infer_request(body)
            or (parse(InferenceRequest, body), []))


#: the largest body ``small_request`` reads (a binary request's header is about 150 bytes)
SMALL_BODY = 4096
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def small_request(body: bytes) -> tuple[InferenceRequest, Arrays] | None:
    """A small request with no JSON data (the binary extension's header): orjson makes it
    Python objects at once, which at this size costs a tenth of reaching into simdjson's
    document (2 us a lookup), and pydantic validates them as on the fast path. None for
    anything else (a larger body, any ``"data"``, JSON orjson refuses, what pydantic
    refuses): the paths below then read it, and name the field when it is wrong. orjson
    and pydantic's own parser agree on what they both read (a repeated key: the last),
    but for integers beyond 64 bits, which orjson makes floats: 19 digits in a row go
    the other way."""
    if (len(body) > SMALL_BODY or b'"data"' in body or body.startswith(b"\xef\xbb\xbf")
            or _LONG_DIGITS.search(body)):
        return None
    try:
        doc = orjson.loads(body)
        return InferenceRequest.model_validate(doc), []
    except (orjson.JSONDecodeError, ValidationError):
        return None


def to_inference(req: InferenceRequest, arrays: Arrays, binaries: dict[str, bytes],
                 name: str, version: str | None) -> Inference:
    """The typed request: the body's model_name / model_version (what KServe's client
    adds) must agree with the URL's; each input decoded from the fast path's array (ARRAYS,
    in order), its JSON data or its binary chunk (BINARIES, by input name)."""
    for field, value, in_url in (("model_name", req.model_name, name),
                                 ("model_version", req.model_version, version)):
        if value is not None and in_url is not None and value != in_url:
            raise ClientError(f"{field}: the body names {value!r}, the URL {in_url!r}")
    # the id is echoed in the answer (and, captured, in X-Request-Id and the records): a
    # header cannot hold every string (a "\u20ac" was a 500, a "\\n" a dropped connection)
    if req.id is not None and not is_request_id(req.id):
        raise ClientError(f"id: {REQUEST_ID_RULE}")
    read = arrays or [None] * len(req.inputs)
    parameters = req.parameters or {}
    secret = parameters.get("session_secret")
    if secret is not None and not isinstance(secret, str):
        raise ClientError("parameters.session_secret: must be a string")
    return Inference(inputs=[decode_input(inp, binaries.get(inp.name), arr)
                             for inp, arr in zip(req.inputs, read, strict=True)],
                     outputs=req.outputs, id=req.id, parameters=parameters,
                     sequence=sequence_of(parameters), session_secret=secret)


SEQUENCE_KEYS = ("sequence_id", "sequence_start", "sequence_end", "sequence_position")


def sequence_of(params: dict) -> Sequence | None:
    """The session of an inference request's parameters, checked (None: none)."""
    if not any(k in params for k in SEQUENCE_KEYS):
        return None
    sid, start, end, position = (params.get(k) for k in SEQUENCE_KEYS)
    if isinstance(sid, bool) or not isinstance(sid, int | str) or sid in ("", 0):
        raise ClientError("parameters.sequence_id: required with sequence_start, "
                          "sequence_end or sequence_position, a non-zero integer or a "
                          "non-empty string")
    # one bound for session ids on both protocols (/predict's session), checked before
    # the id is kept anywhere
    if isinstance(sid, int) and not -2**63 <= sid < 2**64:
        raise ClientError("parameters.sequence_id: an integer id must fit in 64 bits")
    if isinstance(sid, str) and len(sid) > MAX_ID_LENGTH:
        raise ClientError(f"parameters.sequence_id: 1 to {MAX_ID_LENGTH} characters; got "
                          f"{len(sid)}")
    for key, flag in (("sequence_start", start), ("sequence_end", end)):
        if flag is not None and not isinstance(flag, bool):
            raise ClientError(f"parameters.{key}: must be true or false")
    if position is not None and (not is_integer(position) or not 0 <= position < 2**62):
        raise ClientError("parameters.sequence_position: must be an integer >= 0 (the "
                          "time steps the sequence has consumed)")
    return Sequence(str(sid), bool(start), bool(end), position)


def document(result: InferenceResult, binary: set[str]) -> tuple[dict, list[bytes]]:
    """The answer's JSON document and the blobs of the outputs named in BINARY ("*":
    all), in order."""
    outputs, blobs = [], []
    for out in result.outputs:
        item: dict[str, Any] = {"name": out.name, "shape": list(out.data.shape),
                                "datatype": out.datatype}
        if out.name in binary or "*" in binary:
            blob = out.data.astype(DATATYPES[out.datatype].numpy).tobytes()
            item["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            item["data"] = out.data.reshape(-1)
        outputs.append(item)
    answer: dict[str, Any] = {"model_name": result.served.model,
                              "model_version": str(result.served.version),
                              "outputs": outputs}
    if result.id is not None:
        answer["id"] = result.id
    if result.session_secret is not None:
        answer["parameters"] = {"session_secret": result.session_secret}
    return answer, blobs


def decode_input(inp: RequestInput, binary: bytes | None, read: np.ndarray | None = None
                 ) -> InputTensor:
    """One input as a flat array of its declared datatype (from its binary chunk, the fast
    path's READ numbers, or its JSON data), its element count checked against its shape
    (data None for a datatype the service does not know: the model's check names the one
    it expects)."""
    field = f"inputs[{inp.name}]"
    shape = tuple(inp.shape)
    datatype = DATATYPES.get(inp.datatype)
    if datatype is None:
        return InputTensor(inp.name, inp.datatype, shape, None)
    wire = datatype.numpy
    dtype = wire.type
    count = math.prod(shape)
    if count > 1 << 28:
        raise ClientError(f"{field}.shape: too many elements ({count})")
    if binary is not None:
        if len(binary) != count * wire.itemsize:
            raise ClientError(f"{field}: binary_data_size {len(binary)} does not match shape "
                              f"{inp.shape} of {inp.datatype}")
        arr = np.frombuffer(binary, dtype=wire).astype(dtype)
    else:
        if read is not None:  # from fast_infer_request: already numbers
            with np.errstate(over="ignore"):  # beyond float32: inf, refused below
                arr = read.astype(dtype)
        elif inp.data is None:
            raise ClientError(f"{field}.data: required (or binary_data_size)")
        else:
            arr = _flatten(inp.data, inp.datatype, field)
        if arr.size != count:
            raise ClientError(f"{field}.data: {arr.size} elements do not match shape "
                              f"{inp.shape}")
    if arr.dtype == np.float32 and not np.isfinite(arr).all():
        raise ClientError(f"{field}.data: numbers must be finite (float32 range)")
    return InputTensor(inp.name, inp.datatype, shape, arr)


def _flatten(data: list, datatype: str, field: str) -> np.ndarray:
    flat: list = []
    stack = [iter(data)]
    depth_limit = 16
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                if len(stack) >= depth_limit:
                    raise ClientError(f"{field}.data: nested too deeply")
                stack.append(iter(v))
                break
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ClientError(f"{field}.data: numbers only; got {type(v).__name__}")
            if datatype == "INT64" and (isinstance(v, float) or not -2**63 <= v < 2**63):
                raise ClientError(f"{field}.data: INT64 values must be 64-bit integers; "
                                  f"got {v!r}")
            flat.append(v)
        else:
            stack.pop()
    if datatype == "INT64":
        return np.array(flat, dtype=np.int64)
    with np.errstate(over="ignore"):
        return np.array(flat, dtype=np.float64).astype(np.float32)


_INFER_KEYS = frozenset(InferenceRequest.model_fields)
_INPUT_KEYS = frozenset(RequestInput.model_fields)
# pysimdjson's buffers of JSON numbers: doubles ("d") or 64-bit integers ("i")
_JSON_BUFFERS = {"d": np.float64, "i": np.int64}


def _python(value: Any) -> Any:
    """A simdjson value as plain Python (small values: names, shapes, parameters)."""
    if type(value) is simdjson.Object:
        return value.as_dict()
    if type(value) is simdjson.Array:
        return value.as_list()
    return value


def _get(obj: Any, key: str) -> Any:
    """OBJ[KEY] of a simdjson Object, or None: through its keys, since a missing key's
    lookup raises inside simdjson (2 us each, as much as reading the body)."""
    return obj[key] if key in set(obj.keys()) else None


def _count_parameters(doc: Any) -> None:
    """ClientError for a ``parameters`` object (the request's, an input's, an output's) of
    more than MAX_PARAMETERS keys: counted on simdjson's document, before any of it becomes
    a Python object here or in pydantic (the body goes there when it is unusual)."""
    found = [("parameters", _get(doc, "parameters"))]
    for field in ("inputs", "outputs"):
        items = _get(doc, field)
        if type(items) is simdjson.Array:
            found += [(f"{field}[{i}].parameters", _get(item, "parameters"))
                      for i, item in enumerate(items) if type(item) is simdjson.Object]
    for field, value in found:
        if type(value) is simdjson.Object and len(value) > MAX_PARAMETERS:
            raise ClientError(f"{field}: at most {MAX_PARAMETERS} keys; got {len(value)}")


def fast_infer_request(body: bytes) -> tuple[InferenceRequest, Arrays] | None:
    """An OIP JSON inference request read with simdjson: each input's ``data`` becomes a
    flat numpy array through ``as_buffer`` (no Python object per number), everything else
    is validated by pydantic as usual. None when anything is unusual (a string, boolean or
    null among the numbers, a duplicate key, a datatype other than FP32 / INT64, a BOM):
    the caller then parses the body with pydantic alone, whose messages name the field.
    ``to_inference`` checks the element count against the shape on either path."""
    doc = parse_object(body)
    if doc is None:
        return None
    _count_parameters(doc)
    keys = set(doc.keys())
    inputs = _get(doc, "inputs")
    if len(keys) != len(doc) or not keys <= _INFER_KEYS or type(inputs) is not simdjson.Array:
        return None
    metas: list[dict] = []
    arrays: list[np.ndarray | None] = []
    for inp in inputs:
        if type(inp) is not simdjson.Object:
            return None
        ikeys = set(inp.keys())
        if len(ikeys) != len(inp) or not ikeys <= _INPUT_KEYS:
            return None
        meta = {k: _python(inp[k]) for k in ikeys if k != "data"}
        data = inp["data"] if "data" in ikeys else None
        if data is None:
            arrays.append(None)
        else:
            named = meta.get("datatype")  # any JSON value: a list is unhashable (a 500
            # found by tests/fuzz); pydantic's path names the field for anything but a str
            datatype = DATATYPES.get(named) if isinstance(named, str) else None
            if type(data) is not simdjson.Array or datatype is None:
                return None
            kind = datatype.json_buffer
            try:
                arrays.append(np.frombuffer(data.as_buffer(of_type=kind),
                                            dtype=_JSON_BUFFERS[kind]))
            except NUMBER_ERRORS:
                return None
            meta["data"] = []  # validated as present; the numbers are the array above
        metas.append(meta)
    try:
        req = InferenceRequest.model_validate(
            {**{k: _python(doc[k]) for k in keys if k != "inputs"}, "inputs": metas})
    except ValidationError:
        return None
    return req, arrays
