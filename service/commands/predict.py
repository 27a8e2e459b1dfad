"""``orthornn predict``: a small client of a running service's /predict (standard library
only, so it runs without the serve extra): a file of sequences in, a line per answer out,
or each sequence streamed in chunks through a server-side session."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import POSITION_HEADER, SECRET_HEADER

DEFAULT_URL = "http://127.0.0.1:8000"  # where orthornn serve and the quickstart listen


def add_predict_parser(sub: Any) -> None:
    predict = sub.add_parser(
        "predict", help="send a file to a running service's /predict and print the answers",
        description="Send FILE to a running service's /predict and print one line per "
                    "sequence: '0: 4 (p=0.98)' for a classifier (with --top-k, the k "
                    "likeliest labels on the same line), the value of a regressor, the "
                    "labels of a seq2seq model, the likeliest next tokens of a language "
                    "model; --verbose prints the whole JSON answer. FILE: .json (a list of "
                    "sequences, or a whole /predict body), .npy (the array x) or .npz "
                    "(arrays x and optional lengths [N]), x [N, T, d] numbers ([N, T] for "
                    "one feature, or token ids), or .txt (one text per line, for language "
                    "models).")
    predict.add_argument("file", metavar="FILE", help="the sequences to send (formats above)")
    predict.add_argument("--url", default=DEFAULT_URL,
                         help=f"service base URL (default {DEFAULT_URL}, where orthornn serve "
                              f"and the quickstart listen)")
    predict.add_argument("--model", required=True, help="the model's name in the repository")
    predict.add_argument("--version", type=int, help="a loaded version (default: the promoted "
                                                      "one, else the newest)")
    predict.add_argument("--top-k", type=int,
                         help="classifiers: also the k likeliest labels; language models: "
                              "next tokens listed (default 5)")
    predict.add_argument("--timeout", type=float, default=60.0,
                         help="seconds to wait for each answer (default 60)")
    predict.add_argument("--verbose", "-v", action="store_true",
                         help="print the whole JSON answer (with --stream: one JSON line per "
                              "chunk) instead of a line per sequence")
    predict.add_argument("--stream", action="store_true",
                         help="send each sequence in chunks through a server-side session and "
                              "print a line per chunk (the answer after it); each chunk names "
                              "the session's position, and one whose connection broke is sent "
                              "once more (the service applies it exactly once)")
    predict.add_argument("--chunk-size", type=int, default=8,
                         help="with --stream: time steps (or words of a text) per chunk "
                              "(default 8)")
    predict.set_defaults(run=run_predict)


def _request_body(path: Path, model: str, version: int | None, top_k: int | None) -> dict:
    if not path.is_file():
        raise ValueError(f"FILE {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"FILE {str(path)!r} is not valid JSON: {e}") from None
        body = dict(data) if isinstance(data, dict) else {"inputs": data}
    elif suffix in (".npy", ".npz"):
        import numpy as np

        x, lengths = _read_array_file(path, suffix)
        if x.dtype.kind not in "iuf":
            raise ValueError(f"x must hold numbers; got dtype {x.dtype}")
        if x.ndim == 2 and x.dtype.kind in "iu":  # token ids [N, T]
            x = x.astype(np.int64)
        elif x.ndim not in (2, 3):
            raise ValueError(f"x must be [N, T, d] (or [N, T] with one feature) numbers or "
                             f"[N, T] token ids; got shape {list(x.shape)}")
        rows = x.tolist()
        if lengths is not None:
            lengths = np.asarray(lengths)
            if lengths.shape != (len(rows),) or lengths.dtype.kind not in "iu" or (
                    len(rows) and not 1 <= lengths.min() <= lengths.max() <= x.shape[1]):
                raise ValueError(f"lengths must be {len(rows)} integers in [1, {x.shape[1]}] "
                                 f"(one per sequence of x); got {lengths.dtype} "
                                 f"{list(lengths.shape)}")
            rows = [r[:int(n)] for r, n in zip(rows, lengths, strict=True)]
        body = {"inputs": rows}
    elif suffix == ".txt":
        body = {"text": [line for line in path.read_text().splitlines() if line.strip()]}
    else:
        raise ValueError(f"FILE must be .json, .npy, .npz or .txt; got {path.name!r}")
    body["model"] = model
    if version is not None:
        body["version"] = version
    if top_k is not None:
        body["top_k"] = top_k
    return body


def _read_array_file(path: Path, suffix: str) -> tuple[Any, Any]:
    """(x, lengths or None) of a .npy file (x itself) or an .npz file (arrays x and
    optional lengths); ValueError naming the file when it cannot be read."""
    import numpy as np

    try:
        if suffix == ".npy":
            return np.asarray(np.load(path, allow_pickle=False)), None
        with np.load(path, allow_pickle=False) as loaded:
            if "x" not in loaded.files:
                raise ValueError(f"FILE {str(path)!r} has no array 'x' (it holds "
                                 f"{', '.join(loaded.files) or 'no arrays'})")
            lengths = loaded["lengths"] if "lengths" in loaded.files else None
            return np.asarray(loaded["x"]), lengths
    except (OSError, EOFError) as error:
        raise ValueError(f"FILE {str(path)!r} is not a readable {suffix} file: {error}") \
            from None
    except ValueError as error:
        if str(error).startswith("FILE "):
            raise
        raise ValueError(f"FILE {str(path)!r} is not a readable {suffix} file: {error}") \
            from None


class _HTTPFailure(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _Unreachable(ValueError):
    """No answer: the connection failed, broke or timed out (the request may or may not
    have been applied)."""




def _post(url: str, body: dict, timeout: float, headers: dict[str, str] | None = None
          ) -> tuple[dict, dict[str, str]]:
    """POST BODY to URL/predict (with HEADERS): (the JSON answer, its headers, lower-case
    names)."""
    import http.client
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url.rstrip("/") + "/predict",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
            return answer, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", "")
        except ValueError:
            message = ""
        raise _HTTPFailure(e.code, message or str(e.reason)) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise _Unreachable(f"cannot reach {url!r}: {getattr(e, 'reason', e)} (is orthornn "
                           f"serve running there? --url names another address)") from None


def _post_predict(url: str, body: dict, timeout: float) -> dict:
    return _post(url, body, timeout)[0]


def _p(probability: float) -> str:
    return f"{probability:.3g}"


def summary(output: dict) -> str:
    """One sequence's /predict output on one line: the label and its probability (and
    the top_k), the value, the seq2seq labels or the next tokens; else compact JSON."""
    if "next_tokens" in output:  # lm
        line = "next: " + ", ".join(f"{json.dumps(t['token'], ensure_ascii=False)} "
                                    f"{_p(t['probability'])}" for t in output["next_tokens"])
        if output.get("perplexity") is not None:
            line += f"; perplexity {output['perplexity']:.4g}"
        return line
    if "labels" in output:  # seq2seq: a label per time step
        return " ".join(map(str, output["labels"]))
    if "value" in output:  # regress
        value = output["value"]
        return f"{value:.4g}" if not isinstance(value, list) else \
            "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    if "label" in output:  # classify
        line, probabilities = str(output["label"]), output.get("probabilities")
        if probabilities and output.get("index") is not None:
            line += f" (p={_p(probabilities[output['index']])})"
        if output.get("top_k"):
            line += f"; top {len(output['top_k'])}: " + ", ".join(
                f"{c['label']} {_p(c['probability'])}" for c in output["top_k"])
        return line
    return json.dumps(output)


def _stream(args: argparse.Namespace, body: dict) -> None:
    """Each sequence of the body through its own session, --chunk-size steps (or words)
    a request; a line per chunk (--verbose: a JSON line). Each chunk names the session's
    position (the time steps before it, as the previous answer's Orthornn-Session-Position
    header gave it), so a chunk whose answer was lost to a broken connection is sent once
    more, at the same position: the service applies it exactly once (a retry of a chunk it
    applied is answered again). Each session's secret (192 random bits) is chosen here and
    sent with every chunk, its start included (header Orthornn-Session-Secret): a retried
    start is then recognised as this client's, and no other client can continue or end
    the session."""
    import secrets
    import uuid

    if args.chunk_size < 1:
        raise ValueError(f"--chunk-size must be an integer >= 1; got {args.chunk_size}")
    texts = body.pop("text", None)
    items = [t.split() for t in texts] if texts is not None else body.pop("inputs", None)
    if not items:
        raise ValueError(f"FILE {args.file!r} holds no sequence to stream")
    field = "text" if texts is not None else "inputs"
    run = uuid.uuid4().hex[:12]
    for i, seq in enumerate(items):
        session = f"predict-{run}-{i}"
        owner = {SECRET_HEADER: secrets.token_urlsafe(24)}
        starts = list(range(0, len(seq), args.chunk_size)) or [0]
        position: int | None = 0
        for k, start in enumerate(starts):
            part = seq[start:start + args.chunk_size]
            chunk = {**body, field: [" ".join(part) if texts is not None else part],
                     "session": session, "start": k == 0, "end": k == len(starts) - 1}
            if position is not None:
                chunk["position"] = position
            try:
                answer, headers = _post(args.url, chunk, args.timeout, owner)
            except _Unreachable:
                if position is None:  # without a position a second try could apply twice
                    raise
                answer, headers = _post(args.url, chunk, args.timeout, owner)  # once more
            after = headers.get(POSITION_HEADER.lower(), "")
            position = int(after) if after.isdigit() else \
                None if position is None or texts is not None else position + len(part)
            steps, output = [start, start + len(part)], answer["outputs"][0]
            if args.verbose:
                print(json.dumps({"sequence": i, "chunk": k, "steps": steps,
                                  "version": answer["version"], "output": output}), flush=True)
            else:
                unit = "words" if texts is not None else "steps"
                print(f"{i} {unit} {steps[0]}-{steps[1]}: {summary(output)}", flush=True)


def run_predict(args: argparse.Namespace) -> int:
    body = _request_body(Path(args.file), args.model, args.version, args.top_k)
    try:
        if args.stream:
            _stream(args, body)
            return 0
        answer = _post_predict(args.url, body, args.timeout)
    except _HTTPFailure as e:
        print(f"orthornn predict: HTTP {e.code}: {e}", file=sys.stderr)
        return 2 if 400 <= e.code < 500 else 1
    if args.verbose:
        print(json.dumps(answer, indent=2))
    else:
        for i, output in enumerate(answer["outputs"]):
            print(f"{i}: {summary(output)}")
    return 0
