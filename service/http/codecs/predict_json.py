"""The /predict codec: the body into a ``Prediction`` (the common body, float sequences,
through simdjson without a Python object per number; anything else, and every mistake,
through pydantic's ``PredictRequest``, whose messages name the field), a ``PredictResult``
into JSON."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import simdjson

from ...dataplane.checks import F32_MAX
from ...dataplane.messages import Prediction, PredictResult
from ...dataplane.schemas import PredictRequest, parse
from .simd import NUMBER_ERRORS, parse_object


def decode(body: bytes) -> Prediction:
    return fast_predict_request(body) or Prediction.of(parse(PredictRequest, body))


def encode(result: PredictResult) -> bytes:
    answer: dict[str, Any] = {"model": result.served.model, "version": result.served.version,
                              "outputs": result.outputs}
    if result.session is not None:
        answer["session"] = result.session
        answer["position"] = result.position
        if result.session_secret is not None:
            answer["session_secret"] = result.session_secret
    return orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)


# the keys of the common body; any other (streaming ones, allow_unk) takes pydantic's path
_PREDICT_KEYS = frozenset({"model", "version", "inputs", "text", "top_k"})
_OPEN = ord("[")


def fast_predict_request(body: bytes) -> Prediction | None:
    """The common /predict body (float sequences, no text) read with simdjson, whose
    ``as_buffer`` turns a nested array of numbers into doubles without making a Python
    object per number, or None when anything is unusual.

    It accepts only bodies that PredictRequest accepts too, and gives the same numbers
    (simdjson and pydantic both round each number to the nearest double): strings,
    booleans, nulls and objects among the numbers, numbers beyond 64-bit integers or
    doubles, duplicate keys, ragged steps and arrays nested deeper than
    [sequence][step][feature] are refused here (None: pydantic's path). The model's checks
    (``service.dataplane.checks``) give the same messages for this request as for pydantic's.
    """
    data = parse_object(body)
    if data is None:
        return None
    keys = set(data.keys())
    if len(keys) != len(data) or not keys <= _PREDICT_KEYS:
        return None  # a duplicate key (pydantic keeps the last), an unknown or a rare one
    get = data.get  # only for keys that are there: an absent key's get costs 3 us
    model, seqs = get("model"), get("inputs")
    version, top_k = (get(k) if k in keys else None for k in ("version", "top_k"))
    if type(model) is not str or not 1 <= len(model) <= 128 or "[" in model \
            or ("text" in keys and get("text") is not None) or type(seqs) is not simdjson.Array:
        return None
    if version is not None and not (type(version) is int and 1 <= version <= 2**62):
        return None  # strings ("2") and mistakes: pydantic
    if top_k is not None and not (type(top_k) is int and 1 <= top_k <= 1_000_000):
        return None
    try:  # every number of every sequence, flattened; strings, booleans, nulls, objects raise
        flat = np.frombuffer(seqs.as_buffer(of_type="d"), dtype=np.float64)
    except NUMBER_ERRORS:
        return None
    shapes: list[tuple[int, ...]] = []
    brackets = 1 + len(seqs)  # '[' of inputs and of each sequence
    seq: Any
    for seq in seqs:
        if type(seq) is not simdjson.Array:
            return None
        shape: tuple[int, ...] = (len(seq),)
        if shape[0] and type(seq[0]) is simdjson.Array:  # [T, d]: every step a list of d
            width = len(seq[0])
            try:
                widths = [len(step) for step in seq]  # type: ignore[arg-type]  # TypeError
            except TypeError:  # a number among the steps
                return None
            if widths.count(width) != shape[0]:
                return None
            shape, brackets = (shape[0], width), brackets + shape[0]
        shapes.append(shape)
    # as_buffer flattens any nesting: a '[' beyond the expected ones is a deeper array (the
    # keys and the model name hold none); numpy counts them 3x faster than bytes.count
    if np.count_nonzero(np.frombuffer(body, dtype=np.uint8) == _OPEN) != brackets:
        return None
    sizes = [math.prod(shape) for shape in shapes]
    if flat.size != sum(sizes) or (flat.size and not
                                   -F32_MAX <= flat.min() <= flat.max() <= F32_MAX):
        return None  # beyond float32: the checks below name it
    values = flat.astype(np.float32)
    arrays, at = [], 0
    for shape, size in zip(shapes, sizes, strict=True):  # views of the one float32 array
        arrays.append(values[at:at + size].reshape(shape))
        at += size
    return Prediction(model=model, version=version, inputs=arrays, top_k=top_k)
