"""What the load tests share: a small classifier package, an `orthornn serve` process of
this checkout (``Server``), the raw HTTP/1.1 request bytes, the asyncio keep-alive load
loop and the summary of its rounds. A load test takes these from here, never from
another load test (tests/unit/test_bench_listing.py checks).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def build_package(work: Path, hidden: int, steps: int, features: int) -> Path:
    """A repository with the classifier "bench" (svdrnn; one training step on random data:
    speed does not depend on accuracy)."""
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
    def __init__(self, repo: Path, batching: bool, extra: list[str],
                 env: dict[str, str] | None = None):
        """ENV: variables set for the server on top of this process's."""
        self.port = free_port()
        cmd = [sys.executable, "-m", "orthornn", "serve", "--repo", str(repo),
               "--port", str(self.port), "--log-level", "warning",
               "--batching" if batching else "--no-batching", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env={**os.environ, **(env or {})})

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


def request(method: str, path: str, body: bytes = b"") -> bytes:
    """The bytes of one HTTP/1.1 request to the loopback server (a JSON body when any)."""
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


async def load(port: int, requests: list[bytes], concurrency: int, duration: float,
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


def summary(runs: list[tuple[float, list[float], list[str]]], digits: int = 2,
            seconds: bool = True) -> dict:
    """Throughput: the median over the rounds; latency percentiles over all requests, to
    DIGITS decimals; with SECONDS, the rounds' total time too. (bench/load/service.py
    writes 2 digits and the time; tracing.py and rollout.py 3 digits and no time: their
    result files keep the fields they always had.)"""
    lat = np.concatenate([np.array(r[1]) for r in runs]) * 1000
    out = {"requests": int(lat.size), "errors": sum(len(r[2]) for r in runs)}
    if seconds:
        out["seconds"] = round(sum(r[0] for r in runs), 3)
    return {**out, "throughput": round(float(np.median([len(r[1]) / r[0] for r in runs])), 1),
            "p50_ms": round(float(np.percentile(lat, 50)), digits),
            "p99_ms": round(float(np.percentile(lat, 99)), digits)}
