"""Model-dependent request checks: a decoded request (``service.http.codecs``) into the
sequences a model version runs, for /predict and the Open Inference Protocol. Every
violation raises ClientError naming the field."""

from __future__ import annotations

from typing import Any

import numpy as np
from orthornn.export.artifacts.package import INITIAL_STATE, GraphIO

from ..errors import ClientError, NotFound
from ..registry.catalog import ModelVersion
from ..registry.runtime import Chunk
from ..registry.spec import ModelSpec
from .messages import Inference, InputTensor, OutputTensor, Prediction

F32_MAX = float(np.finfo(np.float32).max)


def _float_sequence(spec: ModelSpec, seq: list | np.ndarray, field: str) -> np.ndarray:
    d = spec.feature_size
    arr: np.ndarray | None
    trusted = isinstance(seq, np.ndarray) and seq.dtype == np.float32
    if trusted:  # from fast_predict_request: float32 and finite, used as it is
        arr = np.asarray(seq)
    else:
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
            is_list = isinstance(step, list | np.ndarray)  # a row of the fast path's array
            size = len(step) if is_list else 1
            if size != d or (d != 1 and not is_list):
                raise ClientError(f"{field}[{t}]: each time step must be {expect} "
                                  f"(feature_size {d}); got {size}")
        raise ClientError(f"{field}: each time step must be {expect}")
    if not trusted and not np.isfinite(arr).all():
        t = int(np.argwhere(~np.isfinite(arr))[0][0])
        raise ClientError(f"{field}[{t}]: numbers must be finite and within float32 range "
                          f"(|x| <= {F32_MAX:.4g})")
    return arr


def _echo(value: object) -> str:
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


#: the most bytes one float32 output value takes in a JSON answer, its comma counted:
#: orjson writes the shortest form that reads back, in decimals between 1e-7 and 1e16
#: ("-0.0000010000131,": the longest of every 97th negative float32 bit pattern, 22
#: million values over every exponent); an OIP output tensor sent as binary data takes 4
JSON_VALUE_BYTES = 17


def per_step_bytes(spec: ModelSpec, per_step: bool = False, value_bytes: int = 4) -> int:
    """Bytes of output per sequence and time step that a request makes the model build (a
    language model's logits: the vocabulary; seq2seq: its classes; per_step: every
    output), VALUE_BYTES a value (4: float32; JSON_VALUE_BYTES: as a JSON answer writes
    them), 0 when only the last step's output is built."""
    if spec.task in ("lm", "seq2seq") or per_step:
        return value_bytes * spec.output_size
    return 0


def check_output_budget(spec: ModelSpec, batch: int, steps: int, budget: int,
                        per_step: bool = False, value_bytes: int = 4) -> None:
    """413 before the model runs when BATCH sequences of STEPS steps would make per-step
    outputs (B x T x V x VALUE_BYTES of a language model's logits) beyond BUDGET (0:
    none)."""
    size = batch * steps * per_step_bytes(spec, per_step, value_bytes)
    if budget and size > budget:
        written = "as JSON" if value_bytes != 4 else "float32"
        raise ClientError(
            f"inputs: the answer's per-step outputs would take {size} bytes ({batch} "
            f"sequences x {steps} steps x {spec.output_size} outputs x {value_bytes} bytes "
            f"{written}), over the limit of {budget} bytes (max_lm_output_bytes); send "
            f"fewer or shorter sequences, ask for binary outputs, or carry state across "
            f"requests", 413)


def predict_sequences(spec: ModelSpec, req: Prediction, max_sequences: int,
                      output_budget: int = 0) -> list[np.ndarray]:
    """The request's sequences as arrays: float32 [T, d] or int64 [T] token ids (their
    per-step outputs within OUTPUT_BUDGET bytes: ``check_output_budget``)."""
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
            # the fast path's float32 array: as the numbers pydantic gives (exact below 2**24)
            arr = _token_sequence(spec, seq.tolist() if isinstance(seq, np.ndarray) else seq,
                                  where)
        else:
            _check_length(spec, len(seq), where)
            arr = _float_sequence(spec, seq, where)
        _check_length(spec, len(arr), where + (" (tokens)" if req.text is not None else ""))
        sequences.append(arr)
    if output_budget:  # padded to the longest: what the batch's graph output holds
        check_output_budget(spec, len(sequences), max(len(a) for a in sequences),
                            output_budget, bool(req.per_step))
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


def _model_tensor(inp: InputTensor, expected_dtype: str) -> np.ndarray:
    """An input's array, of the model's datatype and the request's shape."""
    if inp.datatype != expected_dtype or inp.data is None:
        raise ClientError(f"inputs[{inp.name}].datatype: the model expects {expected_dtype}; "
                          f"got {inp.datatype!r}")
    return inp.data.reshape(inp.shape)


def output_value_bytes(spec: ModelSpec, req: Inference) -> int:
    """Bytes a value of the model's main output takes in the answer to REQ: 4 as binary
    data, JSON_VALUE_BYTES in JSON (a 39 MiB tensor went back as 110 MiB of JSON when
    the budget counted 4: issue 59, finding 3)."""
    binary = req.binary_outputs()
    return 4 if spec.output_name in binary or "*" in binary else JSON_VALUE_BYTES


def infer_sequences(spec: ModelSpec, req: Inference, io: GraphIO, max_sequences: int,
                    output_budget: int = 0) -> tuple[list[np.ndarray | Chunk], int]:
    """The sequences of an OIP request (x or tokens [B, T, ...] with optional lengths [B])
    and T; the per-step outputs within OUTPUT_BUDGET as the answer will write them (JSON,
    or binary data: ``output_value_bytes``)."""
    declared = {i.name: i for i in io.inputs}
    seen: dict[str, InputTensor] = {}
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
    rank = len(declared[main].shape)
    if len(x_in.shape) != rank:
        raise ClientError(f"inputs[{main}].shape: rank {rank} expected "
                          f"{declared[main].shape}; got {list(x_in.shape)}")
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
    check_output_budget(spec, batch, steps, output_budget,
                        value_bytes=output_value_bytes(spec, req))
    x = _model_tensor(x_in, declared[main].datatype)
    if spec.kind == "tokens":
        vocab = len(spec.vocabulary or ())
        if x.size and (x.min() < 0 or x.max() >= vocab):
            raise ClientError(f"inputs[tokens].data: token ids must be in [0, {vocab - 1}]")
    if "lengths" in seen:
        ln = seen["lengths"]
        if list(ln.shape) != [batch]:
            raise ClientError(f"inputs[lengths].shape: must be [{batch}]; got "
                              f"{list(ln.shape)}")
        lengths = _model_tensor(ln, declared["lengths"].datatype)
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
                              f"{spec.state_size}]; got {list(st.shape)}")
        states = _model_tensor(st, "FP32")
        seqs = [Chunk(s, states[i]) for i, s in enumerate(arrays)]
    return seqs, steps


def version_param(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if not (isinstance(value, str) and value.isascii() and value.isdigit()) or \
            not 1 <= int(value) < 2**62:
        raise NotFound(f"version must be a positive integer; got {value!r}")
    return int(value)


def session_sequence(seqs: list) -> np.ndarray:
    """The one sequence of a session's chunk (a session keeps its own state)."""
    if len(seqs) != 1:
        raise ClientError(f"a session takes one sequence per request; got {len(seqs)}")
    if isinstance(seqs[0], Chunk):
        raise ClientError("inputs[initial_state]: not with a sequence_id (the session "
                          "keeps its state)")
    return seqs[0]


def check_streaming(mv: ModelVersion) -> None:
    """400 unless MV's graphs take an initial state (what sessions and states need)."""
    if not mv.spec.streaming:
        raise ClientError(f"model {mv.name!r} version {mv.version} was exported before "
                          f"streaming (its graphs take no initial state); export it again "
                          f"to continue sequences across requests")


def state_of(tensors: list[OutputTensor]) -> np.ndarray:
    """The final state of a one-sequence answer's tensors."""
    (state,) = [t.data for t in tensors if t.name == "state"]
    return state[0]
