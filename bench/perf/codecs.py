"""What reading a request body costs, per protocol (``service/codecs``), in this process.

One sequence of T steps of d features (default 128 x 9, the peers harness's input), its
numbers written as the harness writes them (float32 values as JSON doubles), as a
``/predict`` body, an OIP JSON body and an OIP binary body. Each row is the median of
--rounds timings of --reps decodes; the baseline is pydantic's parse of the ``/predict``
body (``protocol.parse``, the path every body without the fast path takes), timed in the
same rounds. Prints a table and writes bench/results/codecs.json.

    python bench/perf/codecs.py [--steps 128] [--features 9] [--reps 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402


def bodies(steps: int, features: int) -> dict[str, tuple[bytes, str | None]]:
    """The three bodies of one random sequence: (body, Inference-Header-Content-Length)."""
    x = np.random.default_rng(0).standard_normal((1, steps, features)).astype(np.float32)
    predict = orjson.dumps({"model": "bench", "inputs": x.tolist()})
    shape = list(x.shape)
    oip = orjson.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                    "data": x.ravel().tolist()}]})
    head = orjson.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}]})
    return {"predict": (predict, None), "oip_json": (oip, None),
            "oip_binary": (head + x.tobytes(), str(len(head)))}


def rows(steps: int, features: int):
    """(name, what it measures, decode function of no arguments)."""
    from orthornn.service.dataplane.schemas import PredictRequest, parse
    from orthornn.service.http.codecs import oip_binary, predict_json

    body = bodies(steps, features)
    predict, _ = body["predict"]
    oip, _ = body["oip_json"]
    binary, head = body["oip_binary"]
    assert predict_json.fast_predict_request(predict) is not None  # the fast path takes it
    return [
        ("predict_pydantic", "/predict, pydantic's parse (baseline)",
         lambda: parse(PredictRequest, predict)),
        ("predict", "/predict (predict_json.decode: simdjson fast path)",
         lambda: predict_json.decode(predict)),
        ("oip_json", "OIP JSON (oip_binary.decode, no binary part)",
         lambda: oip_binary.decode(oip, None, "bench", None)),
        ("oip_binary", "OIP binary (oip_binary.decode)",
         lambda: oip_binary.decode(binary, head, "bench", None)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--features", type=int, default=9)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "codecs.json")
    args = parser.parse_args(argv)
    for name in ("steps", "features", "reps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1; got {getattr(args, name)}")

    measured = rows(args.steps, args.features)
    timings: dict[str, list[float]] = {name: [] for name, _, _ in measured}
    for _ in range(args.rounds):  # rounds interleave the rows: drift hits them alike
        for name, _, decode in measured:
            decode()
            start = time.perf_counter()
            for _ in range(args.reps):
                decode()
            timings[name].append((time.perf_counter() - start) / args.reps * 1e6)
    median = {name: statistics.median(t) for name, t in timings.items()}
    base = median["predict_pydantic"]
    table = [{"row": name, "what": what, "us_per_request": round(median[name], 2),
              "baseline_over_row": round(base / median[name], 2)}
             for name, what, _ in measured]

    print(f"decoding one request of 1 x {args.steps} x {args.features} float32 numbers "
          f"(median of {args.rounds} rounds of {args.reps})")
    print(f"{'row':<18} {'us/request':>10} {'pydantic/row':>12}  what")
    for r in table:
        print(f"{r['row']:<18} {r['us_per_request']:>10.1f} {r['baseline_over_row']:>12.2f}"
              f"  {r['what']}")
    write_result(args.out, {"steps": args.steps, "features": args.features,
                            "reps": args.reps, "rounds": args.rounds, "rows": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
