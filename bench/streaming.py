"""Streaming cost: one long sequence fed to the service in chunks.

A history of ``--history`` steps (default 4,096) arrives ``--chunk`` steps at a time
(default 8), and the client wants a prediction after every chunk. Three ways, each over
the same sequence, against one ``orthornn serve`` process:

    session   POST /predict {"session": ID, ...}: the service keeps the state
    state     POST /predict {"return_state": true, "states": [...]}: the client keeps it
    resend    POST /predict with the whole history so far (what a stateless server needs)

Per way: the median latency of the first and of the last tenth of the chunks (flat means
the cost of a chunk does not grow with the history), the total time, and the ratio of
resend's last-tenth latency to the way's (how much cheaper a chunk is once the history is
long). The final predictions of the three ways are checked to agree. Prints a table and
writes bench/results/streaming.json.

    python bench/streaming.py [--history 4096] [--chunk 8] [--hidden 128] [--features 9]
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from bench.service import Server  # noqa: E402


def build_package(work: Path, hidden: int, steps: int, features: int) -> Path:
    """An svdrnn classifier whose max_length is the whole history (one training step on
    random data: speed does not depend on accuracy)."""
    from orthornn.export.exporter import export_run
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    rng = np.random.default_rng(0)
    data = work / "data.npz"
    np.savez(data, x=rng.normal(size=(10, steps, features)).astype(np.float32),
             y=rng.integers(0, 5, size=10))
    train(TrainConfig(arch="svdrnn", task="classify", data=str(data), hidden_size=hidden,
                      steps=1, batch_size=2, log_every=1, out=str(work / "run")),
          progress=False)
    return Path(export_run(work / "run", work / "repo", "stream")).parents[1]


def post(conn: http.client.HTTPConnection, body: dict) -> tuple[float, dict]:
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    conn.request("POST", "/predict", payload, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    seconds = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
    return seconds, json.loads(data)


def run_way(port: int, way: str, x: np.ndarray, chunk: int) -> tuple[list[float], dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    latencies, state, out = [], None, None
    starts = range(0, len(x), chunk)
    for k, t in enumerate(starts):
        part = x[t:t + chunk].tolist()
        body: dict = {"model": "stream"}
        if way == "session":
            body.update(inputs=[part], session="bench", start=k == 0,
                        end=k == len(starts) - 1)
        elif way == "state":
            body.update(inputs=[part], return_state=True)
            if state is not None:
                body["states"] = [state]
        else:
            body["inputs"] = [x[:t + chunk].tolist()]
        seconds, answer = post(conn, body)
        latencies.append(seconds)
        out = answer["outputs"][0]
        state = out.pop("state", None)
    conn.close()
    return latencies, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--features", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "streaming.json"))
    args = parser.parse_args(argv)
    if args.history < 10 * args.chunk or args.chunk < 1:
        parser.error("--history must be at least 10 chunks and --chunk at least 1")
    x = np.random.default_rng(1).normal(size=(args.history, args.features)).astype(np.float32)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_package(Path(tmp), args.hidden, args.history, args.features)
        server = Server(repo, batching=True, extra=["--inference-threads", "1"])
        try:
            server.wait_ready()
            outputs = {}
            for way in ("session", "state", "resend"):
                latencies, outputs[way] = run_way(server.port, way, x, args.chunk)
                tenth = max(1, len(latencies) // 10)
                rows[way] = {"chunks": len(latencies),
                             "first_ms": round(1000 * float(np.median(latencies[:tenth])), 3),
                             "last_ms": round(1000 * float(np.median(latencies[-tenth:])), 3),
                             "total_s": round(float(np.sum(latencies)), 3)}
        finally:
            server.stop()
    for way in ("session", "state"):
        np.testing.assert_allclose(outputs[way]["probabilities"],
                                   outputs["resend"]["probabilities"], atol=1e-4)
    resend_last = rows["resend"]["last_ms"]
    for row in rows.values():
        row["resend_last_over_last"] = round(resend_last / row["last_ms"], 1)
        row["last_over_first"] = round(row["last_ms"] / row["first_ms"], 2)
    print(f"history {args.history} steps in chunks of {args.chunk}, svdrnn n={args.hidden}, "
          f"d={args.features}")
    print(f"{'way':<8} {'chunks':>6} {'first ms':>9} {'last ms':>9} {'last/first':>10} "
          f"{'total s':>8} {'resend/way (last)':>18}")
    for way, r in rows.items():
        print(f"{way:<8} {r['chunks']:>6} {r['first_ms']:>9.3f} {r['last_ms']:>9.3f} "
              f"{r['last_over_first']:>10.2f} {r['total_s']:>8.2f} "
              f"{r['resend_last_over_last']:>18.1f}")
    write_result(Path(args.out), {"history": args.history, "chunk": args.chunk,
                                  "hidden": args.hidden, "features": args.features,
                                  "machine": platform.machine(), "ways": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
