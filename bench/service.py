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

    python bench/service.py [--duration 3] [--rounds 3] [--concurrency 1 8 32] [--hidden 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_package(work: Path, hidden: int, steps: int, features: int) -> Path:
    from orthornn.export.builder.exporter import export_run
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    rng = np.random.default_rng(0)
    data = work / "data.npz"
    np.savez(data, x=rng.normal(size=(64, steps, features)).astype(np.float32),
             y=rng.integers(0, 5, size=64), labels=np.array(["a", "b", "c", "d", "e"]))
    train(TrainConfig(arch="svdrnn", task="classify", data=str(data), hidden_size=hidden,
                      steps=1, batch_size=16, log_every=1, out=str(work / "run")),
          progress=False)
    repo = work / "repo"
    export_run(work / "run", repo, "bench")
    return repo


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, repo: Path, batching: bool, extra: list[str]):
        self.port = free_port()
        cmd = [sys.executable, "-m", "orthornn", "serve", "--repo", str(repo),
               "--port", str(self.port), "--log-level", "warning",
               "--batching" if batching else "--no-batching", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)

    def wait_ready(self, timeout: float = 120) -> None:
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited: " + self.proc.stderr.read().decode()[-2000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready",
                                            timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
    if body:
        head += "Content-Type: application/json\r\n"
    return (head + "\r\n").encode() + body


async def _worker(port: int, requests: list[bytes], stop_at: float, max_requests: int,
                  latencies: list[float], errors: list[str], offset: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = offset
    try:
        while time.perf_counter() < stop_at and len(latencies) < max_requests:
            start = time.perf_counter()
            writer.write(requests[i % len(requests)])
            i += 1
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if status != 200:
                errors.append(str(status))
            latencies.append(time.perf_counter() - start)
    finally:
        writer.close()


async def _load(port: int, requests: list[bytes], concurrency: int, duration: float,
                max_requests: int) -> tuple[float, list[float], list[str]]:
    """(seconds, latencies, errors) of one measurement, after a short warm-up."""
    await asyncio.gather(*[_worker(port, requests, time.perf_counter() + 0.2, 10**9, [], [], k)
                           for k in range(concurrency)])
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    await asyncio.gather(*[_worker(port, requests, start + duration, max_requests, latencies,
                                   errors, k) for k in range(concurrency)])
    return time.perf_counter() - start, latencies, errors


def _summary(runs: list[tuple[float, list[float], list[str]]]) -> dict:
    """Throughput: the median over the rounds; latency percentiles over all requests."""
    lat = np.concatenate([np.array(r[1]) for r in runs]) * 1000
    return {"requests": int(lat.size), "errors": sum(len(r[2]) for r in runs),
            "seconds": round(sum(r[0] for r in runs), 3),
            "throughput": round(float(np.median([len(r[1]) / r[0] for r in runs])), 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2)}


def measure(port: int, targets: dict[str, list[bytes]], concurrency: int, duration: float,
            rounds: int, max_requests: int) -> dict:
    """Each target (the first is the health ceiling) in alternating rounds (this machine's
    load drifts; alternating keeps them comparable); per target after the first, its
    summary and the median over the rounds of its throughput / the ceiling's."""
    runs: dict[str, list] = {name: [] for name in targets}
    for _ in range(rounds):
        for name, requests in targets.items():
            runs[name].append(asyncio.run(_load(port, requests, concurrency,
                                                duration / rounds, max_requests)))
    ceiling, *others = targets
    out = {"concurrency": concurrency, ceiling: _summary(runs[ceiling])}
    for name in others:
        ratios = [len(r[1]) / r[0] / max(len(c[1]) / c[0], 1e-9)
                  for c, r in zip(runs[ceiling], runs[name], strict=True)]
        out[name] = {**_summary(runs[name]), "ratio": round(float(np.median(ratios)), 3)}
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
            "health": [_request("GET", "/v2/health/live")],
            "predict": [_request("POST", "/predict", json.dumps(
                {"model": "bench", "inputs": [x.tolist()]}).encode()) for x in xs],
            "infer_json": [_request("POST", "/v2/models/bench/infer", json.dumps(
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
