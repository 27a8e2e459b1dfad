"""What a capture record holds, encoded once per batch line (docs/capture.md, "Records"):
a request's inputs, outputs and the next-token log-likelihood of a language model, as
the reader (``export.artifacts.loop.captures``) decodes them; and the answers kept of a
session's chunks (``keep_answer``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pybase64
from orthornn.export.artifacts.scoring import log_softmax

from .. import request
from ..registry.batching import LOG_PROBABILITIES
from ..registry.runtime import Chunk
from ..registry.spec import ModelSpec

_DUMP = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
_DTYPES: dict[np.dtype, bytes] = {}  # a dtype's '"dtype":"<f4"' (dtype.str costs 0.3 µs)

#: what a batch hands its recorder, per tagged request: its scope (``Capture.tag``: the id
#: the client gave, the route; where the sample's decision and the id go), its sequences
#: (arrays or Chunks), its output rows, its compute time (queue and inference, seconds)
Captured = tuple[request.Scope, Sequence[Any], Sequence[dict], float]



def request_line(rid: str, now: float, route: str, model: str, version: int, inputs: list,
          outputs: Any, session: str | None, position: int | None,
          compute_s: float | None) -> bytes:
    """A record's JSON line, encoded straight to bytes: the fields around the arrays by
    orjson, each array spliced in as ``_array_json`` writes it (a dict of base64 strings
    for orjson to copy again cost a fifth more; ``round`` alone a microsecond)."""
    head = orjson.dumps({"id": rid, "time": int(now * 1e6 + 0.5) / 1e6, "route": route,
                         "model": model, "version": version})
    tail = orjson.dumps({"session": session, "position": position,
                         "compute_ms": None if compute_s is None
                         else int(compute_s * 1e6 + 0.5) / 1e3})
    if isinstance(outputs, dict):  # the OIP's output tensors by name
        out = b"{" + b",".join([orjson.dumps(str(name)) + b":" + _array_json(value)
                                for name, value in outputs.items()]) + b"}"
    else:
        out = orjson.dumps(outputs, option=orjson.OPT_SERIALIZE_NUMPY)
    arrays = b",".join([_array_json(s.data if isinstance(s, Chunk) else s) for s in inputs])
    return b"".join((head[:-1], b',"inputs":[', arrays, b'],"outputs":', out, b",",
                     tail[1:], b"\n"))


def batch_line(now: float, model: str, version: int, spec: ModelSpec, graph: str,
                timed: bool, captured: list[Captured]) -> bytes:
    """One line for a batch's sampled requests (``captures.records_of`` reads it back): the
    requests' ids, routes, sequence counts and compute times as lists, every sequence's
    inputs in one array (their lengths apart), the outputs in another: ``kind``
    "classify" the logits [N, C] (read back as the probabilities /predict answers, numpy's
    float64 softmax of them; top-k is their order), "lm" each sequence's log-likelihood of
    its tokens after the first [N], "steps" the graph's rows per step after one another
    (TIMED), else "rows" its row per sequence [N, ...]. Per batch, not per record:
    numpy's ``np.array`` of the rows, one concatenation, two base64 (pybase64)."""
    seqs = [s.data if isinstance(s, Chunk) else s for _, group, _, _ in captured for s in group]
    rows = [r for _, _, group, _ in captured for r in group]
    name = spec.output_name
    head = orjson.dumps({
        "ids": [c[0].id for c in captured], "routes": [c[0].route for c in captured],
        "sequences": [len(c[1]) for c in captured],
        "compute_ms": [int(c[3] * 1e6 + 0.5) / 1e3 for c in captured],
        "time": int(now * 1e6 + 0.5) / 1e6, "model": model, "version": version,
        "lengths": [len(x) for x in seqs]})
    if graph == "model" and spec.task == "lm":
        kind, out = "lm", np.array([_log_likelihood(r, name, x)
                                    for r, x in zip(rows, seqs, strict=True)])
    elif timed:
        kind, out = "steps", np.concatenate([r[name] for r in rows])
    else:  # np.array of the rows: a third of np.stack's time on a batch of small arrays
        kind, out = "classify" if spec.task == "classify" else "rows", \
            np.array([r[name] for r in rows])
    return b"".join((head[:-1], b',"inputs":', _array_json(np.concatenate(seqs)),
                     b',"outputs":{"kind":"', kind.encode(), b'","name":', orjson.dumps(name),
                     b',"value":', _array_json(out), b"}}\n"))


def _log_likelihood(row: dict, name: str, tokens: np.ndarray) -> float:
    """A language model's log-likelihood of TOKENS after the first (the batch's prepare
    step's log-probabilities when /predict asked for them)."""
    logp = row.get(LOG_PROBABILITIES)
    if logp is None:
        logp = log_softmax(row[name].astype(np.float64))
    scored = len(tokens) - 1
    return float(logp[np.arange(scored), tokens[1:]].sum()) if scored > 0 else 0.0


def _array_json(a: np.ndarray) -> bytes:
    """An array as a record holds it, as JSON bytes: its dtype, shape and bytes (in the
    dtype's byte order) in base64 (exact, and ten times cheaper to write than its numbers
    as text); a contiguous one is not copied."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    dtype = _DTYPES.get(a.dtype)
    if dtype is None:
        if a.dtype.hasobject or a.dtype.names is not None:
            raise TypeError(f"an array of {a.dtype} is not captured")
        dtype = _DTYPES[a.dtype] = b'{"dtype":' + orjson.dumps(a.dtype.str)
    return b"".join((dtype, b',"shape":', orjson.dumps(a.shape), b',"b64":"',
                     pybase64.b64encode(a),  # type: ignore[arg-type]  # SIMD: 18 KB in 3 µs
                     b'"}'))


def keep_answer(capture: Any, route: str, model: str, version: int,
                inputs: list, outputs: Any, session: str | None = None,
                position: int | None = None) -> None:
    """(CAPTURE: the server's ``capture.Capture``, or None: off; untyped here, a layer
    below it.) The record of one answered request, when capture is on and it is in the sample: the
    inputs as the model saw them (arrays, token ids), the outputs the client gets, the
    session's id and position after a chunk, the compute time (the request's scope).
    Nothing is encoded for a request not sampled, nor while the disk refuses."""
    if capture is None:
        return
    scope = request.current()
    rid = capture.decide(scope)
    if rid is None:  # not in the sample
        return
    now = capture.clock()
    if not capture.admits(model, version, now):
        scope.id = None  # dropped: its answer carries no id
        return
    try:
        line = request_line(rid, now, route, model, version, inputs, outputs, session,
                            position, scope.compute_s)
    except (TypeError, ValueError) as error:  # outputs orjson cannot write
        capture.warn(f"capture: a record of {model} version {version} dropped: {error}")
        capture.dropped("error")
        return
    capture.write(model, version, line, now)
