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
long). The final predictions of the three ways are checked to agree.

``--parts stores`` (or ``ways,stores``) compares where the sessions live: one server with
the in-process store (``--session-store memory``) and one with a redis-server started for
the run (``--session-store redis://...``, tests/cluster.py's RedisServer), both up at once
and measured in alternating rounds. Per store and per number of open sessions
(``--sessions``, default 128 and 512): the sessions are opened, then ``--concurrency``
(default 32) keep-alive connections send chunks (each naming its position, each session's
chunks in order) for ``--store-seconds``; chunks per second (median over the rounds) and
the p50 / p99 latency of a chunk (over all rounds), the ratio of Redis's throughput to the
in-process store's, and Redis's memory per open session (INFO memory's used_memory after
the run minus before the sessions were opened, over the sessions; the database is flushed
between measurements). Prints a table and writes bench/results/streaming.json.

    python bench/load/streaming.py [--history 4096] [--chunk 8] [--hidden 128] [--features 9]
                                   [--parts ways,stores] [--sessions 128 512] [--concurrency 32]
                                   [--store-seconds 3] [--store-rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import chosen_rows, percentile_ms, write_result  # noqa: E402
from bench.load.client import Server  # noqa: E402


def build_package(work: Path, hidden: int, steps: int, features: int) -> Path:
    """An svdrnn classifier whose max_length is the whole history (one training step on
    random data: speed does not depend on accuracy)."""
    from orthornn.export.builder.exporter import export_run
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


#: the secret this client chose for its sessions (sent with each chunk, its start too)
SECRET = secrets.token_urlsafe(24)


def run_way(port: int, way: str, x: np.ndarray, chunk: int) -> tuple[list[float], dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    latencies, state, out = [], None, None
    starts = range(0, len(x), chunk)
    for k, t in enumerate(starts):
        part = x[t:t + chunk].tolist()
        body: dict = {"model": "stream"}
        if way == "session":
            body.update(inputs=[part], session="bench", start=k == 0,
                        end=k == len(starts) - 1, session_secret=SECRET)
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


# -- where the sessions live ----------------------------------------------------------------

STORES = ("memory", "redis")


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    body: bytes) -> tuple[int, bytes]:
    """One POST /predict on a keep-alive connection: (status, body)."""
    writer.write(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return int(head[9:12]), await reader.readexactly(length)


async def _sessions_load(port: int, sids: list[str], inputs: list[bytes], chunk: int,
                         concurrency: int, seconds: float) -> tuple[float, list[float], list]:
    """Open the sessions SIDS (untimed), then for SECONDS send chunks over CONCURRENCY
    connections, connection k cycling over sessions k, k + CONCURRENCY, ... (so a session's
    chunks go in order, each naming its position); (seconds, latencies, errors)."""
    latencies: list[float] = []
    errors: list[str] = []
    positions = dict.fromkeys(sids, 0)

    def body(sid: str, k: int, start: bool) -> bytes:
        return (b'{"model":"stream","session":"%s","session_secret":"%s","start":%s,'
                b'"position":%d,"inputs":%s}'
                % (sid.encode(), SECRET.encode(), b"true" if start else b"false",
                   positions[sid], inputs[k % len(inputs)]))

    async def worker(mine: list[str], stop_at: float | None) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            k = 0
            while True:
                for sid in mine:
                    opening = stop_at is None
                    if not opening and time.perf_counter() >= stop_at:
                        return
                    begin = time.perf_counter()
                    status, answer = await _exchange(reader, writer, body(sid, k, opening))
                    k += 1
                    if status != 200:
                        errors.append(f"{status}: {answer[:200]!r}")
                        if opening:
                            raise RuntimeError(f"opening session {sid}: {errors[-1]}")
                        continue
                    positions[sid] += chunk
                    if not opening:
                        latencies.append(time.perf_counter() - begin)
                if stop_at is None:
                    return
        finally:
            writer.close()

    groups = [sids[k::concurrency] for k in range(concurrency)]
    groups = [g for g in groups if g]
    await asyncio.gather(*[worker(g, None) for g in groups])  # open every session
    start = time.perf_counter()
    await asyncio.gather(*[worker(g, start + seconds) for g in groups])
    return time.perf_counter() - start, latencies, errors


def measure_stores(repo: Path, args, x: np.ndarray) -> dict:
    """The store comparison (see the module's docstring)."""
    from tests.cluster import RedisServer, program

    if program("redis-server") is None:
        raise SystemExit("--parts stores needs redis-server on PATH or in /usr/sbin "
                         "(scripts/ci-debian.sh installs it)")
    import redis

    inputs = [json.dumps([x[t:t + args.chunk].tolist()]).encode()
              for t in range(0, len(x) - args.chunk + 1, args.chunk)][:64]
    runs: dict[tuple[str, int], list] = {}
    memory_per_session: dict[int, list[float]] = {n: [] for n in args.sessions}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        client = redis.Redis.from_url(server.url)
        common = ["--inference-threads", "1", "--max-sessions", str(10 * max(args.sessions))]
        servers = {"memory": Server(repo, batching=True, extra=[*common, "--session-store",
                                                                "memory"]),
                   "redis": Server(repo, batching=True, extra=[*common, "--session-store",
                                                               server.url])}
        try:
            for s in servers.values():
                s.wait_ready()
            # warm-up, not counted: the servers' Redis connections opened, its scripts
            # loaded (one-time allocations that would count as the first sessions' memory)
            for store, s in servers.items():
                warm = [f"warm-{store}-{i}" for i in range(args.concurrency)]
                asyncio.run(_sessions_load(s.port, warm, inputs, args.chunk,
                                           args.concurrency, 0.5))
            for r in range(args.store_rounds):
                for n in args.sessions:
                    # alternating which store goes first: this machine's load drifts
                    for store in (STORES if r % 2 == 0 else STORES[::-1]):
                        client.flushdb()
                        before = int(client.info("memory")["used_memory"])
                        sids = [f"{store}-{r}-{n}-{i}" for i in range(n)]
                        run = asyncio.run(_sessions_load(
                            servers[store].port, sids, inputs, args.chunk, args.concurrency,
                            args.store_seconds))
                        runs.setdefault((store, n), []).append(run)
                        if store == "redis":
                            used = int(client.info("memory")["used_memory"]) - before
                            memory_per_session[n].append(used / n)
        finally:
            for s in servers.values():
                s.stop()
            client.close()
    rows = []
    for (store, n), measured in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        latencies = [t for m in measured for t in m[1]]
        row = {"store": store, "sessions": n, "chunks": len(latencies),
               "errors": sum(len(m[2]) for m in measured),
               "chunks_per_s": round(float(np.median([len(m[1]) / m[0] for m in measured])),
                                     1),
               "p50_ms": percentile_ms(latencies, 50), "p99_ms": percentile_ms(latencies, 99)}
        if store == "redis":
            row["redis_bytes_per_session"] = round(float(np.median(memory_per_session[n])))
        rows.append(row)
    by = {(r["store"], r["sessions"]): r for r in rows}
    ratios = {str(n): round(by["redis", n]["chunks_per_s"] / by["memory", n]["chunks_per_s"], 3)
              for n in args.sessions}
    return {"concurrency": args.concurrency, "seconds": args.store_seconds,
            "rounds": args.store_rounds, "rows": rows, "redis_over_memory": ratios}


def print_stores(result: dict) -> None:
    print(f"\nsession stores: concurrency {result['concurrency']}, "
          f"{result['rounds']} x {result['seconds']} s per store and size")
    print(f"{'store':<7} {'sessions':>8} {'chunks/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'errors':>6} {'redis B/session':>15}")
    for r in result["rows"]:
        memory = r.get("redis_bytes_per_session")
        print(f"{r['store']:<7} {r['sessions']:>8} {r['chunks_per_s']:>9.0f} "
              f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['errors']:>6} "
              f"{'' if memory is None else memory:>15}")
    for n, ratio in result["redis_over_memory"].items():
        print(f"redis / memory throughput at {n} sessions: {ratio:.2f} "
              f"(Redis costs {100 * (1 - ratio):.0f}%)")


def measure_ways(repo: Path, args, x: np.ndarray) -> dict:
    """The three ways over one history (see the module's docstring)."""
    rows = {}
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
    print(f"{'way':<8} {'chunks':>6} {'first ms':>9} {'last ms':>9} {'last/first':>10} "
          f"{'total s':>8} {'resend/way (last)':>18}")
    for way, r in rows.items():
        print(f"{way:<8} {r['chunks']:>6} {r['first_ms']:>9.3f} {r['last_ms']:>9.3f} "
              f"{r['last_over_first']:>10.2f} {r['total_s']:>8.2f} "
              f"{r['resend_last_over_last']:>18.1f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--features", type=int, default=9)
    parser.add_argument("--parts", default="ways",
                        help="comma-separated: ways (session / state / resend over one "
                             "history), stores (in-process sessions against Redis)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[128, 512],
                        help="stores: open sessions, one measurement each")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="stores: connections sending chunks at once")
    parser.add_argument("--store-seconds", type=float, default=3.0,
                        help="stores: seconds per store, size and round")
    parser.add_argument("--store-rounds", type=int, default=2,
                        help="stores: alternating rounds; throughput is their median")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "streaming.json"))
    args = parser.parse_args(argv)
    parts = chosen_rows(parser, args.parts, ("ways", "stores"))
    if args.history < 10 * args.chunk or args.chunk < 1:
        parser.error("--history must be at least 10 chunks and --chunk at least 1")
    if min(args.sessions) < 1 or args.concurrency < 1 or args.store_rounds < 1 \
            or args.store_seconds <= 0:
        parser.error("--sessions, --concurrency, --store-rounds and --store-seconds must be "
                     "positive")
    x = np.random.default_rng(1).normal(size=(args.history, args.features)).astype(np.float32)
    result: dict = {"history": args.history, "chunk": args.chunk, "hidden": args.hidden,
                    "features": args.features, "machine": platform.machine(),
                    "cpus": os.cpu_count()}
    print(f"history {args.history} steps in chunks of {args.chunk}, svdrnn n={args.hidden}, "
          f"d={args.features}")
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_package(Path(tmp), args.hidden, args.history, args.features)
        if "ways" in parts:
            result["ways"] = measure_ways(repo, args, x)
        if "stores" in parts:
            result["stores"] = measure_stores(repo, args, x)
            print_stores(result["stores"])
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
