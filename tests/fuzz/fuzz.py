"""Coverage-guided fuzz targets (atheris, libFuzzer's engine) for what parses a client's
bytes: the three codecs and the session chunk logic (tests/fuzz/sessions.py). Whatever
the input, the answer is a ServiceError below 500 or a result; anything else (another
exception, a 5xx) is a crash.

    python tests/fuzz/fuzz.py TARGET [libFuzzer flags] [CORPUS_DIR...]

TARGET: predict_json, oip_json, oip_binary, sessions, oip_fields (the OIP id and
parameters, X-Request-Id) or trailers (a chunked body's trailers through the server's
protocol: tests/fuzz/edges.py). ``make fuzz`` runs each for
FUZZ_SECONDS (600) from tests/fuzz/corpus/TARGET, writing what it finds to fuzz-corpus/
(ignored by git); tests/integration/test_fuzz.py runs a short smoke of each in make test. A
crash leaves the input in crash-*; replay it as a test (tests/integration/test_fuzz.py keeps
the found ones).
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the libraries first, uninstrumented (fast); then only orthornn's own code, instrumented
import numpy  # noqa: E402, F401
import orjson  # noqa: E402, F401
import pydantic  # noqa: E402, F401
import simdjson  # noqa: E402, F401

with atheris.instrument_imports(include=["orthornn.service"]):
    from orthornn.service.errors import ServiceError
    from orthornn.service.http.codecs import oip_binary, oip_json, predict_json


def refused_or_ok(call, *args) -> None:
    try:
        call(*args)
    except ServiceError as error:
        if error.status >= 500:
            raise AssertionError(f"{error.status}: {error}") from error


def predict_json_target(data: bytes) -> None:
    refused_or_ok(predict_json.decode, data)


def oip_json_target(data: bytes) -> None:
    refused_or_ok(oip_json.decode, data, "model", None)


def oip_binary_target(data: bytes) -> None:
    # the first line is the Inference-Header-Content-Length header's value, the rest the body
    head, _, body = data.partition(b"\n")
    header = head.decode("latin-1") if head else None
    refused_or_ok(oip_binary.decode, body, header, "model", None)


TARGETS = {"predict_json": predict_json_target, "oip_json": oip_json_target,
           "oip_binary": oip_binary_target, "sessions": None,  # made at start, as are
           "oip_fields": None, "trailers": None}  # these two (tests/fuzz/edges.py)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: fuzz.py TARGET [libFuzzer flags]; TARGET: one of {', '.join(TARGETS)}")
    name = sys.argv.pop(1)
    if name == "sessions":
        with atheris.instrument_imports(include=["orthornn.service"]):
            from tests.fuzz.sessions import setup

            target = setup()  # imports the app: instrumented too
    elif name in ("oip_fields", "trailers"):
        with atheris.instrument_imports(include=["orthornn.service"]):
            from tests.fuzz import edges

            target = edges.oip_fields_target if name == "oip_fields" else \
                edges.trailers_setup()
    else:
        target = TARGETS[name]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
