"""What the load tests share: a small classifier package, an `orthornn serve` process of
this checkout (``Server``), the raw HTTP/1.1 request bytes, the asyncio keep-alive load
loop and the summary of its rounds; and for paired rounds (two servers loaded at once on one
CPU: bench/load/capture.py, collector.py), wrk on a CPU of its own, the round itself, the
ratio's interval and the options. A load test takes these from here, never from another
load test (tests/unit/test_bench_listing.py checks).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
                 env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()):
        """ENV: variables set for the server on top of this process's; LAUNCHER: what
        Python runs the server under (``-m cProfile -o FILE``)."""
        self.port = free_port()
        cmd = [sys.executable, *launcher, "-m", "orthornn", "serve", "--repo", str(repo),
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


def cpu_s(pid: int, thread: bool) -> float:
    """CPU seconds (user + system) of process PID, or of its main thread (the event
    loop's) with THREAD."""
    path = f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds this machine has spent busy, all processes (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def bodies_for(args: argparse.Namespace) -> list[bytes]:
    rng = np.random.default_rng(1)
    return [json.dumps({"model": "bench", "inputs": [
        rng.normal(size=(args.steps, args.features)).round(4).tolist()]}).encode()
        for _ in range(64)]


WRK_SCRIPT = """
local n, body = 0, %s
request = function()
  n = n + 1
  return wrk.format("POST", "/predict", {["Content-Type"] = "application/json",
                    ["X-Request-Id"] = string.format("%%s-%%d", id, n)}, body)
end
done = function(summary, latency)
  local errors = summary.errors.status + summary.errors.connect + summary.errors.read
                 + summary.errors.write + summary.errors.timeout
  io.write(string.format("RESULT %%d %%d %%d %%d %%d\\n", summary.duration,
           summary.requests, errors, latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_missing() -> str | None:
    """Why ``Wrk`` cannot run here (its commands not installed), None when it can."""
    missing = [c for c in ("wrk", "taskset") if shutil.which(c) is None]
    return None if not missing else (f"{' and '.join(missing)} not installed (Debian's wrk "
                                      f"and util-linux packages)")


class Wrk:
    """c=CONCURRENCY load from wrk on CPU 0, the body of /predict BODY, every request an id
    of its own (a prefix per round); servers pinned to the last CPU (``pin``)."""

    def __init__(self, work: Path, body: bytes, concurrency: int):
        self.script = work / "ids.lua"
        self.script.write_text("id = os.getenv('WRK_ID') or 'w'\n"
                               + WRK_SCRIPT % json.dumps(body.decode()))
        self.concurrency, self.ids = concurrency, itertools.count(1)  # a prefix a run
        self.cpu = (os.cpu_count() or 2) - 1

    def pin(self, pid: int) -> None:
        subprocess.run(["taskset", "-a", "-c", "-p", str(self.cpu), str(pid)], check=True,
                       capture_output=True)

    def run(self, port: int, seconds: float) -> tuple[float, int, int, float, float]:
        """(seconds, requests, errors, p50 s, p99 s) of one round."""
        prefix = f"wrk{next(self.ids)}"  # next(): atomic, two threads run wrk at once
        out = subprocess.run(
            ["taskset", "-c", "0", "wrk", "-t1", f"-c{self.concurrency}",
             f"-d{max(1, round(seconds))}s", "-s", str(self.script),
             f"http://127.0.0.1:{port}/predict"], capture_output=True, text=True,
            env={**os.environ, "WRK_ID": prefix}, check=True).stdout
        us, n, errors, p50, p99 = map(int, out.rpartition("RESULT ")[2].split()[:5])
        return us / 1e6, n, errors, p50 / 1e6, p99 / 1e6

    def together(self, ports: list[int], seconds: float) -> list[tuple]:
        """One round of each of PORTS, all loaded at once (a wrk each)."""
        out: list[tuple] = [()] * len(ports)

        def one(k: int) -> None:
            out[k] = self.run(ports[k], seconds)
        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(ports))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def mean_ratio(ratios: list[float], processes: list[int] | None = None
               ) -> tuple[float, list[float]]:
    """The geometric mean of the rounds' ratios and its 95% interval, on the logs (a pair's
    ratio is its round's noise times the cost). PROCESSES: which processes of the pair
    each round ran on. A process is noise of its own, that its rounds share: the same
    server code, started again, ran up to 3% faster or slower against its reference for
    all its rounds (its address space, its hash seed). So with 3 or more processes the
    interval is over the processes' means (Student's t), not over rounds taken as
    independent (which was 3 times narrower than the processes' spread)."""
    logs = np.log(np.asarray(ratios))
    mean = float(np.mean(logs))
    if processes is not None and len(set(processes)) >= 3:
        means = np.array([logs[[p == g for p in processes]].mean()
                          for g in sorted(set(processes))])
        half = float(student_t(len(means) - 1) * np.std(means, ddof=1) / np.sqrt(len(means)))
    else:
        half = 1.96 * float(np.std(logs, ddof=1)) / np.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return round(float(np.exp(mean)), 3), [round(float(np.exp(mean - half)), 3),
                                          round(float(np.exp(mean + half)), 3)]


def student_t(df: int) -> float:
    """The two-sided 95% quantile of Student's t with DF degrees of freedom."""
    from scipy.stats import t
    return float(t.ppf(0.975, df))


def reference_of(name: str) -> str:
    """The capture-off server NAME is paired with."""
    return f"off, paired with {name}"


def paired_round(r: int, servers: dict[str, Server], names: list[str], measure: Callable,
                  args: argparse.Namespace, runs: dict, spent: dict, done: dict) -> float:
    """Round R: each of NAMES (in an order rotating by round) loaded at the same time as
    its capture-off reference, who starts first alternating by round; the share of the
    CPUs other processes took meanwhile."""
    wall, busy, own = time.perf_counter(), machine_busy_s(), time.process_time()
    ours = 0.0
    for name in names[r % len(names):] + names[:r % len(names)]:
        pair = [reference_of(name), name] if r % 2 == 0 else [name, reference_of(name)]
        pids = [servers[n].proc.pid for n in pair]
        before = [(cpu_s(pid, True), cpu_s(pid, False)) for pid in pids]
        got = dict(zip(pair, measure([servers[n].port for n in pair], args.round_s),
                       strict=True))
        runs[name].append((got[name], got[reference_of(name)]))
        for n, pid, (loop, process) in zip(pair, pids, before, strict=True):
            spent[n][0] += cpu_s(pid, True) - loop
            spent[n][1] += cpu_s(pid, False) - process
            done[n] += got[n][1]
            ours += cpu_s(pid, False) - process
    ours += time.process_time() - own  # the load client (wrk: counted as others)
    return max(0.0, machine_busy_s() - busy - ours) / ((time.perf_counter() - wall)
                                                       * (os.cpu_count() or 1))


def round_options(parser: argparse.ArgumentParser, rounds: int, fresh: int | None) -> None:
    """The load benches' options: the rounds (and how often the servers are fresh
    processes), the load's concurrency, the bench package's shape."""
    parser.add_argument("--round-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=rounds)
    if fresh is not None:
        parser.add_argument("--fresh", type=int, default=fresh, metavar="K",
                            help="a fresh process of every server each K rounds")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--features", type=int, default=9)


def one_thread_session(model: Path) -> Any:
    """An onnxruntime session of MODEL on the CPU with one thread (as a server's
    ``--inference-threads 1``), its warnings quiet."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def us_per_sequence(session: Any, batch: int, steps: int, features: int,
                    seconds: float = 2.0) -> float:
    """onnxruntime's own microseconds a sequence at BATCH: the median of runs for SECONDS."""
    feeds = {"x": np.zeros((batch, steps, features), np.float32),
             "lengths": np.full(batch, steps, np.int64)}
    for _ in range(5):
        session.run(None, feeds)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / batch * 1e6
