"""Model-dependent request checks and answer shaping, shared by /predict, /generate and
the Open Inference Protocol. Every violation raises ClientError naming the field."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import simdjson
from orthornn.export.package import DATATYPES, INITIAL_LOGITS, INITIAL_STATE
from pydantic import ValidationError

from .errors import ClientError
from .protocol import InferenceRequest, PredictRequest, RequestInput
from .runtime import Chunk, ModelSpec

F32_MAX = float(np.finfo(np.float32).max)


def _float_sequence(spec: ModelSpec, seq: list | np.ndarray, field: str) -> np.ndarray:
    d = spec.feature_size
    trusted = isinstance(seq, np.ndarray)  # from fast_predict_request: float32, finite
    try:
        with np.errstate(over="ignore"):  # out-of-range numbers become inf: refused below
            arr = np.asarray(seq, dtype=np.float32)
    except (ValueError, TypeError):  # ragged steps or a mixture of numbers and lists
        arr = None
    if arr is not None and arr.ndim == 1 and d == 1:
        arr = arr.reshape(-1, 1)
    if arr is None or arr.ndim != 2 or arr.shape[1] != d:
        expect = "a number or a list of 1 number" if d == 1 else f"a list of {d} numbers"
        for t, step in enumerate(seq):
            size = 1 if not isinstance(step, list) else len(step)
            if size != d or (d != 1 and not isinstance(step, list)):
                raise ClientError(f"{field}[{t}]: each time step must be {expect} "
                                  f"(feature_size {d}); got {size}")
        raise ClientError(f"{field}: each time step must be {expect}")
    if not trusted and not np.isfinite(arr).all():
        t = int(np.argwhere(~np.isfinite(arr))[0][0])
        raise ClientError(f"{field}[{t}]: numbers must be finite and within float32 range "
                          f"(|x| <= {F32_MAX:.4g})")
    return arr


def _echo(value) -> str:
    """A client's number as it most likely wrote it: whole numbers without ".0" (JSON
    integers reach us as floats where the schema also takes fractions)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def _token_sequence(spec: ModelSpec, seq: list, field: str) -> np.ndarray:
    vocab = len(spec.vocabulary or ())
    out = np.empty(len(seq), dtype=np.int64)
    for t, tok in enumerate(seq):
        if isinstance(tok, list) or not float(tok).is_integer() or not 0 <= tok < vocab:
            raise ClientError(f"{field}[{t}]: token ids must be integers in [0, {vocab - 1}] "
                              f"(the vocabulary has {vocab} tokens); got {_echo(tok)}")
        out[t] = int(tok)
    return out


def _check_length(spec: ModelSpec, n: int, field: str) -> None:
    if not 1 <= n <= spec.max_length:
        raise ClientError(f"{field}: sequence length must be in [1, {spec.max_length}] "
                          f"(the model's max_length); got {n}")


def predict_sequences(spec: ModelSpec, req: PredictRequest, max_sequences: int
                      ) -> list[np.ndarray]:
    """The request's sequences as arrays: float32 [T, d] or int64 [T] token ids."""
    if (req.inputs is None) == (req.text is None):
        raise ClientError("inputs: give exactly one of 'inputs' or 'text'"
                          if spec.kind == "tokens" else "inputs: required")
    if req.text is not None and spec.kind != "tokens":
        raise ClientError(f"text: only language models take text; model {spec.name!r} "
                          f"takes 'inputs' (sequences of {spec.feature_size} features)")
    items: list[Any] = req.inputs if req.inputs is not None else req.text or []
    field = "inputs" if req.inputs is not None else "text"
    if not 1 <= len(items) <= max_sequences:
        raise ClientError(f"{field}: between 1 and {max_sequences} sequences per request; "
                          f"got {len(items)}")
    if req.top_k is not None and spec.task in ("regress", "seq2seq"):
        raise ClientError(f"top_k: not used by {spec.task} models")
    if req.allow_unk and spec.task != "lm":
        raise ClientError(f"allow_unk: only language models take it; {spec.name!r} is a "
                          f"{spec.task} model")
    sequences = []
    for i, seq in enumerate(items):
        where = f"{field}[{i}]"
        if req.text is not None:
            arr = np.array(spec.encode(seq), dtype=np.int64)
        elif spec.kind == "tokens":
            _check_length(spec, len(seq), where)
            arr = _token_sequence(spec, seq, where)
        else:
            _check_length(spec, len(seq), where)
            arr = _float_sequence(spec, seq, where)
        _check_length(spec, len(arr), where + (" (tokens)" if req.text is not None else ""))
        sequences.append(arr)
    return sequences


def range_warning(spec: ModelSpec, sequences: list[np.ndarray], field: str) -> str | None:
    """A one-line warning (ASCII, for a header) when a float input lies far outside the
    range the model was trained on (``runtime.RANGE_MARGIN``), else None. Such inputs are
    answered, but the answer means little: usually the client skipped the model's
    preprocessing (GET /v2/models/NAME shows it)."""
    low, high = spec.input_low, spec.input_high
    tmin, tmax = spec.training_min, spec.training_max
    if low is None or tmin is None or tmax is None or spec.kind != "float":
        return None
    # the hot path: two contiguous reductions per sequence rule out most requests (no value
    # below the highest lower bound nor above the lowest upper bound)
    surely_low, surely_high = spec.input_low_max, spec.input_high_min
    for i, seq in enumerate(sequences):
        if not len(seq) or (seq.min() >= surely_low and seq.max() <= surely_high):
            continue
        lo, hi = seq.min(axis=0), seq.max(axis=0)
        bad = (lo < low) | (hi > high)
        if bad.any():
            f = int(np.argmax(bad))
            value = float(lo[f] if lo[f] < low[f] else hi[f])
            return (f"{field}[{i}] feature {f}: {value:.4g} is far outside the training range "
                    f"[{tmin[f]:.4g}, {tmax[f]:.4g}]; inputs must "
                    f"be preprocessed as the model's manifest says (GET /v2/models/{spec.name})")
    return None


# the keys of the common body; any other (streaming ones, allow_unk) takes pydantic's path
_PREDICT_KEYS = frozenset({"model", "version", "inputs", "text", "top_k"})
_NUMBER_ERRORS = (TypeError, ValueError, RuntimeError)  # what simdjson raises on non-numbers


def fast_predict_request(body: bytes) -> PredictRequest | None:
    """The common /predict body (float sequences, no text) read with simdjson, whose
    ``as_buffer`` turns a nested array of numbers into doubles without making a Python
    object per number, or None when anything is unusual.

    It accepts only bodies that PredictRequest accepts too, and gives the same numbers
    (simdjson and pydantic both round each number to the nearest double): strings,
    booleans, nulls and objects among the numbers, numbers beyond 64-bit integers or
    doubles, duplicate keys, ragged steps and arrays nested deeper than
    [sequence][step][feature] are refused here. A None, or a ClientError from
    predict_sequences on this request, sends the caller back to pydantic, whose messages
    name the field.
    """
    if body.startswith(b"\xef\xbb\xbf"):  # simdjson skips a UTF-8 BOM, pydantic refuses it
        return None
    try:  # Any: the checks below are type(...) tests mypy does not narrow on
        data: Any = simdjson.Parser().parse(body)  # a parser per call: thread-safe, cheap
    except _NUMBER_ERRORS:
        return None
    if type(data) is not simdjson.Object:
        return None
    keys = set(data.keys())
    if len(keys) != len(data) or not keys <= _PREDICT_KEYS or "allow_unk" in keys:
        return None  # a duplicate key (pydantic keeps the last), an unknown or a rare one
    model, version, top_k = data.get("model"), data.get("version"), data.get("top_k")
    seqs = data.get("inputs")
    if type(model) is not str or not 1 <= len(model) <= 128 or "[" in model \
            or data.get("text") is not None or type(seqs) is not simdjson.Array:
        return None
    if version is not None and not (type(version) is int and 1 <= version <= 2**62):
        return None  # strings ("2") and mistakes: pydantic
    if top_k is not None and not (type(top_k) is int and 1 <= top_k <= 1_000_000):
        return None
    arrays, brackets = [], 1 + len(seqs)  # '[' of inputs and of each sequence
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
        try:  # strings, booleans, nulls and objects raise
            flat = np.frombuffer(seq.as_buffer(of_type="d"), dtype=np.float64)
        except _NUMBER_ERRORS:
            return None
        if flat.size != math.prod(shape) or (flat.size and not
                                             -F32_MAX <= flat.min() <= flat.max() <= F32_MAX):
            return None  # nested deeper, or beyond float32: the checks below name it
        arrays.append(flat.astype(np.float32).reshape(shape))
    # as_buffer flattens any nesting: a '[' beyond the expected ones is a deeper array (the
    # keys and the model name hold none)
    if body.count(b"[") != brackets:
        return None
    return PredictRequest.model_construct(model=model, version=version, inputs=arrays,
                                          text=None, top_k=top_k, allow_unk=False)


_INFER_KEYS = frozenset(InferenceRequest.model_fields)
_INPUT_KEYS = frozenset(RequestInput.model_fields)
# pysimdjson's buffers of JSON numbers: doubles ("d") or 64-bit integers ("i")
_JSON_BUFFERS = {"d": np.float64, "i": np.int64}


def _python(value):
    """A simdjson value as plain Python (small values: names, shapes, parameters)."""
    if type(value) is simdjson.Object:
        return value.as_dict()
    if type(value) is simdjson.Array:
        return value.as_list()
    return value


def fast_infer_request(body: bytes) -> InferenceRequest | None:
    """An OIP JSON inference request read with simdjson: each input's ``data`` becomes a
    flat numpy array through ``as_buffer`` (no Python object per number), everything else
    is validated by pydantic as usual. None when anything is unusual (a string, boolean or
    null among the numbers, a duplicate key, a datatype other than FP32 / INT64, a BOM):
    the caller then parses the body with pydantic alone, whose messages name the field.
    decode_tensor checks the element count against the shape on either path."""
    if body.startswith(b"\xef\xbb\xbf"):
        return None
    try:  # Any: as in fast_predict_request
        doc: Any = simdjson.Parser().parse(body)
    except _NUMBER_ERRORS:
        return None
    if type(doc) is not simdjson.Object:
        return None
    keys = set(doc.keys())
    inputs = doc.get("inputs")
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
        data = inp.get("data")
        if data is None:
            arrays.append(None)
        else:
            datatype = DATATYPES.get(meta.get("datatype") or "")
            if type(data) is not simdjson.Array or datatype is None:
                return None
            kind = datatype.json_buffer
            try:
                arrays.append(np.frombuffer(data.as_buffer(of_type=kind),
                                            dtype=_JSON_BUFFERS[kind]))
            except _NUMBER_ERRORS:
                return None
            meta["data"] = []  # validated as present; the numbers are the array above
        metas.append(meta)
    try:
        req = InferenceRequest.model_validate(
            {**{k: _python(doc[k]) for k in keys if k != "inputs"}, "inputs": metas})
    except ValidationError:
        return None
    for request_input, arr in zip(req.inputs, arrays, strict=True):
        if arr is not None:
            # the array stands in for the list (decode_tensor takes either)
            request_input.data = arr  # type: ignore[assignment]
    return req


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _label(spec: ModelSpec, i: int) -> str:
    return spec.labels[i] if spec.labels and i < len(spec.labels) else str(i)


PROBABILITIES, INDEX = "_probabilities", "_index"  # added to classify rows by prepare_rows


def prepare_rows(spec: ModelSpec, rows: list[dict]) -> None:
    """Once per batch, in the inference thread: every classify row's probabilities (as a
    list) and most likely class, from one softmax over the batch instead of one per row."""
    if spec.task != "classify" or not rows:
        return
    p = _softmax(np.stack([r[spec.output_name] for r in rows]).astype(np.float64))
    for row, probabilities, index in zip(rows, p.tolist(), p.argmax(axis=-1).tolist(),
                                         strict=True):
        row[PROBABILITIES], row[INDEX] = probabilities, index


def _classify_item(spec: ModelSpec, p: list[float], i: int, top_k: int | None) -> dict:
    item: dict[str, Any] = {"label": _label(spec, i), "index": i, "probabilities": p}
    if top_k:  # most likely first; ties keep the class order (a stable sort)
        best = sorted(range(len(p)), key=lambda j: -p[j])[:top_k]
        item["top_k"] = [{"label": _label(spec, j), "index": j, "probability": p[j]}
                         for j in best]
    return item


def _per_step_items(spec: ModelSpec, y: np.ndarray, top_k: int | None) -> list[dict]:
    """classify / regress outputs after every step (y [T, C] of the "steps" graph)."""
    if spec.task == "regress":
        return [{"value": float(v[0]) if v.size == 1 else v.tolist()}
                for v in y.astype(np.float64)]
    p = _softmax(y.astype(np.float64))
    return [_classify_item(spec, row, i, top_k)
            for row, i in zip(p.tolist(), p.argmax(axis=-1).tolist(), strict=True)]


def shape_outputs(spec: ModelSpec, rows: list[dict], sequences: list,
                  top_k: int | None, per_step: bool = False, allow_unk: bool = False
                  ) -> list[dict]:
    """Per sequence, the /predict answer from its output rows (runs in the inference
    thread). ``sequences``: arrays, or Chunks that continued from a state. Language models
    list no <unk> among next_tokens unless allow_unk."""
    if per_step:
        out = []
        for row in rows:
            steps = _per_step_items(spec, row[spec.output_name], top_k)
            out.append({**steps[-1], "steps": steps})
        return out
    if rows and spec.task == "classify" and PROBABILITIES not in rows[0]:
        prepare_rows(spec, rows)  # not batched through the batcher's prepare step
    out = []
    for row, seq in zip(rows, sequences, strict=True):
        if spec.task == "classify":
            out.append(_classify_item(spec, row[PROBABILITIES], row[INDEX], top_k))
            continue
        y = row[spec.output_name].astype(np.float64)
        if spec.task == "regress":
            item = {"value": float(y[0]) if y.size == 1 else y.tolist()}
        elif spec.task == "seq2seq":
            idx = np.argmax(y, axis=-1)
            item = {"indices": idx.tolist(), "labels": [_label(spec, int(j)) for j in idx]}
        else:  # lm: y [T, V]; position t predicts token t + 1
            tokens = seq.data if isinstance(seq, Chunk) else seq
            logp = _log_softmax(y)
            scored = len(tokens) - 1
            ll = float(logp[np.arange(scored), tokens[1:]].sum()) if scored else 0.0
            if isinstance(seq, Chunk) and seq.state is not None and INITIAL_LOGITS in row:
                # a continued chunk: its first token is predicted by the state it continues
                ll += float(_log_softmax(row[INITIAL_LOGITS].astype(np.float64))[tokens[0]])
                scored += 1
            p = np.exp(logp[-1])
            rank = -p
            if not allow_unk and spec.unk_id is not None:
                rank[spec.unk_id] = np.inf  # last: never among the top k
            best = np.argsort(rank, kind="stable")[:min(top_k or 5, len(p) - (not allow_unk))]
            vocab = spec.vocabulary or []
            item = {"next_tokens": [{"token": vocab[j], "id": int(j),
                                     "probability": float(p[j])} for j in best],
                    "log_likelihood": ll,
                    "perplexity": math.exp(-ll / scored) if scored else None,
                    "tokens": scored}
        out.append(item)
    return out


# -- Open Inference Protocol tensors ---------------------------------------------------

def decode_tensor(inp, binary: bytes | None, expected_dtype: str) -> np.ndarray:
    """One OIP input as a numpy array of its declared shape and the model's datatype."""
    field = f"inputs[{inp.name}]"
    if inp.datatype != expected_dtype:
        raise ClientError(f"{field}.datatype: the model expects {expected_dtype}; "
                          f"got {inp.datatype!r}")
    wire = DATATYPES[expected_dtype].numpy
    dtype = wire.type
    count = math.prod(inp.shape)
    if count > 1 << 28:
        raise ClientError(f"{field}.shape: too many elements ({count})")
    if binary is not None:
        if len(binary) != count * wire.itemsize:
            raise ClientError(f"{field}: binary_data_size {len(binary)} does not match shape "
                              f"{inp.shape} of {expected_dtype}")
        arr = np.frombuffer(binary, dtype=wire).astype(dtype)
    else:
        if inp.data is None:
            raise ClientError(f"{field}.data: required (or binary_data_size)")
        if isinstance(inp.data, np.ndarray):  # from fast_infer_request: already numbers
            with np.errstate(over="ignore"):  # beyond float32: inf, refused below
                arr = inp.data.astype(dtype)
        else:
            arr = _flatten(inp.data, expected_dtype, field)
        if arr.size != count:
            raise ClientError(f"{field}.data: {arr.size} elements do not match shape "
                              f"{inp.shape}")
    arr = arr.reshape(inp.shape)
    if arr.dtype == np.float32 and not np.isfinite(arr).all():
        raise ClientError(f"{field}.data: numbers must be finite (float32 range)")
    return arr


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


def infer_sequences(spec: ModelSpec, req: InferenceRequest, binaries: dict[str, bytes],
                    io: dict, max_sequences: int) -> tuple[list[np.ndarray | Chunk], int]:
    """The sequences of an OIP request (x or tokens [B, T, ...] with optional lengths [B])
    and T."""
    declared = {i["name"]: i for i in io["inputs"]}
    seen = {}
    for inp in req.inputs:
        if inp.name not in declared:
            raise ClientError(f"inputs[{inp.name}]: unknown input; the model takes "
                              f"{sorted(declared)}")
        if inp.name in seen:
            raise ClientError(f"inputs[{inp.name}]: given twice")
        seen[inp.name] = inp
    main = "tokens" if spec.kind == "tokens" else "x"
    if main not in seen:
        raise ClientError(f"inputs: {main!r} is required")
    x_in = seen[main]
    rank = len(declared[main]["shape"])
    if len(x_in.shape) != rank:
        raise ClientError(f"inputs[{main}].shape: rank {rank} expected "
                          f"{declared[main]['shape']}; got {x_in.shape}")
    batch, steps = x_in.shape[0], x_in.shape[1]
    if not 1 <= batch <= max_sequences:
        raise ClientError(f"inputs[{main}].shape[0]: batch must be in [1, {max_sequences}]; "
                          f"got {batch}")
    if not 1 <= steps <= spec.max_length:
        raise ClientError(f"inputs[{main}].shape[1]: sequence length must be in "
                          f"[1, {spec.max_length}]; got {steps}")
    if rank == 3 and x_in.shape[2] != spec.feature_size:
        raise ClientError(f"inputs[{main}].shape[2]: feature_size is {spec.feature_size}; "
                          f"got {x_in.shape[2]}")
    x = decode_tensor(x_in, binaries.get(main), declared[main]["datatype"])
    if spec.kind == "tokens":
        vocab = len(spec.vocabulary or ())
        if x.size and (x.min() < 0 or x.max() >= vocab):
            raise ClientError(f"inputs[tokens].data: token ids must be in [0, {vocab - 1}]")
    if "lengths" in seen:
        ln = seen["lengths"]
        if list(ln.shape) != [batch]:
            raise ClientError(f"inputs[lengths].shape: must be [{batch}]; got {ln.shape}")
        lengths = decode_tensor(ln, binaries.get("lengths"), declared["lengths"]["datatype"])
        if lengths.min() < 1 or lengths.max() > steps:
            raise ClientError(f"inputs[lengths].data: lengths must be in [1, {steps}]")
    else:
        lengths = np.full(batch, steps, dtype=np.int64)
    arrays = [x[i, :int(n)] for i, n in enumerate(lengths)]
    seqs: list[np.ndarray | Chunk] = list(arrays)
    if INITIAL_STATE in seen:  # raw state tensors: the URL names the version they continue
        st = seen[INITIAL_STATE]
        if list(st.shape) != [batch, spec.state_size]:
            raise ClientError(f"inputs[{INITIAL_STATE}].shape: must be [{batch}, "
                              f"{spec.state_size}]; got {st.shape}")
        states = decode_tensor(st, binaries.get(INITIAL_STATE), "FP32")
        seqs = [Chunk(s, states[i]) for i, s in enumerate(arrays)]
    return seqs, steps


def outputs_to_tensors(rows: list[dict], names: list[str], steps: int,
                       per_step: set[str]) -> dict[str, np.ndarray]:
    """Stack the named outputs of per-sequence rows back into [B, ...] tensors; time-axis
    outputs are padded to the request's T with zeros past each sequence's length."""
    out = {}
    for name in names:
        if name in per_step:
            first = rows[0][name]
            arr = np.zeros((len(rows), steps, *first.shape[1:]), dtype=first.dtype)
            for i, r in enumerate(rows):
                arr[i, :len(r[name])] = r[name]
        else:
            arr = np.stack([r[name] for r in rows])
        out[name] = arr
    return out


def binary_chunks(req: InferenceRequest, tail: bytes) -> dict[str, bytes]:
    """The binary tensor data extension: inputs with parameters.binary_data_size take
    consecutive chunks of the bytes after the JSON header."""
    chunks, offset = {}, 0
    for inp in req.inputs:
        size = (inp.parameters or {}).get("binary_data_size")
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ClientError(f"inputs[{inp.name}].parameters.binary_data_size: must be a "
                              f"non-negative integer")
        if offset + size > len(tail):
            raise ClientError(f"inputs[{inp.name}].parameters.binary_data_size: {size} bytes "
                              f"past the end of the body")
        chunks[inp.name] = tail[offset:offset + size]
        offset += size
    if offset != len(tail):
        raise ClientError(f"body: {len(tail) - offset} bytes of binary data belong to no input")
    return chunks

