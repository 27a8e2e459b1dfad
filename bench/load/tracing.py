"""What OpenTelemetry tracing costs the service: the same POST /predict load against four
`orthornn serve` processes of this checkout, up side by side on one package: tracing off,
tracing off again (the noise floor: two identical servers), tracing on with every request
traced (--tracing), and tracing on with 1% of the traces sampled
(OTEL_TRACES_SAMPLER=parentbased_traceidratio, OTEL_TRACES_SAMPLER_ARG=0.01). The on
servers export OTLP/HTTP to a collector stub in a process of its own, so the spans are
built, serialised and sent as in production. Rounds alternate the servers (their order
rotates each round: the machine's load drifts); each ratio is the median over the rounds
of the per-round throughput ratio to the first "off" server. Prints a table and writes
bench/results/tracing.json.

Off, the code that tracing adds is one `is not None` check per request (the route row's
tracer) and two per batch (the batcher's); the "off again" row shows what the same run
measures between two identical servers, the bar an effect of tracing off would have to
clear. The code before the hooks is not in this run (another tree: bench/load/trees.sh).

    python bench/load/tracing.py [--round-s 1.5] [--rounds 5] [--concurrency 1 16] [--hidden 64]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.load.client import Server, build_package, load, request, summary  # noqa: E402

#: each server's extra flags and environment
SERVERS: dict[str, tuple[list[str], dict[str, str]]] = {
    "off": ([], {}),
    "off again": ([], {}),
    "on": (["--tracing"], {}),
    "on, 1% sampled": (["--tracing"], {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                                       "OTEL_TRACES_SAMPLER_ARG": "0.01"}),
}


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes every export and answers 200 (counts them; GET:
    the counts as JSON)."""

    exports = 0
    spans = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        body = json.dumps({"spans": _Collector.spans, "requests": _Collector.exports})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        spans = _count_spans(body)
        with _Collector.lock:
            _Collector.exports += 1
            _Collector.spans += spans
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def collector() -> None:
    """(Its own process.) Serve the collector stub; its port is the first line out."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    print(server.server_port, flush=True)
    server.serve_forever()


def _count_spans(body: bytes) -> int:
    try:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
    except ImportError:  # the otel extra is missing here: count exports only
        return 0
    request = ExportTraceServiceRequest.FromString(body)
    return sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)


def measure(ports: dict[str, int], requests: list[bytes], concurrency: int, round_s: float,
            rounds: int) -> dict:
    runs: dict[str, list] = {name: [] for name in ports}
    names = list(ports)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(asyncio.run(load(ports[name], requests, concurrency, round_s,
                                                10**9)))
    base, *others = names
    row: dict = {"concurrency": concurrency,
                 base: summary(runs[base], digits=3, seconds=False)}
    for name in others:
        ratios = [len(o[1]) / o[0] / max(len(b[1]) / b[0], 1e-9)
                  for b, o in zip(runs[base], runs[name], strict=True)]
        row[name] = {**summary(runs[name], digits=3, seconds=False),
                     "ratio": round(float(np.median(ratios)), 3),
                     "ratios": [round(x, 3) for x in ratios]}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| concurrency | server | req/s | ratio to off | p50 ms | p99 ms | errors |",
             "| ----------- | ------ | ----- | ------------ | ------ | ------ | ------ |"]
    for row in rows:
        for name in SERVERS:
            s = row[name]
            ratio = f"{s['ratio']:.3f}" if "ratio" in s else "1"
            lines.append(f"| {row['concurrency']:11} | {name:14} | {s['throughput']:7.0f} | "
                         f"{ratio:12} | {s['p50_ms']:6.2f} | {s['p99_ms']:6.2f} | "
                         f"{s['errors']:6} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-s", type=float, default=1.5,
                        help="seconds per server, round and concurrency")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds (the servers' order rotates); ratios are their median")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32,
                        help="time steps per sequence (small: HTTP dominates, the worst "
                             "case for a per-request cost)")
    parser.add_argument("--features", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tracing.json"))
    parser.add_argument("--collector", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.collector:
        collector()
        return 0
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    sink = subprocess.Popen([sys.executable, __file__, "--collector"], stdout=subprocess.PIPE,
                            text=True)
    assert sink.stdout is not None
    sink_url = f"http://127.0.0.1:{int(sink.stdout.readline())}"
    # the on servers read these (the SDK's own variables); the off servers never do
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": sink_url,
                       "OTEL_SERVICE_NAME": "orthornn-bench"})
    rows: list[dict] = []
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_package(Path(tmp), args.hidden, args.steps, args.features)
        rng = np.random.default_rng(1)
        requests = [request("POST", "/predict", json.dumps(
            {"model": "bench", "inputs": [rng.normal(size=(args.steps, args.features))
                                          .round(4).tolist()]}).encode())
            for _ in range(64)]
        try:
            for name, (flags, env) in SERVERS.items():
                saved = dict(os.environ)
                os.environ.update(env)  # the server process inherits it
                try:
                    servers[name] = Server(repo, True, flags)
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
            for server in servers.values():
                server.wait_ready()
            ports = {name: s.port for name, s in servers.items()}
            for c in args.concurrency:
                rows.append(measure(ports, requests, c, args.round_s, args.rounds))
                print("\n".join(table(rows[-1:]).splitlines()[2:]), flush=True)
        finally:
            for server in servers.values():
                server.stop()  # each on server flushes its spans as it exits
    with urllib.request.urlopen(sink_url, timeout=5) as answer:
        exported = json.loads(answer.read())
    sink.terminate()
    sink.wait()
    print()
    print(table(rows))
    print(f"\nthe on servers exported {exported['spans']} spans in {exported['requests']} "
          f"OTLP requests")
    result = {"model": {"arch": "svdrnn", "hidden": args.hidden, "steps": args.steps,
                        "features": args.features},
              "round_s": args.round_s, "rounds": args.rounds, "cpus": os.cpu_count(),
              "machine": platform.platform(), "rows": rows,
              "servers": {name: {"flags": flags, "env": env}
                          for name, (flags, env) in SERVERS.items()},
              "exported": exported}
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
