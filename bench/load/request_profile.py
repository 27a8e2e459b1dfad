"""Where a request's CPU goes (issue 62's first table): `orthornn serve` of this checkout run
under cProfile (`python -m cProfile -m orthornn serve`), loaded with POST /predict at
--concurrency from this script's asyncio client for --seconds, then stopped (SIGTERM:
the server drains and exits, and cProfile writes its profile). The event loop's thread
is the one profiled (cProfile follows the main thread: the inference runs beside it, in
the batcher's thread); each function's own time is put in one stage by where it is
defined, less what a server started and stopped without load spent there (its imports,
its model's load), and the table gives each stage's share of the thread's time and its
microseconds a request (cProfile's own cost inflates both alike: the shares are what to
read, not the absolute times).

Prints the table and writes bench/results/request_profile.json.

    python bench/load/request_profile.py [--seconds 10] [--concurrency 32]
        [--route predict|oip_json|oip_binary] [--top N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import Server, build_package, load, request  # noqa: E402

#: (stage, what a function's file path holds): the first that matches takes it (the
#: project's modules as a checkout's service/... or an installed orthornn/service/...)
STAGES = (
    ("parse and checks (codecs, limits)", ("service/http/codecs", "service/http/limits")),
    ("routes and admission", ("service/http/",)),
    ("dataplane", ("service/dataplane/", "service/request")),
    ("queue and batching", ("service/registry/",)),
    ("sessions, capture, tracing", ("service/sessions/", "service/loop/",
                                    "service/tracing")),
    ("metrics", ("prometheus_client", "service/metrics")),
    ("ASGI stack (FastAPI, Starlette)", ("fastapi/", "starlette/", "anyio/")),
    ("HTTP read and write (uvicorn, httptools, h11)", ("uvicorn/", "httptools", "h11/")),
    ("event loop (asyncio)", ("asyncio/",)),
    ("the listener and the lean path (service/server/)", ("service/server/",)),
)
OTHER = "other"


def stage_of(filename: str) -> str:
    for stage, parts in STAGES:
        if any(part in filename for part in parts):
            return stage
    return OTHER


def stage_times(repo: Path, sent: bytes, seconds: float, concurrency: int,
                out: Path) -> tuple[dict[str, float], int, float, dict[str, float]]:
    """Each stage's own time in the profiled thread of one server's whole life, loaded for
    SECONDS (0: started, ready, stopped: what its start and its end cost), the requests
    answered, the load's length, and each function's own time (a builtin's: its name)."""
    server = Server(repo, True, [], launcher=("-m", "cProfile", "-o", str(out)))
    requests, took = 0, 0.0
    try:
        server.wait_ready()
        if seconds:
            took, latencies, errors = asyncio.run(load(
                server.port, [sent], concurrency, seconds,
                10**9))
            if errors:
                raise RuntimeError(f"/predict failed: {errors[:3]}")
            requests = len(latencies)
    finally:
        server.stop()  # SIGTERM: the server drains and exits, and cProfile writes OUT
    stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    by_stage = dict.fromkeys([s for s, _ in STAGES] + [OTHER], 0.0)
    functions: dict[str, float] = {}
    for (filename, line, name), (_, _, own, _, callers) in stats.items():
        where = f"{'/'.join(Path(filename).parts[-2:])}:{line} {name}" if filename != "~" else name
        functions[where] = functions.get(where, 0.0) + own
        if name == "lifespan" and filename.endswith("http/app.py"):
            # the app's lifespan only starts and stops the server, yet cProfile gives its
            # frame, suspended at its yield for the server's whole life, 30-45 us "a
            # request" under load (listed among the functions, left out of the stages)
            continue
        if filename != "~" or not callers:
            by_stage[stage_of(filename)] += own
            continue
        # a builtin (orjson's parse, a numpy call, a socket's send): its time is its
        # callers', shared as each caller's calls of it took
        spent = sum(c[2] for c in callers.values()) or 1.0
        for (caller_file, _, _), c in callers.items():
            by_stage[stage_of(caller_file)] += own * c[2] / spent
    return by_stage, requests, took, functions


def route_request(route: str) -> bytes:
    """The request ROUTE is loaded with: one sequence of 32 steps of 9 features, as
    /predict's JSON, as the OIP infer route's JSON, or as its binary tensor."""
    steps = [[0.1] * 9] * 32
    if route == "predict":
        return request("POST", "/predict", json.dumps({"model": "bench",
                                                       "inputs": [steps]}).encode())
    tensor = {"name": "x", "shape": [1, 32, 9], "datatype": "FP32"}
    if route == "oip_json":
        return request("POST", "/v2/models/bench/infer", json.dumps(
            {"inputs": [{**tensor, "data": [v for step in steps for v in step]}]}).encode())
    data = np.asarray(steps, np.float32).tobytes()
    head = json.dumps({"inputs": [{**tensor, "parameters": {
        "binary_data_size": len(data)}}]}).encode()
    body = head + data
    return (f"POST /v2/models/bench/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {len(body)}\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n\r\n").encode() + body


def profile(seconds: float, concurrency: int, work: Path, route: str = "predict",
            top: int = 0) -> dict:
    """The loaded server's stages, less an unloaded one's (the imports, the model's load,
    the end: not a request's), and its TOP functions by own time (less the unloaded's)."""
    repo = build_package(work, 64, 32, 9)
    sent = route_request(route)
    idle, _, _, idle_functions = stage_times(repo, sent, 0, concurrency, work / "idle.prof")
    loaded, requests, took, functions = stage_times(repo, sent, seconds, concurrency,
                                                    work / "loaded.prof")
    own = {f: t - idle_functions.get(f, 0.0) for f, t in functions.items()}
    by_stage = {stage: max(0.0, loaded[stage] - idle[stage]) for stage in loaded}
    total = sum(by_stage.values())
    return {"route": route, "requests": requests, "seconds": round(took, 2),
            "req_s": round(requests / took, 1), "concurrency": concurrency,
            "stages": {stage: {"share": round(spent / total, 4),
                               "us_per_request": round(spent / requests * 1e6, 1)}
                       for stage, spent in sorted(by_stage.items(), key=lambda kv: -kv[1])},
            "functions": {f: round(t / requests * 1e6, 2)
                          for f, t in sorted(own.items(), key=lambda kv: -kv[1])[:top]}}


def table(result: dict) -> None:
    print(f"\n{result['route']} under cProfile, c={result['concurrency']}: {result['requests']} "
          f"requests in {result['seconds']} s ({result['req_s']:.0f} req/s, profiled)")
    print("| stage (the event loop's thread) | share | us a request (profiled) |")
    print("| --- | ---: | ---: |")
    for stage, row in result["stages"].items():
        print(f"| {stage} | {100 * row['share']:.1f}% | {row['us_per_request']:.1f} |")
    if result["functions"]:
        print("\n| function (own time) | us a request (profiled) |\n| --- | ---: |")
        for name, us in result["functions"].items():
            print(f"| {name} | {us:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--route", choices=("predict", "oip_json", "oip_binary"),
                        default="predict", help="the route loaded (default: /predict)")
    parser.add_argument("--top", type=int, default=0,
                        help="also list the N functions with the most own time")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                             "request_profile.json"))
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.concurrency < 1 or args.top < 0:
        parser.error("--seconds must be positive, --concurrency at least 1, --top at least 0")
    with tempfile.TemporaryDirectory(prefix="orthornn-bench-profile-") as tmp:
        result = profile(args.seconds, args.concurrency, Path(tmp), args.route, args.top)
    table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
