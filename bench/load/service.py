"""Load test of the inference service on loopback (bounded in time and requests).

Builds a classifier package (svdrnn, n = 128, T = 128, 9 features; one training step on
random data: speed does not depend on accuracy), starts ``orthornn serve`` as a separate
process with dynamic batching on and then off, and drives it from this process with a
small asyncio HTTP/1.1 keep-alive client: for each concurrency (default 1, 8, 32),
alternating rounds of ``GET /v2/health/live`` (the HTTP ceiling of the machine: same
server, same client, no model work), ``POST /predict`` with one sequence per request
(JSON numbers) and the same sequence as Open Inference Protocol JSON data and as a binary
tensor (``POST /v2/models/bench/infer``); each ratio is the median of the rounds' ratios to
the ceiling. Prints a table and writes
bench/results/service.json. Client and server share the machine's cores, as a
load balancer's sidecar would not: the ceiling is a ceiling for this setup only.

    python bench/load/service.py [--duration 3] [--rounds 3] [--concurrency 1 8 32] [--hidden 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.load.client import Server, build_package, load, request, summary  # noqa: E402


def measure(port: int, targets: dict[str, list[bytes]], concurrency: int, duration: float,
            rounds: int, max_requests: int) -> dict:
    """Each target (the first is the health ceiling) in alternating rounds (this machine's
    load drifts; alternating keeps them comparable); per target after the first, its
    summary and the median over the rounds of its throughput / the ceiling's."""
    runs: dict[str, list] = {name: [] for name in targets}
    for _ in range(rounds):
        for name, requests in targets.items():
            runs[name].append(asyncio.run(load(port, requests, concurrency,
                                                duration / rounds, max_requests)))
    ceiling, *others = targets
    out = {"concurrency": concurrency, ceiling: summary(runs[ceiling])}
    for name in others:
        ratios = [len(r[1]) / r[0] / max(len(c[1]) / c[0], 1e-9)
                  for c, r in zip(runs[ceiling], runs[name], strict=True)]
        out[name] = {**summary(runs[name]), "ratio": round(float(np.median(ratios)), 3)}
    return out


def _infer_binary(x: np.ndarray) -> bytes:
    """POST /v2/models/bench/infer with x as an OIP binary tensor (no JSON numbers)."""
    blob = x.astype("<f4").tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": [1, *x.shape], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(blob)}}],
                       "outputs": [{"name": "logits"}]}).encode()
    return (f"POST /v2/models/bench/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {len(head) + len(blob)}\r\n"
            f"Content-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n\r\n").encode() + head + blob


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0,
                        help="seconds per endpoint and concurrency (split into the rounds)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating health/predict rounds; the ratio is their median")
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--features", type=int, default=9)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `orthornn serve` flag, e.g. --server-arg=--max-batch-size=16")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "service.json"))
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_package(Path(tmp), args.hidden, args.steps, args.features)
        rng = np.random.default_rng(1)
        xs = [rng.normal(size=(args.steps, args.features)).round(4) for _ in range(64)]
        targets = {
            "health": [request("GET", "/v2/health/live")],
            "predict": [request("POST", "/predict", json.dumps(
                {"model": "bench", "inputs": [x.tolist()]}).encode()) for x in xs],
            "infer_json": [request("POST", "/v2/models/bench/infer", json.dumps(
                {"inputs": [{"name": "x", "shape": [1, *x.shape], "datatype": "FP32",
                             "data": x.ravel().tolist()}],
                 "outputs": [{"name": "logits"}]}).encode()) for x in xs],
            "infer_binary": [_infer_binary(x) for x in xs]}
        for batching in (True, False):
            server = Server(repo, batching, args.server_arg)
            try:
                server.wait_ready()
                for c in args.concurrency:
                    rows.append({"batching": batching, **measure(
                        server.port, targets, c, args.duration, args.rounds,
                        args.max_requests)})
                    print(_row(rows[-1]), flush=True)
            finally:
                server.stop()
    print()
    print(table(rows))
    result = {"model": {"arch": "svdrnn", "hidden": args.hidden, "steps": args.steps,
                        "features": args.features},
              "duration_s": args.duration, "rounds": args.rounds, "cpus": os.cpu_count(),
              "machine": platform.platform(), "server_args": args.server_arg, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


def _row(r: dict) -> str:
    p, h, j, b = r["predict"], r["health"], r["infer_json"], r["infer_binary"]
    return (f"| {'on' if r['batching'] else 'off':8} | {r['concurrency']:11} | "
            f"{h['throughput']:12.0f} | {p['throughput']:13.0f} | {p['ratio']:5.2f} | "
            f"{p['p50_ms']:6.2f} | {p['p99_ms']:6.2f} | {j['throughput']:8.0f} | "
            f"{j['ratio']:5.2f} | {j['p99_ms']:6.2f} | {b['throughput']:10.0f} | "
            f"{b['ratio']:5.2f} | {b['p99_ms']:6.2f} | "
            f"{p['errors'] + h['errors'] + j['errors'] + b['errors']:6} |")


def table(rows: list[dict]) -> str:
    head = ("| batching | concurrency | health req/s | predict req/s | ratio | p50 ms | p99 ms "
            "| OIP JSON | ratio | p99 ms | OIP binary | ratio | p99 ms | errors |\n"
            "| -------- | ----------- | ------------ | ------------- | ----- | ------ | ------ "
            "| -------- | ----- | ------ | ---------- | ----- | ------ | ------ |")
    return "\n".join([head, *(_row(r) for r in rows)])


if __name__ == "__main__":
    raise SystemExit(main())
